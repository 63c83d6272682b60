"""Secure aggregation of FedAvg updates (SecAgg+, Bell et al., CCS 2020), as pure code.

The coordinator learns the sum of a round's updates and nothing about any single one.
Each selected agent, in five stages relayed by the coordinator over the per-agent inboxes:

1. **keys** — makes two fresh X25519 key pairs for the round: ``c`` (to encrypt share
   boxes) and ``s`` (to agree pairwise masks), and advertises the public halves, signed
   with its certificate's key so a coordinator cannot substitute its own. The
   coordinator sends each agent the keys of its neighbours in a sparse graph
   (:func:`neighbour_graph`: a ring over a per-round shuffle, each node linked to the
   ``k/2`` nodes on either side, ``k = 2⌈log₂ n⌉``; complete below about 8 agents).
   **Keys ahead** (setup version 2): a round's setup may name the next round
   (``next_round``); each agent then makes fresh key pairs for that round and sends
   their public halves with its masked input, signed for that round alone and bound to
   the round they were advertised in (:func:`ahead_statement`). When every agent
   selected for that round did so, its setup says ``ahead``: no key stage, the
   coordinator sends the rosters at once (ahead of the model). Any other cohort: a key
   stage for everyone. A key pair serves one round; unused ones are thrown away.
2. **shares** — draws a self-mask seed ``b``, and splits ``b`` and its ``s`` secret key
   into Shamir shares (t of its holders: itself and its neighbours). Each neighbour's
   pair of shares is encrypted with ChaCha20-Poly1305 under a key agreed with that
   neighbour's ``c`` key: the coordinator relays boxes it cannot open.
3. **masked input** — after training, quantises its weighted update into integers mod
   2³² and adds ``PRG(b)`` and, for each neighbour j that completed stage 2,
   ``±PRG(s_ij)`` (+ if its id sorts before j's, − after). Pairwise masks cancel in the
   sum; self masks do not. The mask sum may be drawn ahead, once the roster is in
   (:meth:`SecAggClient.premask`): it does not depend on the update.
4. **consistency** (Bonawitz et al. 2017, kept by Bell et al.) — the coordinator sends
   every survivor (sent a masked input) the list of survivors; each signs it, once per
   round, with its certificate's key. An agent never signs a second list, nor one that
   leaves itself out. The coordinator checks each signature as the agents will: a
   survivor whose signature is not valid takes no further part (its input stays in the
   sum, as a survivor's that falls silent) and its signature is not passed on.
5. **unmasking** — the coordinator names the survivors and the drop-outs (shared keys,
   sent no input) and passes on the signatures of the list. An agent answers only if
   more than ``threshold`` of the round's selected agents signed the very list it
   signed: honest agents sign one list each, so two different lists can never both
   gather that many, and a coordinator cannot tell different agents different survivor
   sets. Each agent returns its share of ``b`` for a survivor and its share of ``s``'s
   secret key for a drop-out, never both for one agent: with a threshold above half the
   holders, no coordinator can collect enough shares of both and strip a survivor's
   masks. With ≥ t shares per secret the coordinator removes the self masks of
   survivors and the dangling pairwise masks of drop-outs and is left with the sum.

Quantisation (:class:`SecAggParams`): an agent's contribution is ``v = r·Δ`` with Δ its
update minus the round's global model (floating tensors only, in name order) and
``r = min(n, W)/W`` its sample weight (n its samples, W the largest sample count among
the selected agents, sent with the round). Each coordinate of v is clipped to
``[-clip, clip]`` and rounded to the nearest of ``2^bits`` levels,
``q = round((v + clip)/step)`` with ``step = 2·clip/(2^bits − 1)``: rounding error
≤ step/2. Sums are taken mod 2³², so at most ``⌊(2³²−1)/(2^bits−1)⌋`` agents fit in a
round (4096 at 20 bits). The coordinator divides the dequantised sum by Σr (sample
counts are metadata it sees, as in plain FedAvg), so each coordinate of the averaged
update is off by at most ``(m/Σr)·step/2`` for m survivors — ``step/2`` when all agents
have the same number of samples — plus whatever the clip cut off.

What this guards against, and what not: the broker and an honest-but-curious coordinator
see only masked vectors and sealed share boxes. A coordinator that lies about who
dropped out is refused the second share of any one agent, and one that tells different
agents different survivor lists gathers too few signatures of either list to be given
any share.

Everything here is deterministic given ``random_bytes``; no clock, socket or thread.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits, decode_weights, encode_weights

Weights = dict[str, np.ndarray]

MODULUS_BITS = 32  # masked sums live in uint32 and wrap
PRIME = 2**521 - 1  # Shamir field; a Mersenne prime above every 32-byte secret
_SHARE_BYTES = 66  # a field element, big-endian
MAX_NEIGHBOURS = 1024
MAX_CERT = 8192
KEY_DOMAIN = b"fedagent-secagg-keys/1"
AHEAD_DOMAIN = b"fedagent-secagg-keys-ahead/2"
SECAGG_VERSION = 2  # carried by every round's setup; 2: keys advertised a round ahead
LIST_DOMAIN = b"fedagent-secagg-survivors/1"
MAX_CLIP = 1e6  # largest quantisation range (SecAggParams.clip)
MAX_LIST = 100_000  # most names in a round's selection or survivor list

__all__ = [
    "AheadKeys",
    "Delta",
    "SecAggClient",
    "SecAggError",
    "SecAggKeys",
    "SecAggMasked",
    "SecAggParams",
    "SecAggReveal",
    "SecAggRoster",
    "SecAggServer",
    "SecAggSetup",
    "SecAggShareBox",
    "SecAggShares",
    "SecAggSignature",
    "SecAggSurvivors",
    "SecAggUnmask",
    "dequantise_sum",
    "flatten",
    "neighbour_graph",
    "quantise",
    "unflatten",
]


class SecAggError(Exception):
    """The protocol cannot go on for this agent or round (a refusal, a bad message)."""


# ---- parameters ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SecAggParams:
    clip: float = 1.0  # each coordinate of a weighted update is clipped to [-clip, clip]
    bits: int = 20  # quantisation levels 2^bits
    neighbours: int = 0  # graph degree k (0: 2⌈log₂ n⌉, at most n − 1)
    threshold: float = 0.5  # a secret needs strictly more than this fraction of its holders
    min_survivors: int = 2  # fewer masked inputs than this: the round is abandoned

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
            raise CodecError("secure aggregation: clip must be a number")
        if not (math.isfinite(self.clip) and 0 < self.clip <= MAX_CLIP):
            raise CodecError(f"secure aggregation: clip must be in (0, {MAX_CLIP:g}]")
        if type(self.bits) is not int or not 2 <= self.bits <= 30:
            raise CodecError("secure aggregation: bits must be an integer in [2, 30]")
        if type(self.neighbours) is not int or not 0 <= self.neighbours <= MAX_NEIGHBOURS:
            raise CodecError(f"secure aggregation: neighbours must be an integer in [0, {MAX_NEIGHBOURS}]")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise CodecError("secure aggregation: threshold must be a number")
        if not 0.5 <= self.threshold < 1:
            raise CodecError(
                "secure aggregation: threshold must be in [0.5, 1): at or below half the holders "
                "a coordinator could collect both shares of an agent from different holders"
            )
        if type(self.min_survivors) is not int or not 2 <= self.min_survivors <= 100_000:
            raise CodecError("secure aggregation: min_survivors must be at least 2 (one input alone is not hidden)")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        return 2.0 * self.clip / self.levels

    @property
    def max_agents(self) -> int:
        """Most masked inputs whose sum cannot wrap mod 2³²."""
        return ((1 << MODULUS_BITS) - 1) // self.levels

    def error_bound(self, weight_sum: float, survivors: int) -> float:
        """Largest quantisation error of one coordinate of the averaged update."""
        return survivors * self.step / 2 / weight_sum

    def threshold_of(self, holders: int) -> int:
        """Shares needed to rebuild a secret held by ``holders`` agents."""
        return min(holders, math.floor(self.threshold * holders) + 1)

    def to_body(self) -> dict[str, Any]:
        return {
            "clip": float(self.clip),
            "bits": self.bits,
            "neighbours": self.neighbours,
            "threshold": float(self.threshold),
            "min_survivors": self.min_survivors,
        }

    @classmethod
    def from_body(cls, body: Any) -> SecAggParams:
        if not isinstance(body, dict) or set(body) != {"clip", "bits", "neighbours", "threshold", "min_survivors"}:
            raise CodecError("secure aggregation: bad parameters")
        return cls(**body)


@dataclass(frozen=True, slots=True)
class SecAggSetup:
    """What a round start adds for a secure round (the round and the selected agents
    are the round start's own)."""

    params: SecAggParams
    seed: bytes  # shuffles the neighbour graph; also binds keys and masks to this round
    max_weight: int  # samples weighing 1 (W)
    # The secure round whose keys the agents advertise ahead, with their masked input
    # (0: none); and whether this round uses the keys advertised in the previous one
    # (no key stage) or asks for fresh ones.
    next_round: int = 0
    ahead: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.seed, bytes) or len(self.seed) != 16:
            raise CodecError("secure aggregation: seed must be 16 bytes")
        if type(self.max_weight) is not int or not 1 <= self.max_weight < 2**53:
            raise CodecError("secure aggregation: max_weight must be a positive integer")
        if type(self.next_round) is not int or not 0 <= self.next_round < 2**53:
            raise CodecError("secure aggregation: next_round must be a non-negative integer")
        if not isinstance(self.ahead, bool):
            raise CodecError("secure aggregation: ahead must be a bool")

    def to_body(self) -> dict[str, Any]:
        return {
            "version": SECAGG_VERSION,
            "params": self.params.to_body(),
            "seed": self.seed,
            "max_weight": self.max_weight,
            "next_round": self.next_round,
            "ahead": self.ahead,
        }

    @classmethod
    def from_body(cls, body: Any, limits: Limits | None = None) -> SecAggSetup:
        if not isinstance(body, dict):
            raise CodecError("secure aggregation: bad setup")
        version = body.get("version", 1)
        if version != SECAGG_VERSION:
            raise CodecError(
                f"secure aggregation version {version!r} from the coordinator; this node speaks "
                f"{SECAGG_VERSION} (upgrade the older side)"
            )
        w = "secure aggregation"
        return cls(
            SecAggParams.from_body(F.need(body, "params", w)),
            F.binary(F.need(body, "seed", w), w, "seed", min_len=16, max_len=16),
            F.count(F.need(body, "max_weight", w), w, "max_weight", low=1),
            F.count(F.need(body, "next_round", w), w, "next_round"),
            F.flag(F.need(body, "ahead", w), w, "ahead"),
        )

    def context(self, round_: int) -> bytes:
        return b"round=%d|" % round_ + self.seed

    def ratio(self, num_samples: int) -> float:
        return min(num_samples, self.max_weight) / self.max_weight


