"""The coordinator daemon's core, shared by every coordinated mode.

The core owns what does not depend on how a federation trains: the state directory and
its history file, the task, the broker connection and the signed messenger, presence
(the coordinator's own, retained, and the table of agents it has heard from), the
control socket (``status``, ``peers``), the Prometheus metrics, the mDNS advert,
sd_notify and a clean shutdown. One event queue feeds everything to the mode one item
at a time, in arrival order: network messages, presence changes, timer wake-ups and
streamed update parts.

A mode is the round logic: a pure machine from :mod:`fedagent.protocols` plus an adapter
(:class:`Mode`) that turns queue items into the machine's events and carries out its
commands through the core (``core.messenger.send``, ``core.history``, ``core.reject``,
timers on ``core.queue``). FedAvg (:mod:`.fedavg`) and Sync-Opt (:mod:`.syncopt`) are
the two modes; :mod:`.daemon` maps ``mode = "..."`` in the config to one of them.

Liveness is the core's too: agents that send heartbeats are tracked
(:mod:`fedagent.protocols.liveness`), and one silent for its keep-alive is reported to the
mode as offline (``on_presence``) until it is heard again.

Adding a third coordinated mode means:

1. its pure machine in ``protocols/`` (events in, commands out, no I/O; trace-tested);
2. an adapter class here in ``coordinator/`` implementing :class:`Mode`, usually a
   constructor that builds the machine (resuming from ``core.ckpt_path``), ``on_message``
   and ``on_item`` that feed it, an ``_execute`` for its commands, ``snapshot`` for
   ``fedagent status`` and ``recovered_frames`` (what it journaled before a restart);
3. one line in :data:`fedagent.coordinator.daemon.MODES` and the mode name in
   :data:`fedagent.config.MODES`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedagent.config import NodeConfig
from fedagent.coordinator.admission import Admission
from fedagent.errors import EXIT_CONFIG, TransportError
from fedagent.node import sdnotify
from fedagent.node.control import ControlServer
from fedagent.node.discovery import Advert, Discovery
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import make_transport, node_identity, open_history, presence_payload
from fedagent.protocols import topics
from fedagent.protocols.evaluation import HeldOut
from fedagent.protocols.liveness import Liveness, OwnLink
from fedagent.protocols.messages import Evaluation, Heartbeat, ModelCheck, Presence
from fedagent.protocols.peerview import peer_table
from fedagent.security.pki import fingerprint
from fedagent.storage.statefile import cleanup_temp_files, make_dirs
from fedagent.tasks.base import Task, load_task
from fedagent.tasks.fingerprint import task_fingerprint

log = logging.getLogger("fedagent.coordinator")


@dataclass(frozen=True, slots=True)
class Net:
    """A verified message from the broker, as a queue item."""

    incoming: Incoming


@dataclass(frozen=True, slots=True)
class LivenessCheck:
    """Time to look for agents whose heartbeats stopped (asked for at monotonic ``at``)."""

    at: float


#: While events keep coming, the status snapshot kept for readers that come in the middle
#: of an event is refreshed at most this often. A snapshot sorts the agent lists (O(N)):
#: refreshed after every update that arrived on its own (an empty queue between most of
#: them), it made a round of N updates O(N²) at the coordinator. A reader that comes
#: between events gets one built on the spot (:attr:`CoordinatorCore.settled`).
SNAPSHOT_EVERY_S = 1.0
#: A status reader that comes in the middle of an event waits at most this long for it
#: to end (a round's aggregation, a checkpoint), then gets the last snapshot kept.
READER_WAIT_S = 2.0


class Mode(Protocol):
    """The round logic of one coordinated mode, driven by :class:`CoordinatorCore`.

    Every method runs on the core's event loop, one queue item at a time; a mode never
    reads the network itself. ``snapshot`` is what ``fedagent status`` shows of the mode
    and must describe a state the disk has caught up to (checkpoint and history written)."""

    #: The daemon's name in log lines and sd_notify ("coordinator", "Sync-Opt coordinator").
    title: str

    def model_version(self) -> int:
        """The version in the coordinator's retained presence."""
        ...

    async def on_connect(self) -> None:
        """After every (re)connection, once the core's presence is out: re-publish what an
        agent needs on arrival (the agreed vocabulary)."""
        ...

    async def start(self, now: float) -> None:
        """When the event loop starts, before the first queue item."""
        ...

    async def on_presence(self, agent: str, online: bool, samples: int, now: float) -> None:
        """An agent's presence changed (already recorded in ``core.peers``)."""
        ...

    async def on_message(self, inc: Incoming, now: float) -> None:
        """Any other verified message addressed to the coordinator."""
        ...

    async def on_item(self, item: Any, now: float) -> None:
        """A queue item that is not a network message: the mode's timer wake-ups, streamed
        update parts."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """The mode's part of ``fedagent status``."""
        ...

    def refresh_metrics(self, m: NodeMetrics) -> None:
        """Mode gauges, before a Prometheus scrape."""
        ...

    def recovered_frames(self) -> Iterator[tuple[str, bytes]]:
        """(topic, frame) received and made durable before a restart, to be handed on
        again before any new network input (the round in flight: fedagent.storage.roundjournal)."""
        ...

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """Extra tasks to run next to the event loop (e.g. expiring stalled streams)."""
        ...

    def close(self) -> None:
        """On shutdown: cancel the mode's timers."""
        ...


