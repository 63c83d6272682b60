"""The agent's session in a ``mode = "fedavg"`` federation: a round participant.

The pure :class:`~fedagent.protocols.participant.Participant` decides what to do with a
round start, a round result and a global model; this session feeds it what the
coordinator broadcasts, trains in the agent's worker thread when it says so and sends
the update (streamed and compressed as the round asks, or whole). It also offers the
task's vocabulary to the coordinator and adopts the agreed one (SEEC joint learning),
evaluates every global model it receives, and hosts the search service, which
vectorises with the latest global model.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from fedagent.agent import vocabulary as vocab_mod
from fedagent.agent.core import Agent, Session
from fedagent.errors import EXIT_CONFIG, FedagentError, TransportError
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.runtime import presence_payload
from fedagent.node.transport import Subscription
from fedagent.protocols import downlink, dp, topics
from fedagent.protocols.catchup import CatchUp
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.messages import (
    Evaluation,
    GlobalModel,
    ModelCheck,
    ModelRequest,
    Presence,
    RoundResult,
    RoundStart,
    TrainConfig,
    Vocabulary,
)
from fedagent.protocols.participant import (
    AdoptModel,
    Command,
    DeltaReceiver,
    Discarded,
    Leave,
    Participant,
    SendUpdate,
    Train,
    TrainingDone,
)
from fedagent.protocols.secagg import (
    Delta,
    SecAggAgent,
    SecAggError,
    SecAggMasked,
    SecAggMessage,
    SecAggReveal,
    SecAggRoster,
    SecAggShareBox,
    SecAggStart,
    SecAggSurvivors,
    SecAggUnmask,
    layout_size,
)
from fedagent.protocols.secagg.wire import UNOPENED_BOX
from fedagent.security.signing import AuthError, sign_statement
from fedagent.storage import checkpoint
from fedagent.storage.export import LOCAL_LAYERS
from fedagent.tasks.base import Weights, get_weights, set_weights

log = logging.getLogger("fedagent.agent")

#: How much nicer than the daemon the thread evaluating global models runs (Linux: nice
#: is per thread): the evaluation is background work, and on a node shared with other
#: processes (a coordinator, a broker, other agents) it takes the CPU they leave idle
#: rather than slowing the ones a round waits for.
EVAL_NICE = 10


def background_priority() -> None:
    """Raise the calling thread's nice value by EVAL_NICE (up to 19). Raising it needs no
    privilege; where it fails the evaluation simply runs at the daemon's priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + EVAL_NICE))
    except (OSError, AttributeError):
        pass