# ---- wire helpers --------------------------------------------------------------------
def _has(body: Any, keys: tuple[str, ...], what: str) -> Mapping[str, Any]:
    """The body, if it is a map with every one of ``keys`` (others are ignored)."""
    body = F.is_map(body, what)
    for k in keys:
        F.need(body, k, what)
    return body


def _boxes(v: Any, what: str, key: str, size: tuple[int, int]) -> dict[str, bytes]:
    lo, hi = size
    return F.by_node(v, what, key, MAX_NEIGHBOURS, lambda b: F.binary(b, what, key, min_len=lo, max_len=hi))


_BOX_SIZE = (16 + 16, 1024)  # a sealed pair of shares (with its tag)


# ---- wire messages -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SecAggStart:
    """Coordinator → all, just before the round start (which carries the same setup):
    small, so the key and share stages run while the model is still on its way."""

    kind: ClassVar[str] = "secagg_start"
    round: int
    selected: tuple[str, ...]
    setup: SecAggSetup

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "selected": list(self.selected), "setup": self.setup.to_body()}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggStart:
        w = "secagg_start"
        b = _has(body, ("round", "selected", "setup"), w)
        return cls(
            F.count(b["round"], w, "round"),
            F.node_ids(b["selected"], w, "selected", MAX_LIST),
            SecAggSetup.from_body(b["setup"]),
        )


@dataclass(frozen=True, slots=True)
class SecAggKeys:
    """Agent → coordinator, stage 1: this round's public keys, signed by the agent."""

    kind: ClassVar[str] = "secagg_keys"
    round: int
    c_pk: bytes
    s_pk: bytes
    cert: bytes = b""
    sig: bytes = b""

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "c_pk": self.c_pk, "s_pk": self.s_pk, "cert": self.cert, "sig": self.sig}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggKeys:
        w = "secagg_keys"
        b = _has(body, ("round", "c_pk", "s_pk", "cert", "sig"), w)
        return cls(
            F.count(b["round"], w, "round"),
            F.binary(b["c_pk"], w, "c_pk", min_len=32, max_len=32),
            F.binary(b["s_pk"], w, "s_pk", min_len=32, max_len=32),
            F.binary(b["cert"], w, "cert", min_len=0, max_len=MAX_CERT),
            F.binary(b["sig"], w, "sig", min_len=0, max_len=64),
        )


@dataclass(frozen=True, slots=True)
class SecAggRoster:
    """Coordinator → one agent, after stage 1: its neighbours' advertised keys."""

    kind: ClassVar[str] = "secagg_roster"
    round: int
    keys: dict[str, SecAggKeys]

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "keys": {k: v.to_body() for k, v in self.keys.items()}}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggRoster:
        w = "secagg_roster"
        b = _has(body, ("round", "keys"), w)
        keys = F.by_node(b["keys"], w, "keys", MAX_NEIGHBOURS, SecAggKeys.from_body)
        return cls(F.count(b["round"], w, "round"), keys)


@dataclass(frozen=True, slots=True)
class SecAggShares:
    """Agent → coordinator, stage 2: a sealed box of shares per neighbour, and a
    commitment to the self-mask seed (checked when it is rebuilt)."""

    kind: ClassVar[str] = "secagg_shares"
    round: int
    boxes: dict[str, bytes]
    b_digest: bytes

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "boxes": dict(self.boxes), "b_digest": self.b_digest}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggShares:
        w = "secagg_shares"
        b = _has(body, ("round", "boxes", "b_digest"), w)
        return cls(
            F.count(b["round"], w, "round"),
            _boxes(b["boxes"], w, "boxes", _BOX_SIZE),
            F.binary(b["b_digest"], w, "b_digest", min_len=32, max_len=32),
        )


@dataclass(frozen=True, slots=True)
class SecAggShareBox:
    """Coordinator → one agent, after stage 2: the boxes its neighbours sealed for it."""

    kind: ClassVar[str] = "secagg_sharebox"
    round: int
    boxes: dict[str, bytes]

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "boxes": dict(self.boxes)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggShareBox:
        w = "secagg_sharebox"
        b = _has(body, ("round", "boxes"), w)
        return cls(F.count(b["round"], w, "round"), _boxes(b["boxes"], w, "boxes", _BOX_SIZE))


@dataclass(frozen=True, slots=True)
class SecAggMasked:
    """Agent → coordinator, stage 3: the masked, quantised update (uint32 sent as int32)."""

    kind: ClassVar[str] = "secagg_masked"
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

    def to_body(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "base_version": self.base_version,
            "num_samples": self.num_samples,
            "metrics": dict(self.metrics),
            "weights": encode_weights(self.weights),
            "leaving": self.leaving,
            "ahead": None if self.ahead is None else self.ahead.to_body(),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SecAggMasked:
        w = "secagg_masked"
        b = _has(body, ("round", "base_version", "num_samples", "metrics", "weights", "leaving"), w)
        if not isinstance(b["weights"], dict) or set(b["weights"]) != {"masked"}:
            raise CodecError(f"{w}: carries exactly one tensor, 'masked'")
        ahead = b.get("ahead")
        return cls(
            F.count(b["round"], w, "round"),
            F.count(b["base_version"], w, "base_version"),
            F.count(b["num_samples"], w, "num_samples", low=1),
            F.metrics(b["metrics"], w),
            decode_weights(b["weights"], limits),
            F.flag(b["leaving"], w, "leaving"),
            None if ahead is None else SecAggKeys.from_body(ahead),
        )


@dataclass(frozen=True, slots=True)
class SecAggSurvivors:
    """Coordinator → each survivor, stage 4: who sent a masked input, for it to sign."""

    kind: ClassVar[str] = "secagg_survivors"
    round: int
    survivors: tuple[str, ...]  # sorted

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "survivors": list(self.survivors)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggSurvivors:
        w = "secagg_survivors"
        b = _has(body, ("round", "survivors"), w)
        return cls(F.count(b["round"], w, "round"), F.node_ids(b["survivors"], w, "survivors", MAX_LIST))


@dataclass(frozen=True, slots=True)
class SecAggSignature:
    """Agent → coordinator, stage 4: its signature of the survivor list it was sent."""

    kind: ClassVar[str] = "secagg_signature"
    round: int
    cert: bytes = b""
    sig: bytes = b""

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "cert": self.cert, "sig": self.sig}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggSignature:
        w = "secagg_signature"
        b = _has(body, ("round", "cert", "sig"), w)
        return cls(
            F.count(b["round"], w, "round"),
            F.binary(b["cert"], w, "cert", min_len=0, max_len=MAX_CERT),
            F.binary(b["sig"], w, "sig", min_len=0, max_len=64),
        )


