"""The typed messages of the fedagent protocol, carried in an :class:`Envelope` body.

Each message is a frozen dataclass validated on construction. ``to_body`` gives the
msgpack-native body; ``from_body`` validates a decoded body field by field and raises
:class:`CodecError` on anything unexpected. Which class decodes a body is decided by
the receiver's protocol state and the envelope ``kind``, through the fixed table
``KINDS`` — never by looking up a name sent by the peer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits, decode_weights, encode_weights
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.secagg import MESSAGES as SECAGG_MESSAGES
from fedagent.protocols.secagg import SecAggMessage, SecAggSetup
from fedagent.protocols.topics import is_valid_name
from fedagent.protocols.vocab import VocabError, check_counts, vocabulary_digest

Weights = dict[str, np.ndarray]

ROLES = ("agent", "coordinator")
MODES = ("fedavg", "syncopt", "gossip")
MAX_METRICS = F.MAX_METRICS
MAX_NAMES = 100_000  # node ids in a round's selection or a result's participants
MAX_DEADLINE = 7 * 86400.0


_MAX_DOWNLINKS = 8


@dataclass(frozen=True, slots=True)
class Presence:
    """Retained per node; its Last Will is the same with ``online=False``."""

    kind: ClassVar[str] = "presence"
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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise CodecError(f"presence: unknown role {self.role!r}")
        if self.mode not in MODES:
            raise CodecError(f"presence: unknown mode {self.mode!r}")
        F.count(self.num_samples, "presence", "num_samples")
        F.count(self.model_version, "presence", "model_version")
        if not isinstance(self.downlinks, tuple):
            raise CodecError("presence: downlinks must be a tuple of names")
        F.strings(list(self.downlinks), "presence", "downlinks", _MAX_DOWNLINKS, max_len=16)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "online": self.online,
            "role": self.role,
            "mode": self.mode,
            "num_samples": self.num_samples,
            "model_version": self.model_version,
            "broker": self.broker,
        }
        if self.downlinks:
            body["downlinks"] = list(self.downlinks)
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> Presence:
        w = "presence"
        return cls(
            online=F.flag(F.need(body, "online", w), w, "online"),
            role=F.text(F.need(body, "role", w), w, "role", max_len=32),
            mode=F.text(F.need(body, "mode", w), w, "mode", max_len=32),
            num_samples=F.count(body.get("num_samples", 0), w, "num_samples"),
            model_version=F.count(body.get("model_version", 0), w, "model_version"),
            broker=F.text(body.get("broker", ""), w, "broker", max_len=256),
            downlinks=F.strings(body.get("downlinks", []), w, "downlinks", _MAX_DOWNLINKS, max_len=16),
        )


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Agent → coordinator, every ``interval`` seconds: "still here". The coordinator
    declares an agent that has been silent for a few intervals gone from the round long
    before the broker's keep-alive does (see :mod:`fedagent.protocols.liveness`)."""

    kind: ClassVar[str] = "heartbeat"
    interval: float

    def __post_init__(self) -> None:
        v = self.interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.05 <= v <= 3600):
            raise CodecError("heartbeat: interval must be 0.05..3600 seconds")

    def to_body(self) -> dict[str, Any]:
        return {"interval": float(self.interval)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> Heartbeat:
        return cls(F.number(F.need(body, "interval", "heartbeat"), "heartbeat", "interval"))


MAX_LOCAL_STEPS = 10_000_000  # [rounds] local_steps


@dataclass(frozen=True, slots=True)
class TrainConfig:
    epochs: int = 1
    lr: float = 0.05
    batch_size: int = 32
    compression: str = "none"  # how agents send their update: none | fp16 | int8 | topk
    topk_ratio: float = 0.01
    stream: bool = True  # update as a stream folded on arrival; False: one whole update
    # Distributed differential privacy: the agent clips its update's difference from the
    # round's model to dp_clip and adds Gaussian noise of this standard deviation.
    dp_clip: float | None = None
    dp_noise_std: float = 0.0
    # Adaptive clipping under secure aggregation: the agent also masks its clipped-or-not
    # bit (minus ½) with Gaussian noise of this standard deviation (Andrew et al. 2021).
    dp_count_std: float = 0.0
    # Mini-batches of local training a round instead of ``epochs`` passes (0: epochs).
    # A fraction of an epoch a round: the sites average more often for the same passes.
    steps: int = 0

    def __post_init__(self) -> None:
        if type(self.stream) is not bool:
            raise CodecError("train config: stream must be a bool")
        if self.dp_clip is not None and not (math.isfinite(self.dp_clip) and 0 < self.dp_clip < 1e12):
            raise CodecError("train config: dp_clip out of range")
        if not (math.isfinite(self.dp_noise_std) and 0 <= self.dp_noise_std < 1e12):
            raise CodecError("train config: dp_noise_std out of range")
        if self.dp_noise_std and self.dp_clip is None:
            raise CodecError("train config: dp_noise_std needs dp_clip")
        if not (math.isfinite(self.dp_count_std) and 0 <= self.dp_count_std < 1e12):
            raise CodecError("train config: dp_count_std out of range")
        if self.dp_count_std and self.dp_clip is None:
            raise CodecError("train config: dp_count_std needs dp_clip")
        if self.compression != "none" and not self.stream:
            raise CodecError("train config: compression needs streamed updates")
        if not 1 <= self.epochs <= 10_000 or not 1 <= self.batch_size <= 1_000_000:
            raise CodecError("train config: epochs/batch_size out of range")
        if type(self.steps) is not int or not 0 <= self.steps <= MAX_LOCAL_STEPS:
            raise CodecError(f"train config: steps must be an integer in [0, {MAX_LOCAL_STEPS}]")
        if not (math.isfinite(self.lr) and 0 < self.lr < 100):
            raise CodecError("train config: lr out of range")
        if self.compression not in ("none", "fp16", "int8", "topk"):
            raise CodecError("train config: unknown compression")
        if not (math.isfinite(self.topk_ratio) and 0 < self.topk_ratio <= 1):
            raise CodecError("train config: topk_ratio out of range")

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"epochs": self.epochs, "lr": self.lr, "batch_size": self.batch_size}
        if self.steps:
            body["steps"] = self.steps
        if self.compression != "none":
            body["compression"] = self.compression
            body["topk_ratio"] = self.topk_ratio
        if not self.stream:
            body["stream"] = False
        if self.dp_clip is not None:
            body["dp_clip"] = self.dp_clip
            body["dp_noise_std"] = self.dp_noise_std
            if self.dp_count_std:
                body["dp_count_std"] = self.dp_count_std
        return body

    @classmethod
    def from_body(cls, body: Any) -> TrainConfig:
        w = "train config"
        body = F.is_map(body, w)
        dp_clip = body.get("dp_clip")
        return cls(
            epochs=F.count(F.need(body, "epochs", w), w, "epochs"),
            lr=F.number(F.need(body, "lr", w), w, "lr"),
            batch_size=F.count(F.need(body, "batch_size", w), w, "batch_size"),
            compression=F.text(body.get("compression", "none"), w, "compression", max_len=16),
            topk_ratio=F.number(body.get("topk_ratio", 0.01), w, "topk_ratio"),
            stream=F.flag(body.get("stream", True), w, "stream"),
            dp_clip=None if dp_clip is None else F.number(dp_clip, w, "dp_clip"),
            dp_noise_std=F.number(body.get("dp_noise_std", 0.0), w, "dp_noise_std"),
            dp_count_std=F.number(body.get("dp_count_std", 0.0), w, "dp_count_std"),
            steps=F.count(body.get("steps", 0), w, "steps"),
        )


