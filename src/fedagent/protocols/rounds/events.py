"""What the round machine is told (events) and what it asks its caller to do
(commands)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from fedagent.protocols import secagg as SA
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.messages import RoundStart, TrainConfig
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

Weights = dict[str, np.ndarray]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgentOnline:
    agent: str
    num_samples: int = 0
    # The agent rebuilds round starts sent as int8 steps (its presence says so); agents
    # of earlier releases do not, and take part only in rounds whose start carries the
    # whole model (RoundConfig.whole_model_every).
    reads_steps: bool = True
    # A site aggregator's announcement: the agents online at its site (0 for an agent).
    # A tier of site aggregators calibrates distributed DP's noise shares with them.
    agents: int = 0


@dataclass(frozen=True, slots=True)
class AgentOffline:
    agent: str


@dataclass(frozen=True, slots=True)
class UpdateReceived:
    sender: str
    round: int
    base_version: int
    num_samples: int
    weights: Weights
    metrics: Mapping[str, float]
    leaving: bool = False  # the sender's last round: don't select it again


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


@dataclass(frozen=True, slots=True)
class SecAggReceived:
    """A secure-aggregation message from an agent (its certificate's name)."""

    sender: str
    message: SA.SecAggMessage


@dataclass(frozen=True, slots=True)
class Refolded:
    """The caller has replayed what a :class:`Refold` asked for (through
    ``RoundMachine.refold``); ``incomplete``: the senders whose update it could not read
    back whole."""

    round: int
    incomplete: frozenset[str] = frozenset()


Event = (
    AgentOnline
    | AgentOffline
    | UpdateReceived
    | Wakeup
    | UpdateHead
    | UpdatePart
    | UpdateEnd
    | SecAggReceived
    | Refolded
)


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartRound:
    round: int
    model_version: int
    selected: tuple[str, ...]
    weights: Weights
    train: TrainConfig
    deadline_s: float
    resumed: bool = False  # the same round again after a restart (see RoundMachine.resume)
    secagg: SA.SecAggSetup | None = None
    # Secure-aggregation messages to send after the setup and before the model (the
    # rosters, when the keys were advertised ahead): they overtake the model.
    secagg_first: tuple[SendSecAgg, ...] = ()
    # the model as the int8 step from the previous version ([transfer] downlink), or None:
    # send ``weights``
    delta: ModelDelta | None = None
    # ``selected`` is every agent online: the round start says so instead of naming them
    everyone: bool = False

    def message(self) -> RoundStart:
        """The round start to broadcast: the model whole or as the step, and the agents
        by name, or as a count when the round selects every agent online."""
        return RoundStart(
            self.round,
            self.model_version,
            () if self.everyone else self.selected,
            self.deadline_s,
            self.train,
            None if self.delta is not None else self.weights,
            self.secagg,
            self.delta,
            everyone=self.everyone,
            agents=len(self.selected) if self.everyone else 0,
        )

    def to_whom(self) -> str:
        """The selection for a log line: a count for every agent online (a list of
        thousands of names a round helps nobody), the names of a sample or cohort."""
        if self.everyone:
            return f"all {len(self.selected)} agents online"
        return ", ".join(self.selected)


@dataclass(frozen=True, slots=True)
class RoundAggregated:
    round: int
    model_version: int
    weights: Weights
    participants: tuple[str, ...]
    metrics: dict[str, float]
    final: bool
    weights_used: dict[str, float] = field(default_factory=dict)  # participant -> aggregation weight
    dropped: dict[str, float] = field(default_factory=dict)  # sender -> the metric that dropped it
    privacy: dict[str, float] | None = None  # ε spent so far, δ, clip norm, noise (DP only)
    # The server momentum's velocity after this round (empty without momentum): the
    # checkpoint keeps it with ``weights``, which it made.
    velocity: Weights = field(default_factory=dict)
    # participant -> how its update was bounded: {"samples": claimed, "weight": used} when
    # its weight was capped, {"norm": its distance, "bound": the bound} when scaled down
    bounded: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundAbandoned:
    round: int
    model_version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    sender: str
    round: int
    reason: str  # short code: stale, duplicate, unselected, shape, non-finite, ...
    detail: str


@dataclass(frozen=True, slots=True)
class LateUpdate:
    """An update for a round that was abandoned, or from an agent that came online just
    after a round that selected every agent online had started: late, not wrong (not a
    refusal)."""

    sender: str
    round: int
    detail: str


@dataclass(frozen=True, slots=True)
class Refold:
    """Replay these updates of ``round`` (sender, the stream's transfer id or None for a
    whole update), each part in the order it arrived, into ``RoundMachine.refold``, then
    hand the machine :class:`Refolded`. The machine folds what was held back (an update
    past the norm bound, scaled down) and takes out what was folded of an update that
    then failed; the caller keeps every frame of the round in flight (its journal), so
    nothing of an update has to stay in memory for this."""

    round: int
    updates: tuple[tuple[str, str | None], ...]
    # Senders whose update is counted in once replayed: replay one only if the journal
    # holds it whole (else report it incomplete). The others are taken out: replay
    # whatever of them the journal holds, from its first part on.
    counted: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    model_version: int
    weights: Weights
    reason: str = ""  # why before the configured rounds (the privacy budget)


@dataclass(frozen=True, slots=True)
class SendSecAgg:
    """Send a secure-aggregation message to one agent's inbox."""

    to: str
    message: SA.SecAggMessage


Command = (
    StartRound
    | RoundAggregated
    | RoundAbandoned
    | Rejected
    | LateUpdate
    | Refold
    | RequestWakeup
    | Finished
    | SendSecAgg
)


class Phase(str, Enum):
    WAITING = "waiting"  # for a quorum of agents
    TRAINING = "training"  # a round is in progress
    DONE = "done"
