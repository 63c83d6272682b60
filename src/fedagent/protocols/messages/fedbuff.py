"""The messages of asynchronous buffered FedAvg (``mode = "async"``): the coordinator's
task for one agent, each model it publishes, and an agent's update when it travels whole
(:mod:`fedagent.protocols.fedbuff` has the machines).

An update usually travels as a stream (:mod:`fedagent.protocols.streaming`): its header's
``round`` is then the task's number, ``base_version`` the model it trained from. The
whole form below is for the rounds that must see an update at once (its norm first:
central differential privacy, ``clip_norm``) or send it uncompressed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.messages.rounds import MAX_DEADLINE, MAX_NAMES, TrainConfig

Weights = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class AsyncTask(F.WireMessage):
    """Coordinator → one agent: train from global model ``model_version`` and send the
    update for task ``task``. The model is not in it: the agent holds it (every
    published model is broadcast) or asks for it."""

    kind: ClassVar[str] = "async_task"
    WIRE: ClassVar[F.Body] = F.Body(
        "async_task",
        F.Field("task", F.Count(low=1)),
        F.Field("model_version", F.Count()),
        F.Field("train", F.Nested(TrainConfig)),
        F.Field("deadline_s", F.Number(above=0, at_most=MAX_DEADLINE)),
    )
    task: int
    model_version: int
    train: TrainConfig
    deadline_s: float


@dataclass(frozen=True, slots=True)
class AsyncModel(F.WireMessage):
    """Coordinator → all: global model ``model_version``, whole or as the int8 step from
    the version before (exactly one), made from ``updates`` updates of ``contributors``."""

    kind: ClassVar[str] = "async_model"
    WIRE: ClassVar[F.Body] = F.Body(
        "async_model",
        F.Field("model_version", F.Count(low=1)),
        F.Field("updates", F.Count()),
        F.Field("contributors", F.NodeIds(MAX_NAMES)),
        F.Field("metrics", F.Metrics()),
        F.Field("weights", F.Tensors(), default=None, omit_default=True),
        F.Field("delta", F.Nested(ModelDelta, heavy=True), default=None, omit_default=True),
    )
    model_version: int
    updates: int
    contributors: tuple[str, ...]
    metrics: dict[str, float]
    weights: Weights | None = field(default=None, repr=False)
    delta: ModelDelta | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.weights is None) == (self.delta is None):
            raise CodecError("async_model: needs the model whole or as a step, and not both")
        if self.delta is not None and self.delta.base_version != self.model_version - 1:
            raise CodecError("async_model: a step must start from the version before")

    @classmethod
    def from_body(cls, body: Any, limits: Limits = F.DEFAULT_LIMITS) -> AsyncModel:
        # Before either is decoded: a body with both would have a peer's model decoded twice.
        if isinstance(body, dict) and ("weights" in body) == ("delta" in body):
            raise CodecError("async_model: needs 'weights' or 'delta', and not both")
        return cls(**cls.WIRE.read(body, limits))


@dataclass(frozen=True, slots=True)
class AsyncUpdate(F.WireMessage):
    """Agent → coordinator, whole: what training from model ``base_version`` changed.
    ``delta`` holds every floating tensor as trained minus base (the coordinator adds it
    to a newer model than the one it was trained from) and every other tensor (counters)
    as trained. ``task`` 0: trained on the agent's own initiative while it was cut off."""

    kind: ClassVar[str] = "async_update"
    WIRE: ClassVar[F.Body] = F.Body(
        "async_update",
        F.Field("task", F.Count()),
        F.Field("base_version", F.Count()),
        F.Field("num_samples", F.Count(low=1)),
        F.Field("metrics", F.Metrics()),
        F.Field("delta", F.Tensors()),
    )
    task: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    delta: Weights = field(repr=False)

    @property
    def weights(self) -> Weights:
        """The tensors, under the name the messenger chunks a large message by."""
        return self.delta