def _signatures(v: Any, what: str) -> dict[str, tuple[bytes, bytes]]:
    def pair(p: Any) -> tuple[bytes, bytes]:
        if not isinstance(p, list | tuple) or len(p) != 2:
            raise F.refuse(what, "signatures", "must map each node id to a certificate and a signature")
        cert = F.binary(p[0], what, "signatures", min_len=0, max_len=MAX_CERT)
        return cert, F.binary(p[1], what, "signatures", min_len=0, max_len=64)

    return F.by_node(v, what, "signatures", MAX_LIST, pair)


@dataclass(frozen=True, slots=True)
class SecAggUnmask:
    """Coordinator → one agent, stage 5: which shares it wants, how many inputs the sum
    has (an agent refuses to help unmask a sum of fewer than ``min_survivors``) and the
    survivors' signatures of their list (``name -> (cert, sig)``)."""

    kind: ClassVar[str] = "secagg_unmask"
    round: int
    b_of: tuple[str, ...]  # survivors: their self-mask seed
    sk_of: tuple[str, ...]  # drop-outs: their mask secret key
    survivors: int
    signatures: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "b_of": list(self.b_of),
            "sk_of": list(self.sk_of),
            "survivors": self.survivors,
            "signatures": {k: [c, s] for k, (c, s) in self.signatures.items()},
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggUnmask:
        w = "secagg_unmask"
        b = _has(body, ("round", "b_of", "sk_of", "survivors", "signatures"), w)
        return cls(
            F.count(b["round"], w, "round"),
            F.node_ids(b["b_of"], w, "b_of", MAX_NEIGHBOURS + 1),
            F.node_ids(b["sk_of"], w, "sk_of", MAX_NEIGHBOURS + 1),
            F.count(b["survivors"], w, "survivors"),
            _signatures(b["signatures"], w),
        )


@dataclass(frozen=True, slots=True)
class SecAggReveal:
    """Agent → coordinator, stage 5: the shares asked for, or a refusal."""

    kind: ClassVar[str] = "secagg_reveal"
    round: int
    b_shares: dict[str, bytes]
    sk_shares: dict[str, bytes]
    refused: str = ""

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "b_shares": self.b_shares, "sk_shares": self.sk_shares, "refused": self.refused}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits | None = None) -> SecAggReveal:
        w = "secagg_reveal"
        b = _has(body, ("round", "b_shares", "sk_shares", "refused"), w)
        size = (_SHARE_BYTES + 2, _SHARE_BYTES + 2)
        return cls(
            F.count(b["round"], w, "round"),
            _boxes(b["b_shares"], w, "b_shares", size),
            _boxes(b["sk_shares"], w, "sk_shares", size),
            F.text(b["refused"], w, "refused", max_len=1000),
        )


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


# ---- building blocks -----------------------------------------------------------------
def _degree(n: int, configured: int) -> int:
    if n <= 1:
        return 0
    k = configured or 2 * math.ceil(math.log2(n))
    if k >= n - 1:
        return n - 1
    return k + (k % 2)  # each node takes k/2 on either side of the ring


def neighbour_graph(agents: Sequence[str], seed: bytes, degree: int = 0) -> dict[str, tuple[str, ...]]:
    """The round's sparse graph: everyone computes the same one from the sorted agents
    and the round's seed (a hash order, the same on every platform)."""
    order = sorted(set(agents), key=lambda a: hashlib.sha256(seed + a.encode()).digest())
    n = len(order)
    k = _degree(n, degree)
    if k >= n - 1:
        return {a: tuple(sorted(b for b in order if b != a)) for a in order}
    out: dict[str, tuple[str, ...]] = {}
    for p, a in enumerate(order):
        near = {order[(p + d) % n] for d in range(1, k // 2 + 1)} | {order[(p - d) % n] for d in range(1, k // 2 + 1)}
        out[a] = tuple(sorted(near))
    return out


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


BLOCK = 1 << 15  # values per block of the fused passes (256 KiB of float64: stays in cache)


class _Streams:
    """Pseudo-random mask streams of uint32 (AES-256 in counter mode, keyed by a 32-byte
    seed), each added (or subtracted) into a vector block by block: a block's values
    and its keystream stay in the CPU cache, so the vector is read and written once
    whatever the number of streams, and no model-sized keystream buffer is made. A
    stream drawn in blocks is the same stream as drawn whole (the cipher keeps its
    counter between blocks)."""

    def __init__(self) -> None:
        self._zeros = memoryview(bytes(4 * BLOCK))
        self._buf = bytearray(4 * BLOCK + 15)  # update_into wants a block of slack
        self._streams: list[tuple[Any, int]] = []

    def add_stream(self, seed: bytes, nonce: bytes = bytes(16), sign: int = 1) -> None:
        self._streams.append((Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor(), sign))

    def __len__(self) -> int:
        return len(self._streams)

    def apply(self, y: np.ndarray) -> None:
        """Adds the next ``y.size`` values of every stream into ``y`` (uint32, a block
        at most; wraps mod 2³²)."""
        m = y.size
        zeros, buf = self._zeros[: 4 * m], self._buf
        for enc, sign in self._streams:
            enc.update_into(zeros, buf)
            k = np.frombuffer(buf, dtype="<u4", count=m)
            if sign > 0:
                np.add(y, k, out=y)
            else:
                np.subtract(y, k, out=y)

    def add_all(self, y: np.ndarray) -> None:
        """Every stream over the whole of ``y`` (uint32, contiguous)."""
        for lo in range(0, y.size, BLOCK):
            self.apply(y[lo : lo + BLOCK])


_SELF_NONCE = b"\x01" + bytes(15)


def pair_seed(own_sk: X25519PrivateKey, their_pk: bytes, context: bytes) -> bytes:
    shared = own_sk.exchange(X25519PublicKey.from_public_bytes(their_pk))
    return _hkdf(shared, b"fedagent-secagg-mask/1|" + context)


def _box_key(own_sk: X25519PrivateKey, their_pk: bytes, context: bytes) -> bytes:
    shared = own_sk.exchange(X25519PublicKey.from_public_bytes(their_pk))
    return _hkdf(shared, b"fedagent-secagg-box/1|" + context)


def _box_nonce(sender: str, receiver: str) -> bytes:
    # One box per direction per round under a key used for one round: sender and
    # receiver in the nonce keep i→j and j→i apart.
    return hashlib.sha256(f"{sender}>{receiver}".encode()).digest()[:12]


def shamir_split(secret: bytes, xs: Sequence[int], t: int, random_bytes: Callable[[int], bytes]) -> dict[int, bytes]:
    s = int.from_bytes(secret, "big")
    coeffs = [s] + [int.from_bytes(random_bytes(_SHARE_BYTES), "big") % PRIME for _ in range(t - 1)]
    out: dict[int, bytes] = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(_SHARE_BYTES, "big")
    return out


def shamir_combine(shares: Mapping[int, bytes], size: int = 32) -> bytes:
    pts = [(x, int.from_bytes(y, "big")) for x, y in shares.items()]
    s = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        s = (s + yi * num * pow(den, -1, PRIME)) % PRIME
    if s >= 1 << (8 * size):
        raise SecAggError("shares do not rebuild a secret of the expected size")
    return s.to_bytes(size, "big")


def _pack_share(x: int, y: bytes) -> bytes:
    return x.to_bytes(2, "big") + y


def _unpack_share(data: bytes) -> tuple[int, bytes]:
    if len(data) != _SHARE_BYTES + 2:
        raise SecAggError("malformed share")
    return int.from_bytes(data[:2], "big"), data[2:]


def _layout(weights: Mapping[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(weights[k].shape)) for k in sorted(weights) if weights[k].dtype.kind == "f"]


def flatten(weights: Mapping[str, np.ndarray]) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray]:
    """The floating tensors of ``weights`` in name order, as one float64 vector."""
    layout = _layout(weights)
    if not layout:
        return layout, np.zeros(0)
    return layout, np.concatenate([np.asarray(weights[k], dtype=np.float64).reshape(-1) for k, _ in layout])


def unflatten(
    layout: Sequence[tuple[str, tuple[int, ...]]], vec: np.ndarray, like: Mapping[str, np.ndarray]
) -> Weights:
    out: Weights = {}
    pos = 0
    for k, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))
        out[k] = vec[pos : pos + n].reshape(shape).astype(like[k].dtype)
        pos += n
    return out


