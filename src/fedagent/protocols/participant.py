"""The agent's side of coordinated FedAvg rounds, as pure code.

The agent trains when a ``RoundStart`` names it, and sends its update only if that
round is still the newest one it has heard of: work finished after a newer round
started (the agent was paused, or slow) is discarded rather than submitted stale.
Redelivered or repeated round starts (QoS 1 after a reconnect) don't train twice.

With ``leave_after = k`` the agent takes part in k rounds and then leaves (a vehicle
driving out of a road-side unit's coverage): its k-th update says ``leaving`` so the
coordinator stops selecting it, and once that round's result (or any later round) is
heard the machine returns ``Leave``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.downlink import rebuild
from fedagent.protocols.messages import GlobalModel, RoundResult, RoundStart, TrainConfig, Update

Weights = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class TrainingDone:
    round: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Train:
    round: int
    base_version: int
    train: TrainConfig
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class SendUpdate:
    update: Update


@dataclass(frozen=True, slots=True)
class Discarded:
    round: int
    reason: str


@dataclass(frozen=True, slots=True)
class AdoptModel:
    """Keep this global model (for evaluation, status and the next restart)."""

    model_version: int
    round: int
    final: bool
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Leave:
    """Done: leave the federation (the daemon exits cleanly)."""

    reason: str


Command = Train | SendUpdate | Discarded | AdoptModel | Leave


class Participant:
    def __init__(self, agent_id: str, *, model_version: int = 0, leave_after: int = 0) -> None:
        if leave_after < 0:
            raise ValueError("leave_after must be >= 0")
        self.agent_id = agent_id
        self.leave_after = leave_after
        self.leaving_round: int | None = None  # round of the update that said `leaving`
        self.left = False
        self.latest_round = 0  # newest round heard of
        self.training_round: int | None = None
        self.rounds_done = 0
        self.model_version = model_version
        self.last_metrics: dict[str, float] = {}
        self.last_result: RoundResult | None = None
        self.finished = False

    def handle(self, event: RoundStart | TrainingDone | RoundResult | GlobalModel) -> list[Command]:
        if self.left:
            return []
        if isinstance(event, RoundStart):
            if event.round <= self.latest_round:
                return []  # repeated or older: already handled
            self.latest_round = event.round
            if self.leaving_round is not None:  # the result of our last round was lost
                return self._leave()
            self.model_version = max(self.model_version, event.model_version)
            if not event.selects(self.agent_id):
                return []
            if event.weights is None:
                raise ValueError("a round start with a step must be resolved first (DeltaReceiver)")
            self.training_round = event.round
            return [Train(event.round, event.model_version, event.train, event.weights)]
        if isinstance(event, TrainingDone):
            if self.training_round != event.round:
                return [Discarded(event.round, "not the round being trained")]
            self.training_round = None
            if event.round < self.latest_round:
                return [Discarded(event.round, f"round {self.latest_round} started meanwhile")]
            self.rounds_done += 1
            self.last_metrics = dict(event.metrics)
            leaving = bool(self.leave_after) and self.rounds_done >= self.leave_after
            if leaving:
                self.leaving_round = event.round
            return [
                SendUpdate(
                    Update(
                        event.round,
                        event.base_version,
                        event.num_samples,
                        dict(event.metrics),
                        event.weights,
                        leaving=leaving,
                    )
                )
            ]
        if isinstance(event, RoundResult):
            if self.last_result is None or event.round >= self.last_result.round:
                self.last_result = event
            if self.leaving_round is not None and event.round >= self.leaving_round:
                return self._leave()
            return []
        if isinstance(event, GlobalModel):
            if event.model_version < self.model_version:
                return []
            self.model_version = event.model_version
            self.finished = self.finished or event.final
            return [AdoptModel(event.model_version, event.round, event.final, event.weights)]
        raise TypeError(f"not a participant event: {event!r}")

    def _leave(self) -> list[Command]:
        self.left = True
        return [Leave(f"took part in {self.rounds_done} round(s) (leave_after = {self.leave_after})")]


class DeltaReceiver:
    """The agent's side: a round start with the model it can train from, or a note that
    the model must be fetched first (the start is kept until it comes)."""

    def __init__(self) -> None:
        self.pending: RoundStart | None = None
        self.rebuilt = 0
        self.fetched = 0

    def resolve(self, start: RoundStart, held: tuple[int, Weights] | None) -> tuple[RoundStart | None, str]:
        """``start`` with its weights, and ""; or None and why the model must be fetched
        (``start`` is then pending). ``held``: the version and model this agent has."""
        if self.pending is not None and self.pending.round <= start.round:
            self.pending = None  # a newer round start supersedes the one waiting
        delta = start.delta
        if delta is None:
            return start, ""
        if held is not None and held[0] == start.model_version:
            return replace(start, weights=held[1], delta=None), ""
        if held is None or held[0] != delta.base_version:
            why = f"the step is from version {delta.base_version}, this agent holds {held[0] if held else 'none'}"
        else:
            try:
                weights = rebuild(held[1], delta)
            except CodecError as exc:
                why = str(exc)
            else:
                self.rebuilt += 1
                return replace(start, weights=weights, delta=None), ""
        self.pending = start
        return None, why

    def on_model(self, version: int, weights: Weights) -> RoundStart | None:
        """A whole model arrived: the pending round start, if it was waiting for it."""
        p = self.pending
        if p is None or version < p.model_version:
            return None
        self.pending = None
        if version > p.model_version:
            return None  # its round is over: a newer model exists
        self.fetched += 1
        return replace(p, weights=weights, delta=None)
