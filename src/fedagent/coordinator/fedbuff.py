"""Asynchronous buffered FedAvg: the coordinator mode over the pure
:class:`~fedagent.protocols.fedbuff.BufferMachine`.

Queue items become the machine's events (agents online/offline, streamed and whole
updates, wake-ups); its commands are carried out here: send a task, checkpoint and
broadcast a model, refuse an update, schedule a wake-up.

Durability is the round journal's (:mod:`fedagent.coordinator.durability`): every frame
of an update is written to the journal and acknowledged to the broker only once it is
durable, whatever its task or base version. A model's checkpoint records the updates it
holds (by agent, task and base version, within the staleness bound); the journal is
replaced only after that checkpoint is durable, and only when no update is in transfer
(its first frames would go with the old journal). A restarted coordinator hands every
journaled frame to the machine again: what the checkpoint holds is refused as a
duplicate, what it does not hold goes into the buffer. So no update acknowledged to the
broker is lost, and none counts twice. Where some update is always in transfer, the
journal past ``journal_max_bytes`` is rewritten at a model instead, without the frames
that checkpoint makes useless (:mod:`fedagent.coordinator.compaction`): it stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np

from fedagent.config import buffer_config
from fedagent.coordinator.compaction import JournalBound, JournalSift
from fedagent.coordinator.core import CoordinatorCore
from fedagent.coordinator.durability import JOURNALED_KINDS, DurableJournal, reconcile_history
from fedagent.coordinator.fedavg import norm_history_of
from fedagent.coordinator.refold import held_whole_updates, replay_updates
from fedagent.coordinator.streams import StreamFeed
from fedagent.coordinator.velocity import FileVelocity
from fedagent.coordinator.vocabstage import has_vocabulary
from fedagent.errors import ConfigError, FedagentError, TransportError
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import Timer, release_large_frees
from fedagent.protocols import fedbuff as FB
from fedagent.protocols import topics
from fedagent.protocols.catchup import ModelServer
from fedagent.protocols.codec import Envelope
from fedagent.protocols.messages import AsyncModel, AsyncTask, AsyncUpdate, Evaluation, GlobalModel, ModelRequest
from fedagent.protocols.ratelimit import Rate, SenderBudget
from fedagent.protocols.streaming import StreamEvent
from fedagent.storage import checkpoint
from fedagent.storage.roundjournal import InFlight
from fedagent.storage.statefile import atomic_write, read_bytes
from fedagent.tasks.base import get_weights

log = logging.getLogger("fedagent.coordinator")

#: Task numbers are reserved on disk this many at a time: a restart never gives one twice.
TASK_BLOCK = 1000

#: What one agent may send an asynchronous coordinator, by kind, before its frames are
#: checked (fedagent.protocols.ratelimit), as for FedAvg rounds: an update's frames (a
#: stream's chunks, or a whole update's), its presence, heartbeats, model requests on
#: reconnecting and evaluations (one per model it receives: models come faster than
#: rounds, and past 20 a second the held-out line skips versions); a kind this
#: coordinator has no use for gets next to nothing.
RATES: dict[str, Rate] = {
    "presence": Rate(2.0, 10),
    "heartbeat": Rate(5.0, 20),
    "model_request": Rate(2.0, 10),
    "evaluation": Rate(20.0, 40),
    "update": Rate(500.0, 5000),
}
OTHER = Rate(2.0, 10)

__all__ = ["AsyncMode"]


def _any_update(env: Envelope, inflight: InFlight) -> bool:
    """Every update frame is journaled: a buffer takes updates of any task and age."""
    return True


class AsyncMode:
    title = "asynchronous coordinator"

    def __init__(self, core: CoordinatorCore) -> None:
        release_large_frees()  # before the model is built (see its docstring)
        self.core = core
        cfg = self.cfg = core.cfg
        if has_vocabulary(core.task):
            raise ConfigError(
                f"{cfg.path}: task {cfg.task!r} agrees on a vocabulary before round 1, which mode = 'async' "
                "does not run: use mode = 'fedavg' for it"
            )
        self.config = buffer_config(cfg)
        self.durability = DurableJournal(
            core.dir / "round-journal",
            max_frame=core.messenger.wire_limits.max_message_bytes,
            per_sender=2 * cfg.max_model_bytes + 2**20,
            replay=core.messenger.replay_journal,
            kinds=JOURNALED_KINDS | {AsyncUpdate.kind},
            belongs=_any_update,
        )
        self.journal_bound = JournalBound(cfg.fedbuff.journal_max_bytes)
        self.journal_rewrites = 0
        core.messenger.journal = self.durability.frame
        core.messenger.before_replay_commit = self.durability.flush
        self.durability.before_drop = core.messenger.persist_replay
        core.messenger.lazy_durable_kinds = core.messenger.lazy_durable_kinds | {Evaluation.kind}
        # A stream that stops for this long is over (its sender's link went down): a
        # model waits for the streams being added, so a silent one must not hold it long.
        core.messenger.intake.timeout = min(core.messenger.intake.timeout, 30.0)
        core.transport.hold_limit = 1
        self.timer = Timer(core.queue, FB.Wakeup())
        self.streams = StreamFeed(core.queue)
        core.messenger.on_stream = self._on_stream
        core.messenger.budget = SenderBudget(RATES, other=OTHER)
        self.model_server = ModelServer()
        self._answering = asyncio.Lock()
        self._answers: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()
        self._reserved_path = core.dir / "task-reserved"
        self._published_at = time.monotonic()
        self._started = False  # the first task went out
        self.last_model_seconds: float | None = None
        self.velocity_file: FileVelocity | None = None
        self.machine = self._build_machine()
        # Every frame the journal kept is handed on again (see the module docstring).
        self._recovered = self.durability.journal.recover()

    def _build_machine(self) -> FB.BufferMachine:
        core, cfg = self.core, self.config
        weights = get_weights(self.task_model())
        resumed = checkpoint.load(core.ckpt_path)
        meta: dict[str, Any] = {}
        if resumed is not None:
            saved, meta = resumed
            weights = {k: v for k, v in saved.items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)}
            log.info("resuming from %s: model version %s", core.ckpt_path, meta.get("model_version"))
            reconcile_history(core.history, meta)
        self.streams.size_for(sum(int(w.nbytes) for w in weights.values()))
        version = int(meta.get("model_version", 0))
        store = None
        if cfg.momentum > 0:
            store = self.velocity_file = FileVelocity(core.ckpt_path.parent)
            if store.open(version, weights):
                log.info("server momentum %g: resuming with the velocity of model version %d", cfg.momentum, version)
        reserved = read_bytes(self._reserved_path, 64)
        self._reserved = int(reserved) if reserved and reserved.strip().isdigit() else 1
        bounds: dict[str, Any] = meta["bounds"] if isinstance(meta.get("bounds"), dict) else {}
        try:
            machine = FB.BufferMachine(
                cfg,
                weights,
                model_version=version,
                accepted=meta.get("accepted", []) if isinstance(meta.get("accepted"), list) else [],
                first_task=self._reserved,
                privacy_state=meta.get("privacy") if isinstance(meta.get("privacy"), dict) else None,
                velocity_store=store,
                # the journal holds every frame of the buffer's updates: they can be read back
                replays=True,
                norm_history=norm_history_of(bounds.get("norms")),
                announced=_announced(bounds.get("announced")),
            )
        except ValueError as exc:
            raise FedagentError(f"{core.ckpt_path}: {exc}; move it away to start afresh") from None
        privacy = machine.privacy()
        if privacy is not None:
            log.info(
                "differential privacy (%s): noise multiplier %.4g, clip norm %.4g, epsilon spent %.4g per %d-update model",
                cfg.dp.mode if cfg.dp is not None else "?",
                privacy["noise_multiplier"],
                privacy["clip_norm"],
                privacy["epsilon"],
                cfg.buffer_size,
            )
        return machine

    def task_model(self) -> Any:
        return self.core.task.build_model()

    # -- Mode ----------------------------------------------------------------------------
    def model_version(self) -> int:
        return self.machine.model_version

    async def on_connect(self) -> None:
        return None

    async def start(self, now: float) -> None:
        m = self.machine
        if m.phase is FB.Phase.DONE:
            log.info("checkpoint says training already finished; serving status only")
        if self._recovered is None:
            await self.durability.begin(m.model_version + 1, m.model_version, ())
        else:
            log.info(
                "%d update frames in the journal (from model version %d): handed on again",
                self.durability.journal.frames,
                self._recovered.model_version,
            )
        log.info(
            "buffer of %d updates, staleness bound %d, %s; %s",
            self.config.buffer_size,
            self.config.max_staleness,
            f"at most {self.config.concurrency} agents training" if self.config.concurrency else "every agent trains",
            f"{self.config.versions} models to publish" if self.config.ends else "models published until stopped",
        )

    def recovered_frames(self) -> Iterator[tuple[str, bytes]]:
        if self._recovered is None:
            return iter(())
        return self.durability.journal.frames_of()

    async def on_presence(self, agent: str, online: bool, samples: int, now: float) -> None:
        if online:
            reads = "int8" in self.core.peers.get(agent, {}).get("downlinks", ())
            await self._handle(FB.AgentOnline(agent, samples, reads_steps=reads))
        else:
            await self._handle(FB.AgentOffline(agent))

    async def on_message(self, inc: Incoming, now: float) -> None:
        msg = inc.message
        if isinstance(msg, AsyncUpdate):
            if inc.role != "agent":
                self.core.messenger.reject("role", inc.sender, f"update signed by a {inc.role or 'non-agent'}")
                return
            if inc.envelope.round != msg.task:
                # The signed envelope binds the update to its task, as a round elsewhere.
                self.core.messenger.reject(
                    "round", inc.sender, f"task {msg.task} in an envelope of {inc.envelope.round}"
                )
                return
            await self._handle(
                FB.WholeUpdate(inc.sender, msg.task, msg.base_version, msg.num_samples, msg.metrics, msg.delta)
            )
        elif isinstance(msg, ModelRequest):
            self._model_request(inc, msg, now)
        else:
            log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)

    async def on_item(self, item: Any, now: float) -> None:
        self.streams.taken(item)
        await self._handle(item)

    def snapshot(self) -> dict[str, Any]:
        m = self.machine.status()
        return {
            **m,
            # what the FedAvg rows read: a model is this mode's unit of progress
            "round": self.machine.model_version,
            "completed_rounds": self.machine.model_version,
            "rounds": self.config.versions,
            "last_model_seconds": self.last_model_seconds,
            "privacy": {"mode": self.config.dp.mode, **m["privacy"]} if m.get("privacy") and self.config.dp else None,
            "stop_reason": m.get("stop_reason") or None,
            "updates": self.update_transfer(),
            "server_step": {
                "lr": self.config.server_lr,
                "momentum": self.config.momentum,
                "default": self.cfg.rounds.server_momentum is None,
                "default_reason": "default in async mode",
            },
            "journal": {**self.durability.journal.status(), "rewrites": self.journal_rewrites},
            "model_requests": {"answered": self.model_server.answered, "refused": dict(self.model_server.refused)},
        }

    def update_transfer(self) -> dict[str, Any]:
        train = self.config.train
        return {
            "compression": train.compression,
            "streamed": train.stream,
            "default": self.cfg.compression is None,
            "downlink": self.config.downlink,
            "downlink_default": self.cfg.downlink is None,
            "whole_model_only": self.machine.whole_model_only(),
        }

    def refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_model_version(self.machine.model_version)
        m.round_started(self.machine.model_version)
        privacy = self.machine.privacy()
        if privacy is not None:
            m.set_privacy(privacy)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self.streams.expire_stalled(self.core.messenger, 2.0)]

    def close(self) -> None:
        self.timer.cancel()
        self.durability.close()
        for task in self._answers:
            task.cancel()

    # -- streams ---------------------------------------------------------------------------
    async def _on_stream(self, events: list[StreamEvent]) -> None:
        await self.streams.put(events)

    # -- catch-up ---------------------------------------------------------------------------
    def _model_request(self, inc: Incoming, msg: ModelRequest, now: float) -> None:
        if inc.role != "agent":
            self.core.messenger.reject("role", inc.sender, f"model request signed by a {inc.role or 'non-agent'}")
            return
        m = self.machine
        # Version 0 is the initial model, which no task carries: an agent that says it has
        # version 0 may hold none at all, so it gets it (once per interval).
        have = msg.have_version if msg.have_version > 0 else -1
        if not self.model_server.answer(inc.sender, have, m.model_version, now):
            return
        model = GlobalModel(m.model_version, m.model_version, m.phase is FB.Phase.DONE, m.weights)
        task = asyncio.get_running_loop().create_task(self._send_model(inc.sender, model, msg.have_version))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _send_model(self, agent: str, model: GlobalModel, had: int) -> None:
        async with self._answering:
            topic = topics.direct(self.core.fed, self.core.cfg.id, agent, "model")
            try:
                n = await self.core.messenger.send(topic, model, round_=model.round, stable=True)
            except TransportError as exc:
                log.warning("model version %d for %s not sent: %s", model.model_version, agent, exc)
                return
            log.info("sent model version %d to %s (it had %d): %d bytes", model.model_version, agent, had, n)

    # -- the machine ------------------------------------------------------------------------
    async def _handle(self, event: Any) -> None:
        cmds = self.machine.handle(event, time.monotonic())
        del event
        for cmd in cmds:
            await self._execute(cmd)

    async def _execute(self, cmd: FB.Command) -> None:
        core, fed = self.core, self.core.fed
        if isinstance(cmd, FB.AssignTask):
            if not self._started:
                # What a model's time counts from (the first one: from the first task).
                self._started = True
                self._published_at = time.monotonic()
                core.history.append({"event": "training_started", "model_version": self.machine.model_version})
            if cmd.task >= self._reserved:
                # Durable before the task leaves: a restart starts numbering above it.
                self._reserved = cmd.task + TASK_BLOCK
                await asyncio.to_thread(atomic_write, self._reserved_path, str(self._reserved).encode())
            try:
                await core.messenger.send(
                    topics.direct(fed, self.cfg.id, cmd.agent, "async_task"),
                    AsyncTask(cmd.task, cmd.model_version, cmd.train, cmd.deadline_s),
                    round_=cmd.task,
                )
            except TransportError as exc:
                # Its deadline frees the place; the agent, when back, gets another.
                log.warning("task %d for %s not sent: %s", cmd.task, cmd.agent, exc)
        elif isinstance(cmd, FB.Published):
            await self._published(cmd)
        elif isinstance(cmd, FB.Refold):
            await self._refold(cmd)
        elif isinstance(cmd, FB.BufferSpoilt):
            log.warning(
                "buffer of model version %d spoilt, %d updates lost: %s",
                cmd.model_version + 1,
                len(cmd.lost),
                cmd.reason,
            )
            core.metrics.round_abandoned()
            core.history.append(
                {"event": "abandoned", "round": cmd.model_version + 1, "reason": cmd.reason, "lost": list(cmd.lost)}
            )
        elif isinstance(cmd, FB.Rejected):
            core.reject(cmd.sender, cmd.reason, cmd.detail, task=cmd.round)
        elif isinstance(cmd, FB.RequestWakeup):
            self.timer.request(cmd.at)
        elif isinstance(cmd, FB.Finished):
            if cmd.reason:
                log.warning("training stopped at model version %d: %s", cmd.model_version, cmd.reason)
                core.history.append({"event": "stopped", "reason": cmd.reason, "privacy": self.machine.privacy()})
            log.info("training finished: model version %d", cmd.model_version)
            sdnotify.status(f"finished: model version {cmd.model_version}")
            await core.messenger.send(
                topics.broadcast(fed, "model"),
                GlobalModel(cmd.model_version, cmd.model_version, True, cmd.weights),
                round_=cmd.model_version,
                stable=True,
            )
            self.done.set()

    async def _published(self, cmd: FB.Published) -> None:
        core, m = self.core, self.machine
        took = time.monotonic() - self._published_at
        self._published_at = time.monotonic()
        self.last_model_seconds = took
        meta: dict[str, Any] = {
            "model_version": cmd.model_version,
            "round": cmd.model_version,
            "completed_rounds": cmd.model_version,
            "federation": core.fed,
            "participants": list(cmd.contributors),
            "metrics": cmd.metrics,
            "final": cmd.final,
            # the updates this model holds (within the staleness bound): never taken twice
            "accepted": m.accepted_keys(),
            "mode": "async",
        }
        privacy_state = m.privacy_state()
        if privacy_state is not None:
            meta["privacy"] = privacy_state
        # the norm bound's recent distances and the announced samples: a restart neither
        # warms the bound up again nor takes a journaled claim before any presence
        meta["bounds"] = m.bounds_state()
        await asyncio.to_thread(self._save_checkpoint, cmd.weights, meta, cmd.model_version)
        if self.velocity_file is not None:
            self.velocity_file.prune(cmd.model_version)
        messenger = core.messenger
        if self._journal_settled():
            # Every frame journaled so far is in this checkpoint or was refused.
            # (Otherwise the journal is kept, and replaced at a quiet model.)
            await self.durability.begin(cmd.model_version + 1, cmd.model_version, ())
            self.journal_bound.replaced()
        staleness = [u[3] for u in cmd.updates]
        core.metrics.round_completed(took, cmd.metrics)
        core.metrics.set_model_version(cmd.model_version)
        core.history.append(
            {
                "event": "round",
                "round": cmd.model_version,
                "model_version": cmd.model_version,
                "participants": list(cmd.contributors),
                "metrics": cmd.metrics,
                "aggregation": self.config.strategy.name,
                "updates": [
                    {"agent": a, "task": t, "base_version": b, "staleness": s, "share": w}
                    for a, t, b, s, w in cmd.updates
                ],
                "staleness": {"max": max(staleness), "mean": round(float(np.mean(staleness)), 3)},
                "dropped": cmd.dropped,
                # agent -> its weight capped ({samples, weight}) or its distance scaled
                # down ({norm, bound})
                "bounded": cmd.bounded,
                "seconds": round(took, 4),
                "bytes_in": messenger.bytes_in,
                "bytes_out": messenger.bytes_out,
                **({"privacy": cmd.privacy} if cmd.privacy is not None else {}),
                "syncs": self.durability.round_syncs(),
            }
        )
        self.durability.count_round()
        for agent, what in cmd.bounded.items():
            for bound in ("weight", "norm"):
                if bound in what:
                    core.metrics.bounded(agent, bound)
            log.info("model version %d: %s's update bounded: %s", cmd.model_version, agent, what)
        log.info(
            "model version %d from %d updates (staleness %s) in %.2fs: %s",
            cmd.model_version,
            len(cmd.updates),
            ",".join(map(str, staleness)),
            took,
            ", ".join(f"{k}={v:.4f}" for k, v in cmd.metrics.items()),
        )
        sdnotify.status(
            f"model version {cmd.model_version}" + (f" of {self.config.versions}" if self.config.ends else "")
        )
        if cmd.privacy is not None:
            core.metrics.set_privacy(cmd.privacy)
        delta = cmd.delta
        await messenger.send(
            topics.broadcast(core.fed, "async_model"),
            AsyncModel(
                cmd.model_version,
                len(cmd.updates),
                cmd.contributors,
                cmd.metrics,
                None if delta is not None else cmd.weights,
                delta,
            ),
            round_=cmd.model_version,
            stable=True,  # the machine replaces its model, never changes it in place
        )
        if self.journal_bound.due(self.durability.journal.size):
            # Not replaced above, and large: rewritten without what this checkpoint holds
            # (after the broadcast, which it need not delay; the machine is not fed meanwhile).
            await self._rewrite_journal(cmd.model_version, meta["accepted"])

    def _journal_settled(self) -> bool:
        """No journaled frame is on its way to the machine: none in a transfer (a stream
        or a chunked update), being checked by the messenger, or queued (as a message or
        a stream's events). A frame that is would be in no checkpoint once the journal is
        replaced: an update that came while a model was read back and published would be
        lost (found as "not held whole" when its own buffer read it back)."""
        messenger = self.core.messenger
        return not (
            self.machine.inflight
            or messenger.intake.pending_transfers
            or messenger.reassembler.pending_transfers
            or messenger.journaled_in_hand
            or self.core.journaled_queued
            or self.streams.queued
        )

    def _live_transfers(self) -> frozenset[tuple[str, str]] | None:
        """The transfers (sender, transfer id) that may still finish or be read back:
        pending in the messenger, with events queued, or being added by the machine.
        None when a journaled frame is in the messenger's hands (its transfer may not
        be pending anywhere yet)."""
        messenger = self.core.messenger
        if messenger.journaled_in_hand:
            return None
        return frozenset(
            [
                *messenger.intake.transfers(),
                *messenger.reassembler.transfers(),
                *self.streams.queued_transfers,
                *((sender, fl.tid) for sender, fl in self.machine.inflight.items()),
            ]
        )

    async def _rewrite_journal(self, version: int, accepted: list[list[Any]]) -> None:
        """The journal rewritten without the frames the checkpoint of ``version`` (just
        made durable, holding ``accepted``) makes useless; see
        :mod:`fedagent.coordinator.compaction`."""
        journal = self.durability.journal
        m = self.core.messenger
        before = journal.size
        # The mark and the transfers that may still finish, at one moment of the event loop.
        mark = journal.rewrite_mark()
        sift = JournalSift(
            held=[(a, t, b) for a, t, b in accepted],
            floor=version - self.config.max_staleness,
            live=self._live_transfers(),
            wire_limits=m.wire_limits,
            model_limits=m.model_limits,
        )

        def choose(records: Any) -> list[tuple[int, int, str]]:
            for rec in records:
                sift.feed(*rec)
            return sift.kept()

        t0 = time.perf_counter()
        if not await self.durability.rewrite(mark, InFlight(version + 1, version, ()), choose):
            return
        self.journal_rewrites += 1
        self.journal_bound.rewritten(journal.size)
        log.info(
            "model version %d: round journal rewritten in %.2fs without what its checkpoint holds: "
            "from %d to %d bytes, %d frames",
            version,
            time.perf_counter() - t0,
            before,
            journal.size,
            journal.frames,
        )

    async def _refold(self, cmd: FB.Refold) -> None:
        """Read updates of the buffer back from the journal into the machine (a worker
        thread: the event loop keeps reading meanwhile; nothing else touches the machine
        until its Refolded is handled, which this awaits)."""
        machine = self.machine
        m = self.core.messenger
        journal = self.durability.journal
        asked = {(a, t, tid, b if tid is None else None): (a, t, b, tid) for a, t, b, tid in cmd.updates}

        def work() -> frozenset[FB.ReplayKey]:
            counted = [w for w, k in asked.items() if k in cmd.counted]
            whole = held_whole_updates(journal.frames_of(), counted, m.wire_limits) if counted else set()
            missing = frozenset(asked[w] for w in counted if w not in whole)
            replay = [w for w, k in asked.items() if k not in missing]
            if replay:
                for w, part in replay_updates(
                    journal.frames_of(),
                    replay,
                    federation=self.core.fed,
                    wire_limits=m.wire_limits,
                    model_limits=m.model_limits,
                ):
                    machine.refold(asked[w], part)
            return missing

        t0 = time.perf_counter()
        incomplete = await asyncio.to_thread(work)
        log.info(
            "model version %d: %d update(s) read back from the journal in %.2fs (%s)%s",
            cmd.model_version + 1,
            len(asked),
            time.perf_counter() - t0,
            ", ".join(f"{a}/{t}/{b}" for a, t, b, _ in cmd.updates),
            f"; not held whole: {', '.join(f'{a}/{t}/{b}' for a, t, b, _ in sorted(incomplete))}" if incomplete else "",
        )
        await self._handle(FB.Refolded(cmd.model_version, incomplete))

    def _save_checkpoint(self, weights: dict[str, np.ndarray], meta: dict[str, Any], version: int) -> None:
        if self.velocity_file is not None:
            self.velocity_file.sync(version)
        checkpoint.save(self.core.ckpt_path, weights, meta)


def _announced(saved: Any) -> dict[str, int]:
    """The samples each agent announced, as a checkpoint kept them ({} if absent or not a
    table of positive counts)."""
    if not isinstance(saved, dict):
        return {}
    return {str(a): n for a, n in saved.items() if type(n) is int and n > 0}
