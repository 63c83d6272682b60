"""What the buffer machine is told (events) and what it asks its caller to do
(commands). Agents' presence, wake-ups and refusals are those of FedAvg rounds
(:mod:`fedagent.protocols.rounds.events`); streamed updates are
:mod:`fedagent.protocols.streaming`'s events, whose ``round`` is the task's number."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.events import AgentOffline, AgentOnline, Rejected, RequestWakeup, Wakeup
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

Weights = dict[str, np.ndarray]

__all__ = [
    "AgentOffline",
    "AgentOnline",
    "AssignTask",
    "BufferSpoilt",
    "Command",
    "Event",
    "Finished",
    "Phase",
    "Published",
    "Rejected",
    "RequestWakeup",
    "Wakeup",
    "WholeUpdate",
]


@dataclass(frozen=True, slots=True)
class WholeUpdate:
    """An update that travelled whole: ``delta`` holds the floating tensors as trained
    minus base and the others as trained (:class:`~fedagent.protocols.messages.AsyncUpdate`)."""

    sender: str
    task: int
    base_version: int
    num_samples: int
    metrics: Mapping[str, float]
    delta: Weights = field(repr=False)


Event = AgentOnline | AgentOffline | Wakeup | WholeUpdate | UpdateHead | UpdatePart | UpdateEnd


@dataclass(frozen=True, slots=True)
class AssignTask:
    """Send ``agent`` task ``task``: train from model ``model_version``."""

    agent: str
    task: int
    model_version: int
    train: TrainConfig
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Published:
    """A buffer became model ``model_version``: checkpoint it and broadcast it (as
    ``delta``, the int8 step from the version before, when that is not None)."""

    model_version: int
    weights: Weights = field(repr=False)
    delta: ModelDelta | None = field(repr=False)
    contributors: tuple[str, ...]
    metrics: dict[str, float]
    # (sender, task, base version, staleness, share of the aggregate) per update
    updates: tuple[tuple[str, int, int, int, float], ...]
    dropped: dict[str, float]
    privacy: dict[str, float] | None
    final: bool


@dataclass(frozen=True, slots=True)
class BufferSpoilt:
    """An update failed after parts of it were added to the buffer: the buffer is emptied
    and its ``lost`` updates with it (a value cannot be taken back out of a sum)."""

    model_version: int
    lost: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Finished:
    model_version: int
    weights: Weights = field(repr=False)
    reason: str = ""  # why before the configured versions (the privacy budget)


Command = AssignTask | Published | BufferSpoilt | Rejected | RequestWakeup | Finished


class Phase(str, Enum):
    WAITING = "waiting"  # for a quorum of agents before the first task
    RUNNING = "running"
    DONE = "done"
