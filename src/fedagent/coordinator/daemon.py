"""``fedagent coordinator``: drives the FedAvg round machine over MQTT.

One event queue feeds the pure :class:`RoundMachine`; network messages, presence
changes and timer wake-ups all become events on it, so the machine sees them one at
a time in arrival order. Its commands are carried out here: broadcast a round,
checkpoint and announce an aggregate, schedule a wake-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from fedagent import checkpoint
from fedagent.config import NodeConfig
from fedagent.coordinator.vocabstage import VocabStage, has_vocabulary, vocab_config
from fedagent.errors import CodecError, ConfigError, FedagentError
from fedagent.metrics import NodeMetrics
from fedagent.node import sdnotify
from fedagent.node.control import ControlServer
from fedagent.node.discovery import Advert, Discovery
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.runtime import History, Timer, make_transport, node_identity, presence_payload, release_large_frees
from fedagent.pki import fingerprint
from fedagent.protocols import rounds as R
from fedagent.protocols import topics
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.messages import GlobalModel, Presence, RoundResult, RoundStart, TrainConfig, Update, VocabOffer
from fedagent.protocols.streaming import UpdatePart
from fedagent.statefile import atomic_write, cleanup_temp_files, read_bytes
from fedagent.tasks.base import get_weights, load_task

log = logging.getLogger("fedagent.coordinator")

# Bytes of streamed update values allowed to wait in the coordinator before it stops
# acknowledging chunks (the broker then holds the rest): a few chunks, not N models.
STREAM_BUDGET = 16 * 2**20


@dataclass(frozen=True, slots=True)
class _Net:
    incoming: Incoming


@dataclass(frozen=True, slots=True)
class _VocabWakeup:
    pass


def round_config(cfg: NodeConfig) -> R.RoundConfig:
    r = cfg.rounds
    try:
        strategy = Strategy(
            r.aggregation,
            r.weight_key,
            r.drop_above,
            byzantine=r.byzantine,
            trim=r.trim,
            krum_m=r.krum_m,
            clip_norm=r.clip_norm,
        )
        if cfg.stream_updates and not strategy.streams:
            raise ValueError(
                f"[transfer] stream_updates = true, but aggregation {strategy.name!r}"
                f"{' with clip_norm' if strategy.clip_norm is not None else ''} needs whole "
                "updates (the median, trimmed mean and Krum read every update at once; clipping "
                "needs an update's norm before any of it is added): remove stream_updates"
            )
        stream = strategy.streams if cfg.stream_updates is None else cfg.stream_updates
        return R.RoundConfig(
            rounds=r.rounds,
            min_agents=r.min_agents,
            expected_agents=r.expected_agents,
            start_grace=r.start_grace,
            agents_per_round=r.agents_per_round,
            min_updates=r.min_updates,
            round_timeout=r.round_timeout,
            max_norm=r.max_norm,
            seed=r.seed,
            lr_schedule=r.lr_schedule,
            strategy=strategy,
            train=TrainConfig(
                epochs=r.local_epochs,
                lr=r.lr,
                batch_size=r.batch_size,
                compression=cfg.compression,
                topk_ratio=cfg.topk_ratio,
                stream=stream,
            ),
        )
    except (ValueError, TypeError, CodecError) as exc:
        raise ConfigError(f"{cfg.path}: [rounds]/[transfer]: {exc}") from None


class Coordinator:
    def __init__(self, cfg: NodeConfig) -> None:
        if cfg.mode != "fedavg":
            raise ConfigError(f"{cfg.path}: mode {cfg.mode!r} is not available yet; use 'fedavg'")
        self.cfg = cfg
        self.fed = cfg.federation
        release_large_frees()  # before the model is built: see its docstring for the measurement
        self.dir = cfg.state_dir / "coordinator" / self.fed
        self.dir.mkdir(parents=True, exist_ok=True)
        cleanup_temp_files(self.dir)
        self.ckpt_path = self.dir / "global.ckpt"
        self.history = History(self.dir / "history.jsonl")
        torch.set_num_threads(cfg.torch_threads)
        self.task = load_task(cfg.task, cfg.task_options)
        self.round_path = self.dir / "last_round_started"
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)
        self.timer = Timer(self.queue, R.Wakeup())
        self.transport = make_transport(
            cfg,
            self.fed,
            cfg.broker,
            subscriptions=[topics.all_presence(self.fed), topics.inbox(self.fed, cfg.id)],
            on_connect=self._on_connect,
            # Backpressure: chunks arriving faster than they are folded wait at the broker,
            # not here (an unbounded inbox held ~17 models at 50 agents × 4.4 MB).
            receive_maximum=max(4, min(256, STREAM_BUDGET // max(cfg.max_chunk_bytes, 1))),
        )
        self._stream_bytes = 0  # values of streamed parts queued, not yet folded
        self._stream_room = asyncio.Event()
        self._stream_room.set()
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
        self.messenger.on_stream = self._on_stream
        self.peers: dict[str, dict[str, Any]] = {}
        self.rejections: list[dict[str, Any]] = []
        self.round_started_at: float | None = None
        self.last_round_seconds: float | None = None
        self.done = asyncio.Event()
        # SEEC Algorithm 1: a task with a vocabulary first agrees on it with the agents;
        # the round machine (and the initial model m_1) exists only after that.
        self.vocab: VocabStage | None = None
        self.machine: R.RoundMachine | None = None
        if has_vocabulary(self.task):
            self.vocab = VocabStage(
                self.dir / "vocabulary.json",
                vocab_config(cfg.rounds, str(cfg.path)),
                self.messenger,
                self.fed,
                Timer(self.queue, _VocabWakeup()),
                self.history,
                self._vocab_rejected,
            )
        if self.vocab is None or self.vocab.agreed:
            self._build_machine()
        self.settled = self._snapshot()

    def _build_machine(self) -> None:
        cfg = self.cfg
        if self.vocab is not None:
            assert self.vocab.vocabulary is not None
            self.task.set_vocabulary(list(self.vocab.vocabulary.terms))
            torch.manual_seed(cfg.rounds.seed)
        weights = get_weights(self.task.build_model())
        resumed = checkpoint.load(self.ckpt_path)
        meta: dict[str, Any] = {}
        if resumed is not None:
            weights, meta = resumed
            digest = self.vocab.vocabulary.digest if self.vocab and self.vocab.vocabulary else ""
            if meta.get("vocab_digest", "") != digest:
                raise FedagentError(f"{self.ckpt_path} was trained on another vocabulary; move it away")
            log.info(
                "resuming from %s: model version %s after round %s",
                self.ckpt_path,
                meta.get("model_version"),
                meta.get("round"),
            )
            self._reconcile_history(meta)
        # A restart never reuses the number of a round it had started: agents ignore a
        # round start they have seen, and the updates of that round may already have been
        # acknowledged by this process before it died. The unfinished round is abandoned
        # (its late updates are stale) and a new one starts from the checkpointed model.
        started = read_bytes(self.round_path, 64)
        last_started = int(started) if started and started.strip().isdigit() else 0
        self.machine = R.RoundMachine(
            round_config(cfg),
            weights,
            model_version=int(meta.get("model_version", 0)),
            completed_rounds=int(meta.get("completed_rounds", 0)),
            last_round=max(int(meta.get("round", 0)), last_started),
        )

    def _snapshot(self) -> dict[str, Any]:
        """What `status` shows: the machine's view once the commands of the last event have
        been carried out (checkpoint saved, history appended), never a state the disk has
        not caught up to. Before the vocabulary is agreed there is no round machine yet."""
        vs = self.vocab.status() if self.vocab is not None else {}
        if self.machine is None:
            return {
                "phase": "vocabulary",
                "round": 0,
                "completed_rounds": 0,
                "rounds": self.cfg.rounds.rounds,
                "model_version": 0,
                "selected": [],
                "received": [],
                "metrics": {},
                **vs,
            }
        return {**self.machine.status(), **vs}

    def _vocab_rejected(self, sender: str, reason: str, detail: str) -> None:
        log.warning("rejected vocabulary offer from %s: %s (%s)", sender, reason, detail)
        self.metrics.rejected(reason)
        self.rejections = (self.rejections + [{"sender": sender, "round": 0, "reason": reason, "detail": detail}])[-20:]

    def _reconcile_history(self, meta: dict[str, Any]) -> None:
        """The checkpoint is written before the history line of its round; a crash or a
        full disk between the two leaves a model version the history lacks. Restore the
        line from the checkpoint's own record so the history stays one line per version."""
        last = 0
        try:
            with self.history.path.open("rb") as f:
                f.seek(max(0, f.seek(0, 2) - 65536))
                for line in f.read().splitlines():
                    if b'"event": "round"' in line:
                        try:
                            last = max(last, int(json.loads(line).get("model_version", 0)))
                        except (ValueError, AttributeError):
                            continue
        except FileNotFoundError:
            pass
        version = int(meta.get("model_version", 0))
        if version == last + 1:
            log.warning(
                "history lacks model version %d (the process stopped between checkpoint and "
                "history); restored from the checkpoint",
                version,
            )
            self.history.append(
                {
                    "event": "round",
                    "round": meta.get("round"),
                    "model_version": version,
                    "participants": meta.get("participants", []),
                    "metrics": meta.get("metrics", {}),
                    "recovered": True,
                }
            )

    # -- network -----------------------------------------------------------------------
    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                model_version=self.machine.model_version if self.machine else 0,
                broker=self.cfg.broker,
            ),
            retain=True,
        )
        if self.vocab is not None and self.vocab.agreed:
            await self.vocab.publish()

    async def _on_payload(self, topic: str, payload: bytes) -> None:
        await self.messenger.receive(topic, payload, self._deliver)

    async def _deliver(self, inc: Incoming) -> None:
        await self.queue.put(_Net(inc))

    async def _on_stream(self, events: list) -> None:
        # Parts go through the same queue as everything else, so the machine sees an
        # update's parts in order with presence changes and timer wake-ups; each part is
        # a chunk-sized view, folded and dropped when its turn comes.
        for ev in events:
            if isinstance(ev, UpdatePart):
                self._stream_bytes += ev.values.nbytes
            await self.queue.put(ev)
        # The chunk is acknowledged when this returns: holding it while too many parts
        # wait keeps the backlog at the broker (Receive Maximum), bounding this process.
        while self._stream_bytes > STREAM_BUDGET:
            self._stream_room.clear()
            await self._stream_room.wait()

    async def _expire_streams(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            events = self.messenger.intake.expire(time.monotonic())
            for ev in events:
                self.messenger._reject("stream", ev.sender, ev.reason)
            await self._on_stream(events)

    def _to_event(self, inc: Incoming) -> R.Event | None:
        msg = inc.message
        if isinstance(msg, Presence):
            if msg.role != "agent" or inc.sender == self.cfg.id:
                return None
            self.peers[inc.sender] = {
                "online": msg.online,
                "role": msg.role,
                "samples": msg.num_samples,
                "last_seen": time.time(),
            }
            return R.AgentOnline(inc.sender, msg.num_samples) if msg.online else R.AgentOffline(inc.sender)
        if isinstance(msg, Update):
            if inc.role != "agent":
                # As for streams (messaging): only an agent's certificate may submit an update.
                self.messenger._reject("role", inc.sender, f"update signed by a {inc.role or 'non-agent'}")
                return None
            return R.UpdateReceived(
                inc.sender, msg.round, msg.base_version, msg.num_samples, msg.weights, msg.metrics, msg.leaving
            )
        log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)
        return None

    async def _vocab_event(self, item: Any, now: float) -> bool:
        """Feed the vocabulary stage; True when ``item`` was its business. Once agreed, the
        round machine is built and told which agents are online."""
        assert self.vocab is not None
        if isinstance(item, _VocabWakeup):
            agreed = await self.vocab.wakeup(now)
        elif isinstance(item, _Net) and isinstance(item.incoming.message, VocabOffer):
            inc = item.incoming
            if inc.role != "agent":
                self._vocab_rejected(inc.sender, "role", f"a vocabulary offer signed by a {inc.role or 'non-agent'}")
                return True
            agreed = await self.vocab.offer(inc.sender, inc.message.terms, inc.message.counts, now)
        else:
            return False
        if agreed is not None and self.machine is None:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._build_machine)
            log.info("model built on the vocabulary (%d terms) in %.2fs", len(agreed.terms), time.perf_counter() - t0)
            assert self.machine is not None
            for aid, info in sorted(self.peers.items()):
                if info.get("online"):
                    for cmd in self.machine.handle(R.AgentOnline(aid, info.get("samples", 0)), time.monotonic()):
                        await self._execute(cmd)
        return True

    # -- commands ----------------------------------------------------------------------
    async def _execute(self, cmd: R.Command) -> None:
        if isinstance(cmd, R.StartRound):
            self.round_started_at = time.monotonic()
            await asyncio.to_thread(atomic_write, self.round_path, str(cmd.round).encode())
            self.metrics.round_started(cmd.round)
            log.info("round %d: model version %d to %s", cmd.round, cmd.model_version, ", ".join(cmd.selected))
            sdnotify.status(f"round {cmd.round}: training on {len(cmd.selected)} agents")
            await self.messenger.send(
                topics.broadcast(self.fed, "round_start"),
                RoundStart(cmd.round, cmd.model_version, cmd.selected, cmd.deadline_s, cmd.train, cmd.weights),
                round_=cmd.round,
            )
        elif isinstance(cmd, R.RoundAggregated):
            took = time.monotonic() - (self.round_started_at or time.monotonic())
            self.last_round_seconds = took
            self.metrics.round_completed(took, cmd.metrics)
            self.metrics.set_model_version(cmd.model_version)
            meta = {
                "model_version": cmd.model_version,
                "round": cmd.round,
                "completed_rounds": self.machine.completed,
                "federation": self.fed,
                "participants": list(cmd.participants),
                "metrics": cmd.metrics,
                "final": cmd.final,
                "vocab_digest": self.vocab.vocabulary.digest if self.vocab and self.vocab.vocabulary else "",
            }
            await asyncio.to_thread(checkpoint.save, self.ckpt_path, cmd.weights, meta)
            self.history.append(
                {
                    "event": "round",
                    "round": cmd.round,
                    "model_version": cmd.model_version,
                    "participants": list(cmd.participants),
                    "metrics": cmd.metrics,
                    "aggregation": self.machine.config.strategy.name,
                    "agg_weights": cmd.weights_used,
                    "dropped": cmd.dropped,
                    "seconds": round(took, 4),
                    "bytes_in": self.messenger.bytes_in,
                    "bytes_out": self.messenger.bytes_out,
                }
            )
            log.info(
                "round %d aggregated from %d agents in %.2fs: %s",
                cmd.round,
                len(cmd.participants),
                took,
                ", ".join(f"{k}={v:.4f}" for k, v in cmd.metrics.items()),
            )
            await self.messenger.send(
                topics.broadcast(self.fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version, cmd.participants, cmd.metrics),
                round_=cmd.round,
            )
        elif isinstance(cmd, R.RoundAbandoned):
            log.warning("round %d abandoned: %s", cmd.round, cmd.reason)
            self.history.append({"event": "abandoned", "round": cmd.round, "reason": cmd.reason})
            await self.messenger.send(
                topics.broadcast(self.fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version, (), {}, aggregated=False, reason=cmd.reason),
                round_=cmd.round,
            )
        elif isinstance(cmd, R.Rejected):
            log.warning("rejected update from %s for round %d: %s (%s)", cmd.sender, cmd.round, cmd.reason, cmd.detail)
            self.metrics.rejected(cmd.reason)
            self.rejections = (
                self.rejections
                + [{"sender": cmd.sender, "round": cmd.round, "reason": cmd.reason, "detail": cmd.detail}]
            )[-20:]
        elif isinstance(cmd, R.RequestWakeup):
            self.timer.request(cmd.at)
        elif isinstance(cmd, R.Finished):
            log.info("training finished: model version %d", cmd.model_version)
            sdnotify.status(f"finished: model version {cmd.model_version}")
            await self.messenger.send(
                topics.broadcast(self.fed, "model"),
                GlobalModel(cmd.model_version, self.machine.round, True, cmd.weights),
                round_=self.machine.round,
            )
            self.done.set()

    async def _process(self) -> None:
        if self.vocab is not None:
            self.vocab.start(time.monotonic())
        while True:
            item = await self.queue.get()
            if self.vocab is not None and await self._vocab_event(item, time.monotonic()):
                self.settled = self._snapshot()
                continue
            if isinstance(item, _Net):
                event = self._to_event(item.incoming)
                if event is None:
                    continue
            else:
                event = item
            if isinstance(event, UpdatePart):
                self._stream_bytes -= event.values.nbytes
                if self._stream_bytes <= STREAM_BUDGET:
                    self._stream_room.set()
            if self.machine is None:
                # Presence before the vocabulary is agreed: kept in self.peers (by
                # _to_event) and replayed to the round machine once it exists.
                del item, event
                continue
            cmds = self.machine.handle(event, time.monotonic())
            del item, event
            for cmd in cmds:
                await self._execute(cmd)
            del cmds
            # status() sorts the agent lists: O(N) per event would make a round of N
            # updates O(N²). Refreshed when the burst is over, it is still never ahead of the disk.
            if self.queue.empty():
                self.settled = self._snapshot()

    # -- control -----------------------------------------------------------------------
    async def _status(self, _args: dict) -> dict:
        m = self.settled
        return {
            "role": "coordinator",
            "id": self.cfg.id,
            "federation": self.fed,
            "mode": self.cfg.mode,
            "broker": self.cfg.broker,
            "connection": self.transport.state,
            "reconnects": self.transport.reconnects,
            "last_error": self.transport.last_error,
            "phase": m["phase"],
            "round": m["round"],
            "completed_rounds": m["completed_rounds"],
            "rounds": m["rounds"],
            "model_version": m["model_version"],
            "selected": m["selected"],
            "received": m["received"],
            "metrics": m["metrics"],
            "peers": {k: v for k, v in sorted(self.peers.items())},
            "vocabulary_size": m.get("vocabulary_size"),
            "vocab_digest": m.get("vocab_digest"),
            "vocabulary_offers": m.get("vocabulary_offers", []),
            "last_round_seconds": self.last_round_seconds,
            "rejected": dict(self.messenger.rejected),
            "recent_rejections": self.rejections,
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "checkpoint": str(self.ckpt_path),
            "metrics_url": self.metrics_url,
        }

    def _refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_connected(self.transport.connected)
        m.set_reconnects(self.transport.reconnects)
        m.set_peers(sum(1 for p in self.peers.values() if p.get("online")))
        if self.machine is not None:
            m.set_model_version(self.machine.model_version)
            m.round_started(self.machine.round)

    async def _peers(self, _args: dict) -> dict:
        return {
            "id": self.cfg.id,
            "federation": self.fed,
            "peers": {k: {**v, "broker": self.cfg.broker, "mdns": False} for k, v in sorted(self.peers.items())},
        }

    # -- main --------------------------------------------------------------------------
    async def run(self) -> None:
        ready = asyncio.Event()
        control = ControlServer(self.cfg.control_socket, {"status": self._status, "peers": self._peers})
        await control.start()
        if self.cfg.metrics_port >= 0:
            host, port = await self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
            self.metrics_url = f"http://{host}:{port}/metrics"
        try:
            async with asyncio.TaskGroup() as tg, Discovery(self.cfg.interfaces) as disc:
                tg.create_task(self.transport.run(self._on_payload, ready))
                tg.create_task(sdnotify.watchdog_loop())
                await ready.wait()
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
                sdnotify.ready(f"coordinator of {self.fed}: waiting for agents")
                log.info("coordinator %s of federation %s on %s", self.cfg.id, self.fed, self.cfg.broker)
                tg.create_task(self._process())
                tg.create_task(self._expire_streams())
                if self.machine is not None and self.machine.phase is R.Phase.DONE:
                    log.info("checkpoint says training already finished; serving status only")
                await asyncio.Event().wait()
        finally:
            sdnotify.stopping()
            self.timer.cancel()
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
