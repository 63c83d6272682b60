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
    "Refold",
    "Refolded",
    "Rejected",
    "ReplayKey",
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


#: One update as a replay names it: (agent, task, base version, the stream's transfer
#: id or None for a whole update).
ReplayKey = tuple[str, int, int, str | None]


@dataclass(frozen=True, slots=True)
class Refolded:
    """The caller has replayed what a :class:`Refold` asked for (through
    ``BufferMachine.refold``); ``incomplete``: the updates it could not read back whole."""

    model_version: int
    incomplete: frozenset[ReplayKey] = frozenset()


Event = AgentOnline | AgentOffline | Wakeup | WholeUpdate | UpdateHead | UpdatePart | UpdateEnd | Refolded


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
    # agent -> its weight capped ({samples, weight}) or its distance scaled down ({norm, bound})
    bounded: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refold:
    """Before the buffer of model ``model_version`` + 1 is published: replay these
    updates from the journal, each part in the order it arrived, into
    ``BufferMachine.refold``, then hand the machine :class:`Refolded`. The machine folds
    what it held back (an update past the norm bound, scaled down to it, or any update
    while the bound warms up) and takes out what was folded of an update that then
    failed. The frames of the updates of a buffer are all in the journal (it is replaced
    only at a model published with no update in transfer), so nothing of an update has
    to stay in memory for this."""

    model_version: int
    updates: tuple[ReplayKey, ...]
    # Updates counted in once replayed: replay one only if the journal holds it whole
    # (else report it incomplete). The others are taken out: replay whatever of them the
    # journal holds, from its first part on.
    counted: frozenset[ReplayKey] = frozenset()


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


Command = AssignTask | Published | BufferSpoilt | Refold | Rejected | RequestWakeup | Finished


class Phase(str, Enum):
    WAITING = "waiting"  # for a quorum of agents before the first task
    RUNNING = "running"
    DONE = "done"
