"""The coordinator's machine of asynchronous buffered FedAvg, as pure code (the
package's docstring says what it guarantees): tasks and the concurrency limit, the
intake of updates with their staleness, the buffer, and each model it publishes. The
server step (:class:`~fedagent.protocols.rounds.serverstep.ServerStep`) and the DP
accounting (:class:`~fedagent.protocols.rounds.privacy.PrivacyBudget`) are those of
FedAvg rounds."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedagent.protocols.aggregation import Plan, StrategyAggregator, UpdateRejected, check_update, weighted_metrics
from fedagent.protocols.fedbuff.config import BufferConfig
from fedagent.protocols.fedbuff.events import (
    AgentOffline,
    AgentOnline,
    AssignTask,
    BufferSpoilt,
    Command,
    Event,
    Finished,
    Phase,
    Published,
    Refold,
    Refolded,
    Rejected,
    ReplayKey,
    RequestWakeup,
    Wakeup,
    WholeUpdate,
)
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.bounds import Influence, Replay, part_sq_distance, scaled
from fedagent.protocols.rounds.privacy import PrivacyBudget
from fedagent.protocols.rounds.serverstep import ServerStep
from fedagent.protocols.serveropt import VelocityStore
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

Weights = dict[str, np.ndarray]
#: (agent, task, base version): one update, whatever path it came by (0: the agent's own).
Key = tuple[str, int, int]
#: Staleness values kept for the quantiles ``status`` shows.
RECENT = 256


@dataclass(slots=True)
class Task:
    """A task given to an agent; ``holds_slot`` while it counts against the concurrency
    limit (until its update comes, its deadline passes or its agent goes offline)."""

    number: int
    base_version: int
    deadline: float
    holds_slot: bool = True


@dataclass(frozen=True, slots=True)
class Entry:
    """An update in the buffer."""

    key: Key
    staleness: int
    num_samples: int
    metrics: dict[str, float]
    weight: float  # what its values were added with
    dropped: float | None = None  # drop_above: the metric that kept it out

    @property
    def sender(self) -> str:
        return self.key[0]

    @property
    def label(self) -> str:
        return f"{self.key[0]}/{self.key[1]}/{self.key[2]}"


@dataclass(slots=True)
class _Inflight:
    """A streamed update being folded into the buffer."""

    tid: str
    key: Key
    staleness: int
    head: UpdateHead
    fold: Plan
    commit: Plan
    samples: int  # the weight it carries (num_samples, capped)
    folded: int = 0  # values folded at the fold plan's weight (a prefix of the stream)
    dsq: float = 0.0  # squared distance (of its floating deltas) so far: the norm bound
    held: bool = False  # past the bound (or warming up): the rest waits for a replay


@dataclass(slots=True)
class AgentView:
    """What ``status`` shows of one agent."""

    task: int = 0
    training_from: int | None = None  # the model version of its task
    last_base: int | None = None  # the version its last update was trained from
    last_staleness: int | None = None
    accepted: int = 0
    refused: int = 0


class BufferMachine:
    def __init__(
        self,
        config: BufferConfig,
        weights: Weights,
        *,
        model_version: int = 0,
        accepted: Iterable[object] = (),
        first_task: int = 1,
        privacy_state: Mapping[str, object] | None = None,
        velocity_store: VelocityStore | None = None,
        rng: np.random.Generator | None = None,
        replays: bool = False,
        norm_history: Sequence[Sequence[float]] = (),
        announced: Mapping[str, int] | None = None,
    ) -> None:
        """``model_version``, ``accepted`` (the updates already in that model, within the
        staleness bound), ``privacy_state`` and the velocity in ``velocity_store`` resume
        from a checkpoint; ``first_task``: task numbers start here (a restart never gives
        a number twice). ``rng`` draws central DP's noise.

        ``replays``: the caller carries out :class:`Refold` (its journal holds every
        frame of the buffer's updates): the norm bound needs it (ValueError without), and
        an update that fails after parts of it were added is then taken out of the sums
        instead of spoiling the buffer. ``norm_history`` and ``announced``
        (:meth:`bounds_state`) resume the norm bound's recent distances and the samples
        the agents announced: a restart neither warms the bound up again nor takes an
        update journaled before any presence at its word."""
        if config.bounds_norms and not replays:
            raise ValueError("the norm bound needs a caller that replays updates (replays=True)")
        self.config = config
        self.weights = weights
        self.model_version = model_version
        self.server_step = ServerStep(
            weights,
            server_lr=config.server_lr,
            momentum=config.momentum,
            downlink=config.downlink,
            store=velocity_store,
        )
        self.budget: PrivacyBudget | None = None
        if config.dp is not None:
            self.budget = PrivacyBudget(config.dp, privacy_state, rng if rng is not None else np.random.default_rng())
        self.phase = Phase.DONE if config.last(model_version) else Phase.WAITING
        self.stop_reason = ""
        self.online: dict[str, int] = {}
        self._whole_only: set[str] = set()
        self.tasks: dict[str, Task] = {}
        self.next_task = max(1, first_task)
        self.idle_since: dict[str, float] = {}  # online agents without a task in hand
        self.quorum_since: float | None = None
        # updates in this model or the buffer, by key, with the version they trained from
        self.accepted: dict[Key, int] = {k: k[2] for k in map(_key, accepted)}
        self.entries: list[Entry] = []
        self.inflight: dict[str, _Inflight] = {}
        self.ignored: set[tuple[str, str]] = set()
        # The buffer's running sums, made when its first update comes: after a model is
        # published, the model before it is gone by then (two models and a sum at most).
        self._acc: StrategyAggregator | None = None
        self._unclipped = 0  # central DP: updates of the buffer within the clip bound
        self.last_metrics: dict[str, float] = {}
        self.recent_staleness: deque[int] = deque(maxlen=RECENT)
        self.staleness_counts: Counter[int] = Counter()
        self.refused: Counter[str] = Counter()
        self.spoilt = 0
        self.agents: dict[str, AgentView] = {}
        self.replays = replays
        # The member protections of rounds, a buffer in place of a round: the weight cap
        # against what the agents announced, the norm bound over recent buffers.
        self.announced: dict[str, int] = {
            str(a): int(n) for a, n in (announced or {}).items() if type(n) is int and n > 0
        }
        self.influence = Influence(config, norm_history)
        self.influence.open(self.announced, self.announced)
        self._replay: dict[ReplayKey, Replay] = {}  # updates to replay before the buffer is published
        self._refolding: tuple[ReplayKey, ...] = ()  # the replays of the Refold out, until its Refolded

    # -- public ------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, AgentOnline):
            self.online[event.agent] = event.num_samples
            if event.num_samples > 0:
                self.announced[event.agent] = event.num_samples
                self.influence.announce(event.agent, event.num_samples, joins=True)
            if event.reads_steps:
                self._whole_only.discard(event.agent)
            else:
                self._whole_only.add(event.agent)
            if event.agent not in self.tasks or not self.tasks[event.agent].holds_slot:
                self.idle_since.setdefault(event.agent, now)
            if self.phase is Phase.WAITING:
                return self._maybe_start(now)
            return self._assign(now)
        if isinstance(event, AgentOffline):
            self.online.pop(event.agent, None)
            self._whole_only.discard(event.agent)
            self.idle_since.pop(event.agent, None)
            task = self.tasks.get(event.agent)
            if task is not None:
                # It may train on, cut off, and send its update later: the task stays
                # known, its place goes to an agent that is here.
                task.holds_slot = False
            if self.phase is Phase.WAITING and len(self.online) < self.config.min_agents:
                self.quorum_since = None
            return self._assign(now)
        if isinstance(event, UpdatePart):
            return self._on_part(event, now)
        if isinstance(event, UpdateHead):
            return self._on_head(event, now)
        if isinstance(event, UpdateEnd):
            return self._on_end(event, now)
        if isinstance(event, WholeUpdate):
            return self._on_whole(event, now)
        if isinstance(event, Refolded):
            return self._on_refolded(event, now)
        if isinstance(event, Wakeup):
            if self.phase is Phase.WAITING:
                return self._maybe_start(now)
            return self._expire(now)
        raise TypeError(f"not a buffer event: {event!r}")

    @property
    def fill(self) -> int:
        """Updates in the buffer (those drop_above kept out count too)."""
        return len(self.entries)

    def whole_model_only(self) -> list[str]:
        return sorted(a for a in self._whole_only if a in self.online)

    def privacy(self) -> dict[str, float] | None:
        return self.budget.report() if self.budget is not None else None

    def privacy_state(self) -> dict[str, object] | None:
        return self.budget.state() if self.budget is not None else None

    def bounds_state(self) -> dict[str, object]:
        """What a checkpoint keeps of the member protections: the distances of recent
        buffers (``norms``) and the samples each agent announced (``announced``)."""
        return {"norms": self.influence.state(), "announced": dict(sorted(self.announced.items()))}

    def accepted_keys(self) -> list[list[object]]:
        """The updates in the current model within the staleness bound: a checkpoint
        keeps them, so that none is taken twice after a restart."""
        buffered = {e.key for e in self.entries}
        return [[a, t, b] for (a, t, b) in self.accepted if (a, t, b) not in buffered]

    def staleness(self) -> dict[str, object]:
        """Quantiles of the recent updates' staleness and the counts of every value."""
        recent = sorted(self.recent_staleness)
        out: dict[str, object] = {"updates": sum(self.staleness_counts.values())}
        if recent:
            out.update(
                p50=recent[len(recent) // 2],
                p90=recent[min(len(recent) - 1, (9 * len(recent)) // 10)],
                max=recent[-1],
                mean=round(sum(recent) / len(recent), 2),
            )
        out["histogram"] = {str(s): n for s, n in sorted(self.staleness_counts.items())}
        return out

    def status(self) -> dict[str, Any]:
        running = sum(1 for t in self.tasks.values() if t.holds_slot)
        return {
            "phase": self.phase.value,
            "model_version": self.model_version,
            "versions": self.config.versions,
            "buffer": {"fill": self.fill, "size": self.config.buffer_size, "streaming": len(self.inflight)},
            "training": running,
            "concurrency": self.config.concurrency or None,
            "online": sorted(self.online),
            "staleness": self.staleness(),
            "max_staleness": self.config.max_staleness,
            "refused": dict(self.refused),
            "spoilt_buffers": self.spoilt,
            "bounds": self.influence.status(),
            "agents": {
                a: {
                    "online": a in self.online,
                    "task": v.task or None,
                    "training_from": v.training_from,
                    "last_base": v.last_base,
                    "last_staleness": v.last_staleness,
                    "accepted": v.accepted,
                    "refused": v.refused,
                }
                for a, v in sorted(self.agents.items())
            },
            "metrics": dict(self.last_metrics),
            "privacy": self.privacy(),
            "stop_reason": self.stop_reason,
        }

    # -- starting and tasks ----------------------------------------------------------
    def _maybe_start(self, now: float) -> list[Command]:
        cfg = self.config
        n = len(self.online)
        if n < cfg.min_agents:
            self.quorum_since = None
            return []
        if self.quorum_since is None:
            self.quorum_since = now
        enough = cfg.expected_agents and n >= cfg.expected_agents
        if not enough and now < self.quorum_since + cfg.start_grace:
            return [RequestWakeup(self.quorum_since + cfg.start_grace)]
        why = self._over_budget()
        if why:
            return self._finish(why)
        self.phase = Phase.RUNNING
        return self._assign(now)

    def _train(self) -> TrainConfig:
        train = replace(self.config.train, lr=self.config.lr_for(self.model_version))
        if self.budget is not None:
            train = self.budget.train(train, self.config.buffer_size)
        return train

    def _assign(self, now: float) -> list[Command]:
        """Tasks for idle agents, the longest idle first, while the limit allows."""
        if self.phase is not Phase.RUNNING:
            return []
        cfg = self.config
        limit = cfg.concurrency or math.inf
        running = sum(1 for t in self.tasks.values() if t.holds_slot)
        out: list[Command] = []
        # An agent with its share of the buffer (under DP: one update) waits for the
        # next model: its update would be refused.
        limit_each = 1 if self.budget is not None else self._share()
        counts = Counter(e.sender for e in self.entries)
        full = {a for a, n in counts.items() if n >= limit_each}
        idle = [a for a in self.online if a not in full and (a not in self.tasks or not self.tasks[a].holds_slot)]
        idle.sort(key=lambda a: (self.idle_since.get(a, now), a))
        train: TrainConfig | None = None
        for agent in idle:
            if running >= limit:
                break
            if train is None:
                train = self._train()
            task = Task(self.next_task, self.model_version, now + cfg.task_timeout)
            self.next_task += 1
            self.tasks[agent] = task
            self.idle_since.pop(agent, None)
            view = self._view(agent)
            view.task, view.training_from = task.number, task.base_version
            running += 1
            out.append(AssignTask(agent, task.number, task.base_version, train, cfg.task_timeout))
        return out + self._wake()

    def _wake(self) -> list[Command]:
        due = [t.deadline for t in self.tasks.values() if t.holds_slot]
        return [RequestWakeup(min(due))] if due else []

    def _expire(self, now: float) -> list[Command]:
        for agent, task in self.tasks.items():
            if task.holds_slot and task.deadline <= now:
                # Slow, stuck or cut off without a word: its place is free again, the
                # longest idle agent gets it (this one too, last: a new task waits on an
                # agent until its training ends, and one that failed trains again). Its
                # update is still taken when it comes, within the staleness bound.
                task.holds_slot = False
                if agent in self.online:
                    self.idle_since.setdefault(agent, now)
        return self._assign(now)

    def _task_answered(self, sender: str, task: int, now: float) -> None:
        """An update of ``sender`` for ``task`` came (taken or not): the agent is idle
        again when that was its current task."""
        current = self.tasks.get(sender)
        if current is not None and current.number == task:
            del self.tasks[sender]
            self._view(sender).task = 0
        if sender in self.online and (sender not in self.tasks or not self.tasks[sender].holds_slot):
            self.idle_since.setdefault(sender, now)

    def _view(self, agent: str) -> AgentView:
        v = self.agents.get(agent)
        if v is None:
            v = self.agents[agent] = AgentView()
        return v

    # -- intake ------------------------------------------------------------------------
    def _admit(self, sender: str, task: int, base: int) -> tuple[str, str] | int:
        """The update's staleness, or why it is refused (reason, detail)."""
        if self.phase is Phase.DONE:
            return "done", "training has ended"
        if base > self.model_version:
            return "version", f"trained from version {base}, the current one is {self.model_version}"
        s = self.model_version - base
        if s > self.config.max_staleness:
            return "stale", (
                f"trained from version {base}, {s} versions behind {self.model_version} "
                f"(max_staleness {self.config.max_staleness})"
            )
        if (sender, task, base) in self.accepted:
            return "duplicate", f"task {task} from version {base} was taken already"
        if self.budget is not None and any(e.sender == sender for e in self.entries):
            return "once", "under differential privacy an agent adds one update to a model"
        mine = sum(1 for e in self.entries if e.sender == sender)
        share = self._share()
        if mine >= share:
            # Any agent may send an update of its own (task 0, trained while cut off) or
            # answer a task late: without this, one member answering at once, or sending
            # unasked, could fill whole buffers, and each buffer's distances would then
            # be its own, raising the norm bound it is held to.
            return "share", (
                f"{mine} of this buffer's {self.config.buffer_size} updates are {sender}'s already "
                f"(at most {share} per agent with {len(self.online)} online)"
            )
        return s

    def _share(self) -> int:
        """The updates one agent may add to the buffer: see :meth:`BufferConfig.share`.
        (Before any presence after a restart, the updates handed on from the journal are
        judged by the agents the checkpoint knew.)"""
        return self.config.share(len(self.online) or len(self.announced))

    def _plans(
        self, sender: str, num_samples: int, metrics: Mapping[str, float], staleness: int
    ) -> tuple[Plan, Plan, int]:
        """(fold, commit, samples): what the values are added with, what the update counts
        for in the mean's denominator and the samples it weighs as (its claim, capped);
        FedBuff's damping: a stale update's values weigh less, the denominator does not."""
        if self.budget is not None:
            # Equal weights: a per-agent bound of C is what makes the sensitivity. Central
            # DP keeps the staleness weight (≤ 1, it only lowers the sensitivity);
            # distributed DP cannot (it would scale the agents' noise shares down).
            w = 1.0 if self.budget.config.mode == "distributed" else self.config.weight(staleness)
            return Plan(w), Plan(1.0), num_samples
        samples = self.influence.samples(sender, num_samples) if num_samples > 0 else num_samples
        p = self._sums().plan(samples, metrics)
        w = self.config.weight(staleness)
        return Plan(p.weight * w, p.level * w, p.dropped), p, samples

    def _refuse(self, sender: str, task: int, reason: str, detail: str, now: float) -> list[Command]:
        self.refused[reason] += 1
        self._view(sender).refused += 1
        self._task_answered(sender, task, now)
        return [Rejected(sender, task, reason, detail), *self._assign(now)]

    def _check_names(self, head: UpdateHead) -> tuple[str, str] | None:
        specs = {t.name: t for t in head.tensors}
        if specs.keys() != self.weights.keys():
            missing = sorted(set(self.weights) - set(specs))
            extra = sorted(set(specs) - set(self.weights))
            return "names", f"missing {missing[:3]}, unexpected {extra[:3]}"
        for name, ref in self.weights.items():
            t = specs[name]
            if t.shape != ref.shape:
                return "shape", f"{name}: {t.shape} != {ref.shape}"
            if t.dtype != ref.dtype.name:
                return "dtype", f"{name}: {t.dtype} != {ref.dtype}"
            if ref.dtype.kind == "f" and t.enc == "raw":
                # Raw weights are an update against the model they were trained from,
                # which may be gone: floating tensors travel as deltas.
                return "encoding", f"{name}: a streamed update carries floating tensors as deltas"
        return None

    def _on_head(self, ev: UpdateHead, now: float) -> list[Command]:
        out: list[Command] = []
        old = self.inflight.get(ev.sender)
        if old is not None:
            # An agent sends one update at a time: a new stream means the old one broke
            # off (its link went down, and its outbox sends the update again).
            out = self._on_end(UpdateEnd(ev.sender, old.tid, False, "a new stream started before it ended"), now)
        if self.config.whole:
            self.ignored.add((ev.sender, ev.tid))
            return out + self._refuse(ev.sender, ev.round, "stream", "updates travel whole in this federation", now)
        admitted = self._admit(ev.sender, ev.round, ev.base_version)
        bad = self._check_names(ev) if isinstance(admitted, int) else admitted
        if bad is None:
            assert isinstance(admitted, int)
            try:
                fold, commit, samples = self._plans(ev.sender, ev.num_samples, ev.metrics, admitted)
            except UpdateRejected as exc:
                bad = exc.reason, exc.detail
        if bad is not None:
            self.ignored.add((ev.sender, ev.tid))
            return out + self._refuse(ev.sender, ev.round, *bad, now)
        assert isinstance(admitted, int)
        key = (ev.sender, ev.round, ev.base_version)
        if fold.dropped is not None:
            # drop_above: counted, never added; its parts are ignored.
            self.ignored.add((ev.sender, ev.tid))
            return out + self._taken(key, admitted, samples, ev.metrics, fold, now)
        fl = _Inflight(ev.tid, key, admitted, ev, fold, commit, samples)
        # While the bound warms up nothing is added before the buffer is full.
        fl.held = self.influence.bounds_norms and self.influence.bound is None
        self.inflight[ev.sender] = fl
        return out

    def _on_part(self, ev: UpdatePart, now: float) -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            return []  # refused at its header, or from a spoilt buffer
        vals = ev.values
        if vals.dtype.kind == "f" and not np.isfinite(vals).all():
            return self._on_end(
                UpdateEnd(ev.sender, ev.tid, False, f"{ev.name} contains NaN or Inf"), now, reason="non-finite"
            )
        if self.influence.bounds_norms and self.weights[ev.name].dtype.kind == "f":
            # (floating tensors only, as clip_norm and rounds' bound: counters are values)
            fl.dsq += part_sq_distance(self.weights[ev.name], ev)
            bound = self.influence.bound
            if not fl.held and (bound is None or fl.dsq > bound * bound):
                # Past the bound: its distance is known only at its end, so the rest is
                # not added; the whole update is replayed scaled to the bound before the
                # buffer is published.
                fl.held = True
        if fl.held:
            return []
        self._sums().fold(fl.fold, ev.name, ev.start, vals, ev.indices, delta=ev.delta)
        fl.folded += vals.size
        return []

    def _on_end(self, ev: UpdateEnd, now: float, *, reason: str = "transfer") -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            self.ignored.discard((ev.sender, ev.tid))
            return []
        del self.inflight[ev.sender]
        if not ev.ok:
            out: list[Command] = [Rejected(ev.sender, fl.key[1], reason, ev.reason)]
            self.refused[reason] += 1
            self._view(ev.sender).refused += 1
            task = self.tasks.get(ev.sender)
            if task is not None and task.number == fl.key[1]:
                task.holds_slot = False  # it may send it again (from its outbox)
            if fl.folded and self.replays:
                # What was added of it is taken out (replayed at weight 0) before the
                # buffer is published: the buffer and its other updates stay.
                self._replay[(*fl.key, fl.tid)] = Replay(fl.tid, fl.fold, fl.folded, 0.0, count=False)
            elif fl.folded:
                out += self._spoil(
                    f"the update of {ev.sender} failed after parts of it were added ({ev.reason})",
                    also=(f"{fl.key[0]}/{fl.key[1]}/{fl.key[2]}",),
                )
            return out + self._assign(now) + self._maybe_publish(now)
        if self.influence.bounds_norms:
            norm = math.sqrt(max(fl.dsq, 0.0))
            bound = self.influence.bound
            if fl.held:
                self._replay[(*fl.key, fl.tid)] = Replay(
                    fl.tid,
                    fl.fold,
                    fl.folded,
                    None if bound is None else Influence.scale(norm, bound),
                    norm,
                    commit=fl.commit,
                )
                return self._taken(fl.key, fl.staleness, fl.samples, fl.head.metrics, fl.fold, now, None)
            self.influence.accepted(ev.sender, norm, bound)
        return self._taken(fl.key, fl.staleness, fl.samples, fl.head.metrics, fl.fold, now, fl.commit)

    def _on_whole(self, ev: WholeUpdate, now: float) -> list[Command]:
        if not self.config.whole:
            return self._refuse(ev.sender, ev.task, "stream", "updates travel as streams in this federation", now)
        admitted = self._admit(ev.sender, ev.task, ev.base_version)
        if not isinstance(admitted, int):
            return self._refuse(ev.sender, ev.task, *admitted, now)
        try:
            check_update(self.weights, ev.delta)
            fold, commit, samples = self._plans(ev.sender, ev.num_samples, ev.metrics, admitted)
        except UpdateRejected as exc:
            return self._refuse(ev.sender, ev.task, exc.reason, exc.detail, now)
        key = (ev.sender, ev.task, ev.base_version)
        if fold.dropped is None:
            bound = self._clip_bound()
            if bound is not None:
                norm = _delta_norm(self.weights, ev.delta)
                if norm <= bound:
                    self._unclipped += 1
                else:
                    fold = replace(fold, weight=fold.weight * bound / norm, level=fold.level * bound / norm)
            elif self.influence.bounds_norms:
                norm = _delta_norm(self.weights, ev.delta)
                bound = self.influence.bound
                if bound is None:
                    # Warming up: held (nothing of it kept here) and replayed from the
                    # journal once the buffer is full and its own distances give the bound.
                    self._replay[(*key, None)] = Replay(None, fold, 0, None, norm, commit=commit)
                    return self._taken(key, admitted, samples, ev.metrics, fold, now, None)
                fold = scaled(fold, Influence.scale(norm, bound))
                self.influence.accepted(ev.sender, norm, bound)
            acc = self._sums()
            for name, ref in self.weights.items():
                # Floating tensors are deltas; counters are values (their mean is taken).
                acc.fold(fold, name, 0, np.asarray(ev.delta[name]).reshape(-1), None, delta=ref.dtype.kind == "f")
        return self._taken(key, admitted, samples, ev.metrics, fold, now, commit)

    def _clip_bound(self) -> float | None:
        """The L2 bound a whole update's delta is scaled down to before it is added:
        central DP's ``C``, else ``clip_norm``."""
        if self.budget is not None and self.budget.config.mode == "central":
            return self.budget.clip.value
        return self.config.strategy.clip_norm

    def _taken(
        self,
        key: Key,
        staleness: int,
        num_samples: int,
        metrics: Mapping[str, float],
        fold: Plan,
        now: float,
        commit: Plan | None = None,
    ) -> list[Command]:
        """``key`` is in the buffer: its values were added with ``fold`` and it counts for
        ``commit`` in the mean (None: held for a replay, which counts it in)."""
        sender = key[0]
        entry = Entry(key, staleness, num_samples, dict(metrics), fold.weight, fold.dropped)
        if fold.dropped is not None:
            self._sums().dropped[entry.label] = fold.dropped
        elif commit is not None:
            self._sums().commit(entry.label, commit)
        else:
            self._sums()  # (made now: the replay folds into it)
        self.entries.append(entry)
        self.accepted[key] = key[2]
        self.recent_staleness.append(staleness)
        self.staleness_counts[staleness] += 1
        view = self._view(sender)
        view.accepted += 1
        view.last_base, view.last_staleness = key[2], staleness
        self._task_answered(sender, key[1], now)
        return self._maybe_publish(now) + self._assign(now)

    # -- the buffer --------------------------------------------------------------------
    def _sums(self) -> StrategyAggregator:
        if self._acc is None:
            strategy = self.config.strategy
            if strategy.clip_norm is not None:
                # (clipping is done here, on the delta: the aggregator adds what it is given)
                strategy = replace(strategy, clip_norm=None)
            self._acc = StrategyAggregator(strategy, self.weights, compact=True)
        return self._acc

    def _empty(self) -> None:
        """A new, empty buffer (its sums are made when its first update comes)."""
        self._acc = None
        self.entries = []
        self._unclipped = 0
        self._replay = {}
        self._refolding = ()
        # Its weight cap against every agent that announced samples so far; its norm
        # bound from the distances of the last buffers (None while warming up).
        self.influence.open(self.announced, self.announced)

    def _spoil(self, reason: str, *, also: tuple[str, ...] = ()) -> list[Command]:
        lost = (
            tuple(e.label for e in self.entries)
            + also
            + tuple(f"{fl.key[0]}/{fl.key[1]}/{fl.key[2]}" for fl in self.inflight.values() if fl.folded)
        )
        for e in self.entries:
            self.accepted.pop(e.key, None)
        for sender, fl in list(self.inflight.items()):
            if fl.folded:  # its parts are in the sum being thrown away
                self.ignored.add((sender, fl.tid))
                del self.inflight[sender]
        self.spoilt += 1
        self._empty()
        return [BufferSpoilt(self.model_version, lost, reason)]

    # -- replays -----------------------------------------------------------------------
    def _refold(self) -> list[Command]:
        """The buffer is full: the held updates get their scale from the bound (while
        warming up, from the buffer's own distances), and the caller is asked to replay
        them, and those to take out."""
        if self.influence.bounds_norms:
            pending = [r.norm for r in self._replay.values() if r.count and r.scale is None]
            bound = self.influence.bound = self.influence.final_bound(pending)
            for r in self._replay.values():
                if r.scale is None:
                    r.scale = Influence.scale(r.norm, bound)
        self._refolding = tuple(sorted(self._replay, key=lambda k: (k[0], k[1], k[2], k[3] or "")))
        return [
            Refold(
                self.model_version,
                self._refolding,
                frozenset(k for k in self._refolding if self._replay[k].count),
            )
        ]

    def refold(self, update: ReplayKey, part: UpdatePart) -> None:
        """One part of ``update``, replayed (in the order its parts came) for a
        :class:`Refold`: what was added of it at full weight is taken out, and the update
        added at its scale. Parts of an update not asked for are ignored."""
        r = self._replay.get(update)
        if r is None or update not in self._refolding or self._acc is None:
            return
        if r.tid is not None and part.tid != r.tid:
            return
        # Floating tensors are deltas; counters are values (their mean is taken).
        delta = part.delta if r.tid is not None else self.weights[part.name].dtype.kind == "f"
        r.fold(self._acc, part, delta=delta)

    def _on_refolded(self, ev: Refolded, now: float) -> list[Command]:
        if not self._refolding or ev.model_version != self.model_version:
            return []
        keys, self._refolding = self._refolding, ()
        out: list[Command] = []
        bound = self.influence.bound
        for k in keys:
            r = self._replay.pop(k)
            if r.done < r.prefix or (r.count and k in ev.incomplete and r.done):
                # Part of it is in the sums and could not be taken out.
                return (
                    out
                    + self._spoil(
                        f"the update {k[0]}/{k[1]}/{k[2]} could not be read back from the journal to take it out "
                        "of the sums"
                    )
                    + self._assign(now)
                )
            if not r.count:
                continue
            label = f"{k[0]}/{k[1]}/{k[2]}"
            if k in ev.incomplete or not r.done:
                # (nothing read back: it would count in the mean without its values)
                self.entries = [e for e in self.entries if e.label != label]
                self.accepted.pop(k[:3], None)
                self.refused["journal"] += 1
                self._view(k[0]).refused += 1
                out.append(Rejected(k[0], k[1], "journal", "its update could not be read back from the journal"))
                continue
            assert self._acc is not None and r.commit is not None
            self._acc.commit(label, r.commit)
            if self.influence.bounds_norms:
                self.influence.accepted(k[0], r.norm, bound)
        return out + self._maybe_publish(now) + self._assign(now)

    def _maybe_publish(self, now: float) -> list[Command]:
        if self.fill < self.config.buffer_size or self.inflight or self.phase is Phase.DONE or self._refolding:
            # A stream being folded is in the sums: the model waits for its end (and for
            # a replay out).
            return []
        if self._replay:
            return self._refold()
        acc = self._sums()
        entries = self.entries
        if acc.count == 0:  # every update of the buffer was dropped (drop_above)
            self._empty()
            return []
        aggregate = acc.result()
        if self.budget is not None:
            budget = self.budget
            n = acc.count
            if budget.config.mode == "central":
                std = budget.config.update_noise_multiplier(self.config.buffer_size) * budget.clip.value / n
                for name, ref in self.weights.items():
                    if ref.dtype.kind == "f":
                        aggregate[name] = (aggregate[name] + budget.rng.normal(0.0, std, ref.shape)).astype(ref.dtype)
                budget.clip.update(self._unclipped, n, self.config.buffer_size, budget.rng)
            budget.charge(self.config.buffer_size, self.config.buffer_size, 1.0)
        counted = [e for e in entries if e.dropped is None]
        shares = _shares(acc, counted)
        del acc  # (it holds the model before: gone with it once the next one is adopted)
        self._acc = None
        new, velocity = self.server_step.propose(self.weights, aggregate, self.model_version)
        del aggregate
        overflow = [k for k, v in new.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if overflow:
            self.server_step.drop()
            return self._spoil(f"the aggregate is not finite in {', '.join(sorted(overflow)[:3])}")
        # (only a model's distances join the norm bound's window, not a spoilt buffer's)
        bounded = self.influence.aggregated(sorted({e.sender for e in counted}))
        self.weights = self.server_step.adopt(self.weights, new, velocity, self.model_version)
        self.model_version += 1
        floor = self.model_version - self.config.max_staleness
        self.accepted = {k: b for k, b in self.accepted.items() if b >= floor}
        self.last_metrics = weighted_metrics([(e.metrics, e.num_samples) for e in counted])
        updates = tuple((*e.key, e.staleness, shares.get(e.label, 0.0)) for e in entries)
        dropped = {e.label: e.dropped for e in entries if e.dropped is not None}
        final = self.config.last(self.model_version)
        why = "" if final else self._over_budget()
        delta = self.server_step.delta if not self.whole_model_only() else None
        out: list[Command] = [
            Published(
                self.model_version,
                self.weights,
                delta,
                tuple(sorted({e.sender for e in counted})),
                dict(self.last_metrics),
                updates,
                dropped,
                self.privacy(),
                final or bool(why),
                bounded,
            )
        ]
        self._empty()
        if final or why:
            return out + self._finish(why)
        return out

    def _over_budget(self) -> str:
        return self.budget.over_budget(self.config.buffer_size, 1.0) if self.budget is not None else ""

    def _finish(self, why: str) -> list[Command]:
        self.phase = Phase.DONE
        self.stop_reason = why
        self.tasks.clear()
        return [Finished(self.model_version, self.weights, why)]


def _key(raw: object) -> Key:
    """An update's key as a checkpoint keeps it (``[agent, task, base version]``)."""
    if not isinstance(raw, list | tuple) or len(raw) != 3:
        raise ValueError(f"not an update key: {raw!r}")
    agent, task, base = raw
    if not isinstance(agent, str) or type(task) is not int or type(base) is not int or task < 0 or base < 0:
        raise ValueError(f"not an update key: {raw!r}")
    return agent, task, base


def _delta_norm(reference: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> float:
    sq = 0.0
    for name, ref in reference.items():
        if ref.dtype.kind == "f":
            sq += float(np.square(np.asarray(delta[name]), dtype=np.float64).sum())
    return math.sqrt(sq)


def _shares(acc: StrategyAggregator, entries: list[Entry]) -> dict[str, float]:
    """Each update's share of the aggregate's step (after :meth:`StrategyAggregator.result`)."""
    if acc.strategy.name == "blur":
        return {label: round(w, 6) for label, w in acc.weights.items()}
    total = sum(acc.weights.values())
    return {e.label: round(e.weight / total, 6) for e in entries} if total > 0 else {}
