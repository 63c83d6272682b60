"""The agent's session in a ``mode = "gossip"`` federation: no coordinator at all.

The pure :class:`~fedagent.protocols.gossip.GossipMachine` decides everything (when to
train, which peer gets the model, what to merge); this module only connects it to the
world:

* **Peer view.** Every agent of the federation that mDNS shows or that has a retained
  presence on our broker. A peer whose presence says offline (a clean stop or its Last
  Will) is gone at once; a peer known only through mDNS (one on another broker) is
  gone when its advert is withdrawn. A peer that dies silently is found by the
  machine's send timeout: the send goes to another peer and nothing waits.
* **Links.** Each agent subscribes to its inbox on its *home* broker (the one it is
  configured with or found by mDNS, and the one it advertises). A model for a peer is
  published to that peer's inbox on the peer's broker, keeping one extra connection per
  distinct broker; with a shared broker there is only the home connection.
* **Training** runs in the agent's worker thread, ``period_steps`` mini-batches at a
  time (``Task.fit_steps``). The event loop keeps receiving while it trains.
* **Vocabulary** (``[gossip] vocab_agents`` > 0, tasks with ``term_counts`` and
  ``set_vocabulary``): before the gossip machine exists, the
  :class:`~fedagent.protocols.gossip_vocab.VocabConsensus` runs: offers go to each
  peer as it comes up (signed ``VocabOffer``, terms and counts only), digests are
  exchanged, and only a confirmed vocabulary is installed in the task, which then
  builds the model on it. The agreed vocabulary is kept in the state directory, so a
  restart resumes without a new consensus; a failure (missing peers by the deadline,
  a digest mismatch) leaves the session in state ``vocabulary failed`` with the reason
  in ``fedagent status``, and nothing is trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import inspect
import logging
import secrets
import time
from typing import Any, ClassVar

import numpy as np

from fedagent.agent.core import Agent, Session
from fedagent.agent.vocabulary import VocabularyTask, needs_vocabulary, vocabulary_task
from fedagent.config import consensus_config
from fedagent.errors import ConfigError
from fedagent.node import sdnotify
from fedagent.node.discovery import Advert
from fedagent.node.messaging import Incoming
from fedagent.node.runtime import Timer, presence_payload, tls_files
from fedagent.node.transport import Subscription, Transport
from fedagent.protocols import dp, topics
from fedagent.protocols import gossip as g
from fedagent.protocols import gossip_vocab as gv
from fedagent.protocols.fingerprint import first_difference
from fedagent.protocols.messages import GossipAck, GossipModel, ModelCheck, Presence, VocabDigest, VocabOffer
from fedagent.storage import checkpoint, vocabfile
from fedagent.tasks.base import Weights, get_weights, set_weights

log = logging.getLogger("fedagent.gossip")

LINK_CONNECT_TIMEOUT = 10.0


class _VocabWakeup:
    """The consensus's own wake-up (the gossip machine's Wakeup is another event)."""


def resolve_exchange(patterns: tuple[str, ...] | None, names: list[str]) -> tuple[str, ...] | None:
    """Parameter names matching ``patterns`` (exact names or globs), in model order."""
    if patterns is None:
        return None
    chosen = tuple(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched or not chosen:
        raise ConfigError(
            f"gossip.exchange {list(unmatched or patterns)} matches no parameter of the model "
            f"(its parameters: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''})"
        )
    return chosen


class _Peer:
    __slots__ = ("broker", "last_seen", "mdns", "num_samples", "presence", "refused")

    def __init__(self) -> None:
        self.broker = ""
        self.mdns = False
        self.presence: bool | None = None  # None: no presence seen on our broker
        self.last_seen = 0.0
        self.num_samples = 0
        self.refused = ""  # why this agent exchanges nothing with it (its model differs)

    @property
    def up(self) -> bool:
        # Presence is authoritative when our broker carries it (its Last Will fires when
        # the peer dies); peers on other brokers are known through mDNS only. A peer
        # whose model differs is never up: no model goes to it, none of its is merged.
        if self.refused:
            return False
        return self.presence if self.presence is not None else self.mdns


class GossipSession(Session):
    """Membership of one gossip federation."""

    # A gossip federation has no coordinator: any member's broker will do.
    DISCOVERY_ROLES: ClassVar[tuple[str, ...]] = ("coordinator", "broker", "agent")
    MODEL_FILE: ClassVar[str] = "model.ckpt"
    QUEUE_SIZE: ClassVar[int] = 10_000

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        super().__init__(agent, federation, broker)
        self.settings = self.cfg.gossip
        self.vocab_path = self.dir / "vocabulary.json"
        self.consensus: gv.VocabConsensus | None = None
        self.machine: g.GossipMachine | None = None
        self._peers: dict[str, _Peer] = {}
        self.state = "starting"
        if self.settings.vocab_agents:
            self._init_consensus()
        if self.consensus is None or self.consensus.phase is gv.Phase.AGREED:
            self._make_machine()
        self.last_metrics: dict[str, float] = {}
        self.last_eval: dict[str, Any] = {}
        self.timer = Timer(self.queue, g.Wakeup())
        self.vocab_timer = Timer(self.queue, _VocabWakeup())
        self.links: dict[str, tuple[Transport, asyncio.Event]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self.dp_stopped = ""  # why this agent no longer sends models (its privacy budget)
        self._trained: tuple[Weights, int] | None = None  # the latest trained model and its period
        self._saved = -1  # the period of the model last saved by this process

    def subscriptions(self) -> list[Subscription]:
        return [topics.inbox(self.fed, self.cfg.id), topics.all_presence(self.fed)]

    def _running(self) -> g.GossipMachine:
        """The gossip machine, once the vocabulary (if any) is agreed."""
        assert self.machine is not None, "the gossip machine runs only after the vocabulary is agreed"
        return self.machine

    # -- the gossip machine and the vocabulary it is built on ------------------------------
    def _make_machine(self) -> g.GossipMachine:
        agent = self.agent
        weights = get_weights(agent.model)  # the task's seeded initial model
        resumed = checkpoint.load(self.model_path)
        self.local_dp: dp.LocalRelease | None = None
        privacy = self.cfg.privacy
        if privacy is not None:
            if privacy.target_epsilon is not None and not self.settings.periods:
                raise ConfigError("[privacy] target_epsilon needs [gossip] periods (the releases it is spread over)")
            # The seeded initial model is public (every agent builds it alike): the first
            # reference. After a restart ε goes on from the checkpoint's record.
            self.local_dp = dp.LocalRelease(
                privacy.resolve(self.settings.sends()),
                weights,
                np.random.default_rng(),
                (resumed[1].get("privacy") if resumed is not None else None) or [],
            )
        position: g.Resume | None = None
        if (
            resumed is not None
            and resumed[0].keys() == weights.keys()
            and all(resumed[0][k].shape == v.shape for k, v in weights.items())
            and resumed[1].get("vocab_digest", "") == self.vocab_digest
        ):
            weights = resumed[0]
            position = g.Resume.from_meta(resumed[1])
            if position is None:
                log.warning("%s gives no usable period and age: resuming its model from period 0", self.model_path)
            else:
                log.info("resuming from %s (period %d, age %.0f)", self.model_path, position.period, position.age)
        names = resolve_exchange(self.settings.exchange, list(weights))
        fp = agent.fingerprint
        fixed = fp.roles().fixed if fp is not None else frozenset()
        self.machine = g.GossipMachine(
            self.cfg.id,
            self.settings.machine_config(names, fixed),
            weights,
            num_samples=agent.task.num_samples(),
            session=secrets.token_hex(4),
            resume=position,
        )
        return self.machine

    def _init_consensus(self) -> None:
        if not needs_vocabulary(self.agent.task):
            raise ConfigError(
                f"[gossip] vocab_agents is set but task {self.cfg.task!r} has no vocabulary "
                "(term_counts/set_vocabulary)"
            )
        own = vocabulary_task(self.agent.task).term_counts()
        terms = sorted(own)
        counts = [int(own[t]) for t in terms]
        cfg = consensus_config(self.settings)
        saved = self._load_vocabulary()
        if saved is not None:
            self.consensus = gv.VocabConsensus.resumed(self.cfg.id, cfg, terms, counts, saved)
            self._install_vocabulary(saved)
            log.info("resuming with the agreed vocabulary of %d terms from %s", len(saved.terms), self.vocab_path)
        else:
            self.consensus = gv.VocabConsensus(self.cfg.id, cfg, terms, counts)
        self._own_offer = VocabOffer(tuple(terms), tuple(counts))

    def _load_vocabulary(self) -> gv.Agreed | None:
        try:
            saved = vocabfile.load(self.vocab_path)
        except ValueError as exc:
            raise ConfigError(f"{self.vocab_path} is unreadable ({exc}); move it away to agree afresh") from exc
        if saved is None:
            return None
        return gv.Agreed(saved.terms, saved.counts, saved.contributors, saved.digest)

    def _install_vocabulary(self, agreed: gv.Agreed) -> None:
        """Re-index the task's data on the agreed terms and rebuild the model on them."""
        agent = self.agent
        task: VocabularyTask = vocabulary_task(agent.task)
        params = inspect.signature(task.set_vocabulary).parameters
        with agent.thread_lock:
            if "counts" in params:
                task.set_vocabulary(list(agreed.terms), list(agreed.counts))
            else:
                task.set_vocabulary(list(agreed.terms))
            agent.model = agent.task.build_model()
        self.vocab_digest = agreed.digest

    async def _run_consensus(self, cmds: list) -> None:
        for cmd in cmds:
            if isinstance(cmd, gv.SendOffer):
                self.agent.spawn(self._send_direct(cmd.peer, "vocab_offer", self._own_offer))
            elif isinstance(cmd, gv.SendDigest):
                msg = VocabDigest(cmd.digest, cmd.contributors, cmd.agreed)
                self.agent.spawn(self._send_direct(cmd.peer, "vocab_digest", msg))
            elif isinstance(cmd, gv.RequestWakeup):
                self.vocab_timer.request(cmd.at)
            elif isinstance(cmd, gv.OfferRejected):
                self.messenger.reject(f"vocab-{cmd.reason}", cmd.sender, cmd.detail)
            elif isinstance(cmd, gv.Failed):
                self.vocab_timer.cancel()
                self.state = "vocabulary failed"
                log.error("vocabulary consensus failed (%s): %s; not training", cmd.reason, cmd.detail)
                self.history.append(
                    {"event": "vocab_failed", "reason": cmd.reason, "detail": cmd.detail, "missing": list(cmd.missing)}
                )
                sdnotify.status(f"{self.fed}: vocabulary consensus failed: {cmd.reason}")
            elif isinstance(cmd, gv.Agreed):
                self.vocab_timer.cancel()
                await self._vocabulary_agreed(cmd)

    async def _vocabulary_agreed(self, cmd: gv.Agreed) -> None:
        await asyncio.to_thread(vocabfile.save, self.vocab_path, cmd.terms, cmd.counts, cmd.contributors, cmd.digest)
        await asyncio.to_thread(self._install_vocabulary, cmd)
        self.history.append(vocabfile.history_record(cmd.terms, cmd.contributors, cmd.dropped_terms, cmd.digest))
        log.info(
            "vocabulary agreed with %d peers: %d terms (digest %s, %d cut by min_count/max_size)",
            len(cmd.contributors) - 1,
            len(cmd.terms),
            cmd.digest[:12],
            cmd.dropped_terms,
        )
        machine = self._make_machine()
        self.state = "waiting for peers"
        for pid, p in sorted(self._peers.items()):
            if p.up:
                await self._apply(machine.handle(g.PeerUp(pid), time.monotonic()))

    async def _send_direct(self, peer: str, kind: str, msg: VocabOffer | VocabDigest) -> None:
        topic = topics.direct(self.fed, self.cfg.id, peer, kind)
        try:
            link = await self._link(self._peer_broker(peer))
            await asyncio.wait_for(self.messenger.send(topic, msg, transport=link), self.settings.send_timeout)
        except Exception as exc:  # noqa: BLE001 - the peer gets it again when it comes back up
            log.warning("sending %s to %s failed: %s", kind, peer, exc or type(exc).__name__)

    @property
    def current_round(self) -> int:
        return self.machine.period if self.machine is not None else 0

    @property
    def peers(self) -> dict[str, dict[str, Any]]:
        """The peer view in the shape of the other modes' (for ``fedagent peers``, metrics)."""
        return {
            pid: {
                "role": "agent",
                "online": p.up,
                "broker": p.broker or self.broker,
                "last_seen": p.last_seen,
                "samples": p.num_samples,
            }
            for pid, p in self._peers.items()
        }

    # -- connections ---------------------------------------------------------------------
    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                num_samples=self.agent.task.num_samples(),
                broker=self.broker,
                model=self.model_digest,
            ),
            retain=True,
        )

    async def _link(self, broker: str) -> Transport:
        """The connection to ``broker``: the home one, or one opened on first use."""
        if not broker or broker == self.broker:
            return self.transport
        if broker not in self.links:
            assert self._tg is not None
            t = Transport(uri=broker, client_id=self.cfg.id, tls=tls_files(self.cfg))
            ready = asyncio.Event()
            self.links[broker] = (t, ready)
            self._tg.create_task(self._run_link(broker, t, ready))
            log.info("opening a link to %s (a peer's broker)", broker)
        t, ready = self.links[broker]
        await asyncio.wait_for(ready.wait(), LINK_CONNECT_TIMEOUT)
        return t

    async def _run_link(self, broker: str, t: Transport, ready: asyncio.Event) -> None:
        async def ignore(_topic: str, _payload: bytes | bytearray) -> None:
            return None

        try:
            await t.run(ignore, ready)
        except Exception as exc:  # noqa: BLE001 - one bad peer broker must not end the session
            log.warning("link to %s failed: %s", broker, exc)
            self.links.pop(broker, None)

    # -- peer view -----------------------------------------------------------------------
    def on_advert(self, kind: str, advert: Advert) -> None:
        """mDNS news (called by the agent's Discovery, on the event loop)."""
        if advert.federation != self.fed or advert.node_id == self.cfg.id or advert.role != "agent":
            return
        peer = self._peers.setdefault(advert.node_id, _Peer())
        was = peer.up
        peer.mdns = kind != "removed"
        if peer.mdns:
            peer.broker = advert.broker_uri or peer.broker
            peer.last_seen = time.time()
        self._peer_changed(advert.node_id, was, peer.up)

    def _on_presence(self, sender: str, msg: Presence) -> None:
        if sender == self.cfg.id or msg.role != "agent":
            return
        peer = self._peers.setdefault(sender, _Peer())
        was = peer.up
        peer.presence = msg.online
        peer.last_seen = time.time()
        peer.num_samples = msg.num_samples
        if msg.broker:
            peer.broker = msg.broker
        if msg.online and msg.model and self.model_digest and msg.model != self.model_digest:
            if not peer.refused:
                peer.refused = f"its model ({msg.model}) differs from this one ({self.model_digest})"
                log.warning("peer %s refused: %s", sender, peer.refused)
                self.agent.spawn(self._send_model_check(sender, msg.model))
        elif msg.online and msg.model:
            peer.refused = ""
        self._peer_changed(sender, was, peer.up)

    async def _send_model_check(self, peer: str, digest: str) -> None:
        """Our fingerprint to a peer whose model differs, so it can name the tensor too."""
        try:
            link = await self._link(self._peer_broker(peer))
            await asyncio.wait_for(self.send_model_check(peer, digest, transport=link), self.settings.send_timeout)
        except Exception as exc:  # noqa: BLE001 - its own refusal stands without our list
            log.warning("this model's fingerprint for %s was not sent: %s", peer, exc or type(exc).__name__)

    def _peer_model(self, sender: str, msg: ModelCheck) -> None:
        """A peer's fingerprint (its model differs): the first tensor that differs becomes
        the reason it is refused."""
        ours = self.agent.fingerprint
        if ours is None or msg.digest == ours.digest:
            return
        diff = first_difference(ours, msg.fingerprint, here="here", there=f"on {sender}")
        peer = self._peers.setdefault(sender, _Peer())
        was = peer.up
        peer.refused = f"its model differs: {diff}"
        log.warning("peer %s refused: %s", sender, peer.refused)
        self.history.append({"event": "refused", "peer": sender, "reason": peer.refused})
        self._peer_changed(sender, was, peer.up)

    def peers_up(self) -> int:
        return sum(1 for p in self._peers.values() if p.up)

    def _peer_changed(self, peer: str, was: bool, now: bool) -> None:
        if was != now:
            log.info("peer %s %s", peer, "up" if now else "down")
            self.queue.put_nowait(g.PeerUp(peer) if now else g.PeerDown(peer))
            if now and self.consensus is not None:
                # The consensus serves every peer that comes up, even after it agreed.
                self.queue.put_nowait(gv.PeerUp(peer))

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        ready = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.transport.run(self._on_payload, ready))
                await ready.wait()
                log.info(
                    "agent %s joined gossip federation %s via %s (%d samples)",
                    self.cfg.id,
                    self.fed,
                    self.broker,
                    self.agent.task.num_samples(),
                )
                disc = self.agent.discovery
                if disc is not None:
                    for advert in disc.peers.values():
                        self.on_advert("added", advert)
                if self.machine is None:
                    assert self.consensus is not None
                    self.state = "vocabulary"
                    log.info("vocabulary consensus: waiting for %d offers", self.consensus.config.expected_agents)
                    await self._run_consensus(self.consensus.start(time.monotonic()))
                else:
                    self.state = "waiting for peers"
                while True:
                    m = self.machine
                    if m is not None and not m.started and self.peers_up() >= self.settings.min_peers:
                        log.info("%d peers known: starting to train", self.peers_up())
                        self.state = "training"
                        await self._apply(m.handle(g.Start(), time.monotonic()))
                    item = await self.queue.get()
                    if isinstance(item, Incoming):
                        await self._on_message(item)
                    elif isinstance(item, (gv.PeerUp, _VocabWakeup)):
                        if self.consensus is not None:
                            ev = gv.Wakeup() if isinstance(item, _VocabWakeup) else item
                            await self._run_consensus(self.consensus.handle(ev, time.monotonic()))
                    elif self.machine is not None:
                        await self._apply(self.machine.handle(item, time.monotonic()))
        finally:
            self.timer.cancel()
            self.vocab_timer.cancel()

    async def _on_message(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, Presence):
            return self._on_presence(inc.sender, msg)
        # Direct messages must come on our own inbox topic (the messenger already
        # checked that the topic's sender is the envelope's sender).
        _fed, _sender, receiver, kind = topics.parse(inc.topic)
        expected = {
            GossipModel: "gossip",
            GossipAck: "gossip_ack",
            VocabOffer: "vocab_offer",
            VocabDigest: "vocab_digest",
            ModelCheck: "model_check",
        }.get(type(msg))
        if expected is None:
            return self.messenger.reject("mode", inc.sender, f"{msg.kind} in a gossip federation")
        if receiver != self.cfg.id or kind != expected:
            return self.messenger.reject("topic", inc.sender, f"{msg.kind} on {inc.topic}")
        if isinstance(msg, ModelCheck):
            return self._peer_model(inc.sender, msg)
        if isinstance(msg, (VocabOffer, VocabDigest)):
            if self.consensus is None:
                return self.messenger.reject("mode", inc.sender, f"{msg.kind} but no vocabulary consensus here")
            ev = (
                gv.OfferReceived(inc.sender, msg.terms, msg.counts)
                if isinstance(msg, VocabOffer)
                else gv.DigestReceived(inc.sender, msg.digest, msg.contributors, msg.agreed)
            )
            return await self._run_consensus(self.consensus.handle(ev, time.monotonic()))
        if self.machine is None:
            # Still agreeing on the vocabulary: refusing hands the model's mass back to
            # its sender (push-sum), nothing is lost.
            if isinstance(msg, GossipModel):
                self.agent.spawn(self._send_ack(g.SendAck(inc.sender, msg.exchange_id, False, "not-ready")))
            return None
        if isinstance(msg, GossipModel):
            event = g.ModelReceived(
                inc.sender, msg.exchange_id, msg.weights, mass=msg.mass, age=msg.age, returned=msg.returned
            )
            await self._apply(self.machine.handle(event, time.monotonic()))
        elif isinstance(msg, GossipAck):
            await self._apply(
                self.machine.handle(
                    g.AckReceived(inc.sender, msg.exchange_id, msg.accepted, msg.reason), time.monotonic()
                )
            )

    async def _apply(self, cmds: list[g.Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, g.Train):
                self.agent.spawn(self._train(cmd))
            elif isinstance(cmd, g.SendModel):
                self.agent.spawn(self._send_model(cmd))
            elif isinstance(cmd, g.SendAck):
                self.agent.spawn(self._send_ack(cmd))
            elif isinstance(cmd, g.RequestWakeup):
                self.timer.request(cmd.at)
            elif isinstance(cmd, g.ModelChanged):
                await self._model_changed(cmd)
            elif isinstance(cmd, g.Dropped):
                log.info("dropped model %s from %s: %s %s", cmd.exchange_id or "-", cmd.sender, cmd.reason, cmd.detail)
            elif isinstance(cmd, g.Finished):
                await self._finished(cmd)

    async def _train(self, cmd: g.Train) -> None:
        seed = self.settings.seed * 1_000_003 + cmd.train_id
        started = time.monotonic()
        try:
            # The schedule's value at both ends of the period: a task that can (fit_steps
            # with lr_end) decays within the period instead of in steps of one period.
            period = self._running().period
            lr, lr_end = self.settings.lr_at(period), self.settings.lr_at(period + 1)
            weights, metrics = await asyncio.to_thread(self._fit_steps, cmd.weights, cmd.steps, seed, lr, lr_end)
        except Exception:
            log.exception("local training failed; keeping the model it started from")
            weights, metrics = cmd.weights, {}
        self.agent.metrics.training_seconds(time.monotonic() - started)
        if metrics:
            self.last_metrics = metrics
        # Pacing: when training is much faster than the network, a period still lasts
        # period_seconds, so that models have time to travel between exchanges.
        left = started + self.settings.period_seconds - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)
        await self.queue.put(g.TrainingDone(cmd.train_id, weights, cmd.steps))

    def _fit_steps(
        self, weights: Weights, steps: int, seed: int, lr: float, lr_end: float | None = None
    ) -> tuple[Weights, dict[str, float]]:
        """``steps`` local mini-batches from ``weights`` (worker thread); a task whose
        ``fit_steps`` takes ``lr_end`` moves the step size linearly to it."""
        agent = self.agent
        extra = {}
        if lr_end is not None and "lr_end" in inspect.signature(agent.task.fit_steps).parameters:
            extra["lr_end"] = lr_end
        with agent.thread_lock:
            set_weights(agent.model, weights)
            metrics = agent.task.fit_steps(
                agent.model, steps=steps, lr=lr, batch_size=self.settings.batch_size, seed=seed, **extra
            )
            return get_weights(agent.model), metrics

    def _peer_broker(self, peer: str) -> str:
        p = self._peers.get(peer)
        return p.broker if p is not None and p.broker else self.broker

    async def _send_model(self, cmd: g.SendModel) -> None:
        period = self._running().period
        weights = cmd.weights
        if self.local_dp is not None and not cmd.returned:
            # Local DP: every model of ours leaves clipped and noised, and is accounted.
            why = self.dp_stopped or self.local_dp.over_budget()
            if why:
                if not self.dp_stopped:
                    self.dp_stopped = why
                    self.state = "privacy budget reached: no longer sending"
                    log.warning("%s; this agent keeps training and merging but sends no more models", why)
                    self.history.append({"event": "stopped_sending", "reason": why, "privacy": self.local_dp.status()})
                await self.queue.put(g.SendFailed(cmd.exchange_id, "privacy budget reached"))
                return
            weights = await asyncio.to_thread(self.local_dp.release, cmd.weights)
        msg = GossipModel(cmd.exchange_id, period, cmd.mass, cmd.age, cmd.returned, weights)
        topic = topics.direct(self.fed, self.cfg.id, cmd.peer, "gossip")
        try:
            link = await self._link(self._peer_broker(cmd.peer))
            # stable: the machine replaces its model, never changes it in place, and a
            # received model it passes on is never written to either, so the chunks are
            # cut from the tensors themselves instead of an encoded copy of the model.
            n = await asyncio.wait_for(
                self.messenger.send(topic, msg, round_=period, transport=link, stable=True),
                self.settings.send_timeout,
            )
            log.debug("sent model %s to %s (%d bytes)", cmd.exchange_id, cmd.peer, n)
        except Exception as exc:  # noqa: BLE001 - any failure: the machine picks another peer
            log.warning("sending model %s to %s failed: %s", cmd.exchange_id, cmd.peer, exc or type(exc).__name__)
            await self.queue.put(g.SendFailed(cmd.exchange_id, str(exc)))

    async def _send_ack(self, cmd: g.SendAck) -> None:
        topic = topics.direct(self.fed, self.cfg.id, cmd.peer, "gossip_ack")
        try:
            link = await self._link(self._peer_broker(cmd.peer))
            await asyncio.wait_for(
                self.messenger.send(topic, GossipAck(cmd.exchange_id, cmd.accepted, cmd.reason), transport=link),
                self.settings.send_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - the sender's timeout covers a lost ack
            log.warning("acknowledging %s to %s failed: %s", cmd.exchange_id, cmd.peer, exc or type(exc).__name__)

    async def _model_changed(self, cmd: g.ModelChanged) -> None:
        self._trained = (cmd.weights, cmd.period)  # the machine replaces its model, never changes it
        every = self.settings.eval_every
        if every and cmd.period % every == 0:
            await self._checkpoint(cmd.weights, cmd.period, final=False)
            self.agent.spawn(self._evaluate(cmd.weights, cmd.period))
        sdnotify.status(f"{self.fed}: gossip period {cmd.period}")

    async def _checkpoint(self, weights: Weights, period: int, *, final: bool) -> None:
        meta = {
            "period": period,
            "age": self._running().age,
            "mass": self._running().mass,
            "final": final,
            "vocab_digest": self.vocab_digest,
        }
        if self.local_dp is not None:
            meta["privacy"] = self.local_dp.accountant.to_state()
        if self.agent.fingerprint is not None:  # what export restores and counts
            meta["model"] = self.agent.fingerprint.meta()
        await asyncio.to_thread(checkpoint.save, self.model_path, weights, meta)
        self._saved = period

    async def _evaluate(self, weights: Weights, period: int) -> None:
        metrics = await asyncio.to_thread(self.agent.evaluate, weights)
        self.last_eval = {"period": period, **metrics}
        self.agent.metrics.report(metrics, prefix="local_")
        st = self._running().status()
        self.history.append(
            {
                "event": "gossip_eval",
                "period": period,
                "metrics": metrics,
                "train": self.last_metrics,
                "disagreement": st["disagreement"],
                "lag": st["lag"],
                "age": st["age"],
                "sent": st["sent"],
                "received": st["received"],
                "dropped": st["dropped"],
                "bytes_in": self.messenger.bytes_in,
                "bytes_out": self.messenger.bytes_out,
                **({"privacy": self.local_dp.status()} if self.local_dp is not None else {}),
            }
        )
        log.info("period %d: %s", period, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

    async def _finished(self, cmd: g.Finished) -> None:
        await self._checkpoint(cmd.weights, cmd.period, final=True)
        await self._evaluate(cmd.weights, cmd.period)
        self.state = "finished"
        log.info("gossip finished after %d periods", cmd.period)
        sdnotify.status(f"{self.fed}: gossip finished after {cmd.period} periods")

    # -- status --------------------------------------------------------------------------
    def mode_status(self) -> dict[str, Any]:
        vocab = None
        if self.consensus is not None:
            vocab = self.consensus.status()
        if self.machine is None:
            return {
                **self.connection_status(),
                "round": 0,
                "period": 0,
                "round_state": self.state,
                "vocabulary": vocab,
                "peers": {
                    pid: {"role": "agent", "online": p.up, "broker": p.broker or self.broker}
                    for pid, p in sorted(self._peers.items())
                },
                "rejected": dict(self.messenger.rejected),
                "bytes_in": self.messenger.bytes_in,
                "bytes_out": self.messenger.bytes_out,
            }
        st = self.machine.status()
        peers = {
            pid: {
                "role": "agent",
                "online": p.up,
                "broker": p.broker or self.broker,
                "mdns": p.mdns,
                "presence": p.presence,
                "last_seen": p.last_seen,
                "num_samples": p.num_samples,
                **({"refused": p.refused} if p.refused else {}),
            }
            for pid, p in sorted(self._peers.items())
        }
        gossip = {
            k: st[k]
            for k in (
                "sent",
                "received",
                "dropped",
                "rejected",
                "refused",
                "acked",
                "timeouts",
                "retries",
                "returned",
                "reclaimed",
                "late_acks",
                "duplicates",
                "merged",
                "in_flight",
                "inbox",
                "mass",
                "merge",
                "create",
                "screened",
                "screen_short",
            )
        }
        return {
            **self.connection_status(),
            "round": self.machine.period,
            "period": self.machine.period,
            "round_state": self.state,
            "model_age": st["age"],
            "disagreement": st["disagreement"],
            "disagreement_rel": st["disagreement_rel"],
            "lag": st["lag"],
            "lag_mean": st["lag_mean"],
            "gossip": gossip,
            "links": sorted([self.broker, *self.links]),
            "last_metrics": self.last_metrics,
            "local_model_eval": self.last_eval,
            "peers": peers,
            "rejected": dict(self.messenger.rejected),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "vocabulary": vocab,
            "privacy": self.metrics_privacy(),
            "stop_reason": self.dp_stopped or None,
            "refused_peers": {pid: p.refused for pid, p in sorted(self._peers.items()) if p.refused},
        }

    def metrics_privacy(self) -> dict[str, Any] | None:
        local_dp = getattr(self, "local_dp", None)
        return None if local_dp is None else {"mode": "local", **local_dp.status()}

    def offline_presence(self) -> bytes:
        return presence_payload(self.cfg, self.fed, False, broker=self.broker)

    async def close(self) -> None:
        trained = self._trained
        if self.machine is not None and not self.machine.finished and trained is not None and trained[1] > self._saved:
            # A clean stop keeps the latest trained model (what the periodic checkpoint
            # holds, a period old at most instead of up to eval_every - 1): a restart
            # goes back no further than that.
            try:
                await self._checkpoint(trained[0], trained[1], final=False)
            except Exception as exc:  # noqa: BLE001 - the last periodic checkpoint stands
                log.warning("the model was not saved at the stop: %s", exc or type(exc).__name__)
        await super().close()
        for t, _ready in list(self.links.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.close(), 5)
