"""The agent daemon's core, the same whatever the federation's mode.

One TaskGroup owns everything: the control socket (status, join, leave, peers and the
services' commands), mDNS, the systemd watchdog, the metrics endpoint and the *session*
of the federation the agent belongs to. ``join`` replaces the session without
restarting the process. Training runs in a worker thread so the event loop keeps
answering ``status``, MQTT keep-alives and the watchdog.

A mode (FedAvg participant, Sync-Opt, gossip) is a :class:`Session` subclass; a service
(search) is a :class:`Service` registered on the :class:`Agent` with a
:class:`ServiceSpec` and hosted by the sessions whose mode names it in ``SERVICES``.
Nothing here imports a mode or a service: :mod:`fedagent.agent.daemon` puts them together.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedagent.config import NodeConfig, check_interfaces
from fedagent.config import load as load_config
from fedagent.errors import EXIT_CONFIG, ConfigError, FedagentError, TransportError
from fedagent.node import sdnotify
from fedagent.node.control import ControlServer, Handler
from fedagent.node.discovery import Advert, Discovery
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import keep_freed_memory, make_transport, node_identity, open_history, presence_payload
from fedagent.node.transport import Subscription
from fedagent.protocols import topics
from fedagent.protocols.fingerprint import Fingerprint, first_difference
from fedagent.protocols.liveness import heartbeat_interval
from fedagent.protocols.messages import Heartbeat, ModelCheck
from fedagent.protocols.peerview import online_count, peer_table
from fedagent.security.pki import fingerprint
from fedagent.storage.statefile import cleanup_temp_files, make_dirs
from fedagent.tasks.base import Task, Weights, load_task, set_weights, warm_up_torch
from fedagent.tasks.fingerprint import task_fingerprint

log = logging.getLogger("fedagent.agent")
#: Until its first heartbeat an agent looks this often (seconds) for a coordinator to send it to.
FIRST_BEAT_POLL = 0.25
#: Seconds an agent whose model differs from the coordinator's waits for the
#: coordinator's fingerprint (to name the tensor that differs) before it stops anyway.
MODEL_CHECK_WAIT = 5.0

DISCOVERY_TIMEOUT = 10.0


class Service(abc.ABC):
    """A capability a session hosts beside its mode's protocol (search).

    It receives the messages of the types it names (on the event loop: long work is
    spawned), answers the control command of its name and adds fields to the status."""

    message_types: ClassVar[tuple[type, ...]] = ()

    @abc.abstractmethod
    def on_message(self, inc: Incoming) -> None:
        """A message of one of ``message_types``, already verified by the messenger."""

    @abc.abstractmethod
    async def command(self, args: dict[str, Any]) -> dict[str, Any]:
        """The control socket's command of the service's name."""

    def status(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class ServiceSpec:
    """A service registered on the agent: ``name`` is also its control command;
    ``unavailable`` is that command's error while no session hosts it ({id}: this agent)."""

    name: str
    make: Callable[[Session], Service]
    unavailable: str