def layout_size(weights: Mapping[str, np.ndarray]) -> int:
    return sum(int(w.size) for w in weights.values() if w.dtype.kind == "f")


def quantise(v: np.ndarray, params: SecAggParams, scale: float = 1.0) -> np.ndarray:
    """``scale · v`` clipped and rounded to its level:
    ``round((clip(scale·v, −c, c) + c) / step)``, computed as
    ``round(clip(scale·v/step, −L/2, L/2) + L/2)`` (c/step = L/2 for L levels)."""
    out = np.empty(v.size, np.uint32)
    work = np.empty(min(v.size, BLOCK))
    for lo in range(0, v.size, BLOCK):
        _quantise_block(v.reshape(-1)[lo : lo + BLOCK], params, scale, out[lo : lo + BLOCK], work)
    return out


def _quantise_block(v: np.ndarray, params: SecAggParams, scale: float, out: np.ndarray, work: np.ndarray) -> None:
    """:func:`quantise` of one block into ``out`` (uint32), with ``work`` (float64, at
    least as long) as scratch."""
    half = params.levels / 2
    w = work[: v.size]
    np.multiply(v, scale / params.step, out=w, dtype=np.float64, casting="unsafe")
    np.clip(w, -half, half, out=w)
    w += half
    np.rint(w, out=w)
    # In [0, 2^30]: the same value in int32, whose conversion is the faster one.
    np.copyto(out.view(np.int32), w, casting="unsafe")


class Delta:
    """An update's difference from the round's model, as the pairs of floating tensors
    (trained, global) in :func:`flatten` order: read block by block when it is masked,
    never flattened into a model-sized float64 copy."""

    def __init__(self, new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray]) -> None:
        layout = _layout(old)
        if _layout(new) != layout:
            raise SecAggError("the trained weights do not have the round model's floating tensors")
        self.pairs = [(np.asarray(new[k]).reshape(-1), np.asarray(old[k]).reshape(-1)) for k, _ in layout]
        self.size = sum(a.size for a, _ in self.pairs)

    def blocks(self, work: np.ndarray) -> Iterator[np.ndarray]:
        """The difference in consecutive blocks of at most ``work.size`` values (float64,
        in ``work``; each block is valid until the next is drawn)."""
        for a, b in self.pairs:
            for lo in range(0, a.size, work.size):
                m = min(work.size, a.size - lo)
                yield np.subtract(a[lo : lo + m], b[lo : lo + m], out=work[:m], dtype=np.float64, casting="unsafe")


def _delta_blocks(delta: np.ndarray | Delta, work: np.ndarray) -> Iterator[np.ndarray]:
    if isinstance(delta, Delta):
        yield from delta.blocks(work)
        return
    flat = delta.reshape(-1)
    for lo in range(0, flat.size, work.size):
        yield flat[lo : lo + work.size]


def dequantise_sum(s: np.ndarray, count: int, params: SecAggParams) -> np.ndarray:
    """The real-valued sum of ``count`` quantised inputs whose integer sum is ``s``."""
    return s.astype(np.float64) * params.step - count * params.clip


def _sign(a: str, b: str) -> int:
    return 1 if a < b else -1