@dataclass(frozen=True, slots=True)
class RoundStart:
    """Coordinator → all: train from the global model if you are in ``selected``. The
    model comes whole (``weights``) or as an int8 step from an earlier version
    (``delta``; protocols/downlink.py): exactly one of the two."""

    kind: ClassVar[str] = "round_start"
    round: int
    model_version: int
    selected: tuple[str, ...]
    deadline_s: float
    train: TrainConfig
    weights: Weights | None = field(repr=False)
    secagg: SecAggSetup | None = None  # a secure round (protocols/secagg.py)
    delta: ModelDelta | None = None

    def __post_init__(self) -> None:
        if (self.weights is None) == (self.delta is None):
            raise CodecError("round_start: needs the model whole or as a step, and not both")
        if self.delta is not None and self.delta.base_version >= self.model_version:
            raise CodecError("round_start: a step must start from an older version")

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "round": self.round,
            "model_version": self.model_version,
            "selected": list(self.selected),
            "deadline_s": self.deadline_s,
            "train": self.train.to_body(),
        }
        if self.weights is not None:
            body["weights"] = encode_weights(self.weights)
        if self.delta is not None:
            body["delta"] = self.delta.to_body()
        if self.secagg is not None:
            body["secagg"] = self.secagg.to_body()
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> RoundStart:
        w = "round_start"
        if ("weights" in body) == ("delta" in body):
            raise CodecError("round_start: needs 'weights' or 'delta', and not both")
        return cls(
            round=F.count(F.need(body, "round", w), w, "round"),
            model_version=F.count(F.need(body, "model_version", w), w, "model_version"),
            selected=F.node_ids(F.need(body, "selected", w), w, "selected", MAX_NAMES),
            deadline_s=F.number(F.need(body, "deadline_s", w), w, "deadline_s", above=0, at_most=MAX_DEADLINE),
            train=TrainConfig.from_body(F.need(body, "train", w)),
            weights=decode_weights(body["weights"], limits) if "weights" in body else None,
            secagg=SecAggSetup.from_body(body["secagg"]) if "secagg" in body else None,
            delta=ModelDelta.from_body(body["delta"], limits) if "delta" in body else None,
        )