class Session(abc.ABC):
    """Membership of one federation: its connection, messenger, state directory, history
    and the services its mode hosts. A mode subclasses it."""

    SERVICES: ClassVar[frozenset[str]] = frozenset()  # the services (by name) this mode hosts
    DISCOVERY_ROLES: ClassVar[tuple[str, ...]] = ("coordinator", "broker")  # whose mDNS advert names the broker
    MODEL_FILE: ClassVar[str] = "global.ckpt"  # the model's checkpoint in the session's directory
    QUEUE_SIZE: ClassVar[int] = 1000

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.fed = federation
        self.broker = broker
        self.coordinator: str | None = None
        # The vocabulary this member uses ("" while none is agreed), and the latest global
        # model it holds: what services vectorise with. Modes without one leave them empty.
        self.vocab_digest = ""
        self.global_weights: Weights | None = None
        self.global_version: int | None = None
        self.dir = self.cfg.state_dir / "agent" / federation
        make_dirs(self.dir)  # its entry durable: a power cut must not take the whole directory
        cleanup_temp_files(self.dir)
        self.model_path = self.dir / self.MODEL_FILE
        self.history = open_history(self.cfg, self.dir)
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=self.QUEUE_SIZE)
        self.transport = make_transport(
            self.cfg,
            federation,
            broker,
            subscriptions=self.subscriptions(),
            on_connect=self._on_connect,
            retired_subscriptions=self.retired_subscriptions(),
        )
        self.messenger = Messenger(
            federation=federation,
            node_id=self.cfg.id,
            transport=self.transport,
            max_chunk_bytes=self.cfg.max_chunk_bytes,
            max_model_bytes=self.cfg.max_model_bytes,
            metrics=agent.metrics,
            identity=node_identity(self.cfg),
            max_skew=self.cfg.max_clock_skew,
            state_dir=self.dir,
        )
        self.services: dict[str, Service] = {
            spec.name: spec.make(self) for spec in agent.service_specs if spec.name in self.SERVICES
        }
        self._model_checked: set[tuple[str, str]] = set()  # (peer, digest) our fingerprint went to

    # -- what a mode provides ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def peers(self) -> dict[str, dict[str, Any]]:
        """Peers seen over MQTT: id -> role, online, last_seen, model_version."""

    @property
    @abc.abstractmethod
    def current_round(self) -> int:
        """The round (step, period) the federation is in, as far as this member knows."""

    @abc.abstractmethod
    async def run(self) -> None:
        """Connect and take part until cancelled."""

    @abc.abstractmethod
    async def _on_connect(self) -> None:
        """Publish this member's retained presence (each time the connection is made)."""

    @abc.abstractmethod
    def mode_status(self) -> dict[str, Any]:
        """The mode's fields of ``fedagent status``."""

    def subscriptions(self) -> list[Subscription]:
        """Filters (QoS 1: queued in the persistent session while the member is away) or
        ``(filter, 0)`` for what must not be queued for it (see Transport)."""
        return [
            topics.all_broadcasts(self.fed),
            topics.inbox(self.fed, self.cfg.id),
            topics.all_presence(self.fed),
        ]

    def retired_subscriptions(self) -> list[str]:
        """Filters an earlier version of this mode subscribed to in its persistent session."""
        return []

    def on_advert(self, kind: str, advert: Advert) -> None:
        """mDNS news ("added", "updated", "removed"); only gossip listens."""
        return None

    def metrics_model_version(self) -> int | None:
        """The model version the metrics endpoint shows (None: not shown)."""
        return None

    def metrics_privacy(self) -> dict[str, float] | None:
        """ε spent and the rest of the privacy figures the metrics show (None: no DP here)."""
        return None

    # -- shared by every mode ---------------------------------------------------------------
    def connection_status(self) -> dict[str, Any]:
        silent = self.transport.silent_for()
        return {
            "federation": self.fed,
            "broker": self.broker,
            "connection": self.transport.link_state,
            "broker_silent_s": None if silent is None else round(silent, 1),
            "reconnects": self.transport.reconnects,
            "last_error": self.transport.last_error,
            "coordinator": self.coordinator,
        }

    def status(self) -> dict[str, Any]:
        out = self.mode_status()
        for service in self.services.values():
            out.update(service.status())
        out["rejected"] = dict(self.messenger.rejected)
        out["recent_rejections"] = list(self.messenger.recent_rejections)
        return out

    def to_service(self, inc: Incoming) -> bool:
        """Hand ``inc`` to the hosted service that takes its type; False if none does."""
        for service in self.services.values():
            if isinstance(inc.message, service.message_types):
                service.on_message(inc)
                return True
        return False

    async def _on_payload(self, topic: str, payload: bytes | bytearray) -> None:
        await self.messenger.receive(topic, payload, self.queue.put)

    async def heartbeats(self) -> None:
        """Tell the coordinator "still here" every keep-alive / 4 seconds, so that it can
        take a silent member out of a round before the broker's keep-alive would (see
        :mod:`fedagent.protocols.liveness`). Runs beside the mode's loop; training is in a
        worker thread, so a busy agent still beats."""
        loop = asyncio.get_running_loop()
        interval = heartbeat_interval(self.cfg.keepalive)
        beat = Heartbeat(interval)
        # The coordinator tracks an agent from its first heartbeat on: the first one goes
        # out as soon as the coordinator is known (looked for every quarter second), not a
        # whole interval later, so that an agent cut off in its first rounds is declared
        # silent too instead of being waited for until the round's deadline.
        due = loop.time()
        first = True
        while True:
            due += min(interval, FIRST_BEAT_POLL) if first else interval
            now = loop.time()
            if due < now:  # this loop was held up: beat now, and keep the period from here
                due = now
            await asyncio.sleep(due - now)
            coordinator = self.coordinator
            if coordinator is None or not self.transport.connected:
                continue
            first = False
            try:
                await self.messenger.send(topics.direct(self.fed, self.cfg.id, coordinator, "heartbeat"), beat)
            except TransportError as exc:
                if exc.exit_code == EXIT_CONFIG:
                    raise
                log.debug("heartbeat not sent: %s", exc)

    # -- the model check (protocols/fingerprint.py) --------------------------------------
    @property
    def model_digest(self) -> str:
        """The digest this member announces ("" while its model waits for a vocabulary)."""
        fp = self.agent.fingerprint
        return fp.digest if fp is not None else ""

    async def send_model_check(self, peer: str, digest: str, *, transport: Any = None) -> bool:
        """Our fingerprint to ``peer``, which announced model ``digest``, once per digest;
        False when there is nothing to send (the same model, or none known)."""
        ours = self.agent.fingerprint
        if ours is None or not digest or digest == ours.digest or (peer, digest) in self._model_checked:
            return False
        self._model_checked.add((peer, digest))
        try:
            await self.messenger.send(
                topics.direct(self.fed, self.cfg.id, peer, ModelCheck.kind), ModelCheck.of(ours), transport=transport
            )
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            log.warning("this model's fingerprint for %s was not sent: %s", peer, exc)
        return True

    async def coordinator_model(self, coordinator: str, digest: str) -> None:
        """The coordinator announced model ``digest``. Another model than this agent's is
        refused by the coordinator: the agent stops with a configuration error (exit 78,
        so systemd does not restart it in a loop), naming the first tensor that differs
        once the coordinator's fingerprint is in, or after MODEL_CHECK_WAIT seconds without."""
        if await self.send_model_check(coordinator, digest):
            self.agent.spawn(self._refused_after(coordinator, digest))

    async def _refused_after(self, coordinator: str, digest: str) -> None:
        await asyncio.sleep(MODEL_CHECK_WAIT)
        raise self._model_refused(coordinator, "which tensor differs is not known (no fingerprint came back)", digest)

    async def on_model_check(self, inc: Incoming, msg: ModelCheck) -> None:
        """The fingerprint of a node whose model differs (coordinated modes: only the
        coordinator's matters): ConfigError naming the first tensor that differs."""
        ours = self.agent.fingerprint
        if inc.role != "coordinator":
            return self.messenger.reject("role", inc.sender, "a model check from a node that is no coordinator")
        if ours is None or msg.digest == ours.digest:
            return None
        await self.send_model_check(inc.sender, msg.digest)  # so the coordinator names it too
        diff = first_difference(ours, msg.fingerprint, here="here", there=f"on {inc.sender}")
        raise self._model_refused(inc.sender, diff, msg.digest)

    def _model_refused(self, coordinator: str, diff: str, theirs: str) -> ConfigError:
        self.history.append({"event": "refused", "by": coordinator, "reason": diff})
        return ConfigError(
            f"{self.cfg.path}: the model of task {self.cfg.task!r} differs from {coordinator}'s, which refuses "
            f"this agent: {diff} (model digests {self.model_digest} here, {theirs} there); every node must build "
            "the same model from its [task] options"
        )

    def offline_presence(self) -> bytes:
        return presence_payload(self.cfg, self.fed, False)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.transport.close((topics.presence(self.fed, self.cfg.id), self.offline_presence())), 5
            )


