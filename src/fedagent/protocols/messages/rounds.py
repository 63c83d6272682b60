"""The messages of FedAvg rounds: a round's start (with its training settings), an
agent's update, the round's result, the global model, an agent's evaluation of it, and
a returning agent's request for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.secagg import SecAggSetup

Weights = dict[str, np.ndarray]

MAX_LOCAL_STEPS = 10_000_000  # [rounds] local_steps
MAX_NAMES = 100_000  # node ids in a round's selection
MAX_DEADLINE = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class TrainConfig(F.WireMessage):
    WIRE: ClassVar[F.Body] = F.Body(
        "train config",
        F.Field("epochs", F.Count()),
        F.Field("lr", F.Number()),
        F.Field("batch_size", F.Count()),
        F.Field("steps", F.Count(), default=0, omit_default=True),
        F.Field("compression", F.Text(max_len=16), default="none", omit_default=True),
        F.Field("topk_ratio", F.Number(), default=0.01, send=lambda t: t.compression != "none"),
        F.Field("stream", F.Flag(), default=True, omit_default=True),
        F.Field("dp_clip", F.Nullable(F.Number()), default=None, omit_default=True),
        F.Field("dp_noise_std", F.Number(), default=0.0, send=lambda t: t.dp_clip is not None),
        F.Field("dp_count_std", F.Number(), default=0.0, omit_default=True),
        F.Field("dp_cohort", F.Count(), default=0, omit_default=True),
        F.Field("local_norm", F.Flag(), default=False, omit_default=True),
    )
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
    # The number of agents dp_noise_std is calibrated for (their shares add up to the
    # round's noise): the round's agents, or across tiers every site's. A site
    # aggregator takes no more agents than this into a round (0: not said).
    dp_cohort: int = 0
    # Mini-batches of local training a round instead of ``epochs`` passes (0: epochs).
    # A fraction of an epoch a round: the sites average more often for the same passes.
    steps: int = 0
    # FedBN: the agents keep their own normalisation layers (parameters and buffers),
    # train from the global model's other tensors and send the global model's values
    # for those (protocols/fingerprint.py).
    local_norm: bool = False

    def __post_init__(self) -> None:
        if type(self.stream) is not bool or type(self.local_norm) is not bool:
            raise CodecError("train config: stream and local_norm must be bools")
        if self.dp_clip is not None and not (math.isfinite(self.dp_clip) and 0 < self.dp_clip < 1e12):
            raise CodecError("train config: dp_clip out of range")
        if not (math.isfinite(self.dp_noise_std) and 0 <= self.dp_noise_std < 1e12):
            raise CodecError("train config: dp_noise_std out of range")
        if self.dp_noise_std and self.dp_clip is None:
            raise CodecError("train config: dp_noise_std needs dp_clip")
        if not (math.isfinite(self.dp_count_std) and 0 <= self.dp_count_std < 1e12):
            raise CodecError("train config: dp_count_std out of range")
        if self.dp_count_std and self.dp_clip is None:
            # (so dp_count_std is sent only beside dp_clip)
            raise CodecError("train config: dp_count_std needs dp_clip")
        if type(self.dp_cohort) is not int or not 0 <= self.dp_cohort < 2**31:
            raise CodecError("train config: dp_cohort out of range")
        if self.dp_cohort and self.dp_clip is None:
            raise CodecError("train config: dp_cohort needs dp_clip")
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


@dataclass(frozen=True, slots=True)
class RoundStart(F.WireMessage):
    """Coordinator → all: train from the global model if the round selects you. The
    model comes whole (``weights``) or as an int8 step from an earlier version
    (``delta``; protocols/downlink.py): exactly one of the two.

    Who the round selects: with ``everyone``, every agent the coordinator counted
    online when it started the round (``agents`` of them, no ids: the message stays the
    same size however many there are); otherwise the ids in ``selected`` (a sampled
    round lists its k agents, a secure round its cohort, which every member needs for
    its pairwise masks, and a round resumed after a restart the selection it had)."""

    kind: ClassVar[str] = "round_start"
    WIRE: ClassVar[F.Body] = F.Body(
        "round_start",
        F.Field("round", F.Count()),
        F.Field("model_version", F.Count()),
        F.Field("selected", F.NodeIds(MAX_NAMES), default=(), send=lambda m: not m.everyone),
        F.Field("deadline_s", F.Number(above=0, at_most=MAX_DEADLINE)),
        F.Field("train", F.Nested(TrainConfig)),
        F.Field("weights", F.Tensors(), default=None, omit_default=True),
        F.Field("delta", F.Nested(ModelDelta, heavy=True), default=None, omit_default=True),
        F.Field("secagg", F.Nested(SecAggSetup), default=None, omit_default=True),
        F.Field("everyone", F.Flag(), default=False, omit_default=True),
        F.Field("agents", F.Count(), default=0, omit_default=True),
    )
    round: int
    model_version: int
    selected: tuple[str, ...]  # () with ``everyone``
    deadline_s: float
    train: TrainConfig
    weights: Weights | None = field(repr=False)
    secagg: SecAggSetup | None = None  # a secure round (protocols/secagg/)
    delta: ModelDelta | None = None
    everyone: bool = False
    agents: int = 0  # with ``everyone``: how many agents that is (0 otherwise)

    def __post_init__(self) -> None:
        if (self.weights is None) == (self.delta is None):
            raise CodecError("round_start: needs the model whole or as a step, and not both")
        if self.delta is not None and self.delta.base_version >= self.model_version:
            raise CodecError("round_start: a step must start from an older version")
        if self.everyone:
            if self.selected or self.agents < 1:
                raise CodecError("round_start: 'everyone' comes with a count of agents and no ids")
            if self.secagg is not None:
                raise CodecError("round_start: a secure round lists its cohort")
        elif self.agents:
            raise CodecError("round_start: a count of agents comes only with 'everyone'")

    @classmethod
    def from_body(cls, body: Any, limits: Limits = F.DEFAULT_LIMITS) -> RoundStart:
        # Before either is decoded: a body with both would have a peer's model decoded twice.
        if isinstance(body, dict) and ("weights" in body) == ("delta" in body):
            raise CodecError("round_start: needs 'weights' or 'delta', and not both")
        if isinstance(body, dict) and "selected" not in body and body.get("everyone") is not True:
            raise CodecError("round_start: missing field 'selected'")
        return cls(**cls.WIRE.read(body, limits))

    def selects(self, agent: str) -> bool:
        """Whether this round selects ``agent``, as far as the message says: with
        ``everyone``, an agent that came online after the round started reads yes too
        (the coordinator discards its update as late, without holding it against it)."""
        return self.everyone or agent in self.selected

    @property
    def count(self) -> int:
        """How many agents the round selected."""
        return self.agents if self.everyone else len(self.selected)


@dataclass(frozen=True, slots=True)
class Update(F.WireMessage):
    """Agent → coordinator: the locally trained weights for ``round``."""

    kind: ClassVar[str] = "update"
    WIRE: ClassVar[F.Body] = F.Body(
        "update",
        F.Field("round", F.Count()),
        F.Field("base_version", F.Count()),
        F.Field("num_samples", F.Count(low=1)),
        F.Field("metrics", F.Metrics()),
        F.Field("weights", F.Tensors()),
        F.Field("leaving", F.Flag(), default=False, omit_default=True),
    )
    round: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    weights: Weights = field(repr=False)
    leaving: bool = False  # the sender's last round: it leaves afterwards (a vehicle out of range)


@dataclass(frozen=True, slots=True)
class RoundResult(F.WireMessage):
    """Coordinator → all: the outcome of a round (no weights: those come with the next
    ``RoundStart`` or the final ``GlobalModel``). How many agents' updates made it,
    not who: the coordinator's history keeps the names."""

    kind: ClassVar[str] = "round_result"
    WIRE: ClassVar[F.Body] = F.Body(
        "round_result",
        F.Field("round", F.Count()),
        F.Field("model_version", F.Count()),
        F.Field("agents", F.Count()),
        F.Field("metrics", F.Metrics()),
        F.Field("aggregated", F.Flag()),
        F.Field("reason", F.Text(max_len=1000), default=""),
    )
    round: int
    model_version: int
    agents: int  # the participants: how many agents' updates the aggregate holds
    metrics: dict[str, float]
    aggregated: bool = True
    reason: str = ""

    @classmethod
    def from_body(cls, body: Any, limits: Limits = F.DEFAULT_LIMITS) -> RoundResult:
        if isinstance(body, dict) and "agents" not in body and "participants" in body:
            # From a coordinator of an earlier release, which listed the participants.
            names = F.node_ids(body["participants"], "round_result", "participants", MAX_NAMES)
            body = {**body, "agents": len(names)}
        return cls(**cls.WIRE.read(body, limits))