@dataclass(frozen=True, slots=True)
class Update:
    """Agent → coordinator: the locally trained weights for ``round``."""

    kind: ClassVar[str] = "update"
    round: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    weights: Weights = field(repr=False)
    leaving: bool = False  # the sender's last round: it leaves afterwards (a vehicle out of range)

    def to_body(self) -> dict[str, Any]:
        body = {
            "round": self.round,
            "base_version": self.base_version,
            "num_samples": self.num_samples,
            "metrics": dict(self.metrics),
            "weights": encode_weights(self.weights),
        }
        if self.leaving:
            body["leaving"] = True
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> Update:
        w = "update"
        return cls(
            round=F.count(F.need(body, "round", w), w, "round"),
            base_version=F.count(F.need(body, "base_version", w), w, "base_version"),
            num_samples=F.count(F.need(body, "num_samples", w), w, "num_samples", low=1),
            metrics=F.metrics(F.need(body, "metrics", w), w),
            weights=decode_weights(F.need(body, "weights", w), limits),
            leaving=F.flag(body.get("leaving", False), w, "leaving"),
        )


@dataclass(frozen=True, slots=True)
class RoundResult:
    """Coordinator → all: the outcome of a round (no weights: those come with the next
    ``RoundStart`` or the final ``GlobalModel``)."""

    kind: ClassVar[str] = "round_result"
    round: int
    model_version: int
    participants: tuple[str, ...]
    metrics: dict[str, float]
    aggregated: bool = True
    reason: str = ""

    def to_body(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "model_version": self.model_version,
            "participants": list(self.participants),
            "metrics": dict(self.metrics),
            "aggregated": self.aggregated,
            "reason": self.reason,
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> RoundResult:
        w = "round_result"
        return cls(
            round=F.count(F.need(body, "round", w), w, "round"),
            model_version=F.count(F.need(body, "model_version", w), w, "model_version"),
            participants=F.node_ids(F.need(body, "participants", w), w, "participants", MAX_NAMES),
            metrics=F.metrics(F.need(body, "metrics", w), w),
            aggregated=F.flag(F.need(body, "aggregated", w), w, "aggregated"),
            reason=F.text(body.get("reason", ""), w, "reason", max_len=1000),
        )


@dataclass(frozen=True, slots=True)
class GlobalModel:
    """Coordinator → all, retained: the latest global model, ``final`` when training ended."""

    kind: ClassVar[str] = "model"
    model_version: int
    round: int
    final: bool
    weights: Weights = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return {
            "model_version": self.model_version,
            "round": self.round,
            "final": self.final,
            "weights": encode_weights(self.weights),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> GlobalModel:
        w = "model"
        return cls(
            model_version=F.count(F.need(body, "model_version", w), w, "model_version"),
            round=F.count(F.need(body, "round", w), w, "round"),
            final=F.flag(F.need(body, "final", w), w, "final"),
            weights=decode_weights(F.need(body, "weights", w), limits),
        )


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Agent → coordinator: this agent's metrics of global model ``model_version`` on its
    own held-out data, with the samples its mean is weighted by."""

    kind: ClassVar[str] = "evaluation"
    model_version: int
    num_samples: int
    metrics: dict[str, float]

    def __post_init__(self) -> None:
        F.count(self.model_version, "evaluation", "model_version")
        F.count(self.num_samples, "evaluation", "num_samples")

    def to_body(self) -> dict[str, Any]:
        return {"model_version": self.model_version, "num_samples": self.num_samples, "metrics": dict(self.metrics)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> Evaluation:
        w = "evaluation"
        return cls(
            model_version=F.count(F.need(body, "model_version", w), w, "model_version"),
            num_samples=F.count(F.need(body, "num_samples", w), w, "num_samples"),
            metrics=F.metrics(F.need(body, "metrics", w), w),
        )


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """Agent → coordinator, on each (re)connection: the agent has ``have_version`` and
    asks for the current global model, answered with a ``GlobalModel`` on its inbox when
    it is behind (see :mod:`fedagent.protocols.catchup`)."""

    kind: ClassVar[str] = "model_request"
    have_version: int

    def to_body(self) -> dict[str, Any]:
        return {"have_version": self.have_version}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> ModelRequest:
        w = "model_request"
        F.exactly(body, ("have_version",), w)
        return cls(have_version=F.count(body["have_version"], w, "have_version"))


MAX_EXCHANGE_ID = 64


@dataclass(frozen=True, slots=True)
class GossipModel:
    """Agent → agent (gossip mode): the sender's exchanged parameters, with the push-sum
    ``mass`` they carry and their ``age`` (local steps); ``returned`` when the receiver
    sends back mass it had to evict (see :mod:`fedagent.protocols.gossip`)."""

    kind: ClassVar[str] = "gossip_model"
    exchange_id: str
    period: int
    mass: float
    age: float
    returned: bool
    weights: Weights = field(repr=False)

    def to_body(self) -> dict[str, Any]:
        return {
            "exchange_id": self.exchange_id,
            "period": self.period,
            "mass": self.mass,
            "age": self.age,
            "returned": self.returned,
            "weights": encode_weights(self.weights),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> GossipModel:
        w = "gossip_model"
        return cls(
            exchange_id=F.text(F.need(body, "exchange_id", w), w, "exchange_id", min_len=1, max_len=MAX_EXCHANGE_ID),
            period=F.count(F.need(body, "period", w), w, "period"),
            mass=F.number(F.need(body, "mass", w), w, "mass", finite=True, above=0),
            age=F.number(F.need(body, "age", w), w, "age", finite=True, at_least=0),
            returned=F.flag(F.need(body, "returned", w), w, "returned"),
            weights=decode_weights(F.need(body, "weights", w), limits),
        )


@dataclass(frozen=True, slots=True)
class GossipAck:
    """Agent → agent (gossip mode): the receiver took custody of a model, or refused it
    (then the sender takes the model's mass back)."""

    kind: ClassVar[str] = "gossip_ack"
    exchange_id: str
    accepted: bool
    reason: str = ""

    def to_body(self) -> dict[str, Any]:
        return {"exchange_id": self.exchange_id, "accepted": self.accepted, "reason": self.reason}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> GossipAck:
        w = "gossip_ack"
        return cls(
            exchange_id=F.text(F.need(body, "exchange_id", w), w, "exchange_id", min_len=1, max_len=MAX_EXCHANGE_ID),
            accepted=F.flag(F.need(body, "accepted", w), w, "accepted"),
            reason=F.text(body.get("reason", ""), w, "reason", max_len=200),
        )


# ---- gFedNTM: vocabulary consensus and Sync-Opt steps -----------------------------
MAX_VOCAB_TERMS = 100_000  # the codec's default array limit; see protocols/vocab.py
MAX_TERM_CHARS = 200
MAX_DIGEST = 64


def _terms_and_counts(body: Mapping[str, Any], what: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    # Lengths first: nothing is copied out of a list that is too long.
    terms = F.items(F.need(body, "terms", what), what, "terms", MAX_VOCAB_TERMS)
    counts = F.items(F.need(body, "counts", what), what, "counts", MAX_VOCAB_TERMS)
    if len(counts) != len(terms):
        raise CodecError(f"{what}: {len(terms)} terms but {len(counts)} counts")
    return tuple(terms), tuple(counts)


def _check_vocab(terms: tuple[str, ...], counts: tuple[int, ...], what: str) -> None:
    try:
        check_counts(terms, counts, max_terms=MAX_VOCAB_TERMS)
    except VocabError as exc:
        raise CodecError(f"{what}: {exc}") from None


@dataclass(frozen=True, slots=True)
class VocabOffer:
    """Agent → coordinator: the terms of the agent's corpus and how often each occurs.
    Only terms and counts: no document, no order of words, no per-document data."""

    kind: ClassVar[str] = "vocab_offer"
    terms: tuple[str, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_vocab(self.terms, self.counts, "vocab_offer")

    def to_body(self) -> dict[str, Any]:
        return {"terms": list(self.terms), "counts": list(self.counts)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> VocabOffer:
        F.exactly(body, ("terms", "counts"), "vocab_offer")
        return cls(*_terms_and_counts(body, "vocab_offer"))


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Coordinator → all: the common vocabulary in index order, with the merged counts
    and the agents whose offers it merges."""

    kind: ClassVar[str] = "vocabulary"
    terms: tuple[str, ...]
    counts: tuple[int, ...]
    contributors: tuple[str, ...]
    digest: str

    def __post_init__(self) -> None:
        _check_vocab(self.terms, self.counts, "vocabulary")
        if not self.terms:
            raise CodecError("vocabulary: empty")
        if self.digest != vocabulary_digest(self.terms):
            raise CodecError("vocabulary: digest does not match the terms")
        if not all(is_valid_name(c) for c in self.contributors):
            raise CodecError("vocabulary: invalid contributor id")

    def to_body(self) -> dict[str, Any]:
        return {
            "terms": list(self.terms),
            "counts": list(self.counts),
            "contributors": list(self.contributors),
            "digest": self.digest,
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> Vocabulary:
        w = "vocabulary"
        terms, counts = _terms_and_counts(body, w)
        digest = F.text(F.need(body, "digest", w), w, "digest", max_len=MAX_DIGEST)
        return cls(terms, counts, F.node_ids(F.need(body, "contributors", w), w, "contributors", MAX_NAMES), digest)


@dataclass(frozen=True, slots=True)
class VocabDigest:
    """Agent → agent (gossip mode, no coordinator): the digest of the vocabulary this
    agent merged and whose offers it merged, so peers can confirm they index the same
    terms the same way before training (see :mod:`fedagent.protocols.gossip_vocab`)."""

    kind: ClassVar[str] = "vocab_digest"
    digest: str
    contributors: tuple[str, ...]
    agreed: bool = False  # the sender has agreed already (an answer; not to be answered)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not 0 < len(self.digest) <= MAX_DIGEST:
            raise CodecError("vocab_digest: bad digest")
        if not self.contributors or not all(is_valid_name(c) for c in self.contributors):
            raise CodecError("vocab_digest: invalid contributor id")

    def to_body(self) -> dict[str, Any]:
        return {"digest": self.digest, "contributors": list(self.contributors), "agreed": self.agreed}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> VocabDigest:
        w = "vocab_digest"
        return cls(
            F.text(F.need(body, "digest", w), w, "digest", max_len=MAX_DIGEST),
            F.node_ids(F.need(body, "contributors", w), w, "contributors", 10_000),
            F.flag(body.get("agreed", False), w, "agreed"),
        )


@dataclass(frozen=True, slots=True)
class SyncStep:
    """Coordinator → all (Sync-Opt): compute the gradient of your mini-batch ``step`` at
    model ``model_version`` if you are among ``participants``. ``weights`` is None when
    every participant already holds that version (a repeated step): then only the
    version travels. ``validate`` (an epoch's end, early stopping): instead of a
    gradient, evaluate that model on your held-out documents and answer
    :class:`SyncValidation`. ``sliced_gradients``: the coordinator decodes gradients
    sent without their all-zero slices (absent from older coordinators: then every
    gradient goes whole)."""

    kind: ClassVar[str] = "sync_step"
    step: int
    model_version: int
    participants: tuple[str, ...]
    deadline_s: float
    vocab_digest: str
    weights: Weights | None = field(default=None, repr=False)
    validate: bool = False
    sliced_gradients: bool = False

    def __post_init__(self) -> None:
        F.count(self.step, "sync_step", "step")
        F.count(self.model_version, "sync_step", "model_version")
        if not (math.isfinite(self.deadline_s) and 0 < self.deadline_s <= 7 * 86400):
            raise CodecError("sync_step: deadline out of range")
        if not isinstance(self.vocab_digest, str) or len(self.vocab_digest) > MAX_DIGEST:
            raise CodecError("sync_step: vocab_digest must be a string of at most 64 characters")

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "step": self.step,
            "model_version": self.model_version,
            "participants": list(self.participants),
            "deadline_s": self.deadline_s,
            "vocab_digest": self.vocab_digest,
        }
        if self.weights is not None:
            body["weights"] = encode_weights(self.weights)
        if self.validate:
            body["validate"] = True
        if self.sliced_gradients:
            body["sliced_gradients"] = True
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SyncStep:
        w = "sync_step"
        return cls(
            step=F.count(F.need(body, "step", w), w, "step"),
            model_version=F.count(F.need(body, "model_version", w), w, "model_version"),
            participants=F.node_ids(F.need(body, "participants", w), w, "participants", MAX_NAMES),
            deadline_s=F.number(F.need(body, "deadline_s", w), w, "deadline_s"),
            vocab_digest=F.text(F.need(body, "vocab_digest", w), w, "vocab_digest", max_len=MAX_DIGEST),
            weights=decode_weights(body["weights"], limits) if "weights" in body else None,
            validate=F.flag(body.get("validate", False), w, "validate"),
            sliced_gradients=F.flag(body.get("sliced_gradients", False), w, "sliced_gradients"),
        )


@dataclass(frozen=True, slots=True)
class SyncGradient:
    """Agent → coordinator (Sync-Opt): the gradient of the mean loss over the agent's
    mini-batch ``step`` at ``base_version``, the batch's size and its mean loss.

    ``sliced`` (not a wire field): encode the tensors without their all-zero slices
    (:func:`~fedagent.protocols.codec.encode_tensor_sliced`), for a coordinator whose
    step said ``sliced_gradients``. The receiver always accepts both forms and gets
    the same dense arrays, bit for bit."""

    kind: ClassVar[str] = "sync_gradient"
    step: int
    base_version: int
    num_samples: int
    loss: float
    gradient: Weights = field(repr=False)
    sliced: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        F.count(self.step, "sync_gradient", "step")
        F.count(self.base_version, "sync_gradient", "base_version")
        F.count(self.num_samples, "sync_gradient", "num_samples", low=1)
        if not math.isfinite(self.loss):
            raise CodecError("sync_gradient: loss must be finite")

    def to_body(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "base_version": self.base_version,
            "num_samples": self.num_samples,
            "loss": self.loss,
            "gradient": encode_weights(self.gradient, sliced=self.sliced),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SyncGradient:
        w = "sync_gradient"
        return cls(
            step=F.count(F.need(body, "step", w), w, "step"),
            base_version=F.count(F.need(body, "base_version", w), w, "base_version"),
            num_samples=F.count(F.need(body, "num_samples", w), w, "num_samples", low=1),
            loss=F.number(F.need(body, "loss", w), w, "loss"),
            gradient=decode_weights(F.need(body, "gradient", w), limits, sliced=True),
        )


@dataclass(frozen=True, slots=True)
class SyncValidation:
    """Agent → coordinator (Sync-Opt early stopping): the mean validation loss of model
    ``base_version`` over the agent's ``num_docs`` held-out documents (one scalar and a
    count; no document leaves the node). ``num_docs`` = 0: it has none (``loss`` is then
    ignored). A non-finite loss is allowed: a diverged model is a non-improvement."""

    kind: ClassVar[str] = "sync_validation"
    step: int
    base_version: int
    loss: float
    num_docs: int

    def __post_init__(self) -> None:
        F.count(self.step, "sync_validation", "step")
        F.count(self.base_version, "sync_validation", "base_version")
        F.count(self.num_docs, "sync_validation", "num_docs")
        if not isinstance(self.loss, float):
            raise CodecError("sync_validation: loss must be a number")

    def to_body(self) -> dict[str, Any]:
        return {"step": self.step, "base_version": self.base_version, "loss": self.loss, "num_docs": self.num_docs}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SyncValidation:
        w = "sync_validation"
        return cls(
            step=F.count(F.need(body, "step", w), w, "step"),
            base_version=F.count(F.need(body, "base_version", w), w, "base_version"),
            loss=F.number(F.need(body, "loss", w), w, "loss"),
            num_docs=F.count(F.need(body, "num_docs", w), w, "num_docs"),
        )


# ---- SEEC: cross-site semantic search ----------------------------------------------
MAX_QUERY_ID = 64


def _query_id(value: Any, what: str, key: str = "query_id") -> str:
    return F.text(value, what, key, min_len=1, max_len=MAX_QUERY_ID, printable=True)


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """Agent → agent: rank your documents against ``vector`` (already in the receiver's
    vector space) and answer with your top ``k``. ``space`` names that space (the
    common vocabulary's digest in a joint-learning federation), so a receiver whose
    model differs refuses instead of answering nonsense. Never the query's text."""

    kind: ClassVar[str] = "search_query"
    query_id: str
    k: int
    space: str
    vector: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        from fedagent.protocols.search import MAX_DIM, MAX_K

        _query_id(self.query_id, "search_query")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise CodecError(f"search_query: k must be an integer in 1..{MAX_K}")
        if not isinstance(self.space, str) or len(self.space) > MAX_DIGEST:
            raise CodecError("search_query: space must be a string of at most 64 characters")
        v = self.vector
        if not isinstance(v, np.ndarray) or v.ndim != 1 or not 0 < v.shape[0] <= MAX_DIM or v.dtype.kind != "f":
            raise CodecError(f"search_query: vector must be a 1-D float array of 1..{MAX_DIM} entries")

    def to_body(self) -> dict[str, Any]:
        return {
            "query_id": self.query_id,
            "k": self.k,
            "space": self.space,
            "vector": encode_weights({"q": self.vector}),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SearchQuery:
        from fedagent.protocols.search import MAX_DIM

        w = "search_query"
        F.exactly(body, ("query_id", "k", "space", "vector"), w)
        raw = body["vector"]
        if not isinstance(raw, dict) or set(raw) != {"q"}:
            raise CodecError("search_query: vector must hold one tensor named q")
        # A small budget: a query is one vector; a peer cannot make this site allocate more.
        small = Limits(max_tensor_bytes=8 * MAX_DIM, max_map_len=1)
        vec = decode_weights(raw, small)["q"]
        return cls(
            _query_id(body["query_id"], w),
            F.count(body["k"], w, "k", low=1),
            F.text(body["space"], w, "space", max_len=MAX_DIGEST),
            vec,
        )


@dataclass(frozen=True, slots=True)
class SearchAnswer:
    """Agent → agent: the answerer's top documents for ``query_id``, best first, as
    (document id, cosine score); or an ``error`` code and no hits."""

    kind: ClassVar[str] = "search_answer"
    query_id: str
    doc_ids: tuple[str, ...]
    scores: tuple[float, ...]
    error: str = ""

    def __post_init__(self) -> None:
        from fedagent.protocols.search import MAX_DOC_ID, MAX_K

        _query_id(self.query_id, "search_answer")
        if len(self.doc_ids) != len(self.scores) or len(self.doc_ids) > MAX_K:
            raise CodecError(f"search_answer: at most {MAX_K} hits, one score per document")
        for d in self.doc_ids:
            if not isinstance(d, str) or not 0 < len(d) <= MAX_DOC_ID or not d.isprintable():
                raise CodecError(f"search_answer: document ids are printable strings of 1..{MAX_DOC_ID} characters")
        for x in self.scores:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise CodecError("search_answer: scores must be finite numbers")
        if not isinstance(self.error, str) or len(self.error) > 200 or (self.error and self.doc_ids):
            raise CodecError("search_answer: an error of at most 200 characters, and then no hits")

    def to_body(self) -> dict[str, Any]:
        return {
            "query_id": self.query_id,
            "doc_ids": list(self.doc_ids),
            "scores": list(self.scores),
            "error": self.error,
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> SearchAnswer:
        from fedagent.protocols.search import MAX_K

        w = "search_answer"
        ids = F.items(F.need(body, "doc_ids", w), w, "doc_ids", MAX_K)
        scores = F.items(F.need(body, "scores", w), w, "scores", MAX_K)
        return cls(
            _query_id(F.need(body, "query_id", w), w),
            tuple(ids),
            tuple(F.number(x, w, "scores", finite=True) for x in scores),
            F.text(F.need(body, "error", w), w, "error", max_len=200),
        )


@dataclass(frozen=True, slots=True)
class PublicVectorsRequest:
    """Agent → agent (mapped search): send me your vectors of the public corpus
    ``public`` (a digest naming the agreed public documents), unless your space is still
    ``have_space`` (then an answer without vectors confirms the mapper is current)."""

    kind: ClassVar[str] = "public_vectors_request"
    request_id: str
    public: str
    have_space: str = ""

    def __post_init__(self) -> None:
        _query_id(self.request_id, "public_vectors_request")
        for name, v in (("public", self.public), ("have_space", self.have_space)):
            if not isinstance(v, str) or len(v) > MAX_DIGEST:
                raise CodecError(f"public_vectors_request: {name} must be a string of at most {MAX_DIGEST} characters")

    def to_body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "public": self.public, "have_space": self.have_space}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> PublicVectorsRequest:
        w = "public_vectors_request"
        F.exactly(body, ("request_id", "public", "have_space"), w)
        return cls(
            _query_id(body["request_id"], w, "request_id"),
            F.text(body["public"], w, "public", max_len=MAX_DIGEST),
            F.text(body["have_space"], w, "have_space", max_len=MAX_DIGEST),
        )


@dataclass(frozen=True, slots=True)
class PublicVectors:
    """Agent → agent (mapped search): the sender's vectors of the public documents
    (one row each, in the request's order) in its space ``space``; no rows when the
    asker's mapper is for this space already; or an ``error`` code. Never private data."""

    kind: ClassVar[str] = "public_vectors"
    request_id: str
    space: str
    vectors: np.ndarray | None = field(default=None, repr=False)
    error: str = ""

    def __post_init__(self) -> None:
        from fedagent.protocols.search import MAX_DIM, MAX_PUBLIC_DOCS

        _query_id(self.request_id, "public_vectors")
        if not isinstance(self.space, str) or len(self.space) > MAX_DIGEST:
            raise CodecError(f"public_vectors: space must be a string of at most {MAX_DIGEST} characters")
        v = self.vectors
        if v is not None and (
            not isinstance(v, np.ndarray)
            or v.ndim != 2
            or v.dtype != np.float32
            or not 0 < v.shape[0] <= MAX_PUBLIC_DOCS
            or not 0 < v.shape[1] <= MAX_DIM
        ):
            raise CodecError(f"public_vectors: vectors must be float32 of at most {MAX_PUBLIC_DOCS} x {MAX_DIM}")
        if not isinstance(self.error, str) or len(self.error) > 200 or (self.error and v is not None):
            raise CodecError("public_vectors: an error of at most 200 characters, and then no vectors")

    def to_body(self) -> dict[str, Any]:
        shape = list(self.vectors.shape) if self.vectors is not None else [0, 0]
        return {
            "request_id": self.request_id,
            "space": self.space,
            "error": self.error,
            "shape": shape,
            "vectors": encode_weights({"p": self.vectors}) if self.vectors is not None else {},
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits) -> PublicVectors:
        from fedagent.protocols.search import MAX_DIM, MAX_PUBLIC_DOCS

        w = "public_vectors"
        F.exactly(body, ("request_id", "space", "error", "shape", "vectors"), w)
        shape = body["shape"]
        if not isinstance(shape, list) or len(shape) != 2 or not all(type(x) is int for x in shape):
            raise CodecError(f"{w}: shape must be two integers")
        n, d = shape
        raw = body["vectors"]
        if not isinstance(raw, dict):
            raise CodecError(f"{w}: vectors must be a map")
        vectors = None
        if (n, d) != (0, 0) or raw:
            # The declared shape is checked against the bounds first and then bounds the
            # decode exactly, so a peer cannot make this site allocate more than that.
            if not (0 < n <= MAX_PUBLIC_DOCS and 0 < d <= MAX_DIM):
                raise CodecError(f"{w}: at most {MAX_PUBLIC_DOCS} x {MAX_DIM} vectors")
            small = Limits(max_tensor_bytes=4 * n * d, max_map_len=1)
            vectors = decode_weights(raw, small, expect={"p": ("float32", (n, d))})["p"]
        return cls(
            _query_id(body["request_id"], w, "request_id"),
            F.text(body["space"], w, "space", max_len=MAX_DIGEST),
            vectors,
            F.text(body["error"], w, "error", max_len=200),
        )


Message = (
    Presence
    | RoundStart
    | Update
    | RoundResult
    | GlobalModel
    | Evaluation
    | ModelRequest
    | GossipModel
    | GossipAck
    | VocabOffer
    | Vocabulary
    | SyncStep
    | SyncGradient
    | SyncValidation
    | VocabDigest
    | SearchQuery
    | SearchAnswer
    | PublicVectorsRequest
    | PublicVectors
    | Heartbeat
    | SecAggMessage
)

# The fixed table from an envelope kind to the class that validates its body.
KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        Presence,
        Heartbeat,
        RoundStart,
        Update,
        RoundResult,
        GlobalModel,
        Evaluation,
        ModelRequest,
        GossipModel,
        GossipAck,
        VocabOffer,
        Vocabulary,
        SyncStep,
        SyncGradient,
        SyncValidation,
        VocabDigest,
        SearchQuery,
        SearchAnswer,
        PublicVectorsRequest,
        PublicVectors,
        *SECAGG_MESSAGES,
    )
}


def body_of(kind: str, body: Mapping[str, Any], limits: Limits) -> Message:
    cls = KINDS.get(kind)
    if cls is None:
        raise CodecError(f"unknown message kind {kind!r}")
    return cls.from_body(body, limits)
