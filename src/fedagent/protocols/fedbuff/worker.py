"""The agent's side of asynchronous buffered FedAvg, as pure code: an agent that keeps
working when its link does not.

The agent trains when the coordinator gives it a task, from the newest global model it
holds (at least the task's), and its finished update goes into a one-entry outbox on disk
(:class:`Keep`, before anything is sent: a crash never loses it) and then to the
coordinator (:class:`Send`); it leaves the outbox once the broker has acknowledged all of
it (:class:`Discard`). While the link is down:

* an update that is finished waits in the outbox and is sent when the link is back;
* the agent does not wait for a task: it trains on the model it holds (the task's
  settings of its last task; task 0 on the wire), and trains its outbox update further
  (a longer local training from the same base model, which replaces the entry), at most
  ``offline_trainings`` times per outage. Under differential privacy an update is noised
  once, when it is kept, so it is never trained further.

The coordinator takes what comes back within its staleness bound; this machine does not
know the bound and never drops work on a guess. Nothing here reads a clock, a file or a
socket: the session (:mod:`fedagent.agent.fedbuff`) carries the commands out and feeds
back their results.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedagent.protocols.messages import AsyncTask, TrainConfig

Weights = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Work:
    """An update being made or made: trained from model ``base_version`` (``base``),
    ``trainings`` trainings so far, for ``task`` (0: the agent's own)."""

    task: int
    base_version: int
    train: TrainConfig
    base: Weights = field(repr=False)
    trainings: int = 1
    offline: bool = False  # started while the link was down


@dataclass(frozen=True, slots=True)
class Pending:
    """A finished update in the outbox."""

    work: Work
    weights: Weights = field(repr=False)  # as trained
    num_samples: int
    metrics: dict[str, float]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinkUp:
    pass


@dataclass(frozen=True, slots=True)
class LinkDown:
    pass


@dataclass(frozen=True, slots=True)
class ModelIn:
    """The whole global model of ``version`` is here (rebuilt from a step, fetched, final)."""

    version: int
    weights: Weights = field(repr=False)
    final: bool = False


@dataclass(frozen=True, slots=True)
class TaskIn:
    task: AsyncTask


@dataclass(frozen=True, slots=True)
class Trained:
    work: Work
    weights: Weights = field(repr=False)
    num_samples: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class TrainingFailed:
    work: Work
    reason: str


@dataclass(frozen=True, slots=True)
class Delivered:
    pending: Pending


@dataclass(frozen=True, slots=True)
class NotDelivered:
    pending: Pending
    reason: str


@dataclass(frozen=True, slots=True)
class Restored:
    """The outbox's entry, read back after a restart."""

    pending: Pending


Event = LinkUp | LinkDown | ModelIn | TaskIn | Trained | TrainingFailed | Delivered | NotDelivered | Restored


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Train:
    """Train ``start`` (the base model, or an update trained further) as ``work`` says."""

    work: Work
    start: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Keep:
    """Write ``pending`` to the outbox (replacing what is there) before it is sent."""

    pending: Pending


@dataclass(frozen=True, slots=True)
class Send:
    pending: Pending


@dataclass(frozen=True, slots=True)
class Discard:
    pending: Pending
    reason: str


@dataclass(frozen=True, slots=True)
class Fetch:
    """Ask the coordinator for its current model (this agent holds ``have_version``)."""

    have_version: int


Command = Train | Keep | Send | Discard | Fetch


class AsyncWorker:
    """One agent's work: ``offline_trainings`` bounds the trainings it starts on its own
    per outage (0: it only finishes the task it has)."""

    def __init__(self, *, offline_trainings: int = 2, model: tuple[int, Weights] | None = None) -> None:
        if offline_trainings < 0:
            raise ValueError("offline_trainings must be >= 0")
        self.offline_trainings = offline_trainings
        self.model = model  # (version, weights) of the newest global model held
        self.train_config: TrainConfig | None = None  # the last task's, for training on its own
        self.task: AsyncTask | None = None  # the newest task not started yet
        self.last_task = 0
        self.training: Work | None = None
        self.outbox: Pending | None = None
        self.sending = False
        self.fetching = False
        self.connected = False
        # The link was up and went down (not: not up yet after a start): only then does
        # the agent work on its own.
        self.cut_off = False
        self.offline_started = 0  # trainings started since the link went down
        self.finished = False
        self.trained = 0
        self.sent = 0

    def handle(self, event: Event) -> list[Command]:
        out: list[Command] = []
        if isinstance(event, LinkUp):
            self.connected = True
            self.cut_off = False
            self.offline_started = 0
        elif isinstance(event, LinkDown):
            self.connected = False
            self.cut_off = True
        elif isinstance(event, ModelIn):
            if self.model is None or event.version >= self.model[0]:
                self.model = (event.version, event.weights)
            self.fetching = False
            if event.final:
                self.finished = True
                self.task = None
                if self.outbox is not None and not self.sending:
                    out.append(Discard(self.outbox, "training has ended"))
                    self.outbox = None
        elif isinstance(event, TaskIn):
            t = event.task
            if t.task <= self.last_task or self.finished:
                return []  # a task seen before (delivered again), or training is over
            self.last_task = t.task
            self.task = t  # a newer task replaces one not started
            self.train_config = t.train
        elif isinstance(event, Trained):
            self.training = None
            self.trained += 1
            pending = Pending(event.work, event.weights, event.num_samples, dict(event.metrics))
            if self.finished:
                return []
            self.outbox = pending
            out.append(Keep(pending))
        elif isinstance(event, TrainingFailed):
            self.training = None
        elif isinstance(event, Delivered):
            self.sending = False
            self.sent += 1
            if self.outbox is event.pending:
                self.outbox = None
                out.append(Discard(event.pending, "delivered"))
        elif isinstance(event, NotDelivered):
            self.sending = False
            # Sent again on the next connection: retrying at once on a link that just
            # failed would spin.
            self.connected = False
            self.cut_off = True
        elif isinstance(event, Restored):
            if self.outbox is None:
                self.outbox = event.pending
        else:
            raise TypeError(f"not a worker event: {event!r}")
        return out + self._next()

    def _next(self) -> list[Command]:
        if self.finished or self.training is not None or self.sending:
            return []
        if self.outbox is not None:
            if self.connected:
                self.sending = True
                return [Send(self.outbox)]
            return self._train_further(self.outbox) if self.cut_off else []
        task = self.task
        if task is not None:
            if self.model is not None and self.model[0] >= task.model_version:
                # The newest model held: at least as fresh as the one the task names.
                self.task = None
                version, weights = self.model
                return self._start(Work(task.task, version, task.train, weights), weights)
            if self.connected and not self.fetching:
                self.fetching = True
                return [Fetch(self.model[0] if self.model is not None else 0)]
            return []
        if self.cut_off and self.model is not None and self.train_config is not None:
            if self.offline_started < self.offline_trainings:
                version, weights = self.model
                return self._start(Work(0, version, self.train_config, weights, offline=True), weights)
        return []

    def _train_further(self, pending: Pending) -> list[Command]:
        """Cut off with a finished update: train it further, within the bound per outage
        (never under DP: the update was noised when it was kept)."""
        if self.offline_started >= self.offline_trainings or pending.work.train.dp_clip is not None:
            return []
        work = replace(pending.work, trainings=pending.work.trainings + 1, offline=True)
        return self._start(work, pending.weights)

    def _start(self, work: Work, start: Weights) -> list[Command]:
        if work.offline:
            self.offline_started += 1
        self.training = work
        return [Train(work, start)]

    def status(self) -> dict[str, Any]:
        p = self.outbox
        return {
            "model_version": self.model[0] if self.model is not None else None,
            "training": None
            if self.training is None
            else {
                "task": self.training.task,
                "from_version": self.training.base_version,
                "training": self.training.trainings,
                "offline": self.training.offline,
            },
            "next_task": None if self.task is None else self.task.task,
            "outbox": None
            if p is None
            else {"task": p.work.task, "base_version": p.work.base_version, "trainings": p.work.trainings},
            "trained": self.trained,
            "sent": self.sent,
        }