@dataclass(frozen=True, slots=True)
class GlobalModel(F.WireMessage):
    """Coordinator → all, retained: the latest global model, ``final`` when training ended."""

    kind: ClassVar[str] = "model"
    WIRE: ClassVar[F.Body] = F.Body(
        "model",
        F.Field("model_version", F.Count()),
        F.Field("round", F.Count()),
        F.Field("final", F.Flag()),
        F.Field("weights", F.Tensors()),
    )
    model_version: int
    round: int
    final: bool
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Evaluation(F.WireMessage):
    """Agent → coordinator: this agent's metrics of global model ``model_version`` on its
    own held-out data, with the samples its mean is weighted by."""

    kind: ClassVar[str] = "evaluation"
    WIRE: ClassVar[F.Body] = F.Body(
        "evaluation",
        F.Field("model_version", F.Count()),
        F.Field("num_samples", F.Count()),
        F.Field("metrics", F.Metrics()),
    )
    model_version: int
    num_samples: int
    metrics: dict[str, float]

    def __post_init__(self) -> None:
        F.count(self.model_version, "evaluation", "model_version")
        F.count(self.num_samples, "evaluation", "num_samples")


@dataclass(frozen=True, slots=True)
class ModelRequest(F.WireMessage):
    """Agent → coordinator, on each (re)connection: the agent has ``have_version`` and
    asks for the current global model, answered with a ``GlobalModel`` on its inbox when
    it is behind (see :mod:`fedagent.protocols.catchup`)."""

    kind: ClassVar[str] = "model_request"
    WIRE: ClassVar[F.Body] = F.Body("model_request", F.Field("have_version", F.Count()), exact=True)
    have_version: int
