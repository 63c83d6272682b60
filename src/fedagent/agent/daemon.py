"""``fedagent agent``: the daemon every site or vehicle runs.

One TaskGroup owns everything: the control socket (status, join), mDNS, the systemd
watchdog, and the *session* of the federation the agent belongs to. ``join`` replaces
the session without restarting the process. Training runs in a worker thread so the
event loop keeps answering ``status``, MQTT keep-alives and the watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import Any

import torch

from fedagent import checkpoint
from fedagent import config as config_mod
from fedagent.agent import vocabulary as vocab_mod
from fedagent.agent.gossip import GossipSession
from fedagent.agent.search import SearchService
from fedagent.agent.syncopt import SyncOptSession
from fedagent.config import NodeConfig
from fedagent.errors import EXIT_CONFIG, ConfigError, FedagentError, TransportError
from fedagent.metrics import NodeMetrics
from fedagent.node import sdnotify
from fedagent.node.control import ControlServer
from fedagent.node.discovery import Advert, Discovery
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.runtime import History, make_transport, node_identity, presence_payload
from fedagent.pki import fingerprint
from fedagent.protocols import topics
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.messages import (
    GlobalModel,
    Presence,
    PublicVectors,
    PublicVectorsRequest,
    RoundResult,
    RoundStart,
    SearchAnswer,
    SearchQuery,
    Vocabulary,
)
from fedagent.protocols.participant import AdoptModel, Discarded, Leave, Participant, SendUpdate, Train, TrainingDone
from fedagent.statefile import cleanup_temp_files
from fedagent.tasks.base import Task, get_weights, load_task, set_weights

log = logging.getLogger("fedagent.agent")

DISCOVERY_TIMEOUT = 10.0


class Session:
    """Membership of one federation: a connection, a participant machine, peers."""

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.fed = federation
        self.broker = broker
        self.coordinator: str | None = None
        self.participant = Participant(self.cfg.id, leave_after=self.cfg.rounds.leave_after)
        self.peers: dict[str, dict[str, Any]] = {}
        self.round_state = "idle"
        self.current_round = 0
        self.last_eval: dict[str, float] = {}
        self.needs_vocabulary = vocab_mod.needs_vocabulary(agent.task)
        self.vocab_digest = ""
        self.vocabulary_size: int | None = None
        self.coordinator_online = False
        self.offers_sent = 0
        self.dir = self.cfg.state_dir / "agent" / federation
        self.dir.mkdir(parents=True, exist_ok=True)
        cleanup_temp_files(self.dir)
        self.model_path = self.dir / "global.ckpt"
        self.history = History(self.dir / "history.jsonl")
        resumed = checkpoint.load(self.model_path)
        # The latest global model seen, which a search vectorises with.
        self.global_weights = None
        self.global_version: int | None = None
        if resumed is not None:
            self.participant.model_version = int(resumed[1].get("model_version", 0))
            self.global_weights, self.global_version = resumed[0], self.participant.model_version
        self.search = SearchService(self)
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self.compressor = Compressor()  # keeps the top-k residual across rounds
        self._base: tuple[int, Any, Any] | None = None  # (round, global weights, train config) being trained
        self.transport = make_transport(
            self.cfg,
            federation,
            broker,
            subscriptions=[
                topics.all_broadcasts(federation),
                topics.inbox(federation, self.cfg.id),
                topics.all_presence(federation),
            ],
            on_connect=self._on_connect,
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

    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                num_samples=self.agent.task.num_samples(),
                model_version=self.participant.model_version,
            ),
            retain=True,
        )

    async def _on_payload(self, topic: str, payload: bytes) -> None:
        await self.messenger.receive(topic, payload, self.queue.put)

    async def run(self) -> None:
        ready = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.transport.run(self._on_payload, ready))
            await ready.wait()
            log.info("agent %s joined federation %s via %s", self.cfg.id, self.fed, self.broker)
            sdnotify.status(f"member of {self.fed}: waiting for a round")
            while True:
                item = await self.queue.get()
                if isinstance(item, Incoming):
                    await self._on_message(item)
                else:
                    await self._apply(self.participant.handle(item))

    async def _on_message(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, Presence):
            if inc.sender != self.cfg.id:
                self.peers[inc.sender] = {
                    "role": msg.role,
                    "online": msg.online,
                    "last_seen": time.time(),
                    "model_version": msg.model_version,
                }
            if msg.role == "coordinator" and inc.role == "coordinator":
                came_online = msg.online and not self.coordinator_online
                self.coordinator_online = msg.online
                if msg.online:
                    self.coordinator = inc.sender
                if came_online and self.needs_vocabulary and not self.vocab_digest:
                    await self._offer_vocabulary()
            return
        if isinstance(msg, SearchQuery):
            self.agent.spawn(self.search.on_query(inc))
            return
        if isinstance(msg, SearchAnswer):
            self.search.on_answer(inc)
            return
        if isinstance(msg, PublicVectorsRequest):
            self.agent.spawn(self.search.on_vectors_request(inc))
            return
        if isinstance(msg, PublicVectors):
            self.search.on_vectors(inc)
            return
        if isinstance(msg, Vocabulary):
            if not inc.topic.startswith(topics.federation_root(self.fed) + "/global/") or inc.role != "coordinator":
                return self.messenger._reject("role", inc.sender, "a vocabulary not broadcast by a coordinator")
            self.coordinator = inc.sender
            await self._adopt_vocabulary(msg)
            return
        if isinstance(msg, (RoundStart, RoundResult, GlobalModel)):
            if not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
                return self.messenger._reject("topic", inc.sender, f"{msg.kind} outside global/")
            if inc.role != "coordinator":
                # The ACL keeps agents off global/, but the broker is not trusted with
                # that: only a coordinator's certificate may sign what steers training.
                return self.messenger._reject(
                    "role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-coordinator'}"
                )
            self.coordinator = inc.sender
            if (
                isinstance(msg, (RoundStart, GlobalModel))
                and msg.weights is not None
                and msg.model_version >= (self.global_version or 0)
            ):
                self.global_weights, self.global_version = msg.weights, msg.model_version
            if isinstance(msg, RoundStart) and msg.round > self.current_round:
                self.current_round = msg.round
                self.round_state = "training" if self.cfg.id in msg.selected else "not selected"
                self.agent.spawn(self._evaluate_global(msg.weights, msg.model_version))
            if isinstance(msg, RoundResult) and msg.round >= self.current_round:
                self.round_state = "aggregated" if msg.aggregated else f"abandoned: {msg.reason}"
            await self._apply(self.participant.handle(msg))

    async def _offer_vocabulary(self) -> None:
        if self.coordinator is None:
            return
        offer = await asyncio.to_thread(vocab_mod.make_offer, self.agent.task)
        n = await self.messenger.send(topics.direct(self.fed, self.cfg.id, self.coordinator, "vocab_offer"), offer)
        self.offers_sent += 1
        self.round_state = "vocabulary offered"
        self.history.append({"event": "vocab_offer", "terms": len(offer.terms), "bytes": n})
        log.info("offered %d terms (%d bytes) to %s", len(offer.terms), n, self.coordinator)

    async def _adopt_vocabulary(self, msg: Vocabulary) -> None:
        if not self.needs_vocabulary or msg.digest == self.vocab_digest:
            return
        if self.cfg.id not in msg.contributors:
            log.warning("the vocabulary does not include this agent's offer; using it anyway")
        await asyncio.to_thread(self.agent.adopt_vocabulary, list(msg.terms))
        self.vocab_digest = msg.digest
        self.vocabulary_size = len(msg.terms)
        self.round_state = "vocabulary agreed"
        self.history.append({"event": "vocabulary", "terms": len(msg.terms), "digest": msg.digest})
        log.info("adopted the common vocabulary: %d terms (digest %s)", len(msg.terms), msg.digest[:12])

    async def _evaluate_global(self, weights, version: int) -> None:
        metrics = await asyncio.to_thread(self.agent.evaluate, weights)
        self.last_eval = {"model_version": version, **metrics}
        self.agent.metrics.report(metrics, prefix="global_")
        self.history.append({"event": "global_eval", "model_version": version, "metrics": metrics})

    async def _apply(self, cmds) -> None:
        for cmd in cmds:
            if isinstance(cmd, Train):
                self.agent.spawn(self._train(cmd))
            elif isinstance(cmd, SendUpdate):
                if self.coordinator is None:
                    log.warning("no coordinator known; update for round %d dropped", cmd.update.round)
                    continue
                topic = topics.direct(self.fed, self.cfg.id, self.coordinator, "update")
                train = None
                if self._base is not None and self._base[0] == cmd.update.round:
                    _, base, train = self._base
                try:
                    if train is not None and train.stream:
                        comp = CompressionConfig(train.compression, train.topk_ratio)
                        if comp != self.compressor.config:
                            self.compressor = Compressor(comp)
                        n = await self.messenger.send_update(topic, cmd.update, base=base, compressor=self.compressor)
                    else:
                        # The round asked for a whole update (a robust aggregator or
                        # clip_norm reads it at once), or its settings are not known here:
                        # a whole update is what every coordinator accepts.
                        n = await self.messenger.send(topic, cmd.update, round_=cmd.update.round)
                except TransportError as exc:
                    if exc.exit_code == EXIT_CONFIG:
                        raise
                    # Cut off from the broker for longer than the publish timeout (a
                    # partition): by the time we are back the round is over and the update
                    # stale, so it is dropped here instead of ending the daemon.
                    log.warning(
                        "round %d: update not delivered (%s); the round goes on without it", cmd.update.round, exc
                    )
                    self.round_state = "update not delivered"
                    continue
                self.round_state = "update sent"
                self.agent.metrics.round_completed(None, cmd.update.metrics)
                self.history.append(
                    {
                        "event": "update",
                        "round": cmd.update.round,
                        "base_version": cmd.update.base_version,
                        "metrics": cmd.update.metrics,
                        "num_samples": cmd.update.num_samples,
                        "bytes": n,
                        "bytes_in": self.messenger.bytes_in,
                        "bytes_out": self.messenger.bytes_out,
                    }
                )
                log.info(
                    "round %d: update sent (%d bytes, %s)",
                    cmd.update.round,
                    n,
                    ", ".join(f"{k}={v:.4f}" for k, v in cmd.update.metrics.items()),
                )
            elif isinstance(cmd, Discarded):
                log.info("discarded training of round %d: %s", cmd.round, cmd.reason)
            elif isinstance(cmd, Leave):
                self.round_state = "left"
                self.history.append(
                    {"event": "left", "reason": cmd.reason, "rounds_trained": self.participant.rounds_done}
                )
                log.info("leaving federation %s: %s", self.fed, cmd.reason)
                self.agent.request_exit(cmd.reason)
            elif isinstance(cmd, AdoptModel):
                meta = {"model_version": cmd.model_version, "round": cmd.round, "final": cmd.final}
                await asyncio.to_thread(checkpoint.save, self.model_path, cmd.weights, meta)
                if cmd.final:
                    self.round_state = "finished"
                    sdnotify.status(f"{self.fed}: training finished (model version {cmd.model_version})")

    async def _train(self, cmd: Train) -> None:
        self._base = (cmd.round, cmd.weights, cmd.train)
        sdnotify.status(f"{self.fed}: training round {cmd.round}")
        started = time.monotonic()
        try:
            weights, metrics = await asyncio.to_thread(self.agent.train, cmd)
            self.agent.metrics.training_seconds(time.monotonic() - started)
        except Exception:
            log.exception("training for round %d failed", cmd.round)
            self.round_state = "training failed"
            return
        await self.queue.put(TrainingDone(cmd.round, cmd.base_version, self.agent.task.num_samples(), metrics, weights))

    def status(self) -> dict[str, Any]:
        p = self.participant
        return {
            "federation": self.fed,
            "broker": self.broker,
            "connection": self.transport.state,
            "reconnects": self.transport.reconnects,
            "last_error": self.transport.last_error,
            "coordinator": self.coordinator,
            "round": self.current_round,
            "round_state": self.round_state,
            "rounds_trained": p.rounds_done,
            "model_version": p.model_version,
            "last_metrics": p.last_metrics,
            "global_model_eval": self.last_eval,
            "peers": dict(sorted(self.peers.items())),
            "rejected": dict(self.messenger.rejected),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "vocabulary_size": self.vocabulary_size,
            "vocab_digest": self.vocab_digest or None,
            "vocab_offers_sent": self.offers_sent,
            **self.search.status(),
        }

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.transport.close(
                    (topics.presence(self.fed, self.cfg.id), presence_payload(self.cfg, self.fed, False))
                ),
                5,
            )


class Agent:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.task: Task = load_task(cfg.task, cfg.task_options)
        self.model = self.task.build_model()
        self.session: Session | None = None
        self._session_task: asyncio.Task | None = None
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

    # Training and evaluation run in worker threads, one at a time on the one model.
    def train(self, cmd: Train):
        with self._thread_lock:
            set_weights(self.model, cmd.weights)
            metrics = self.task.fit(
                self.model, epochs=cmd.train.epochs, lr=cmd.train.lr, batch_size=cmd.train.batch_size, seed=cmd.round
            )
            return get_weights(self.model), metrics

    def adopt_vocabulary(self, terms: list[str]) -> None:
        """Re-index the local data on the common vocabulary and rebuild the model on it
        (worker thread)."""
        with self._thread_lock:
            self.task.set_vocabulary(terms)
            self.model = self.task.build_model()
            self.search_index = None

    def train_steps(self, weights, steps: int, seed: int, lr: float, lr_end: float | None = None):
        """Gossip mode: ``steps`` local mini-batches from ``weights`` (a copy is trained);
        a task whose ``fit_steps`` takes ``lr_end`` moves the step size linearly to it."""
        extra = {}
        if lr_end is not None and "lr_end" in inspect.signature(self.task.fit_steps).parameters:
            extra["lr_end"] = lr_end
        with self._thread_lock:
            set_weights(self.model, weights)
            metrics = self.task.fit_steps(
                self.model, steps=steps, lr=lr, batch_size=self.cfg.gossip.batch_size, seed=seed, **extra
            )
            return get_weights(self.model), metrics

    @property
    def discovery(self) -> Discovery | None:
        return self._disc

    def _on_advert(self, kind: str, advert: Advert) -> None:
        session = self.session
        if session is not None and hasattr(session, "on_advert"):
            session.on_advert(kind, advert)

    def evaluate(self, weights) -> dict[str, float]:
        with self._thread_lock:
            model = self.task.build_model()
            set_weights(model, weights)
            return self.task.evaluate(model)

    def spawn(self, coro) -> None:
        assert self._tg is not None
        self._tg.create_task(coro)

    async def _find_broker(self, federation: str) -> str:
        assert self._disc is not None
        while True:
            try:
                # A gossip federation has no coordinator: any member's broker will do.
                roles = ("coordinator", "broker", "agent") if self.cfg.mode == "gossip" else ("coordinator", "broker")
                advert = await self._disc.find(federation, roles, DISCOVERY_TIMEOUT)
                return advert.broker_uri
            except FedagentError as exc:
                log.warning("%s; still looking", exc)
                sdnotify.status(f"looking for federation {federation} on mDNS")

    async def _run_session(self, federation: str, broker: str) -> None:
        if not broker:
            broker = await self._find_broker(federation)
            log.info("found federation %s on mDNS: broker %s", federation, broker)
        session: Session | GossipSession | SyncOptSession
        if self.cfg.mode == "gossip":
            session = GossipSession(self, federation, broker)
        elif self.cfg.mode == "syncopt":
            session = SyncOptSession(self, federation, broker)
        else:
            session = Session(self, federation, broker)
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
    async def _status(self, _args: dict) -> dict:
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
        if self._disc is not None:
            out["mdns_peers"] = {
                k: {"role": a.role, "broker": a.broker_uri, "last_seen": self._disc.last_seen.get(k)}
                for k, a in sorted(self._disc.peers.items())
            }
        return out

    def _refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_federation(self.cfg.federation)
        session = self.session
        m.set_connected(session is not None and session.transport.connected)
        if session is not None:
            m.set_reconnects(session.transport.reconnects)
            m.set_peers(sum(1 for p in session.peers.values() if p.get("online")))
            m.round_started(session.current_round)
            if isinstance(session, Session):
                m.set_model_version(session.participant.model_version)

    def _peer_table(self) -> dict[str, dict[str, Any]]:
        """Peers from both sources: retained presence over MQTT and mDNS adverts."""
        table: dict[str, dict[str, Any]] = {}
        if self._disc is not None:
            for pid, a in self._disc.peers.items():
                if pid != self.cfg.id and (not self.cfg.federation or a.federation == self.cfg.federation):
                    table[pid] = {
                        "role": a.role,
                        "broker": a.broker_uri,
                        "mdns": True,
                        "online": None,
                        "last_seen": self._disc.last_seen.get(pid),
                    }
        if self.session is not None:
            for pid, info in self.session.peers.items():
                row = table.setdefault(pid, {"role": info["role"], "broker": None, "mdns": False})
                row.update(
                    online=info["online"],
                    last_seen=max(info["last_seen"], row.get("last_seen") or 0),
                    model_version=info.get("model_version"),
                )
        return dict(sorted(table.items()))

    async def _peers(self, _args: dict) -> dict:
        return {"id": self.cfg.id, "federation": self.cfg.federation or None, "peers": self._peer_table()}

    async def _search(self, args: dict) -> dict:
        session = self.session
        if not isinstance(session, Session):
            raise ConfigError(
                f"agent {self.cfg.id} is in no FedAvg federation: search needs a joint model "
                "(mode fedavg) and a running session"
            )
        return await session.search.search(args)

    async def _leave(self, _args: dict) -> dict:
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

    async def _join(self, args: dict) -> dict:
        federation = topics.check_name(str(args.get("federation", "")), "federation")
        broker = str(args.get("broker", ""))
        if broker and not broker.startswith("mqtts://"):
            raise ConfigError(f"broker must look like mqtts://HOST:PORT, not {broker!r}")
        self.cfg = self.cfg.with_membership(federation, broker)
        self._start_session(federation, broker)
        return {"federation": federation, "broker": broker or "(mDNS)"}

    async def run(self) -> None:
        import threading

        self._thread_lock = threading.Lock()
        self._exit = asyncio.Event()
        control = ControlServer(
            self.cfg.control_socket,
            {
                "status": self._status,
                "join": self._join,
                "leave": self._leave,
                "peers": self._peers,
                "search": self._search,
            },
        )
        await control.start()
        if self.cfg.metrics_port >= 0:
            host, port = await self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_url = f"http://{host}:{port}/metrics"
        try:
            async with Discovery(self.cfg.interfaces, on_change=self._on_advert) as disc, asyncio.TaskGroup() as tg:
                self._disc, self._tg = disc, tg
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
            await control.close()
            await self.metrics.close()


def load_agent_config(path) -> NodeConfig:
    return config_mod.load(path, "agent")