def key_statement(agent: str, context: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    """What an agent signs for its advertised keys (bound to the round and itself)."""
    return msgpack.packb([KEY_DOMAIN, context, agent, c_pk, s_pk], use_bin_type=True)


def ahead_statement(agent: str, round_: int, advertised_in: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    """What an agent signs for keys advertised ahead: bound to the one round they are for
    (``round_``) and to the round they were advertised in (its context: round and seed)."""
    return msgpack.packb([AHEAD_DOMAIN, round_, advertised_in, agent, c_pk, s_pk], use_bin_type=True)


def list_statement(agent: str, context: bytes, survivors: Sequence[str]) -> bytes:
    """What an agent signs in the consistency stage: the round's survivor list."""
    return msgpack.packb([LIST_DOMAIN, context, agent, sorted(survivors)], use_bin_type=True)


Signer = Callable[[bytes], tuple[bytes, bytes]]  # statement -> (cert, sig)
KeyVerifier = Callable[[str, bytes, bytes, bytes], None]  # (agent, statement, cert, sig); raises


# ---- the agent's side ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AheadKeys:
    """An agent's key pairs for one future round, advertised (signed) with its masked
    input of the round before: the secret halves stay with the agent until that round
    starts, and are used in it or thrown away."""

    round: int  # the only round they are for
    advertised_in: bytes  # the context (round and seed) of the round they were advertised in
    c_sk: bytes = field(repr=False)
    s_sk: bytes = field(repr=False)
    public: SecAggKeys


class SecAggClient:
    """One agent's part in one secure round. Methods take what the coordinator relayed
    and return what to send; :class:`SecAggError` means: stop taking part in this round."""

    def __init__(
        self,
        agent: str,
        round_: int,
        selected: Sequence[str],
        setup: SecAggSetup,
        *,
        sign: Signer | None = None,
        verify: KeyVerifier | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
        keys: AheadKeys | None = None,
    ) -> None:
        """``keys``: the key pairs this agent advertised ahead for this round (the setup
        says ``ahead``); without them fresh pairs are made, to :meth:`advertise`."""
        if agent not in selected:
            raise SecAggError(f"{agent} is not selected for round {round_}")
        if setup.ahead and (keys is None or keys.round != round_):
            raise SecAggError(f"round {round_} uses keys advertised ahead, and I advertised none for it")
        self.agent = agent
        self.round = round_
        self.setup = setup
        self.params = setup.params
        self.context = setup.context(round_)
        self.graph_neighbours = neighbour_graph(selected, setup.seed, setup.params.neighbours)[agent]
        self.selected = frozenset(selected)
        self.signed: tuple[str, ...] | None = None  # the survivor list this agent signed
        self._rand = random_bytes
        self._sign = sign
        self._verify = verify
        # Where the neighbours' keys were signed: this round's context, or (keys
        # advertised ahead) the context of the round they were advertised in.
        self._ahead_ctx: bytes | None = None
        if setup.ahead:
            assert keys is not None
            self._c_sk = X25519PrivateKey.from_private_bytes(keys.c_sk)
            self._s_sk = X25519PrivateKey.from_private_bytes(keys.s_sk)
            self._ahead_ctx = keys.advertised_in
        else:
            self._c_sk = X25519PrivateKey.from_private_bytes(random_bytes(32))
            self._s_sk = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._b = random_bytes(32)
        self.keys: dict[str, SecAggKeys] = {}  # neighbours that advertised keys
        self.holders: tuple[str, ...] = ()  # who holds shares of my secrets (me first)
        self.held: dict[str, tuple[bytes, bytes]] = {}  # owner -> (b share, sk share) I hold
        self.masking_with: tuple[str, ...] = ()  # neighbours whose shares arrived
        self.revealed: dict[str, str] = {}  # owner -> "b" | "sk": the one share I gave out
        self.masked_sent = False
        # The mask sum drawn ahead (:meth:`premask`) and the neighbours it covers.
        self._premask: tuple[np.ndarray, frozenset[str]] | None = None

    def advertise(self) -> SecAggKeys:
        if self._ahead_ctx is not None:
            raise SecAggError("this round's keys were advertised ahead")
        c_pk = self._c_sk.public_key().public_bytes_raw()
        s_pk = self._s_sk.public_key().public_bytes_raw()
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(key_statement(self.agent, self.context, c_pk, s_pk))
        return SecAggKeys(self.round, c_pk, s_pk, cert, sig)

    def on_roster(self, msg: SecAggRoster) -> SecAggShares:
        if msg.round != self.round or self.holders:
            raise SecAggError("roster for another round, or a second roster")
        stray = set(msg.keys) - set(self.graph_neighbours)
        if stray:
            raise SecAggError(f"roster names agents outside my neighbourhood: {sorted(stray)[:3]}")
        for name, k in msg.keys.items():
            if k.round != self.round:
                raise SecAggError(f"the keys of {name} are for round {k.round}, not {self.round}")
            if self._verify is not None:
                if self._ahead_ctx is None:
                    statement = key_statement(name, self.context, k.c_pk, k.s_pk)
                else:
                    # Signed for this round, advertised in the round before: keys of any
                    # other round (a replay) do not verify.
                    statement = ahead_statement(name, self.round, self._ahead_ctx, k.c_pk, k.s_pk)
                self._verify(name, statement, k.cert, k.sig)
        if not msg.keys:
            raise SecAggError("no neighbour advertised keys: my input would not be hidden")
        self.keys = dict(msg.keys)
        self.holders = (self.agent, *sorted(msg.keys))
        t = self.params.threshold_of(len(self.holders))
        xs = list(range(1, len(self.holders) + 1))
        b_sh = shamir_split(self._b, xs, t, self._rand)
        sk_sh = shamir_split(self._s_sk.private_bytes_raw(), xs, t, self._rand)
        self.held[self.agent] = (_pack_share(1, b_sh[1]), _pack_share(1, sk_sh[1]))
        boxes: dict[str, bytes] = {}
        for x, name in zip(xs[1:], self.holders[1:], strict=True):
            plain = msgpack.packb(
                [self.agent, name, self.round, _pack_share(x, b_sh[x]), _pack_share(x, sk_sh[x])], use_bin_type=True
            )
            key = _box_key(self._c_sk, self.keys[name].c_pk, self.context)
            boxes[name] = ChaCha20Poly1305(key).encrypt(_box_nonce(self.agent, name), plain, self.context)
        return SecAggShares(self.round, boxes, hashlib.sha256(self._b).digest())

    def on_sharebox(self, msg: SecAggShareBox) -> None:
        if msg.round != self.round or not self.holders or self.masking_with:
            raise SecAggError("share box for another round, before my roster, or twice")
        for sender, box in msg.boxes.items():
            if sender not in self.keys:
                raise SecAggError(f"share box from {sender}, not a neighbour with keys")
            key = _box_key(self._c_sk, self.keys[sender].c_pk, self.context)
            try:
                plain = ChaCha20Poly1305(key).decrypt(_box_nonce(sender, self.agent), box, self.context)
            except InvalidTag:
                raise SecAggError(f"the share box from {sender} does not open (altered?)") from None
            try:
                s, r, rnd, b_share, sk_share = msgpack.unpackb(plain, raw=False)
            except (ValueError, TypeError, msgpack.UnpackException):
                raise SecAggError(f"malformed share box from {sender}") from None
            if (s, r, rnd) != (sender, self.agent, self.round) or not all(
                isinstance(x, bytes) and len(x) == _SHARE_BYTES + 2 for x in (b_share, sk_share)
            ):
                raise SecAggError(f"share box from {sender} is not for me in this round")
            self.held[sender] = (b_share, sk_share)
        if not msg.boxes:
            raise SecAggError("no neighbour completed the share stage: my input would not be hidden")
        self.masking_with = tuple(sorted(msg.boxes))

    def advertise_ahead(self) -> AheadKeys | None:
        """Fresh key pairs for the setup's ``next_round``, signed for that round alone
        (and bound to this one), to go with the masked input; None if the setup names no
        next round."""
        target = self.setup.next_round
        if target <= self.round:
            return None
        c_raw, s_raw = self._rand(32), self._rand(32)
        c_pk = X25519PrivateKey.from_private_bytes(c_raw).public_key().public_bytes_raw()
        s_pk = X25519PrivateKey.from_private_bytes(s_raw).public_key().public_bytes_raw()
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(ahead_statement(self.agent, target, self.context, c_pk, s_pk))
        return AheadKeys(target, self.context, c_raw, s_raw, SecAggKeys(target, c_pk, s_pk, cert, sig))

    def premask(self, size: int) -> None:
        """Draws the mask sum for an update of ``size`` values ahead of the update: the
        self mask and the pairwise mask of every neighbour in the roster (the masks do
        not depend on the update, and the keys are agreed once the roster is in). The
        masked input then only quantises the update onto it, and takes back the mask of
        a neighbour whose shares never came (it will not be masking with this agent).
        Costs one uint32 vector of ``size`` values until the masked input is made."""
        if not self.holders or self.masked_sent or self._premask is not None or size < 1:
            return
        streams = self._mask_streams(sorted(self.keys))
        m = np.zeros(size, np.uint32)
        streams.add_all(m)
        self._premask = (m, frozenset(self.keys))

    def _mask_streams(self, neighbours: Sequence[str], sign: int = 1, self_mask: bool = True) -> _Streams:
        streams = _Streams()
        if self_mask:
            streams.add_stream(self._b, _SELF_NONCE, sign)
        for j in neighbours:
            seed = pair_seed(self._s_sk, self.keys[j].s_pk, self.context)
            streams.add_stream(seed, sign=sign * _sign(self.agent, j))
        return streams

    def masked_input(self, delta: np.ndarray | Delta, num_samples: int) -> np.ndarray:
        """``delta``: this round's update minus the global model (:func:`flatten` order,
        or a :class:`Delta`). Quantised and masked in one pass, block by block: the self
        mask and each neighbour's pairwise mask (or the sum drawn by :meth:`premask`)
        are added to a block while it is in cache."""
        if not self.masking_with:
            raise SecAggError("no share box yet")
        if self.masked_sent:
            raise SecAggError("masked input already made for this round")
        size = delta.size
        pre, self._premask = self._premask, None
        if pre is not None and pre[0].size == size and set(self.masking_with) <= pre[1]:
            # The sum drawn ahead, less the masks of neighbours that did not share.
            y = pre[0]
            streams = self._mask_streams(sorted(pre[1] - set(self.masking_with)), sign=-1, self_mask=False)
            q = np.empty(min(size, BLOCK), np.uint32)
        else:
            y = np.empty(size, np.uint32)
            streams = self._mask_streams(self.masking_with)
            q = None
        work = np.empty(min(size, BLOCK))
        scale = self.setup.ratio(num_samples)
        pos = 0
        for v in _delta_blocks(delta, work):
            out = y[pos : pos + v.size]
            if q is None:
                _quantise_block(v, self.params, scale, out, work)
            else:
                _quantise_block(v, self.params, scale, q[: v.size], work)
                np.add(out, q[: v.size], out=out)
            if streams:
                streams.apply(out)
            pos += v.size
        self.masked_sent = True
        return y

    def on_survivors(self, msg: SecAggSurvivors) -> SecAggSignature:
        """Sign the round's survivor list: once per round, and only a list that names
        this agent (it sent its input), agents of the round and enough of them."""
        if msg.round != self.round:
            raise SecAggError(f"survivor list for round {msg.round}, I am in round {self.round}")
        if not self.masked_sent:
            raise SecAggError("survivor list before I sent my masked input")
        survivors = tuple(sorted(set(msg.survivors)))
        if self.signed is not None:
            if survivors == self.signed:  # a redelivery: the same signature again
                return self._sign_list(survivors)
            raise SecAggError("a second, different survivor list for this round: not signed")
        if self.agent not in survivors:
            raise SecAggError("the survivor list leaves me out, but I sent my masked input")
        stray = set(survivors) - self.selected
        if stray:
            raise SecAggError(f"the survivor list names agents outside the round: {sorted(stray)[:3]}")
        if len(survivors) < self.params.min_survivors:
            raise SecAggError(f"a survivor list of {len(survivors)} is below min_survivors {self.params.min_survivors}")
        self.signed = survivors
        return self._sign_list(survivors)

    def _sign_list(self, survivors: tuple[str, ...]) -> SecAggSignature:
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(list_statement(self.agent, self.context, survivors))
        return SecAggSignature(self.round, cert, sig)

    def _list_signers(self, signatures: Mapping[str, tuple[bytes, bytes]]) -> int:
        """How many agents on the list this agent signed signed that same list."""
        assert self.signed is not None
        valid = 0
        for name, (cert, sig) in signatures.items():
            if name not in self.signed:
                continue
            if self._verify is not None:
                try:
                    self._verify(name, list_statement(name, self.context, self.signed), cert, sig)
                except Exception:  # noqa: BLE001 - any failure: the signature does not count
                    continue
            valid += 1
        return valid

    def on_unmask(self, msg: SecAggUnmask) -> SecAggReveal:
        """The shares asked for, unless the request could reveal a single input or does
        not come with enough signatures of the survivor list this agent signed: then a
        refusal, and nothing."""

        def refuse(why: str) -> SecAggReveal:
            return SecAggReveal(self.round, {}, {}, refused=why)

        if msg.round != self.round:
            return refuse(f"request for round {msg.round}, I am in round {self.round}")
        if not self.masked_sent:
            return refuse("I sent no masked input this round")
        both = set(msg.b_of) & set(msg.sk_of)
        if both:
            return refuse(f"both shares asked for {sorted(both)[0]}")
        if self.agent in msg.sk_of:
            return refuse("asked for my own key share, but I sent my input")
        for name in msg.b_of:
            if self.revealed.get(name, "b") != "b":
                return refuse(f"asked for the seed share of {name} after its key share")
        for name in msg.sk_of:
            if self.revealed.get(name, "sk") != "sk":
                return refuse(f"asked for the key share of {name} after its seed share")
        if msg.survivors < self.params.min_survivors:
            return refuse(f"a sum of {msg.survivors} input(s) is below min_survivors {self.params.min_survivors}")
        if self.signed is None:
            return refuse("asked for shares before I signed the survivor list")
        listed = set(self.signed)
        if msg.survivors != len(listed) or not set(msg.b_of) <= listed or set(msg.sk_of) & listed:
            return refuse("the request does not match the survivor list I signed")
        need = self.params.threshold_of(len(self.selected))
        signers = self._list_signers(msg.signatures)
        if signers < need:
            return refuse(
                f"only {signers} valid signatures of the survivor list I signed, need {need} "
                f"of the {len(self.selected)} agents selected"
            )
        unknown = (set(msg.b_of) | set(msg.sk_of)) - set(self.held)
        if unknown:
            return refuse(f"I hold no shares of {sorted(unknown)[0]}")
        for name in msg.b_of:
            self.revealed[name] = "b"
        for name in msg.sk_of:
            self.revealed[name] = "sk"
        return SecAggReveal(self.round, {n: self.held[n][0] for n in msg.b_of}, {n: self.held[n][1] for n in msg.sk_of})


@dataclass(frozen=True, slots=True)
class _Trained:
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    leaving: bool
    delta: np.ndarray | Delta = field(repr=False)


class SecAggAgent:
    """An agent across secure rounds: a :class:`SecAggClient` for the round it is
    selected for, and its trained update held until its share box is in (training and
    the key stages run at the same time). Every method returns the messages to send to
    the coordinator; a protocol error ends this agent's part in the round (``error``)."""

    def __init__(
        self,
        agent: str,
        *,
        sign: Signer | None = None,
        verify: KeyVerifier | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.agent = agent
        self._sign = sign
        self._verify = verify
        self._rand = random_bytes
        self.client: SecAggClient | None = None
        self.round = 0
        self._trained: _Trained | None = None
        self.error = ""
        self.refusals: list[str] = []
        self.ahead: AheadKeys | None = None  # keys advertised for a later round (at most one set)
        self._early: SecAggRoster | None = None  # a roster that came before its round's start

    def on_round_start(self, round_: int, selected: Sequence[str], setup: SecAggSetup) -> list[SecAggMessage]:
        if round_ <= self.round:
            return []
        self.round, self.client, self._trained, self.error = round_, None, None, ""
        keys = self.ahead
        if keys is not None and keys.round <= round_:
            # Used in this round or never: a key pair serves one round.
            self.ahead = None
        early, self._early = self._early, None
        if self.agent not in selected:
            return []
        try:
            self.client = SecAggClient(
                self.agent,
                round_,
                selected,
                setup,
                sign=self._sign,
                verify=self._verify,
                random_bytes=self._rand,
                keys=keys if setup.ahead else None,
            )
        except SecAggError as exc:
            return self._fail(exc)
        if not setup.ahead:
            return [self.client.advertise()]
        if early is not None and early.round == round_:
            return self.on_message(early)
        return []

    def _fail(self, exc: SecAggError) -> list[SecAggMessage]:
        self.error = str(exc)
        self.client = None
        self._trained = None
        return []

    def on_message(self, msg: SecAggMessage) -> list[SecAggMessage]:
        cl = self.client
        if isinstance(msg, SecAggRoster) and msg.round > self.round:
            # Sent right after the round's start, but overtook it: kept for it.
            self._early = msg
            return []
        if cl is None or getattr(msg, "round", None) != cl.round:
            return []
        try:
            if isinstance(msg, SecAggRoster):
                return [cl.on_roster(msg)]
            if isinstance(msg, SecAggShareBox):
                cl.on_sharebox(msg)
                return self._maybe_input()
            if isinstance(msg, SecAggSurvivors):
                return [cl.on_survivors(msg)]
            if isinstance(msg, SecAggUnmask):
                reveal = cl.on_unmask(msg)
                if reveal.refused:
                    self.refusals.append(reveal.refused)
                return [reveal]
        except SecAggError as exc:
            return self._fail(exc)
        return []

    def on_trained(
        self,
        round_: int,
        delta: np.ndarray | Delta,
        *,
        base_version: int,
        num_samples: int,
        metrics: Mapping[str, float],
        leaving: bool = False,
    ) -> list[SecAggMessage]:
        """``delta``: the trained weights minus the round's model (:func:`flatten` order,
        or a :class:`Delta`)."""
        if self.client is None or round_ != self.client.round:
            return []
        self._trained = _Trained(base_version, num_samples, dict(metrics), leaving, delta)
        return self._maybe_input()

    def prepare(self, size: int | None = None) -> None:
        """Draws this round's mask sum ahead (:meth:`SecAggClient.premask`) once the
        roster is in, for an update of ``size`` values (default: the size of the update
        already trained, if any). Worth calling while the agent would otherwise wait
        (training, or the share stage's round trip); never needed."""
        cl = self.client
        if cl is None or cl.masked_sent:
            return
        if size is None and self._trained is not None:
            size = self._trained.delta.size
        if size:
            cl.premask(size)

    def _maybe_input(self) -> list[SecAggMessage]:
        cl, tr = self.client, self._trained
        if cl is None or tr is None or not cl.masking_with or cl.masked_sent:
            return []
        try:
            y = cl.masked_input(tr.delta, tr.num_samples)
        except SecAggError as exc:
            return self._fail(exc)
        self._trained = None
        ahead = cl.advertise_ahead()
        if ahead is not None:
            self.ahead = ahead
        return [
            SecAggMasked(
                cl.round,
                tr.base_version,
                tr.num_samples,
                tr.metrics,
                {"masked": y.view(np.int32)},
                tr.leaving,
                None if ahead is None else ahead.public,
            )
        ]


# ---- the coordinator's side ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Received:
    """A SecAgg message from ``sender`` (its certificate's name)."""

    sender: str
    message: SecAggMessage


@dataclass(frozen=True, slots=True)
class Gone:
    agent: str


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Send:
    to: str
    message: SecAggMessage


@dataclass(frozen=True, slots=True)
class Refused:
    sender: str
    reason: str  # short code
    detail: str


@dataclass(frozen=True, slots=True)
class Wake:
    at: float


@dataclass(frozen=True, slots=True)
class Contribution:
    num_samples: int
    metrics: dict[str, float]
    leaving: bool
    base_version: int


@dataclass(frozen=True, slots=True)
class Unmasked:
    """The round's result: the sample-weighted mean of the survivors' updates."""

    mean: np.ndarray = field(repr=False)  # float64, the flattened layout
    contributors: dict[str, Contribution]
    weight_sum: float
    error_bound: float
    dropped_before_input: tuple[str, ...]  # shared keys, sent no masked input
    silent_at_unmask: tuple[str, ...]  # had sent no shares when enough were in
    # survivor -> why its signature of the survivor list did not verify (its input is in
    # the sum, like a silent survivor's; it was not asked for shares)
    bad_signatures: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


ServerCommand = Send | Refused | Wake | Unmasked | Failed


class SecAggServer:
    """The coordinator's part in one secure round: relays keys and boxes, collects
    masked inputs, asks for shares and removes the masks. ``handle`` returns commands;
    the round ends with exactly one :class:`Unmasked` or :class:`Failed`.

    Stages close early once every agent still online has answered; otherwise at their
    deadline: keys and shares ``stage_timeout`` after they open, masked inputs at
    ``input_deadline`` (training happens meanwhile), the survivor list's signatures and the
    shares ``stage_timeout`` each."""

    KEYS, SHARES, INPUTS, CONSISTENCY, UNMASK, DONE = "keys", "shares", "inputs", "consistency", "unmask", "done"

    def __init__(
        self,
        round_: int,
        selected: Sequence[str],
        setup: SecAggSetup,
        size: int,
        *,
        now: float,
        stage_timeout: float,
        input_deadline: float,
        online: set[str] | None = None,
        admit: Callable[[int], str] | None = None,
        verify: KeyVerifier | None = None,
        ahead: Mapping[str, SecAggKeys] | None = None,
    ) -> None:
        """``admit(survivors)``: asked once the masked inputs are in, before anything is
        unmasked; a reason returned abandons the round (a privacy budget the sum of that
        many updates would overdraw). ``verify``: checks a survivor's signature of the
        survivor list as the agents will (raises if it is not valid); a survivor whose
        signature fails is dropped from the rest of the round, and its signature is
        never passed on. Without it every signature is passed on unchecked. ``ahead``:
        when the setup says so, the keys every selected agent advertised for this round
        with its masked input of the round before (:attr:`next_keys` of that round's
        server); the key stage is skipped and :meth:`start` sends the rosters."""
        if len(selected) > setup.params.max_agents:
            raise SecAggError(
                f"{len(selected)} agents exceed the {setup.params.max_agents} whose masked sum fits "
                f"2^{MODULUS_BITS} at {setup.params.bits} bits"
            )
        self.round = round_
        self.setup = setup
        self.params = setup.params
        self.context = setup.context(round_)
        self.selected = tuple(sorted(selected))
        self.graph = neighbour_graph(self.selected, setup.seed, self.params.neighbours)
        self.size = size
        self.stage_timeout = stage_timeout
        self.input_deadline = input_deadline
        self.online = set(self.selected if online is None else online & set(self.selected))
        self.stage = self.KEYS
        self.deadline = now + stage_timeout
        self.keys: dict[str, SecAggKeys] = {}
        self.rosters: dict[str, tuple[str, ...]] = {}  # agent -> neighbours whose keys it got
        self.shares: dict[str, SecAggShares] = {}
        self.inputs: dict[str, SecAggMasked] = {}
        self._sum: np.ndarray | None = None
        self.admit = admit
        self.survivors: tuple[str, ...] = ()  # the list sent out in the consistency stage
        self.signatures: dict[str, tuple[bytes, bytes]] = {}  # survivor -> (cert, sig) of the list
        self.verify = verify
        self.bad_signatures: dict[str, str] = {}  # survivor -> why its list signature failed
        self.bad_keys: dict[str, str] = {}  # agent -> why its key advertisement failed
        self.asked: set[str] = set()
        self.answered: set[str] = set()
        self.b_shares: dict[str, dict[int, bytes]] = {}
        self.sk_shares: dict[str, dict[int, bytes]] = {}
        self._self_off: set[str] = set()  # survivors whose self mask is off the sum already
        self.received_kinds: list[tuple[str, str]] = []  # (sender, kind): what this round was sent
        # Keys for the setup's next_round, advertised with the masked inputs.
        self.next_keys: dict[str, SecAggKeys] = {}
        self.bad_ahead: dict[str, str] = {}  # agent -> why its keys ahead did not verify
        if setup.ahead:
            missing = [a for a in self.selected if ahead is None or a not in ahead]
            if missing:
                raise SecAggError(f"no keys advertised ahead by {', '.join(missing[:3])}: the round needs a key stage")
            assert ahead is not None
            stray = [a for a in self.selected if ahead[a].round != round_]
            if stray:
                raise SecAggError(f"the keys advertised by {', '.join(stray[:3])} are not for round {round_}")
            self.keys = {a: ahead[a] for a in self.selected}

    def start(self) -> list[ServerCommand]:
        """The first commands: a wake-up at the key stage's deadline, or (keys advertised
        ahead) every agent's roster and a wake-up at the share stage's."""
        if self.setup.ahead:
            return self._rosters(self.deadline - self.stage_timeout)
        return [Wake(self.deadline)]

    def status(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "keys": len(self.keys),
            "shares": len(self.shares),
            "inputs": len(self.inputs),
            "signatures": len(self.signatures),
            "bad_signatures": len(self.bad_signatures),
            "bad_keys": len(self.bad_keys),
            "reveals": len(self.answered),
        }

    def handle(self, event: Received | Gone | Tick, now: float) -> list[ServerCommand]:
        if self.stage == self.DONE:
            return []
        if isinstance(event, Gone):
            self.online.discard(event.agent)
            return self._maybe_close(now)
        if isinstance(event, Tick):
            return self._maybe_close(now)
        return self._on_message(event.sender, event.message, now)

    # -- messages ----------------------------------------------------------------------
    def _on_message(self, sender: str, msg: SecAggMessage, now: float) -> list[ServerCommand]:
        self.received_kinds.append((sender, msg.kind))

        def refuse(reason: str, detail: str) -> list[ServerCommand]:
            return [Refused(sender, reason, detail)]

        if getattr(msg, "round", None) != self.round:
            return refuse("stale", f"{msg.kind} for round {getattr(msg, 'round', '?')}, current {self.round}")
        if sender not in self.graph:
            return refuse("unselected", f"{sender} is not in secure round {self.round}")
        if isinstance(msg, SecAggKeys):
            if self.stage != self.KEYS or sender in self.keys or sender in self.bad_keys:
                return refuse("stage", f"keys from {sender} in stage {self.stage}")
            why = self._check_signature(sender, key_statement(sender, self.context, msg.c_pk, msg.s_pk), msg)
            if why:
                # Passed on, every neighbour would find it invalid and leave the round (below
                # about 8 agents that is everyone): the sender is left out, as if it had
                # never advertised.
                self.bad_keys[sender] = why
                return refuse(
                    "key_signature", f"{sender}'s key advertisement is not validly signed ({why}): left out"
                ) + self._maybe_close(now)
            self.keys[sender] = msg
        elif isinstance(msg, SecAggShares):
            if self.stage != self.SHARES or sender not in self.rosters or sender in self.shares:
                return refuse("stage", f"shares from {sender} in stage {self.stage}")
            if set(msg.boxes) != set(self.rosters[sender]):
                return refuse("shares", f"{sender} sealed boxes for other agents than its roster")
            self.shares[sender] = msg
        elif isinstance(msg, SecAggMasked):
            if self.stage != self.INPUTS or sender not in self.shares or sender in self.inputs:
                return refuse("stage", f"masked input from {sender} in stage {self.stage}")
            if msg.masked.size != self.size:
                return refuse("shape", f"masked input of {msg.masked.size} values, the model has {self.size}")
            # Fold at once: the coordinator keeps one running sum, never the inputs.
            if self._sum is None:
                self._sum = msg.masked.copy()
            else:
                self._sum += msg.masked
            self.inputs[sender] = SecAggMasked(
                msg.round,
                msg.base_version,
                msg.num_samples,
                msg.metrics,
                {"masked": np.zeros(0, np.int32)},
                msg.leaving,
            )
            if msg.ahead is not None and self.setup.next_round and msg.ahead.round == self.setup.next_round:
                k = msg.ahead
                why = self._check_signature(sender, ahead_statement(sender, k.round, self.context, k.c_pk, k.s_pk), k)
                if why:
                    # The input counts; the next round has a key stage instead.
                    self.bad_ahead[sender] = why
                    return refuse(
                        "key_signature",
                        f"{sender}'s keys for round {k.round} are not validly signed ({why}): "
                        "that round has a key stage",
                    ) + self._maybe_close(now)
                self.next_keys[sender] = k
        elif isinstance(msg, SecAggSignature):
            if (
                self.stage != self.CONSISTENCY
                or sender not in self.survivors
                or sender in self.signatures
                or sender in self.bad_signatures
            ):
                return refuse("stage", f"list signature from {sender} in stage {self.stage}")
            why = self._check_list_signature(sender, msg)
            if why:
                # Passed on, it would count for nothing with the honest agents (they check
                # every signature) and could leave them short of the signatures they want:
                # the sender takes no further part, as if it had dropped out after its input.
                self.bad_signatures[sender] = why
                return refuse(
                    "list_signature", f"{sender}'s signature of the survivor list is not valid ({why}): dropped"
                ) + self._maybe_close(now)
            self.signatures[sender] = (msg.cert, msg.sig)
        elif isinstance(msg, SecAggReveal):
            if self.stage != self.UNMASK or sender not in self.asked or sender in self.answered:
                return refuse("stage", f"shares from {sender} in stage {self.stage}")
            self.answered.add(sender)
            if msg.refused:
                return refuse("refused", f"{sender} refused to reveal shares: {msg.refused}") + self._maybe_close(now)
            for store, got in ((self.b_shares, msg.b_shares), (self.sk_shares, msg.sk_shares)):
                for owner, share in got.items():
                    try:
                        x, y = _unpack_share(share)
                    except SecAggError:
                        continue
                    if owner in self.rosters and 1 <= x <= len(self.rosters[owner]) + 1:
                        store.setdefault(owner, {})[x] = y
            # A survivor's self mask comes off as soon as its seed can be rebuilt, while
            # the other answers are on their way.
            for owner in sorted(msg.b_shares):
                if owner in self.inputs and owner not in self._self_off and self._enough(owner):
                    if not self._remove_self_mask(owner):
                        return self._fail(
                            f"the self-mask seed of {owner} rebuilt from shares does not match its commitment"
                        )
        else:
            return refuse("kind", f"{msg.kind} is not sent to a coordinator")
        return self._maybe_close(now)

    def _check_list_signature(self, sender: str, msg: SecAggSignature) -> str:
        """Why ``sender``'s signature of the survivor list is not valid, or ''."""
        return self._check_signature(sender, list_statement(sender, self.context, self.survivors), msg)

    def _check_signature(self, sender: str, statement: bytes, msg: SecAggSignature | SecAggKeys) -> str:
        """Why ``msg``'s signature of ``statement`` is not ``sender``'s, or '' (also
        without a verifier: then everything is passed on unchecked)."""
        if self.verify is None:
            return ""
        try:
            self.verify(sender, statement, msg.cert, msg.sig)
        except Exception as exc:  # noqa: BLE001 - any failure: the signature does not count
            return str(exc) or type(exc).__name__
        return ""

    # -- stages ------------------------------------------------------------------------
    def _owed(self) -> set[str]:
        if self.stage == self.KEYS:
            return set(self.selected) - set(self.keys) - set(self.bad_keys)
        if self.stage == self.SHARES:
            return set(self.rosters) - set(self.shares)
        if self.stage == self.INPUTS:
            return set(self.shares) - set(self.inputs)
        if self.stage == self.CONSISTENCY:
            return set(self.survivors) - set(self.signatures) - set(self.bad_signatures)
        return self.asked - self.answered

    def _maybe_close(self, now: float) -> list[ServerCommand]:
        owed_online = self._owed() & self.online
        if self.stage == self.UNMASK and self._can_unmask():
            return self._finish()
        if owed_online and now < self.deadline:
            return []
        return self._close(now)

    def _fail(self, reason: str) -> list[ServerCommand]:
        self.stage = self.DONE
        self._sum = None
        return [Failed(reason)]

    def _close(self, now: float) -> list[ServerCommand]:
        p = self.params
        if self.stage == self.KEYS:
            if len(self.keys) < p.min_survivors:
                return self._fail(f"{len(self.keys)} agents advertised keys, need {p.min_survivors}")
            return self._rosters(now)
        if self.stage == self.SHARES:
            if len(self.shares) < p.min_survivors:
                return self._fail(f"{len(self.shares)} agents shared their keys, need {p.min_survivors}")
            out: list[ServerCommand] = []
            for j in sorted(self.shares):
                boxes = {i: self.shares[i].boxes[j] for i in self.rosters[j] if i in self.shares}
                if boxes:
                    out.append(Send(j, SecAggShareBox(self.round, boxes)))
            self.stage, self.deadline = self.INPUTS, max(self.input_deadline, now)
            return out + [Wake(self.deadline)]
        if self.stage == self.INPUTS:
            if len(self.inputs) < p.min_survivors:
                return self._fail(f"{len(self.inputs)} masked inputs arrived, need {p.min_survivors}")
            why = self.admit(len(self.inputs)) if self.admit is not None else ""
            if why:
                return self._fail(why)
            self.survivors = tuple(sorted(self.inputs))
            out = [Send(j, SecAggSurvivors(self.round, self.survivors)) for j in self.survivors]
            self.stage, self.deadline = self.CONSISTENCY, now + self.stage_timeout
            return out + [Wake(self.deadline)]
        if self.stage == self.CONSISTENCY:
            need = p.threshold_of(len(self.selected))
            if len(self.signatures) < need:
                bad = sorted(self.bad_signatures)
                return self._fail(
                    f"{len(self.signatures)} survivors signed the survivor list, need {need} "
                    f"of the {len(self.selected)} selected"
                    + (f" ({len(bad)} signatures not valid: {', '.join(bad[:5])})" if bad else "")
                )
            u2 = set(self.inputs)
            needed = self._needed()
            out = []
            for j in sorted(self.signatures):
                owners = [o for o in (j, *self.rosters[j]) if o in needed]
                b_of = tuple(o for o in owners if o in u2)
                sk_of = tuple(o for o in owners if o not in u2)
                self.asked.add(j)
                out.append(Send(j, SecAggUnmask(self.round, b_of, sk_of, len(u2), dict(self.signatures))))
            self.stage, self.deadline = self.UNMASK, now + self.stage_timeout
            return out + [Wake(self.deadline)]
        if self.stage == self.UNMASK:
            if self._can_unmask():
                return self._finish()
            short = sorted(o for o in self._needed() if not self._enough(o))
            return self._fail(f"too few shares to remove the masks of {', '.join(short[:5])}")
        return []

    def _rosters(self, now: float) -> list[ServerCommand]:
        """Each agent with keys gets its neighbours' keys; the share stage opens."""
        out: list[ServerCommand] = []
        for a in sorted(self.keys):
            nb = tuple(b for b in self.graph[a] if b in self.keys)
            if not nb:
                continue  # isolated: its input could not be hidden, so it takes no part
            self.rosters[a] = nb
            out.append(Send(a, SecAggRoster(self.round, {b: self.keys[b] for b in nb})))
        self.stage, self.deadline = self.SHARES, now + self.stage_timeout
        return out + [Wake(self.deadline)]

    def _needed(self) -> set[str]:
        """Whose secret is rebuilt: every survivor's seed, and the key of each drop-out
        that a survivor masked with (one whose neighbours all dropped too left no mask)."""
        u2 = set(self.inputs)
        return u2 | {d for d in self.shares if d not in u2 and any(j in u2 for j in self.rosters[d])}

    def _enough(self, owner: str) -> bool:
        store = self.b_shares if owner in self.inputs else self.sk_shares
        t = self.params.threshold_of(len(self.rosters[owner]) + 1)
        return len(store.get(owner, {})) >= t

    def _can_unmask(self) -> bool:
        return all(self._enough(o) for o in self._needed())

    def _remove_self_mask(self, owner: str) -> bool:
        """Rebuilds ``owner``'s self-mask seed from its first t shares and takes its
        stream off the sum; False if the seed does not match its commitment."""
        assert self._sum is not None
        t = self.params.threshold_of(len(self.rosters[owner]) + 1)
        b = shamir_combine(dict(sorted(self.b_shares[owner].items())[:t]))
        if hashlib.sha256(b).digest() != self.shares[owner].b_digest:
            return False
        streams = _Streams()
        streams.add_stream(b, _SELF_NONCE, sign=-1)
        streams.add_all(self._sum)
        self._self_off.add(owner)
        return True

    def _finish(self) -> list[ServerCommand]:
        assert self._sum is not None
        p = self.params
        total = self._sum
        streams = _Streams()
        dropped = sorted(self._needed() - set(self.inputs))
        for owner in sorted(set(self.inputs) - self._self_off):
            if not self._remove_self_mask(owner):
                return self._fail(f"the self-mask seed of {owner} rebuilt from shares does not match its commitment")
        for d in dropped:
            t = p.threshold_of(len(self.rosters[d]) + 1)
            sk_raw = shamir_combine(dict(sorted(self.sk_shares[d].items())[:t]))
            sk = X25519PrivateKey.from_private_bytes(sk_raw)
            if sk.public_key().public_bytes_raw() != self.keys[d].s_pk:
                return self._fail(f"the mask key of {d} rebuilt from shares does not match its public key")
            for j in self.rosters[d]:
                if j in self.inputs:
                    # j added sign(j, d)·PRG(s_jd) for a neighbour that never sent its input
                    streams.add_stream(pair_seed(sk, self.keys[j].s_pk, self.context), sign=-_sign(j, d))
        survivors = len(self.inputs)
        contributors = {
            a: Contribution(m.num_samples, dict(m.metrics), m.leaving, m.base_version) for a, m in self.inputs.items()
        }
        weight_sum = sum(self.setup.ratio(c.num_samples) for c in contributors.values())
        # One pass, block by block: the masks come off and the block is dequantised and
        # divided while it is in cache.
        mean = np.empty(total.size)
        for lo in range(0, total.size, BLOCK):
            blk = total[lo : lo + BLOCK]
            streams.apply(blk)
            m = mean[lo : lo + BLOCK]
            np.copyto(m, blk)
            m *= p.step
            m -= survivors * p.clip
            m /= weight_sum
        silent = tuple(sorted(self.asked - self.answered))
        self.stage = self.DONE
        self._sum = None
        gone = tuple(sorted(set(self.shares) - set(self.inputs)))
        # ... and the survivors never asked: they did not sign the survivor list (or not
        # validly: those are named apart)
        unsigned = set(self.inputs) - set(self.signatures) - set(self.bad_signatures)
        silent = tuple(sorted(set(silent) | unsigned))
        bound = p.error_bound(weight_sum, survivors)
        return [
            Unmasked(mean, contributors, weight_sum, bound, gone, silent, dict(sorted(self.bad_signatures.items())))
        ]
