"""The secure-aggregation messages, stage by stage (see the package's docstring), each
body declared field by field (:mod:`fedagent.protocols.fields`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.secagg.crypto import SHARE_BYTES
from fedagent.protocols.secagg.params import MAX_CERT, MAX_LIST, MAX_NEIGHBOURS, SecAggSetup

Weights = dict[str, np.ndarray]

_ROUND = F.Field("round", F.Count())
_CERT = F.Binary(0, MAX_CERT)
_SIG = F.Binary(0, 64)
_BOXES = F.ByNode(MAX_NEIGHBOURS, F.Binary(16 + 16, 1024))  # sealed pairs of shares (with their tags)
_SHARES = F.ByNode(MAX_NEIGHBOURS, F.Binary(SHARE_BYTES + 2, SHARE_BYTES + 2))  # (x, y) packed


@dataclass(frozen=True, slots=True)
class SecAggStart(F.WireMessage):
    """Coordinator → all, just before the round start (which carries the same setup):
    small, so the key and share stages run while the model is still on its way."""

    kind: ClassVar[str] = "secagg_start"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_start", _ROUND, F.Field("selected", F.NodeIds(MAX_LIST)), F.Field("setup", F.Nested(SecAggSetup))
    )
    round: int
    selected: tuple[str, ...]
    setup: SecAggSetup


@dataclass(frozen=True, slots=True)
class SecAggKeys(F.WireMessage):
    """Agent → coordinator, stage 1: this round's public keys, signed by the agent."""

    kind: ClassVar[str] = "secagg_keys"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_keys",
        _ROUND,
        F.Field("c_pk", F.Binary(32, 32)),
        F.Field("s_pk", F.Binary(32, 32)),
        F.Field("cert", _CERT),
        F.Field("sig", _SIG),
    )
    round: int
    c_pk: bytes
    s_pk: bytes
    cert: bytes = b""
    sig: bytes = b""


@dataclass(frozen=True, slots=True)
class SecAggRoster(F.WireMessage):
    """Coordinator → one agent, after stage 1: its neighbours' advertised keys."""

    kind: ClassVar[str] = "secagg_roster"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_roster", _ROUND, F.Field("keys", F.ByNode(MAX_NEIGHBOURS, F.Nested(SecAggKeys)))
    )
    round: int
    keys: dict[str, SecAggKeys]


@dataclass(frozen=True, slots=True)
class SecAggShares(F.WireMessage):
    """Agent → coordinator, stage 2: a sealed box of shares per neighbour, and a
    commitment to the self-mask seed (checked when it is rebuilt)."""

    kind: ClassVar[str] = "secagg_shares"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_shares", _ROUND, F.Field("boxes", _BOXES), F.Field("b_digest", F.Binary(32, 32))
    )
    round: int
    boxes: dict[str, bytes]
    b_digest: bytes


@dataclass(frozen=True, slots=True)
class SecAggShareBox(F.WireMessage):
    """Coordinator → one agent, after stage 2: the boxes its neighbours sealed for it."""

    kind: ClassVar[str] = "secagg_sharebox"
    WIRE: ClassVar[F.Body] = F.Body("secagg_sharebox", _ROUND, F.Field("boxes", _BOXES))
    round: int
    boxes: dict[str, bytes]


@dataclass(frozen=True, slots=True)
class SecAggMasked(F.WireMessage):
    """Agent → coordinator, stage 3: the masked, quantised update (uint32 sent as int32)."""

    kind: ClassVar[str] = "secagg_masked"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_masked",
        _ROUND,
        F.Field("base_version", F.Count()),
        F.Field("num_samples", F.Count(low=1)),
        F.Field("metrics", F.Metrics()),
        F.Field("weights", F.Tensors(names=("masked",))),
        F.Field("leaving", F.Flag()),
        # absent from agents of secure-aggregation version 1
        F.Field("ahead", F.Nullable(F.Nested(SecAggKeys)), default=None),
    )
    round: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    weights: Weights = field(repr=False)  # {"masked": int32 vector}
    leaving: bool = False
    ahead: SecAggKeys | None = None  # this agent's signed keys for the setup's next_round

    def __post_init__(self) -> None:
        if set(self.weights) != {"masked"}:
            raise CodecError("secagg_masked: carries exactly one tensor, 'masked'")
        m = self.weights["masked"]
        if m.dtype != np.int32 or m.ndim != 1:
            raise CodecError("secagg_masked: the masked vector must be one-dimensional int32")
        if self.num_samples < 1:
            raise CodecError("secagg_masked: num_samples must be positive")

    @property
    def masked(self) -> np.ndarray:
        return self.weights["masked"].view(np.uint32)


