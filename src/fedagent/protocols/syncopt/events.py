"""What the Sync-Opt step machine is told (events) and what it asks its caller to do
(commands)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

Weights = dict[str, np.ndarray]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Begin:
    """Training may start with these participants (e.g. the vocabulary's contributors)."""

    participants: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AgentOnline:
    agent: str


@dataclass(frozen=True, slots=True)
class AgentOffline:
    agent: str


@dataclass(frozen=True, slots=True)
class GradientReceived:
    sender: str
    step: int
    base_version: int
    num_samples: int
    loss: float
    gradient: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class OptimizerApplied:
    step: int
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


@dataclass(frozen=True, slots=True)
class ValidationReceived:
    """A participant's mean validation loss of W(base_version) over its ``num_docs``
    held-out documents (0 documents: it has none; its loss is then ignored)."""

    sender: str
    step: int
    base_version: int
    loss: float
    num_docs: int


Event = Begin | AgentOnline | AgentOffline | GradientReceived | OptimizerApplied | ValidationReceived | Wakeup


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartStep:
    step: int
    model_version: int
    participants: tuple[str, ...]
    deadline_s: float
    weights: Weights | None = field(repr=False)  # None: every participant holds this version


@dataclass(frozen=True, slots=True)
class ApplyGradient:
    """Apply the optimizer to W(model_version) with ``gradient``; answer OptimizerApplied."""

    step: int
    model_version: int
    gradient: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class StepDone:
    step: int
    model_version: int  # the new version
    weights: Weights = field(repr=False)
    loss: float  # sample-weighted mean of the participants' losses
    rel_change: float
    participants: tuple[str, ...]  # whose gradients were aggregated
    samples: int
    missing: tuple[str, ...] = ()  # expected but absent (fault): the step is not exact
    final: bool = False


@dataclass(frozen=True, slots=True)
class StepRepeated:
    step: int
    model_version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    sender: str
    step: int
    reason: str  # stale, duplicate, unselected, names, shape, dtype, non-finite, norm, weight
    detail: str


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class StartValidation:
    """Send W(model_version) (None: every participant holds it) to be evaluated on each
    participant's held-out documents; answers are ValidationReceived for ``step``."""

    step: int
    model_version: int
    epoch: int  # 1-based: the epoch that just ended
    participants: tuple[str, ...]
    deadline_s: float
    weights: Weights | None = field(repr=False)


@dataclass(frozen=True, slots=True)
class EpochDone:
    """The pooled validation loss of the epoch's model; checkpoint with the stop state."""

    epoch: int  # 1-based
    step: int
    model_version: int
    loss: float
    improved: bool
    best_epoch: int  # 1-based; 0: none yet
    best_loss: float
    participants: tuple[str, ...]  # whose losses were pooled
    documents: int
    missing: tuple[str, ...] = ()
    final: bool = False


@dataclass(frozen=True, slots=True)
class Finished:
    model_version: int
    steps_done: int
    reason: str  # "max steps" | "converged" | "early stopped" | "max epochs"
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Aborted:
    step: int
    model_version: int
    reason: str


Command = (
    StartStep
    | ApplyGradient
    | StepDone
    | StepRepeated
    | StartValidation
    | EpochDone
    | Rejected
    | RequestWakeup
    | Finished
    | Aborted
)


class Phase(str, Enum):
    WAITING = "waiting"  # for Begin
    COLLECTING = "collecting"
    APPLYING = "applying"  # the daemon runs the optimizer
    VALIDATING = "validating"  # collecting the participants' validation losses
    DONE = "done"
    ABORTED = "aborted"
