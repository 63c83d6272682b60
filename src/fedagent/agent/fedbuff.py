"""The agent's session in a ``mode = "async"`` federation (asynchronous buffered FedAvg).

The pure :class:`~fedagent.protocols.fedbuff.worker.AsyncWorker` decides what to do; this
session feeds it the coordinator's tasks and models and the state of the link, trains in
the agent's worker thread when it says so, keeps each finished update in the outbox on
disk (:mod:`fedagent.storage.outbox`) before it sends it, and sends it (streamed and
compressed as the task says, or whole). The link counts as up while the broker
connection answers and the coordinator's presence says it is online: while it is down
the agent goes on working on its own (the worker's docstring says how far). Every
published model it holds is evaluated on the agent's own held-out data in the
background (the newest one; versions published meanwhile are skipped) and the result
sent to the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from fedagent.agent.core import Agent, Session
from fedagent.agent.fedavg import background_priority
from fedagent.errors import EXIT_CONFIG, CodecError, TransportError
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.runtime import presence_payload
from fedagent.node.transport import Subscription
from fedagent.protocols import downlink, dp, topics
from fedagent.protocols.catchup import CatchUp
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.fedbuff import worker as W
from fedagent.protocols.messages import (
    AsyncModel,
    AsyncTask,
    AsyncUpdate,
    Evaluation,
    GlobalModel,
    ModelRequest,
    Presence,
    Update,
)
from fedagent.storage import checkpoint
from fedagent.storage.outbox import Outbox
from fedagent.tasks.base import Weights, get_weights, set_weights

log = logging.getLogger("fedagent.agent")

#: How often the link is looked at (the transport reports no change itself).
LINK_POLL = 0.25


class AsyncSession(Session):
    """Membership of one asynchronous federation: tasks, training, the outbox."""

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        super().__init__(agent, federation, broker)
        self._peer_info: dict[str, dict[str, Any]] = {}
        held = None
        resumed = checkpoint.load(self.model_path)
        if resumed is not None:
            held = (int(resumed[1].get("model_version", 0)), resumed[0])
            self.global_weights, self.global_version = held[1], held[0]
        self.worker = W.AsyncWorker(offline_trainings=self.cfg.fedbuff.offline_trainings, model=held)
        self.outbox = Outbox(self.dir, max_bytes=4 * self.cfg.max_model_bytes)
        self.compressor = Compressor()
        self._dp_rng = np.random.default_rng()  # distributed DP noise, seeded by the OS
        self.coordinator_online = False
        self.link_up = False
        self.link_down_since: float | None = None  # wall-clock time the link went down (a label)
        self._link_down_at: float | None = None  # the same on the monotonic clock (durations)
        self.catchup = CatchUp()
        self.final_version: int | None = None
        self.state = "waiting for a task"
        self.last_eval: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._eval_wanted: tuple[int, Weights] | None = None
        self._evaluating = False
        self._eval_pool = ThreadPoolExecutor(1, "evaluate", initializer=background_priority)
        self.tasks_received = 0
        self.updates_sent = 0
        self.models_rebuilt = 0
        self.models_fetched = 0

    # -- Session ---------------------------------------------------------------------------
    @property
    def peers(self) -> dict[str, dict[str, Any]]:
        return self._peer_info

    @property
    def current_round(self) -> int:
        return self.worker.model[0] if self.worker.model is not None else 0

    def metrics_model_version(self) -> int | None:
        return self.worker.model[0] if self.worker.model is not None else None

    def subscriptions(self) -> list[Subscription]:
        # Published models travel QoS 0: never queued for an agent that is away (it asks
        # for the current model when back). Tasks, the final model and presence are small
        # or sent once: queued in the persistent session.
        return [
            (topics.broadcast(self.fed, "async_model"), 0),
            topics.broadcast(self.fed, "model"),
            topics.inbox(self.fed, self.cfg.id),
            topics.all_presence(self.fed),
        ]

    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                num_samples=self.agent.task.num_samples(),
                model_version=self.current_round,
                downlinks=downlink.READS,
            ),
            retain=True,
        )
        request = self.catchup.connected(self.coordinator_online, self.current_round)
        if request is not None:
            await self._request_model(request)

    async def run(self) -> None:
        ready = asyncio.Event()
        restored = await asyncio.to_thread(self.outbox.get)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.transport.run(self._on_payload, ready))
            await ready.wait()
            tg.create_task(self.heartbeats())
            tg.create_task(self._watch_link())
            log.info("agent %s joined asynchronous federation %s via %s", self.cfg.id, self.fed, self.broker)
            if restored is not None:
                log.info(
                    "outbox: the update of task %d (from model version %d, %d trainings) kept since %s",
                    restored.work.task,
                    restored.work.base_version,
                    restored.work.trainings,
                    time.strftime("%H:%M:%S", time.localtime(self.outbox.since or 0)),
                )
                await self._apply(self.worker.handle(W.Restored(restored)))
            while True:
                item = await self.queue.get()
                if isinstance(item, Incoming):
                    await self._on_message(item)
                else:
                    await self._apply(self.worker.handle(item))

    async def _watch_link(self) -> None:
        """LinkUp / LinkDown for the worker: the broker connection answers and the
        coordinator is online (no callback says when a connection drops, so look)."""
        while True:
            up = (
                self.transport.connected
                and self.transport.link_state != "unresponsive"
                and self.coordinator_online
                and self.coordinator is not None
            )
            if up != self.link_up:
                self.link_up = up
                if up:
                    if self.link_down_since is not None:
                        log.info("link back after %.0f s", self._down_s())
                    self.link_down_since = self._link_down_at = None
                else:
                    self.link_down_since, self._link_down_at = time.time(), time.monotonic()
                    log.info("link down (%s): working on our own", self.transport.link_state)
                self.history.append({"event": "link", "up": up})
                await self.queue.put(W.LinkUp() if up else W.LinkDown())
            await asyncio.sleep(LINK_POLL)

    async def _request_model(self, request: ModelRequest) -> None:
        if self.coordinator is None:
            return
        try:
            await self.messenger.send(topics.direct(self.fed, self.cfg.id, self.coordinator, "model_request"), request)
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            log.warning("could not ask %s for the current model: %s", self.coordinator, exc)

    # -- messages ------------------------------------------------------------------------------
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
                self.coordinator_online = msg.online
                if msg.online:
                    self.coordinator = inc.sender
                    request = self.catchup.coordinator_known(self.current_round)
                    if request is not None:
                        await self._request_model(request)
            return
        if isinstance(msg, (AsyncTask, AsyncModel, GlobalModel)):
            if inc.role != "coordinator":
                # Only a coordinator's certificate may sign what steers training.
                return self.messenger.reject(
                    "role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-coordinator'}"
                )
            self.coordinator = inc.sender
        if isinstance(msg, AsyncTask):
            if inc.topic != topics.direct(self.fed, inc.sender, self.cfg.id, "async_task"):
                return self.messenger.reject("topic", inc.sender, "a task not addressed to this agent")
            self.tasks_received += 1
            await self._apply(self.worker.handle(W.TaskIn(msg)))
        elif isinstance(msg, AsyncModel):
            if not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
                return self.messenger.reject("topic", inc.sender, "async_model outside global/")
            weights = msg.weights
            if weights is None:
                assert msg.delta is not None
                held = self.worker.model
                if held is None or held[0] != msg.delta.base_version:
                    return  # a step from a model we lack: fetched when a task needs it
                try:
                    weights = await asyncio.to_thread(downlink.rebuild, held[1], msg.delta)
                except CodecError as exc:
                    return self.messenger.reject("schema", inc.sender, str(exc))
                self.models_rebuilt += 1
            await self._model_in(msg.model_version, weights, False)
        elif isinstance(msg, GlobalModel):
            answer = inc.topic == topics.direct(self.fed, inc.sender, self.cfg.id, "model")
            if not answer and not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
                return self.messenger.reject("topic", inc.sender, "model outside global/")
            if answer:
                self.models_fetched += 1
                self.history.append({"event": "model_fetched", "model_version": msg.model_version})
            if msg.final:
                self.final_version = msg.model_version
                await asyncio.to_thread(
                    checkpoint.save, self.model_path, msg.weights, {"model_version": msg.model_version, "final": True}
                )
            await self._model_in(msg.model_version, msg.weights, msg.final)
        else:
            log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)

    async def _model_in(self, version: int, weights: Weights, final: bool) -> None:
        if self.global_version is None or version >= self.global_version:
            self.global_weights, self.global_version = weights, version
        await self._apply(self.worker.handle(W.ModelIn(version, weights, final)))
        self._evaluate_soon(version, weights)

    # -- commands -------------------------------------------------------------------------------
    async def _apply(self, cmds: list[W.Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, W.Train):
                w = cmd.work
                self.state = (
                    f"training task {w.task} from model version {w.base_version}"
                    if w.task and not w.offline
                    else f"training on its own from model version {w.base_version} (training {w.trainings}, cut off)"
                )
                sdnotify.status(f"{self.fed}: {self.state}")
                self.agent.spawn(self._train(cmd))
            elif isinstance(cmd, W.Keep):
                since = self.outbox.since if cmd.pending.work.trainings > 1 else None
                await asyncio.to_thread(self.outbox.put, cmd.pending, since=since)
                if not self.link_up:
                    self.state = (
                        f"cut off: keeping the update of task {cmd.pending.work.task} "
                        f"(from model version {cmd.pending.work.base_version}, {cmd.pending.work.trainings} trainings)"
                    )
            elif isinstance(cmd, W.Send):
                self.agent.spawn(self._send(cmd.pending))
            elif isinstance(cmd, W.Discard):
                await asyncio.to_thread(self.outbox.clear)
                if cmd.reason != "delivered":
                    log.info("update of task %d dropped: %s", cmd.pending.work.task, cmd.reason)
            elif isinstance(cmd, W.Fetch):
                self.state = "fetching the model its task needs"
                await self._request_model(ModelRequest(cmd.have_version))

    def _fit(self, work: W.Work, start: Weights) -> tuple[Weights, dict[str, float]]:
        """Training (worker thread); under distributed DP the update is clipped and noised
        here, before it is kept: nothing un-noised reaches the disk or the wire."""
        agent = self.agent
        with agent.thread_lock:
            set_weights(agent.model, start)
            t = work.train
            seed = work.task or (work.base_version * 1000 + work.trainings)
            if t.steps:
                metrics = agent.task.fit_steps(agent.model, steps=t.steps, lr=t.lr, batch_size=t.batch_size, seed=seed)
            else:
                metrics = agent.task.fit(agent.model, epochs=t.epochs, lr=t.lr, batch_size=t.batch_size, seed=seed)
            weights = get_weights(agent.model)
        if t.dp_clip is not None:
            weights, norm = dp.noise_share(work.base, weights, t.dp_clip, t.dp_noise_std, self._dp_rng)
            if norm > t.dp_clip:
                agent.metrics.dp_update_clipped()
        return weights, metrics

    async def _train(self, cmd: W.Train) -> None:
        started = time.monotonic()
        try:
            weights, metrics = await asyncio.to_thread(self._fit, cmd.work, cmd.start)
        except Exception as exc:
            log.exception("training of task %d failed", cmd.work.task)
            self.state = "training failed"
            await self.queue.put(W.TrainingFailed(cmd.work, str(exc)))
            return
        self.agent.metrics.training_seconds(time.monotonic() - started)
        self.last_metrics = dict(metrics)
        self.state = "update trained"
        await self.queue.put(W.Trained(cmd.work, weights, self.agent.task.num_samples(), metrics))

    async def _send(self, pending: W.Pending) -> None:
        work = pending.work
        coordinator = self.coordinator
        try:
            if coordinator is None:
                raise TransportError("no coordinator known")
            topic = topics.direct(self.fed, self.cfg.id, coordinator, "update")
            if work.train.stream:
                comp = CompressionConfig(work.train.compression, work.train.topk_ratio)
                if comp != self.compressor.config:
                    self.compressor = Compressor(comp)
                update = Update(work.task, work.base_version, pending.num_samples, pending.metrics, pending.weights)
                n = await self.messenger.send_update(topic, update, base=work.base, compressor=self.compressor)
            else:
                delta = await asyncio.to_thread(_delta, pending.weights, work.base)
                msg = AsyncUpdate(work.task, work.base_version, pending.num_samples, pending.metrics, delta)
                n = await self.messenger.send(topic, msg, round_=work.task)
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            log.warning("update of task %d not delivered (%s); kept in the outbox", work.task, exc)
            await self.queue.put(W.NotDelivered(pending, str(exc)))
            return
        self.updates_sent += 1
        self.state = "update sent; waiting for a task"
        self.agent.metrics.round_completed(None, pending.metrics)
        self.history.append(
            {
                "event": "update",
                "round": work.task,
                "task": work.task,
                "base_version": work.base_version,
                "trainings": work.trainings,
                "held_s": None if (held := self.outbox.held_s()) is None else round(held, 3),
                "metrics": pending.metrics,
                "num_samples": pending.num_samples,
                "bytes": n,
                "bytes_in": self.messenger.bytes_in,
                "bytes_out": self.messenger.bytes_out,
            }
        )
        log.info(
            "task %d: update from model version %d sent (%d bytes, %d training%s)",
            work.task,
            work.base_version,
            n,
            work.trainings,
            "s" if work.trainings > 1 else "",
        )
        await self.queue.put(W.Delivered(pending))

    # -- evaluation -----------------------------------------------------------------------------
    def _evaluate_soon(self, version: int, weights: Weights) -> None:
        """The newest model is evaluated once the evaluation running (if any) is over."""
        if version <= int(self.last_eval.get("model_version", -1)):
            return
        self._eval_wanted = (version, weights)
        if not self._evaluating:
            self._evaluating = True
            self.agent.spawn(self._evaluate())

    async def _evaluate(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._eval_wanted is not None:
                version, weights = self._eval_wanted
                self._eval_wanted = None
                started, t0, cpu0 = time.time(), time.monotonic(), time.thread_time()
                metrics = await loop.run_in_executor(self._eval_pool, self.agent.evaluate, weights)
                self.last_eval = {"model_version": version, **metrics}
                self.agent.metrics.report(metrics, prefix="global_")
                self.history.append(
                    {
                        "event": "global_eval",
                        "model_version": version,
                        "metrics": metrics,
                        "started": round(started, 4),
                        "seconds": round(time.monotonic() - t0, 4),
                        "cpu": round(time.thread_time() - cpu0, 4),
                    }
                )
                finite = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
                samples = self.agent.task.num_samples()
                if self.coordinator is not None and self.link_up and finite and samples > 0:
                    try:
                        await self.messenger.send(
                            topics.direct(self.fed, self.cfg.id, self.coordinator, "evaluation"),
                            Evaluation(version, samples, finite),
                        )
                    except TransportError as exc:
                        if exc.exit_code == EXIT_CONFIG:
                            raise
                        log.info("evaluation of model version %d not delivered: %s", version, exc)
        finally:
            self._evaluating = False

    async def close(self) -> None:
        self._eval_pool.shutdown(wait=False, cancel_futures=True)
        await super().close()

    def _down_s(self) -> float | None:
        """Seconds since the link went down (monotonic), None while it is up."""
        return None if self._link_down_at is None else time.monotonic() - self._link_down_at

    def mode_status(self) -> dict[str, Any]:
        wk = self.worker.status()
        outbox = wk["outbox"]
        if outbox is not None and self.outbox.since is not None:
            outbox = {**outbox, "since": self.outbox.since, "held_s": round(self.outbox.held_s() or 0.0, 1)}
        state = self.state
        if self.final_version is not None:
            state = "finished"
        return {
            **self.connection_status(),
            "round": self.current_round,
            "round_state": state,
            "model_version": wk["model_version"],
            "link": {
                "up": self.link_up,
                "down_since": self.link_down_since,
                "down_s": None if (down := self._down_s()) is None else round(down, 1),
            },
            "training": wk["training"],
            "next_task": wk["next_task"],
            "outbox": outbox,
            "trained": wk["trained"],
            "tasks_received": self.tasks_received,
            "updates_sent": self.updates_sent,
            "last_metrics": self.last_metrics,
            "global_model_eval": self.last_eval,
            "final_model_version": self.final_version,
            "model_steps": {"rebuilt": self.models_rebuilt, "fetched": self.models_fetched},
            "peers": dict(sorted(self.peers.items())),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
        }


def _delta(trained: Weights, base: Weights) -> Weights:
    """Floating tensors as trained minus base, the others (counters) as trained."""
    out: Weights = {}
    for name, t in trained.items():
        b = base[name]
        out[name] = (t - b).astype(t.dtype, copy=False) if t.dtype.kind == "f" else t
    return out
