"""What the gossip machine is told (events) and what it asks its caller to do (commands)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Weights = dict[str, np.ndarray]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    """Begin the first period (local training; the first send follows it)."""


@dataclass(frozen=True, slots=True)
class PeerUp:
    peer: str


@dataclass(frozen=True, slots=True)
class PeerDown:
    peer: str


@dataclass(frozen=True, slots=True)
class TrainingDone:
    train_id: int
    weights: Weights = field(repr=False)
    steps: int | None = None  # steps actually run; None = as requested


@dataclass(frozen=True, slots=True)
class ModelReceived:
    sender: str
    exchange_id: str
    weights: Weights = field(repr=False)  # the exchanged parameters only
    mass: float = 1.0
    age: float = 0.0
    returned: bool = False  # our own mass sent back by a peer that dropped it


@dataclass(frozen=True, slots=True)
class AckReceived:
    sender: str
    exchange_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The transport could not deliver ``exchange_id`` (publish failed, peer unknown)."""

    exchange_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


Event = Start | PeerUp | PeerDown | TrainingDone | ModelReceived | AckReceived | SendFailed | Wakeup


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Train:
    """Run ``steps`` local steps from ``weights``; answer ``TrainingDone(train_id, ...)``
    with the same names, shapes and dtypes. The arrays are shared, not copied: train on
    a copy, never in place."""

    train_id: int
    weights: Weights = field(repr=False)
    steps: int = 1


@dataclass(frozen=True, slots=True)
class SendModel:
    peer: str
    exchange_id: str
    weights: Weights = field(repr=False)  # the exchanged parameters only
    mass: float = 1.0
    age: float = 0.0
    returned: bool = False


@dataclass(frozen=True, slots=True)
class SendAck:
    peer: str
    exchange_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ModelChanged:
    """The node's model after the training of ``period`` (status, checkpoint, evaluation)."""

    period: int
    weights: Weights = field(repr=False)
    age: float = 0.0
    mass: float = 1.0


@dataclass(frozen=True, slots=True)
class Dropped:
    sender: str  # who sent it (this node's id for a discarded training result)
    exchange_id: str
    reason: str  # inbox-full, names, shape, dtype, non-finite, mass, finished, ...
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    period: int
    weights: Weights = field(repr=False)


Command = Train | SendModel | SendAck | ModelChanged | Dropped | RequestWakeup | Finished