SessionClass = type[Session]


class Agent:
    """The daemon: one node's task and model, its control socket, mDNS and metrics, and
    the session of the mode ``session_class`` while it is in a federation."""

    def __init__(self, cfg: NodeConfig, session_class: SessionClass, services: Sequence[ServiceSpec] = ()) -> None:
        self.cfg = cfg
        self.session_class = session_class
        self.service_specs = tuple(services)
        keep_freed_memory()  # before the model is built: see its docstring
        torch.set_num_threads(cfg.torch_threads)
        self.task: Task = load_task(cfg.task, cfg.task_options)
        samples = self.task.num_samples()
        if samples <= 0:
            # Refused here, not in round 1: its updates would weigh nothing, and a
            # misspelt data option in [task] (taken for a missing one) gives exactly that.
            options = ", ".join(f"{k} = {v!r}" for k, v in dict(cfg.task_options).items()) or "none"
            raise ConfigError(
                f"{cfg.path}: task {cfg.task!r} has no training samples on this agent (built from the [task] "
                f"options: {options}); check those options and the data they name"
            )
        self.model = self.task.build_model()
        # What this agent announces, and what a peer's announced model is compared with:
        # a tensor that cannot travel stops the start here (exit 78).
        self.fingerprint: Fingerprint | None = task_fingerprint(self.task, self.model)
        if getattr(self.task, "uses_torch_optimiser", False):
            # Before the agent announces itself: not in its first round (see warm_up_torch).
            log.debug("torch warmed up in %.2fs", warm_up_torch())
        # Training, evaluation and re-indexing run in worker threads, one at a time on the task.
        self.thread_lock = threading.Lock()
        # (the training model it was made beside, the weights' shapes, the model) of evaluate()
        self._eval_model: tuple[torch.nn.Module, tuple[tuple[str, tuple[int, ...]], ...], torch.nn.Module] | None = None
        self.session: Session | None = None
        self._session_task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._disc: Discovery | None = None
        self._advert: Advert | None = None
        self.metrics = NodeMetrics("agent", cfg.id, cfg.federation)
        self.metrics.before_scrape = self._refresh_metrics
        self.metrics_url: str | None = None
        self._exit: asyncio.Event | None = None
        self.exit_reason: str | None = None

    def request_exit(self, reason: str) -> None:
        """Stop the daemon cleanly (goodbye on MQTT and mDNS, exit status 0)."""
        self.exit_reason = reason
        if self._exit is not None:
            self._exit.set()

    def evaluate(self, weights: Weights) -> dict[str, float]:
        """The task's metrics of ``weights`` on the local held-out data (worker thread).

        The model they are loaded into is built once and kept for the next evaluation
        (a new one cost a model's worth of memory and its random initialisation, which
        the loaded weights then overwrite, every time); it is built anew when the
        training model was (a new vocabulary) or the weights have other shapes."""
        shapes = tuple((k, np.shape(v)) for k, v in weights.items())
        with self.thread_lock:
            kept = self._eval_model
            if kept is None or kept[0] is not self.model or kept[1] != shapes:
                kept = self._eval_model = (self.model, shapes, self.task.build_model())
            model = kept[2]
            set_weights(model, weights)
            return self.task.evaluate(model)

    @property
    def discovery(self) -> Discovery | None:
        return self._disc

    def _on_advert(self, kind: str, advert: Advert) -> None:
        session = self.session
        if session is not None:
            session.on_advert(kind, advert)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        assert self._tg is not None
        self._tg.create_task(coro)

    async def _find_broker(self, federation: str) -> str:
        assert self._disc is not None
        while True:
            try:
                advert = await self._disc.find(federation, self.session_class.DISCOVERY_ROLES, DISCOVERY_TIMEOUT)
                return advert.broker_uri
            except FedagentError as exc:
                log.warning("%s; still looking", exc)
                sdnotify.status(f"looking for federation {federation} on mDNS")

    async def _run_session(self, federation: str, broker: str) -> None:
        if not broker:
            broker = await self._find_broker(federation)
            log.info("found federation %s on mDNS: broker %s", federation, broker)
        session = self.session_class(self, federation, broker)
        self.session = session
        if self.cfg.advertise and self._disc is not None:
            if self._advert is not None and self._advert.federation != federation:
                await self._disc.unregister(self._advert)
            self._advert = Advert(
                federation=federation,
                node_id=self.cfg.id,
                role="agent",
                broker_uri=broker,
                fingerprint=fingerprint(self.cfg.tls.cert),
            )
            await self._disc.register(self._advert)
            self._disc.start_browsing(federation)
        try:
            await session.run()
        finally:
            await session.close()

    def _start_session(self, federation: str, broker: str) -> None:
        assert self._tg is not None
        if self._session_task is not None:
            self._session_task.cancel()
        self.session = None
        self._session_task = self._tg.create_task(self._run_session(federation, broker))

    # -- control -----------------------------------------------------------------------
    async def _status(self, _args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": "agent",
            "id": self.cfg.id,
            "mode": self.cfg.mode,
            "task": self.cfg.task,
            "num_samples": self.task.num_samples(),
            "federation": self.cfg.federation or None,
            "connection": "not joined",
            "metrics_url": self.metrics_url,
        }
        if self.session is not None:
            out.update(self.session.status())
        elif self.cfg.federation:
            out["connection"] = "discovering"
        out["mdns_interfaces"] = list(self.cfg.interfaces)
        # The same table as `fedagent peers`: one source for both commands.
        out["peers"] = self._peer_table()
        return out

    def _refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_federation(self.cfg.federation)
        m.set_state_filesystem(self.cfg.state_dir)
        session = self.session
        m.set_connected(session is not None and session.transport.connected)
        if session is not None:
            m.set_reconnects(session.transport.reconnects)
            m.set_peers(online_count(self._peer_table()))
            m.round_started(session.current_round)
            version = session.metrics_model_version()
            if version is not None:
                m.set_model_version(version)
            privacy = session.metrics_privacy()
            if privacy is not None:
                m.set_privacy(privacy)

    def _peer_table(self) -> dict[str, dict[str, Any]]:
        """Every peer this agent knows of, from its retained presence, its mDNS advert and
        the last message of any kind it sent (:func:`fedagent.protocols.peerview.peer_table`)."""
        adverts: dict[str, dict[str, Any]] = {}
        if self._disc is not None:
            for pid, a in self._disc.peers.items():
                if not self.cfg.federation or a.federation == self.cfg.federation:
                    adverts[pid] = {"role": a.role, "broker": a.broker_uri, "last_seen": self._disc.last_seen.get(pid)}
        session = self.session
        if session is None:
            return peer_table(self.cfg.id, presence={}, heard={}, adverts=adverts, broker="", link_ok=False)
        return peer_table(
            self.cfg.id,
            presence=session.peers,
            heard=session.messenger.last_heard,
            adverts=adverts,
            broker=session.broker,
            link_ok=session.transport.link_state == "connected",
        )

    async def _peers(self, _args: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.cfg.id, "federation": self.cfg.federation or None, "peers": self._peer_table()}

    def _service_command(self, spec: ServiceSpec) -> Handler:
        async def handle(args: dict[str, Any]) -> dict[str, Any]:
            service = self.session.services.get(spec.name) if self.session is not None else None
            if service is None:
                raise ConfigError(spec.unavailable.format(id=self.cfg.id))
            return await service.command(args)

        return handle

    async def _leave(self, _args: dict[str, Any]) -> dict[str, Any]:
        left = self.cfg.federation
        if not left:
            raise ConfigError(f"agent {self.cfg.id} is not in a federation")
        if self._session_task is not None:
            self._session_task.cancel()
            self._session_task = None
        self.session = None
        if self._disc is not None and self._advert is not None:
            await self._disc.unregister(self._advert)
            self._advert = None
        self.cfg = self.cfg.with_membership("", "")
        sdnotify.status(f"agent {self.cfg.id}: left {left}; run `fedagent join NAME`")
        log.info("left federation %s", left)
        return {"left": left}

    async def _join(self, args: dict[str, Any]) -> dict[str, Any]:
        federation = topics.check_name(str(args.get("federation", "")), "federation")
        broker = str(args.get("broker", ""))
        if broker and not broker.startswith("mqtts://"):
            raise ConfigError(f"broker must look like mqtts://HOST:PORT, not {broker!r}")
        raw_ifaces = args.get("interfaces")
        interfaces = check_interfaces(raw_ifaces, "interfaces") if raw_ifaces is not None else None
        old = self.cfg.interfaces
        self.cfg = self.cfg.with_membership(federation, broker, interfaces)
        if self.cfg.interfaces != old:
            await self._rebind_discovery()
        self._start_session(federation, broker)
        return {"federation": federation, "broker": broker or "(mDNS)", "interfaces": list(self.cfg.interfaces)}

    async def _rebind_discovery(self) -> None:
        """Run mDNS on ``cfg.interfaces`` from now on (``join --interface``): goodbye on
        the old addresses, then the session being started advertises and browses anew."""
        old, self._disc, self._advert = self._disc, None, None
        if old is not None:
            await old.close()
        disc = Discovery(self.cfg.interfaces, on_change=self._on_advert)
        await disc.__aenter__()
        self._disc = disc
        log.info("mDNS now runs on %s", ", ".join(self.cfg.interfaces))

    def _membership_on_disk(self) -> NodeConfig | None:
        """The config file's membership when it differs from the one this process started
        with: a `fedagent join` that wrote the file before our control socket existed
        could not tell us, so we read what it recorded once the socket is up."""
        try:
            fresh = load_config(self.cfg.path, "agent")
        except FedagentError as exc:
            log.warning("cannot re-read %s: %s", self.cfg.path, exc)
            return None
        if (fresh.federation, fresh.broker, fresh.interfaces) == (
            self.cfg.federation,
            self.cfg.broker,
            self.cfg.interfaces,
        ):
            return None
        return self.cfg.with_membership(fresh.federation, fresh.broker, fresh.interfaces)

    async def run(self) -> None:
        self._exit = asyncio.Event()
        handlers: dict[str, Handler] = {
            "status": self._status,
            "join": self._join,
            "leave": self._leave,
            "peers": self._peers,
        }
        for spec in self.service_specs:
            handlers[spec.name] = self._service_command(spec)
        control = ControlServer(self.cfg.control_socket, handlers)
        await control.start()
        changed = self._membership_on_disk()
        if changed is not None:
            log.info("the config file records federation %r now; using it", changed.federation)
            self.cfg = changed
        if self.cfg.metrics_port >= 0:
            host, port = await self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_url = f"http://{host}:{port}/metrics"
        try:
            disc = Discovery(self.cfg.interfaces, on_change=self._on_advert)
            await disc.__aenter__()
            self._disc = disc
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                watchdog = tg.create_task(sdnotify.watchdog_loop())
                if self.cfg.federation:
                    self._start_session(self.cfg.federation, self.cfg.broker)
                    sdnotify.ready(f"agent {self.cfg.id}: joining {self.cfg.federation}")
                else:
                    sdnotify.ready(f"agent {self.cfg.id}: not in a federation; run `fedagent join NAME`")
                    log.info("agent %s is not in a federation yet: run `fedagent join FEDERATION`", self.cfg.id)
                await self._exit.wait()
                log.info("agent %s stopping: %s", self.cfg.id, self.exit_reason)
                if self._session_task is not None:
                    self._session_task.cancel()
                watchdog.cancel()
        finally:
            sdnotify.stopping()
            if self._disc is not None:
                await self._disc.close()
            await control.close()
            await self.metrics.close()
