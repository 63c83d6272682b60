"""Messages every node sends, whatever its mode: its presence, its heartbeat and, to a
node whose model differs from its own, its model's fingerprint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.fingerprint import DIGEST_CHARS, MAX_TENSORS, Fingerprint, TensorInfo

ROLES = ("agent", "coordinator")
MODES = ("fedavg", "syncopt", "gossip", "async")
MAX_DOWNLINKS = 8


@dataclass(frozen=True, slots=True)
class Presence(F.WireMessage):
    """Retained per node; its Last Will is the same with ``online=False``."""

    kind: ClassVar[str] = "presence"
    WIRE: ClassVar[F.Body] = F.Body(
        "presence",
        F.Field("online", F.Flag()),
        F.Field("role", F.Text(max_len=32)),
        F.Field("mode", F.Text(max_len=32)),
        F.Field("num_samples", F.Count(), default=0),
        F.Field("model_version", F.Count(), default=0),
        F.Field("broker", F.Text(max_len=256), default=""),
        F.Field("downlinks", F.Strings(MAX_DOWNLINKS, max_len=16), default=(), omit_default=True),
        F.Field("model", F.Text(max_len=DIGEST_CHARS), default="", omit_default=True),
        F.Field("agents", F.Count(), default=0, omit_default=True),
    )
    online: bool
    role: str
    mode: str = "fedavg"
    num_samples: int = 0
    model_version: int = 0
    broker: str = ""
    # The encodings of the global model this agent rebuilds besides the whole model
    # ("int8": round starts as int8 steps, protocols/downlink.py). Agents of releases
    # before the int8 broadcast send none, and get the whole model.
    downlinks: tuple[str, ...] = ()
    # The digest of the node's model fingerprint (protocols/fingerprint.py); "" from
    # earlier releases, and from a node whose model waits for a vocabulary.
    model: str = ""
    # A site aggregator's presence at its upstream tier: the agents online at its site
    # (what operators see of the tree; ``num_samples`` is their announced total).
    agents: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise CodecError(f"presence: unknown role {self.role!r}")
        if self.mode not in MODES:
            raise CodecError(f"presence: unknown mode {self.mode!r}")
        F.count(self.num_samples, "presence", "num_samples")
        F.count(self.model_version, "presence", "model_version")
        F.count(self.agents, "presence", "agents")
        if not isinstance(self.downlinks, tuple):
            raise CodecError("presence: downlinks must be a tuple of names")
        F.strings(list(self.downlinks), "presence", "downlinks", MAX_DOWNLINKS, max_len=16)


@dataclass(frozen=True, slots=True)
class Heartbeat(F.WireMessage):
    """Agent → coordinator, every ``interval`` seconds: "still here". The coordinator
    declares an agent that has been silent for a few intervals gone from the round long
    before the broker's keep-alive does (see :mod:`fedagent.protocols.liveness`)."""

    kind: ClassVar[str] = "heartbeat"
    WIRE: ClassVar[F.Body] = F.Body("heartbeat", F.Field("interval", F.Number(send_float=True)))
    interval: float

    def __post_init__(self) -> None:
        v = self.interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.05 <= v <= 3600):
            raise CodecError("heartbeat: interval must be 0.05..3600 seconds")


@dataclass(frozen=True, slots=True)
class ModelCheck(F.WireMessage):
    """Node → node, when the other's presence announced another model digest than this
    node's: this node's fingerprint, so the receiver can name the first tensor that
    differs on both sides. ``refused``: why the sender does not take the receiver
    (a coordinator refusing an agent; empty from a node that only reports its model)."""

    kind: ClassVar[str] = "model_check"
    WIRE: ClassVar[F.Body] = F.Body(
        "model_check",
        F.Field("digest", F.Text(max_len=DIGEST_CHARS, min_len=1)),
        F.Field("tensors", F.Items(MAX_TENSORS, F.Nested(TensorInfo))),
        F.Field("refused", F.Text(max_len=1000), default="", omit_default=True),
    )
    digest: str
    tensors: tuple[TensorInfo, ...]
    refused: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, tuple) or not all(isinstance(t, TensorInfo) for t in self.tensors):
            raise CodecError("model_check: tensors must be a tuple of model tensors")
        if self.fingerprint.digest != self.digest:
            raise CodecError("model_check: the digest is not the one of the tensors listed")

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.tensors)

    @classmethod
    def of(cls, fp: Fingerprint, refused: str = "") -> ModelCheck:
        return cls(fp.digest, fp.tensors, refused)