@dataclass(frozen=True, slots=True)
class SecAggSurvivors(F.WireMessage):
    """Coordinator → each survivor, stage 4: who sent a masked input, for it to sign."""

    kind: ClassVar[str] = "secagg_survivors"
    WIRE: ClassVar[F.Body] = F.Body("secagg_survivors", _ROUND, F.Field("survivors", F.NodeIds(MAX_LIST)))
    round: int
    survivors: tuple[str, ...]  # sorted


@dataclass(frozen=True, slots=True)
class SecAggSignature(F.WireMessage):
    """Agent → coordinator, stage 4: its signature of the survivor list it was sent."""

    kind: ClassVar[str] = "secagg_signature"
    WIRE: ClassVar[F.Body] = F.Body("secagg_signature", _ROUND, F.Field("cert", _CERT), F.Field("sig", _SIG))
    round: int
    cert: bytes = b""
    sig: bytes = b""


@dataclass(frozen=True, slots=True)
class SecAggUnmask(F.WireMessage):
    """Coordinator → one agent, stage 5: which shares it wants, how many inputs the sum
    has (an agent refuses to help unmask a sum of fewer than ``min_survivors``) and the
    survivors' signatures of their list (``name -> (cert, sig)``)."""

    kind: ClassVar[str] = "secagg_unmask"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_unmask",
        _ROUND,
        F.Field("b_of", F.NodeIds(MAX_NEIGHBOURS + 1)),
        F.Field("sk_of", F.NodeIds(MAX_NEIGHBOURS + 1)),
        F.Field("survivors", F.Count()),
        F.Field("signatures", F.ByNode(MAX_LIST, F.Pair(_CERT, _SIG))),
    )
    round: int
    b_of: tuple[str, ...]  # survivors: their self-mask seed
    sk_of: tuple[str, ...]  # drop-outs: their mask secret key
    survivors: int
    signatures: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SecAggReveal(F.WireMessage):
    """Agent → coordinator, stage 5: the shares asked for, or a refusal."""

    kind: ClassVar[str] = "secagg_reveal"
    WIRE: ClassVar[F.Body] = F.Body(
        "secagg_reveal",
        _ROUND,
        F.Field("b_shares", _SHARES),
        F.Field("sk_shares", _SHARES),
        F.Field("refused", F.Text(max_len=1000)),
    )
    round: int
    b_shares: dict[str, bytes]
    sk_shares: dict[str, bytes]
    refused: str = ""


#: How an agent withdraws after the share stage, in a :class:`SecAggReveal`'s refusal
#: sent in place of its masked input, naming the neighbour whose share box did not open.
#: The coordinator cannot check the claim (the box is sealed between the two), so one
#: agent's word benches no one.
UNOPENED_BOX = "share box unopened: "


SecAggMessage = (
    SecAggStart
    | SecAggKeys
    | SecAggRoster
    | SecAggShares
    | SecAggShareBox
    | SecAggMasked
    | SecAggSurvivors
    | SecAggSignature
    | SecAggUnmask
    | SecAggReveal
)
MESSAGES: tuple[type[SecAggMessage], ...] = (
    SecAggStart,
    SecAggKeys,
    SecAggRoster,
    SecAggShares,
    SecAggShareBox,
    SecAggMasked,
    SecAggSurvivors,
    SecAggSignature,
    SecAggUnmask,
    SecAggReveal,
)