class CoordinatorCore:
    """One coordinator process: connection, presence, control, metrics and the event loop;
    ``make_mode(core)`` builds the round logic once the core's parts exist."""

    def __init__(
        self,
        cfg: NodeConfig,
        make_mode: Callable[[CoordinatorCore], Mode],
        *,
        receive_maximum: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.fed = cfg.federation
        self.dir = cfg.state_dir / "coordinator" / self.fed
        make_dirs(self.dir)  # its entry durable: a power cut must not take the whole directory
        cleanup_temp_files(self.dir)
        self.ckpt_path = self.dir / "global.ckpt"
        self.history = open_history(self.cfg, self.dir)
        torch.set_num_threads(cfg.torch_threads)
        self.task: Task = load_task(cfg.task, cfg.task_options)
        # The model every agent must build too: a refused dtype stops the start here (78).
        self.admission = Admission(task_fingerprint(self.task))
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=10_000)
        # Messages from journaled frames waiting in the queue (see journal_settled).
        self.journaled_queued = 0
        extra: dict[str, Any] = {} if receive_maximum is None else {"receive_maximum": receive_maximum}
        self.transport = make_transport(
            cfg,
            self.fed,
            cfg.broker,
            subscriptions=[topics.all_presence(self.fed), topics.inbox(self.fed, cfg.id)],
            on_connect=self._on_connect,
            **extra,
        )
        self.metrics = NodeMetrics("coordinator", cfg.id, self.fed)
        self.metrics.before_scrape = self._refresh_metrics
        self.metrics_url: str | None = None
        self.messenger = Messenger(
            federation=self.fed,
            node_id=cfg.id,
            transport=self.transport,
            max_chunk_bytes=cfg.max_chunk_bytes,
            max_model_bytes=cfg.max_model_bytes,
            metrics=self.metrics,
            identity=node_identity(cfg),
            max_skew=cfg.max_clock_skew,
            state_dir=self.dir,
        )
        # A coordinator has nothing better to do than get its broadcasts out: a broker
        # slow to acknowledge (busy with a flood) is waited for, never a reason to exit.
        self.messenger.patient = True
        self.peers: dict[str, dict[str, Any]] = {}
        self.held_out = HeldOut()  # the agents' evaluations of the global model
        self._disc: Discovery | None = None
        # Agents that send heartbeats are taken out of a round when they fall silent,
        # before the broker's keep-alive notices (protocols/liveness.py).
        self.liveness = Liveness()
        self.own_link = OwnLink()
        self.silent_since: dict[str, float] = {}  # agent -> wall time it was declared silent
        self._silent_at: dict[str, float] = {}  # the same on the monotonic clock (durations)
        self.last_silenced: dict[str, float] = {}  # the same, kept after the agent is back
        self._liveness_at = float("inf")
        self._liveness_handle: asyncio.TimerHandle | None = None
        # Network input waits until the journaled frames have been handed on again.
        self._recovered = asyncio.Event()
        self.mode: Mode = make_mode(self)
        # The mode's snapshot, taken between events only (never ahead of the disk), and
        # whether events were handled since. ``_idle``: the event loop waits for an item
        # of an empty queue, so the mode's state is settled right now.
        self._settled: dict[str, Any] = self._take_snapshot()
        self._snapshot_at = time.monotonic()
        self._stale = False
        self._idle = True  # (until the event loop starts, nothing moves)
        self._snapshot_wake: asyncio.TimerHandle | None = None
        self._readers: list[asyncio.Future[None]] = []  # status readers waiting for the end of an event

    # -- the status snapshot -------------------------------------------------------------
    @property
    def settled(self) -> dict[str, Any]:
        """What ``status`` shows of the mode: built now if the event loop is between events
        and events came since the last one, else the one taken at the last settled moment."""
        if self._stale and self._idle:
            self._snapshot(time.monotonic())
        return self._settled

    async def settled_for_reader(self, wait: float = READER_WAIT_S) -> dict[str, Any]:
        """The snapshot for a status reader: one built now if the event loop is between
        events; in the middle of one, one built as soon as the queue is empty again (at
        most ``wait`` later, else the last one). Kept snapshots are refreshed at most
        every SNAPSHOT_EVERY_S, but a reader sees what the events before its request
        did, as it did when a snapshot followed every burst of events."""
        if not self._idle:
            done = asyncio.get_running_loop().create_future()
            self._readers.append(done)
            try:
                await asyncio.wait_for(done, wait)
            except TimeoutError:
                pass
        return self.settled

    def _take_snapshot(self) -> dict[str, Any]:
        # The agents' evaluations go with the mode's state of the same moment: a held-out
        # line read live beside a snapshot up to SNAPSHOT_EVERY_S old could name a model
        # version newer than the one status shows.
        return {**self.mode.snapshot(), "held_out": self.held_out.summary()}

    def _snapshot(self, now: float) -> None:
        self._settled = self._take_snapshot()
        self._snapshot_at = now
        self._stale = False

    def _events_done(self, now: float) -> None:
        """The queue is empty after an event: the state is settled. The snapshot kept for
        readers in the middle of an event is refreshed now, or once SNAPSHOT_EVERY_S has
        passed since the last one."""
        self._stale = True
        if self._readers:
            self._snapshot(now)
            for done in self._readers:
                if not done.done():
                    done.set_result(None)
            self._readers.clear()
            return
        wait = self._snapshot_at + SNAPSHOT_EVERY_S - now
        if wait <= 0:
            self._snapshot(now)
        elif self._snapshot_wake is None:
            self._snapshot_wake = asyncio.get_running_loop().call_later(wait, self._snapshot_due)

    def _snapshot_due(self) -> None:
        self._snapshot_wake = None
        if self._stale and self._idle:
            self._snapshot(time.monotonic())
        # (in the middle of an event: taken when the queue is empty again)

    # -- for the modes -----------------------------------------------------------------
    def reject(self, sender: str, reason: str, detail: str, **where: int) -> None:
        """Count and keep a refused message; ``where`` names the round or step it was for.
        Kept by the messenger with its own refusals: one count, one list, in ``status``."""
        at = ", ".join(f"{k} {v}" for k, v in where.items())
        log.warning("rejected from %s%s: %s (%s)", sender, f" ({at})" if at else "", reason, detail)
        self.messenger.record_rejection(sender, reason, detail, **where)

    @property
    def rejections(self) -> list[dict[str, Any]]:
        return self.messenger.recent_rejections

    def online_agents(self) -> dict[str, int]:
        """Agents whose last presence said online and that are not refused, with the
        samples they announced."""
        return {
            a: int(p.get("samples", 0))
            for a, p in sorted(self.peers.items())
            if p.get("online") and not self.admission.is_refused(a)
        }

    # -- network -----------------------------------------------------------------------
    async def _on_connect(self) -> None:
        # Nobody could be heard while this connection was down: not their silence.
        self.liveness.excuse(time.monotonic())
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                model_version=self.mode.model_version(),
                broker=self.cfg.broker,
                model=self.admission.digest,
            ),
            retain=True,
        )
        await self.mode.on_connect()

    async def _on_payload(self, topic: str, payload: bytes | bytearray) -> Awaitable[None] | None:
        # Held (and so not acknowledged: the broker keeps it) until the journal is replayed:
        # a redelivered frame must meet the sequence numbers the journal restores.
        await self._recovered.wait()
        # A journaled frame is acknowledged once its record is durable (the transport
        # waits for what this returns).
        return await self.messenger.receive(topic, payload, self._deliver)

    async def _replay_journal(self) -> None:
        n = 0
        for topic, payload in self.mode.recovered_frames():
            await self.messenger.receive(topic, payload, self._deliver, journaled=True)
            n += 1
        if n:
            log.info("handed on %d update frames from the round journal", n)

    async def _deliver(self, inc: Incoming) -> None:
        if inc.journaled:
            self.journaled_queued += 1
        await self.queue.put(Net(inc))

    # -- liveness ----------------------------------------------------------------------
    def _schedule_liveness(self, at: float | None = None) -> None:
        at = self.liveness.next_check() if at is None else at
        if at >= self._liveness_at or at == float("inf"):
            return
        if self._liveness_handle is not None:
            self._liveness_handle.cancel()
        self._liveness_at = at
        loop = asyncio.get_running_loop()
        self._liveness_handle = loop.call_later(max(0.0, at - time.monotonic()), self._liveness_due, at)

    def _liveness_due(self, at: float) -> None:
        self._liveness_handle = None
        self._liveness_at = float("inf")
        try:
            self.queue.put_nowait(LivenessCheck(at))
        except asyncio.QueueFull:
            # A full queue is being worked through: the check waits for room, it is not
            # lost (nor an error). Asked again shortly, still for the same time.
            self._liveness_handle = asyncio.get_running_loop().call_later(0.05, self._liveness_due, at)
            self._liveness_at = at

    async def _heard(self, agent: str, back: bool, now: float) -> None:
        """``agent`` was heard; ``back``: after it had been declared silent."""
        if not back:
            return
        self.silent_since.pop(agent, None)
        silent_for = now - self._silent_at.pop(agent, now)
        peer = self.peers.get(agent, {})
        log.info("%s is heard again after %.1f s of silence", agent, silent_for)
        if peer.get("online") and not self.admission.is_refused(agent):
            await self.mode.on_presence(agent, True, int(peer.get("samples", 0)), now)

    async def _check_liveness(self, item: LivenessCheck, now: float) -> None:
        # Our own connection down, or quiet and not answering a probe (a partition keeps
        # TCP open): we hear nobody, which says nothing about them. Look again a little
        # later; once the link is back, nobody's silence meanwhile counts.
        verdict, again = self.own_link.verdict(self.transport.silent_for(), now)
        if verdict in ("probe", "wait", "down"):
            if verdict == "probe":
                self.transport.probe()
            self._schedule_liveness(again)
            return
        if verdict == "excuse":
            log.warning("the broker connection carried nothing for a while: no agent's silence meanwhile counts")
            self.liveness.excuse(now)
        for agent in self.liveness.expire(now, late=max(0.0, now - item.at)):
            self.silent_since[agent] = self.last_silenced[agent] = time.time()
            self._silent_at[agent] = now
            timeout = self.liveness.status(now)[agent]["timeout"]
            log.warning("%s is silent: no heartbeat for %.1f s; taken out of the round", agent, timeout)
            if self.peers.get(agent, {}).get("online"):
                await self.mode.on_presence(agent, False, 0, now)
        self._schedule_liveness()

    # -- the event loop ----------------------------------------------------------------
    async def _process(self) -> None:
        mode = self.mode
        await mode.start(time.monotonic())
        while True:
            # (get() returns at once while items wait: only a reader that comes while the
            # queue is empty sees it idle)
            self._idle = True
            item = await self.queue.get()
            self._idle = False
            now = time.monotonic()
            if isinstance(item, Net):
                inc = item.incoming
                if inc.journaled:
                    self.journaled_queued -= 1
                msg = inc.message
                if isinstance(msg, Presence):
                    if msg.role == "agent" and inc.sender != self.cfg.id:
                        self.peers[inc.sender] = {
                            "online": msg.online,
                            # a site aggregator says "agent" and holds an aggregator's certificate
                            "role": "aggregator" if inc.role == "aggregator" else msg.role,
                            "samples": msg.num_samples,
                            "model_version": msg.model_version,
                            "downlinks": list(msg.downlinks),
                            **({"agents": msg.agents} if inc.role == "aggregator" else {}),
                            "last_seen": time.time(),
                        }
                        if not msg.online:
                            self.liveness.forget(inc.sender)
                            self.silent_since.pop(inc.sender, None)
                            self._silent_at.pop(inc.sender, None)
                        refused = await self._refused(inc.sender, msg, now)
                        # A retained "online" of an agent that is silent (delivered again
                        # after a reconnection) does not bring it back; a heartbeat does.
                        if not refused and not self.liveness.is_silent(inc.sender):
                            await mode.on_presence(inc.sender, msg.online, msg.num_samples, now)
                elif isinstance(msg, Evaluation):
                    if inc.role != "agent":
                        self.messenger.reject(
                            "role", inc.sender, f"an evaluation signed by a {inc.role or 'non-agent'}"
                        )
                    else:
                        await self._heard(inc.sender, self.liveness.heard(inc.sender, now), now)
                        current = mode.model_version()
                        why = self.held_out.refusal(msg.model_version, current)
                        if why:
                            self.messenger.reject("version", inc.sender, why)
                        else:
                            self.held_out.add(
                                inc.sender, msg.model_version, msg.num_samples, msg.metrics, current=current
                            )
                elif isinstance(msg, ModelCheck):
                    if inc.role == "agent":
                        diff = self.admission.on_check(inc.sender, msg)
                        if diff:
                            log.warning("%s refused: its model differs from this one: %s", inc.sender, diff)
                elif isinstance(msg, Heartbeat):
                    if inc.role == "agent":
                        await self._heard(inc.sender, self.liveness.heartbeat(inc.sender, msg.interval, now), now)
                        self._schedule_liveness()
                else:
                    if inc.role == "agent":
                        await self._heard(inc.sender, self.liveness.heard(inc.sender, now), now)
                    await mode.on_message(inc, now)
                del inc, msg
            elif isinstance(item, LivenessCheck):
                await self._check_liveness(item, now)
            else:
                sender = getattr(item, "sender", None)
                if isinstance(sender, str):
                    # A streamed update's parts: its sender is alive, whatever its
                    # heartbeats (queued behind the update on the same connection) say.
                    await self._heard(sender, self.liveness.heard(sender, now), now)
                await mode.on_item(item, now)
            # Streamed parts are chunk-sized views: dropped as soon as they are folded.
            del item
            # A snapshot sorts the agent lists: not per event (see SNAPSHOT_EVERY_S).
            if self.queue.empty():
                self._events_done(time.monotonic())

    async def _refused(self, agent: str, msg: Presence, now: float) -> bool:
        """Whether ``agent``'s presence is refused (:mod:`.admission`): the mode then sees
        it offline, and an agent whose model differs gets this model's fingerprint."""
        was = self.admission.is_refused(agent)
        refusal, check = self.admission.on_presence(agent, msg)
        if refusal is None or not msg.online:
            return False
        if not was:
            log.warning("%s refused: %s", agent, refusal.detail)
            # It may have been taken before (a restart with another model or no data).
            await self.mode.on_presence(agent, False, 0, now)
        if check is not None:
            try:
                await self.messenger.send(topics.direct(self.fed, self.cfg.id, agent, check.kind), check)
            except TransportError as exc:
                if exc.exit_code == EXIT_CONFIG:
                    raise
                log.warning("the model fingerprint for %s was not sent: %s", agent, exc)
        return True

    # -- control -----------------------------------------------------------------------
    async def _status(self, _args: dict[str, Any]) -> dict[str, Any]:
        silent = self.transport.silent_for()
        return {
            "role": "coordinator",
            "id": self.cfg.id,
            "federation": self.fed,
            "mode": self.cfg.mode,
            "broker": self.cfg.broker,
            "connection": self.transport.link_state,
            "broker_silent_s": None if silent is None else round(silent, 1),
            "reconnects": self.transport.reconnects,
            "last_error": self.transport.last_error,
            **(await self.settled_for_reader()),
            "mdns_interfaces": list(self.cfg.interfaces),
            "peers": self.peer_table(),
            "refused_agents": self.admission.status(),
            "model_digest": self.admission.digest or None,
            "rejected": dict(self.messenger.rejected),
            "recent_rejections": list(self.messenger.recent_rejections),
            # frames dropped unread: sender -> reason -> count (fedagent.protocols.ratelimit)
            "dropped": _dropped(self.messenger),
            "heartbeats": {
                a: {**v, "silent_since": self.silent_since.get(a)}
                for a, v in self.liveness.status(time.monotonic()).items()
            },
            "last_silenced": dict(sorted(self.last_silenced.items())),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "checkpoint": str(self.ckpt_path),
            "metrics_url": self.metrics_url,
        }

    def peer_table(self) -> dict[str, dict[str, Any]]:
        """The agents as `status` and `peers` both show them (:mod:`fedagent.protocols.peerview`)."""
        adverts: dict[str, dict[str, Any]] = {}
        if self._disc is not None:
            for pid, a in self._disc.peers.items():
                adverts[pid] = {"role": a.role, "broker": a.broker_uri, "last_seen": self._disc.last_seen.get(pid)}
        return peer_table(
            self.cfg.id,
            presence=self.peers,
            heard=self.messenger.last_heard,
            adverts=adverts,
            broker=self.cfg.broker,
            link_ok=self.transport.link_state == "connected",
        )

    async def _peers(self, _args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.cfg.id, "federation": self.fed, "peers": self.peer_table()}
        tier = self.settled.get("tier")
        if isinstance(tier, dict):
            # A hub's sites, or a site aggregator's agents and upstream, as `status` has
            # them: `fedagent peers` draws the tree from the two.
            out["tier"] = tier
        return out

    def _refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_connected(self.transport.connected)
        m.set_reconnects(self.transport.reconnects)
        m.set_peers(sum(1 for p in self.peers.values() if p.get("online")))
        m.set_phase(str(self.settled.get("phase") or ""))
        # What the silent-agent and quorum alerts read: an agent counts as live while its
        # presence says online and its heartbeats keep coming (a stopped process's
        # presence stays "online" until the broker's keep-alive gives up on it).
        m.set_agents({a: not p.get("online") or self.liveness.is_silent(a) for a, p in self.peers.items()})
        m.set_state_filesystem(self.cfg.state_dir)
        self.mode.refresh_metrics(m)

    # -- main --------------------------------------------------------------------------
    async def run(self) -> None:
        ready = asyncio.Event()
        control = ControlServer(self.cfg.control_socket, {"status": self._status, "peers": self._peers})
        await control.start()
        if self.cfg.metrics_port >= 0:
            host, port = await self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_url = f"http://{host}:{port}/metrics"
        title = self.mode.title
        try:
            async with asyncio.TaskGroup() as tg, Discovery(self.cfg.interfaces) as disc:
                tg.create_task(self.transport.run(self._on_payload, ready))
                tg.create_task(sdnotify.watchdog_loop())
                await ready.wait()
                self._disc = disc
                disc.start_browsing(self.fed)  # the agents' adverts, for the peer table
                if self.cfg.advertise:
                    await disc.register(
                        Advert(
                            federation=self.fed,
                            node_id=self.cfg.id,
                            role="coordinator",
                            broker_uri=self.cfg.broker,
                            fingerprint=fingerprint(self.cfg.tls.cert),
                        )
                    )
                sdnotify.ready(f"{title} of {self.fed}: waiting for agents")
                log.info(
                    "%s %s of federation %s on %s (%s)",
                    title,
                    self.cfg.id,
                    self.fed,
                    self.cfg.broker,
                    self.settled.get("phase"),
                )
                tg.create_task(self._process())
                await self._replay_journal()
                self._recovered.set()
                for job in self.mode.background():
                    tg.create_task(job)
                await asyncio.Event().wait()
        finally:
            sdnotify.stopping()
            if self._liveness_handle is not None:
                self._liveness_handle.cancel()
            if self._snapshot_wake is not None:
                self._snapshot_wake.cancel()
            self.mode.close()
            self.messenger.close()
            try:
                await asyncio.wait_for(
                    self.transport.close(
                        (topics.presence(self.fed, self.cfg.id), presence_payload(self.cfg, self.fed, False))
                    ),
                    5,
                )
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("clean close failed: %s", exc)
            await control.close()
            await self.metrics.close()


#: Senders `status` lists by the frames dropped from them (the most first).
DROPPED_SHOWN = 20


def _dropped(messenger: Messenger) -> dict[str, dict[str, int]]:
    budget = messenger.budget
    if budget is None:
        return {}
    top = sorted(budget.dropped.items(), key=lambda kv: -sum(kv[1].values()))[:DROPPED_SHOWN]
    return {sender: dict(sorted(reasons.items())) for sender, reasons in top}