class FedAvgSession(Session):
    """Membership of one FedAvg federation: a connection, a participant machine, peers."""

    SERVICES: ClassVar[frozenset[str]] = frozenset({"search"})

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        super().__init__(agent, federation, broker)
        self.participant = Participant(self.cfg.id, leave_after=self.cfg.rounds.leave_after)
        self._peer_info: dict[str, dict[str, Any]] = {}
        self.round_state = "idle"
        self.latest_round = 0
        self.last_eval: dict[str, float] = {}
        self._evaluated: set[int] = set()  # model versions evaluated (or being evaluated)
        # The version of the final model once training ended: the agent is "finished"
        # only when its own evaluation of that model is in (status, global_model_eval).
        self.final_version: int | None = None
        self.needs_vocabulary = vocab_mod.needs_vocabulary(agent.task)
        self.vocabulary_size: int | None = None
        self.coordinator_online = False
        self.catchup = CatchUp()
        self.downlink = DeltaReceiver()  # round starts that carry the model as a step
        self._waiting_start: Incoming | None = None  # the one waiting for the whole model
        self.offers_sent = 0
        resumed = checkpoint.load(self.model_path)
        if resumed is not None:
            self.participant.model_version = int(resumed[1].get("model_version", 0))
            self.global_weights, self.global_version = resumed[0], self.participant.model_version
        fp = agent.fingerprint
        # Buffers travel exact (a running variance must not come back a quantisation
        # step off); the normalisation layers are this agent's own under local_norm.
        self.buffers = fp.buffers if fp is not None else frozenset()
        self.norm_layers = fp.local_norm if fp is not None else frozenset()
        self.local_path = self.dir / LOCAL_LAYERS
        self.local_layers: Weights | None = self._load_local_layers()
        self.compressor = Compressor(exact=self.buffers)  # keeps the top-k residual across rounds
        self._dp_rng = np.random.default_rng()  # distributed DP noise, seeded by the OS
        self.dp_rounds = 0  # rounds whose update left with this agent's share of DP noise
        self.dp_cut = 0  # noised values the secure quantisation range cut (should stay 0)
        # (round, global weights, train config) being trained
        self._base: tuple[int, Weights, TrainConfig] | None = None
        identity = self.messenger.identity
        self.secagg = SecAggAgent(
            self.cfg.id, sign=lambda data: sign_statement(identity, data), verify=self._verify_statement
        )
        self.secure_round = 0  # the latest round that asked for secure aggregation
        # Wall-clock marks of the rounds this agent trains (model in, training start and
        # end, update sent), written with the round's "update" history line: where the
        # round's time went on this node (bench/tta_trace.py reads them).
        self._marks: dict[int, dict[str, float]] = {}
        # Trainings started whose update is not yet sent (or dropped): while there is one,
        # the evaluation of a global model waits, so that it never delays an update the
        # coordinator is waiting for (the round's critical path). The same model is
        # scored, only later: after this agent's part of the round is done.
        self._trainings = 0
        self._round_done = asyncio.Event()
        self._round_done.set()
        # Its own thread, at a lower priority (EVAL_NICE), never one that also trains. It
        # still takes the agent's thread lock, so an evaluation that is running when the
        # next round's model comes holds that training back until it ends (it started
        # after this agent's update was sent, so the whole of the coordinator's intake
        # and aggregation lies between them).
        self._eval_pool = ThreadPoolExecutor(1, "evaluate", initializer=background_priority)

    def _verify_statement(self, name: str, data: bytes, cert: bytes, sig: bytes) -> None:
        try:
            self.messenger.verifier.check_statement(name, data, cert, sig)
        except AuthError as exc:
            raise SecAggError(f"the keys of {name} are not signed by {name}: {exc}") from None

    def prepare_update(self, weights: Weights, base: Weights, train: TrainConfig, *, secure_round: int = 0) -> Weights:
        """The trained weights as they are about to leave this agent (plain, or before
        masking in a secure round); ``base`` is the round's global model. Distributed DP:
        when the round asks for it, the update's difference from ``base`` is clipped and
        this agent's share of the round's noise goes on here, so nothing un-noised leaves."""
        if train.dp_clip is None:
            return weights
        noised, norm = dp.noise_share(base, weights, train.dp_clip, train.dp_noise_std, self._dp_rng)
        self.dp_rounds += 1
        if norm > train.dp_clip:
            self.agent.metrics.dp_update_clipped()
        if secure_round and train.dp_count_std:
            # Adaptive clipping: whether this update was clipped goes into the masked sum
            # too, with this agent's share of that count's noise.
            noised[dp.COUNT_KEY] = dp.count_share(norm, train.dp_clip, train.dp_count_std, self._dp_rng)
        cl = self.secagg.client
        if secure_round and cl is not None and cl.round == secure_round:
            # The round's quantisation range was chosen to hold the noised update whole
            # (a value cut there loses its noise): say so loudly if one falls outside.
            cut = dp.values_outside(base, noised, cl.params.clip)
            if cut:
                self.dp_cut += cut
                log.warning(
                    "round %d: %d noised values fall outside the quantisation range ±%.4g and are cut",
                    secure_round,
                    cut,
                    cl.params.clip,
                )
                self.history.append({"event": "quantisation_cut", "round": secure_round, "values": cut})
        return noised

    @property
    def peers(self) -> dict[str, dict[str, Any]]:
        return self._peer_info

    @property
    def current_round(self) -> int:
        return self.latest_round

    def metrics_model_version(self) -> int | None:
        return self.participant.model_version

    def subscriptions(self) -> list[Subscription]:
        # Round starts carry the global model: QoS 0, so the broker never queues them for
        # an agent that is away (an hour out of range would be an hour of models held for
        # it). A returning agent asks for the current model instead (CatchUp). What stays
        # QoS 1 in the persistent session is small (round results, the vocabulary,
        # presence, messages addressed to this agent), plus the final model, sent once.
        return [
            (topics.broadcast(self.fed, "round_start"), 0),
            topics.broadcast(self.fed, "round_result"),
            topics.broadcast(self.fed, "model"),
            topics.broadcast(self.fed, "vocabulary"),
            topics.broadcast(self.fed, "secagg_start"),
            topics.inbox(self.fed, self.cfg.id),
            topics.all_presence(self.fed),
        ]

    def retired_subscriptions(self) -> list[str]:
        return [topics.all_broadcasts(self.fed)]

    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                num_samples=self.agent.task.num_samples(),
                model_version=self.participant.model_version,
                downlinks=downlink.READS,
                model=self.model_digest,
            ),
            retain=True,
        )
        # The coordinator's retained presence may have been handled before this runs (it
        # comes with the subscription) or arrive after it: one request either way.
        request = self.catchup.connected(self.coordinator_online, self.participant.model_version)
        if request is not None:
            await self._request_model(request)

    async def _request_model(self, request: ModelRequest) -> None:
        if self.coordinator is None:
            return
        topic = topics.direct(self.fed, self.cfg.id, self.coordinator, "model_request")
        try:
            await self.messenger.send(topic, request)
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            log.warning("could not ask %s for the current model: %s", self.coordinator, exc)
            return
        log.info("asked %s for the current model (this agent has version %d)", self.coordinator, request.have_version)

    async def run(self) -> None:
        ready = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.transport.run(self._on_payload, ready))
            await ready.wait()
            tg.create_task(self.heartbeats())
            log.info("agent %s joined federation %s via %s", self.cfg.id, self.fed, self.broker)
            sdnotify.status(f"member of {self.fed}: waiting for a round")
            while True:
                item = await self.queue.get()
                if isinstance(item, Incoming):
                    await self._on_message(item)
                else:
                    try:
                        await self._apply(self.participant.handle(item))
                    finally:
                        if isinstance(item, TrainingDone):
                            self._training_over()  # its update sent, dropped or discarded

    async def _on_message(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, Presence):
            if inc.sender != self.cfg.id:
                self._peer_info[inc.sender] = {
                    "role": msg.role,
                    "online": msg.online,
                    "last_seen": time.time(),
                    "model_version": msg.model_version,
                }
            if msg.role == "coordinator" and inc.role == "coordinator":
                if msg.online:
                    await self.coordinator_model(inc.sender, msg.model)
                came_online = msg.online and not self.coordinator_online
                self.coordinator_online = msg.online
                if msg.online:
                    self.coordinator = inc.sender
                if came_online and self.needs_vocabulary and not self.vocab_digest:
                    await self._offer_vocabulary()
                if msg.online:
                    request = self.catchup.coordinator_known(self.participant.model_version)
                    if request is not None:
                        await self._request_model(request)
            return
        if isinstance(msg, ModelCheck):
            return await self.on_model_check(inc, msg)
        if self.to_service(inc):
            return
        if isinstance(msg, SecAggStart):
            if inc.role != "coordinator" or not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
                return self.messenger.reject("role", inc.sender, "secagg_start not broadcast by a coordinator")
            self.coordinator = inc.sender
            if msg.round > self.secure_round:
                self.secure_round = msg.round
            await self._secagg_send(self.secagg.on_round_start(msg.round, msg.selected, msg.setup))
            return
        if isinstance(msg, (SecAggRoster, SecAggShareBox, SecAggSurvivors, SecAggUnmask)):
            if inc.role != "coordinator" or inc.sender != self.coordinator:
                return self.messenger.reject("role", inc.sender, f"{msg.kind} not from the coordinator")
            await self._secagg_send(await asyncio.to_thread(self.secagg.on_message, msg))
            if isinstance(msg, SecAggRoster):
                # The masks do not depend on the update: their sum is drawn now, while
                # the model trains and the shares make their round trip (messages are
                # handled one at a time, so nothing else touches the round meanwhile).
                # With keys advertised ahead the roster comes before the model: the
                # update has the size of the last one (a mask sum of another size is
                # not used).
                base = self._base
                if base is not None and base[0] == msg.round:
                    size: int | None = layout_size(base[1])
                else:
                    size = layout_size(self.global_weights) if self.global_weights is not None else None
                await asyncio.to_thread(self.secagg.prepare, size)
            return
        if isinstance(msg, Vocabulary):
            if not inc.topic.startswith(topics.federation_root(self.fed) + "/global/") or inc.role != "coordinator":
                return self.messenger.reject("role", inc.sender, "a vocabulary not broadcast by a coordinator")
            self.coordinator = inc.sender
            await self._adopt_vocabulary(msg)
            return
        if isinstance(msg, (RoundStart, RoundResult, GlobalModel)):
            # The model also comes on this agent's inbox, as the answer to its request.
            answer = isinstance(msg, GlobalModel) and inc.topic == topics.direct(
                self.fed, inc.sender, self.cfg.id, "model"
            )
            if not answer and not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
                return self.messenger.reject("topic", inc.sender, f"{msg.kind} outside global/")
            if inc.role != "coordinator":
                # The ACL keeps agents off global/, but the broker is not trusted with
                # that: only a coordinator's certificate may sign what steers training.
                return self.messenger.reject(
                    "role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-coordinator'}"
                )
            self.coordinator = inc.sender
            if isinstance(msg, RoundStart) and msg.delta is not None:
                resolved = await self._resolve_start(inc, msg)
                if resolved is None:
                    return
                msg = resolved
            evaluate: tuple[Weights, int] | None = None
            if answer:
                assert isinstance(msg, GlobalModel)
                self.history.append({"event": "model_fetched", "model_version": msg.model_version, "round": msg.round})
                log.info("received the current model (version %d) from %s", msg.model_version, inc.sender)
            if (
                isinstance(msg, (RoundStart, GlobalModel))
                and msg.weights is not None
                and msg.model_version >= (self.global_version or 0)
            ):
                self.global_weights, self.global_version = msg.weights, msg.model_version
            if isinstance(msg, RoundStart) and msg.round > self.latest_round:
                self.latest_round = msg.round
                self._marks = {r: m for r, m in self._marks.items() if r > msg.round - 4}
                self._marks[msg.round] = {"model_in": time.time()}
                self.round_state = "training" if msg.selects(self.cfg.id) else "not selected"
                assert msg.weights is not None  # resolved above
                evaluate = (msg.weights, msg.model_version)
            if isinstance(msg, GlobalModel) and msg.weights is not None:
                # The final model (or the latest, retained for a newcomer) comes only this
                # way: no round starts from it, so it is evaluated here.
                self._evaluate_once(msg.weights, msg.model_version)
            if isinstance(msg, RoundResult) and msg.round >= self.latest_round:
                self.round_state = "aggregated" if msg.aggregated else f"abandoned: {msg.reason}"
            if isinstance(msg, RoundStart) and msg.secagg is not None and msg.round > self.secure_round:
                # Keys are exchanged while the model trains.
                self.secure_round = msg.round
                await self._secagg_send(self.secagg.on_round_start(msg.round, msg.selected, msg.secagg))
            await self._apply(self.participant.handle(msg))
            if evaluate is not None:
                # After the training it may have started: the evaluation waits for it.
                self._evaluate_once(*evaluate)
            if isinstance(msg, GlobalModel):
                start = self.downlink.on_model(msg.model_version, msg.weights)
                waiting, self._waiting_start = self._waiting_start, None
                if start is not None and waiting is not None:
                    log.info("round %d: training from the fetched model (version %d)", start.round, start.model_version)
                    await self._on_message(replace(waiting, message=start))
                elif self.downlink.pending is not None:
                    self._waiting_start = waiting

    async def _resolve_start(self, inc: Incoming, msg: RoundStart) -> RoundStart | None:
        """A round start that carries the model as a step from an earlier version, with the
        model rebuilt from the one this agent holds; None when that is another version:
        the current model is asked for, and the round start waits for it."""
        if msg.round <= self.latest_round:
            return None  # repeated or older: already handled
        held = None
        if self.global_weights is not None and self.global_version is not None:
            held = (self.global_version, self.global_weights)
        resolved, why = await asyncio.to_thread(self.downlink.resolve, msg, held)
        if resolved is not None:
            return resolved
        self._waiting_start = inc
        self.round_state = "fetching the model"
        log.info("round %d: %s; asking for the current model", msg.round, why)
        # (a model newer than the round's, after the coordinator went back to an older
        # checkpoint, would not be answered: ask as one with none)
        have = held[0] if held is not None and held[0] < msg.model_version else 0
        await self._request_model(ModelRequest(have))
        return None

    async def _secagg_send(self, msgs: list[SecAggMessage]) -> None:
        if self.secagg.error:
            log.warning("round %d: secure aggregation stopped here: %s", self.secagg.round, self.secagg.error)
            self.round_state = f"secure aggregation stopped: {self.secagg.error}"
            self.secagg.error = ""
        if self.coordinator is None:
            return
        for m in msgs:
            topic = topics.direct(self.fed, self.cfg.id, self.coordinator, m.kind)
            try:
                # (a masked vector is made for this message and never changed: its
                # chunks are cut from it without an encoded copy)
                n = await self.messenger.send(topic, m, round_=m.round, stable=isinstance(m, SecAggMasked))
            except TransportError as exc:
                if exc.exit_code == EXIT_CONFIG:
                    raise
                log.warning("round %d: %s not delivered (%s)", m.round, m.kind, exc)
                return
            if isinstance(m, SecAggReveal) and m.refused.startswith(UNOPENED_BOX):
                log.warning("round %d: left the round, the coordinator told why: %s", m.round, m.refused)
            elif isinstance(m, SecAggReveal) and m.refused:
                log.warning("round %d: refused to reveal shares: %s", m.round, m.refused)
            if isinstance(m, SecAggMasked):
                self.round_state = "masked update sent"
                self.history.append(
                    {
                        "event": "update",
                        "round": m.round,
                        "secure": True,
                        "bytes": n,
                        "bytes_in": self.messenger.bytes_in,
                        "bytes_out": self.messenger.bytes_out,
                    }
                )
                log.info("round %d: masked update sent (%d bytes)", m.round, n)

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
        await asyncio.to_thread(self._set_vocabulary, list(msg.terms), list(msg.counts))
        self.vocab_digest = msg.digest
        self.vocabulary_size = len(msg.terms)
        self.round_state = "vocabulary agreed"
        self.history.append({"event": "vocabulary", "terms": len(msg.terms), "digest": msg.digest})
        log.info("adopted the common vocabulary: %d terms (digest %s)", len(msg.terms), msg.digest[:12])

    def _set_vocabulary(self, terms: list[str], counts: list[int]) -> None:
        """Re-index the local data on the common vocabulary and rebuild the model on it
        (worker thread). A task that takes counts gets the federation's (the merged
        offers): its subsampling and noise words then follow the whole corpus, as a
        centralized model's do, and not this agent's share of it (as the gossip agent)."""
        agent = self.agent
        task = vocab_mod.vocabulary_task(agent.task)
        with agent.thread_lock:
            if "counts" in inspect.signature(task.set_vocabulary).parameters:
                task.set_vocabulary(terms, counts)
            else:
                task.set_vocabulary(terms)
            agent.model = agent.task.build_model()

    def _fit(self, cmd: Train) -> tuple[Weights, dict[str, float]]:
        """Local training of one round from the round's global weights (worker thread)."""
        agent = self.agent
        marks = self._marks.setdefault(cmd.round, {})
        with agent.thread_lock:
            marks["train_start"] = time.time()
            t = cmd.train
            local = self._local_norm(t)
            start = cmd.weights
            if local and self.local_layers is not None:
                start = {**cmd.weights, **self.local_layers}  # FedBN: this site's own layers
            set_weights(agent.model, start)
            cpu = time.thread_time()
            if t.steps:  # [rounds] local_steps: a fraction of an epoch (or more) a round
                metrics = agent.task.fit_steps(
                    agent.model, steps=t.steps, lr=t.lr, batch_size=t.batch_size, seed=cmd.round
                )
            else:
                metrics = agent.task.fit(agent.model, epochs=t.epochs, lr=t.lr, batch_size=t.batch_size, seed=cmd.round)
            # This thread's CPU seconds in the task's training alone (torch runs on the
            # calling thread with torch_threads = 1): what the round's training cost this node.
            marks["train_cpu"] = time.thread_time() - cpu
            weights = get_weights(agent.model)
            if local:
                self._keep_local_layers(weights, cmd)
            marks["train_end"] = time.time()
            return weights, metrics

    # -- local_norm (FedBN): this site's own normalisation layers ------------------------
    def _local_norm(self, train: TrainConfig) -> bool:
        """Whether this round keeps the normalisation layers here; a round without
        local_norm drops the ones kept (they would be stale in a site export)."""
        if train.local_norm and self.norm_layers:
            return True
        if self.local_layers is not None:
            self.local_layers = None
            self.local_path.unlink(missing_ok=True)
        return False

    def _keep_local_layers(self, weights: Weights, cmd: Train) -> None:
        """Keep (and save) the trained normalisation layers, and send the global model's
        values for them instead: nothing of them leaves this agent, and the coordinator,
        which keeps them out of the aggregate, sees a zero step (worker thread)."""
        self.local_layers = {k: weights[k] for k in self.norm_layers}
        fp = self.agent.fingerprint
        meta = {"round": cmd.round, "model_version": cmd.base_version, **({"model": fp.meta()} if fp else {})}
        checkpoint.save(self.local_path, self.local_layers, meta)
        weights.update({k: cmd.weights[k] for k in self.norm_layers})

    def _load_local_layers(self) -> Weights | None:
        """The layers a previous run kept (a restart keeps its site's own statistics)."""
        try:
            loaded = checkpoint.load(self.local_path)
        except FedagentError as exc:
            log.warning("%s; the normalisation layers start from the global model's", exc)
            return None
        if loaded is None:
            return None
        layers = loaded[0]
        own = get_weights(self.agent.model)
        if layers.keys() != self.norm_layers or any(
            layers[k].shape != own[k].shape or layers[k].dtype != own[k].dtype for k in layers
        ):
            log.warning("%s does not fit this model's normalisation layers; not used", self.local_path)
            return None
        return layers

    def own_model(self, weights: Weights) -> Weights:
        """``weights`` (a global model) with this site's own normalisation layers, if it
        keeps them: the model this site uses (evaluation, export with --site)."""
        if self.local_layers is None:
            return weights
        return {**weights, **self.local_layers}

    def _evaluate_once(self, weights: Weights, version: int) -> None:
        if version in self._evaluated:
            return
        self._evaluated = {v for v in self._evaluated if v > version - 4} | {version}
        self.agent.spawn(self._evaluate_global(weights, version))

    def _training_over(self) -> None:
        self._trainings -= 1
        if self._trainings <= 0:
            self._trainings = 0
            self._round_done.set()

    def _timed_evaluate(self, weights: Weights) -> tuple[dict[str, float], float]:
        """The evaluation's metrics and the CPU seconds it took (its own thread)."""
        cpu = time.thread_time()
        metrics = self.agent.evaluate(self.own_model(weights))
        return metrics, time.thread_time() - cpu

    async def _evaluate_global(self, weights: Weights, version: int) -> None:
        # After this agent's update of the round is sent: the model arrives with a round
        # start, and scoring it first would put the evaluation on the round's critical path.
        await self._round_done.wait()
        started, t0 = time.time(), time.monotonic()  # a wall-clock mark; a monotonic duration
        metrics, cpu = await asyncio.get_running_loop().run_in_executor(self._eval_pool, self._timed_evaluate, weights)
        if version >= int(self.last_eval.get("model_version", -1)):
            self.last_eval = {"model_version": version, **metrics}
            self.agent.metrics.report(metrics, prefix="global_")
            if self.final_version is not None:
                self._final_state()
        self.history.append(
            {
                "event": "global_eval",
                "model_version": version,
                "metrics": metrics,
                "started": round(started, 4),
                "seconds": round(time.monotonic() - t0, 4),
                "cpu": round(cpu, 4),
            }
        )
        samples = self.agent.task.num_samples()
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        if self.coordinator is not None and samples > 0 and finite:
            # The coordinator shows the federation's held-out metrics: every agent's
            # evaluation of the same global model, weighted by samples.
            try:
                await self.messenger.send(
                    topics.direct(self.fed, self.cfg.id, self.coordinator, "evaluation"),
                    Evaluation(version, samples, finite),
                )
            except TransportError as exc:
                if exc.exit_code == EXIT_CONFIG:
                    raise
                log.info("evaluation of model version %d not delivered: %s", version, exc)

    async def _apply(self, cmds: list[Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, Train):
                self._trainings += 1
                self._round_done.clear()
                self.agent.spawn(self._train(cmd))
            elif isinstance(cmd, SendUpdate):
                await self._send_update(cmd)
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
                meta: dict[str, Any] = {"model_version": cmd.model_version, "round": cmd.round, "final": cmd.final}
                if self.agent.fingerprint is not None:
                    meta["model"] = self.agent.fingerprint.meta()
                await asyncio.to_thread(checkpoint.save, self.model_path, cmd.weights, meta)
                if cmd.final:
                    self.final_version = cmd.model_version
                    self._final_state()

    def _final_state(self) -> None:
        """After training ended: "finished" once this agent has scored the final model,
        until then what it is doing. The final model comes in after the coordinator is
        done and is evaluated in the background: a status read in between must not show
        "finished" beside the evaluation of the model before it."""
        assert self.final_version is not None
        if int(self.last_eval.get("model_version", -1)) >= self.final_version:
            self.round_state = "finished"
            sdnotify.status(f"{self.fed}: training finished (model version {self.final_version})")
        else:
            self.round_state = f"evaluating the final model, version {self.final_version}"

    async def _send_update(self, cmd: SendUpdate) -> None:
        if self.coordinator is None:
            log.warning("no coordinator known; update for round %d dropped", cmd.update.round)
            return
        topic = topics.direct(self.fed, self.cfg.id, self.coordinator, "update")
        base: Weights | None = None
        train: TrainConfig | None = None
        if self._base is not None and self._base[0] == cmd.update.round:
            _, base, train = self._base
        if (base is None or train is None) and self._base is not None and self._base[2].dp_clip is not None:
            # Under distributed DP nothing leaves un-noised: without its round's model and
            # settings the update cannot be clipped and noised, so it is not sent.
            log.warning("round %d: update without its round's DP settings; not sent", cmd.update.round)
            return
        if cmd.update.round == self.secure_round:
            # Never sent in the clear: masked, or not at all.
            if base is None or train is None:
                log.warning("round %d: no base model for the masked update; not sent", cmd.update.round)
                return
            self.agent.metrics.round_completed(None, cmd.update.metrics)
            await self._secagg_send(await asyncio.to_thread(self._secure_input, cmd, base, train))
            return
        if base is not None and train is not None:
            cmd = SendUpdate(replace(cmd.update, weights=self.prepare_update(cmd.update.weights, base, train)))
        try:
            if train is not None and train.stream:
                comp = CompressionConfig(train.compression, train.topk_ratio)
                if comp != self.compressor.config:
                    self.compressor = Compressor(comp, exact=self.buffers)
                n = await self.messenger.send_update(topic, cmd.update, base=base, compressor=self.compressor)
            else:
                # The round asked for a whole update (a robust aggregator or clip_norm
                # reads it at once), or its settings are not known here: a whole update
                # is what every coordinator accepts.
                n = await self.messenger.send(topic, cmd.update, round_=cmd.update.round)
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            # Cut off from the broker for longer than the publish timeout (a partition):
            # by the time we are back the round is over and the update stale, so it is
            # dropped here instead of ending the daemon.
            log.warning("round %d: update not delivered (%s); the round goes on without it", cmd.update.round, exc)
            self.round_state = "update not delivered"
            return
        self.round_state = "update sent"
        self.agent.metrics.round_completed(None, cmd.update.metrics)
        marks = self._marks.pop(cmd.update.round, {})
        marks["sent"] = time.time()
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
                "marks": {k: round(v, 4) for k, v in marks.items()},
            }
        )
        log.info(
            "round %d: update sent (%d bytes, %s)",
            cmd.update.round,
            n,
            ", ".join(f"{k}={v:.4f}" for k, v in cmd.update.metrics.items()),
        )

    def _secure_input(self, cmd: SendUpdate, base: Weights, train: TrainConfig) -> list[SecAggMessage]:
        """The masked update, if the share box is in (else held until it is): worker thread."""
        u = cmd.update
        noised = self.prepare_update(u.weights, base, train, secure_round=u.round)
        return self.secagg.on_trained(
            u.round,
            Delta(noised, dp.with_slots(base, noised)),
            base_version=u.base_version,
            num_samples=u.num_samples,
            metrics=u.metrics,
            leaving=u.leaving,
        )

    async def _train(self, cmd: Train) -> None:
        self._base = (cmd.round, cmd.weights, cmd.train)
        sdnotify.status(f"{self.fed}: training round {cmd.round}")
        started = time.monotonic()
        try:
            weights, metrics = await asyncio.to_thread(self._fit, cmd)
            self.agent.metrics.training_seconds(time.monotonic() - started)
        except Exception:
            log.exception("training for round %d failed", cmd.round)
            self.round_state = "training failed"
            self._training_over()
            return
        await self.queue.put(TrainingDone(cmd.round, cmd.base_version, self.agent.task.num_samples(), metrics, weights))

    async def close(self) -> None:
        self._eval_pool.shutdown(wait=False, cancel_futures=True)
        await super().close()

    def mode_status(self) -> dict[str, Any]:
        p = self.participant
        return {
            **self.connection_status(),
            "round": self.latest_round,
            "round_state": self.round_state,
            "rounds_trained": p.rounds_done,
            "model_version": p.model_version,
            "last_metrics": p.last_metrics,
            "global_model_eval": self.last_eval,
            "final_model_version": self.final_version,
            "peers": dict(sorted(self.peers.items())),
            "rejected": dict(self.messenger.rejected),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "vocabulary_size": self.vocabulary_size,
            "vocab_digest": self.vocab_digest or None,
            "vocab_offers_sent": self.offers_sent,
            "model_requests_sent": self.catchup.requests,
            "model_steps": {"rebuilt": self.downlink.rebuilt, "fetched": self.downlink.fetched},
            "dp_noised_updates": self.dp_rounds,
            "dp_quantisation_cut": self.dp_cut,
        }
