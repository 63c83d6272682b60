"""The agent's session in a ``mode = "syncopt"`` federation (gFedNTM, client side).

* **Vocabulary.** When the task has one (``term_counts``), the agent sends its terms and
  their counts to the coordinator as soon as it sees the coordinator online, and again
  whenever the coordinator comes back online before a vocabulary arrived. On the
  ``Vocabulary`` broadcast it re-indexes its data (``set_vocabulary``) and builds the
  model on it.
* **Steps.** On a ``SyncStep`` that names it, the agent loads the weights (or checks it
  already holds that version), computes the gradient of its mini-batch in a worker
  thread and sends it with the batch size and loss. The mini-batch is the one of the
  model version the step starts from, so a repeated step (after a fault) uses the same
  documents and a centralized run with the same seeds computes the same thing.
* **Validation** (early stopping): a ``SyncStep`` with ``validate`` asks for the mean
  validation loss of that model over the agent's held-out documents instead of a
  gradient; the agent answers one scalar and the count (``SyncValidation``).
* A gradient finished after a newer step was announced is dropped, never sent stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from typing import Any

import numpy as np
import torch

from fedagent.agent.core import Agent, Session
from fedagent.agent.vocabulary import make_offer, vocabulary_task
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.runtime import presence_payload
from fedagent.protocols import topics
from fedagent.protocols.messages import (
    GlobalModel,
    ModelCheck,
    Presence,
    SyncGradient,
    SyncStep,
    SyncValidation,
    Vocabulary,
)
from fedagent.storage import checkpoint

log = logging.getLogger("fedagent.syncopt")

HISTORY_BATCH = 20


def load_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy ``weights`` into the model's tensors: one copy, straight from the received
    bytes (``set_weights`` makes two)."""
    state = model.state_dict()
    if state.keys() != weights.keys():
        raise ValueError("weights do not match the model's tensors")
    with torch.no_grad(), warnings.catch_warnings():
        # Decoded tensors are read-only views of the message; copy_ only reads them.
        warnings.simplefilter("ignore", UserWarning)
        for name, t in state.items():
            t.copy_(torch.from_numpy(weights[name]))


def compute_gradient(task: Any, model: torch.nn.Module, batch: int) -> tuple[dict[str, np.ndarray], int, float]:
    """The gradient of the task's mean loss over its mini-batch ``batch``, by parameter name.

    The arrays are views of the gradient tensors, not copies: ``zero_grad`` with
    ``set_to_none`` drops them before the next backward pass instead of overwriting them."""
    model.zero_grad(set_to_none=True)
    loss, n = task.step_loss(model, batch)
    loss.backward()
    grads: dict[str, np.ndarray] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            if p.grad is None:
                raise ValueError(f"parameter {name} has no gradient from the step's loss")
            grads[name] = p.grad.detach().numpy()
    model.zero_grad(set_to_none=True)
    return grads, int(n), float(loss.detach())


class SyncOptSession(Session):
    """Membership of one Sync-Opt federation."""

    def __init__(self, agent: Agent, federation: str, broker: str) -> None:
        super().__init__(agent, federation, broker)
        # A step replayed after this agent restarted can only make it compute a gradient
        # for a step the coordinator has closed (refused as stale), and the genuine next
        # step supersedes it: one journal write a second instead of one per step.
        self.messenger.lazy_durable_kinds = frozenset({SyncStep.kind})
        self.coordinator_online = False
        self.task = agent.task
        self.needs_vocabulary = callable(getattr(self.task, "term_counts", None))
        self.vocabulary_size: int | None = None
        self.offers_sent = 0
        self.model: torch.nn.Module | None = None if self.needs_vocabulary else agent.model
        self.held_version: int | None = None
        self.latest_step = 0
        self.steps_done = 0
        self.state = "waiting for the coordinator"
        self.last_loss: float | None = None
        self.compute_seconds = 0.0
        self._peer_info: dict[str, dict[str, Any]] = {}
        self._compute_lock = asyncio.Lock()
        # The latest step, when it came before this agent had the vocabulary (a restarted
        # agent: the retained vocabulary is a replay to it, and comes again only after its
        # new offer): computed once the vocabulary is adopted, if still the latest.
        self._waiting_step: SyncStep | None = None
        self.pending_history: list[dict[str, Any]] = []

    @property
    def peers(self) -> dict[str, dict[str, Any]]:
        return self._peer_info

    @property
    def current_round(self) -> int:
        return self.latest_step

    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.fed, self.cfg.id),
            presence_payload(
                self.cfg,
                self.fed,
                True,
                num_samples=self.task.num_samples(),
                model_version=self.held_version or 0,
                model=self.model_digest,
            ),
            retain=True,
        )

    async def run(self) -> None:
        ready = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.transport.run(self._on_payload, ready))
            await ready.wait()
            log.info("agent %s joined Sync-Opt federation %s via %s", self.cfg.id, self.fed, self.broker)
            sdnotify.status(f"member of {self.fed} (syncopt): waiting for the coordinator")
            while True:
                item = await self.queue.get()
                await self._on_message(item, tg)

    def _from_coordinator(self, inc: Incoming) -> bool:
        if not inc.topic.startswith(topics.federation_root(self.fed) + "/global/"):
            self.messenger.reject("topic", inc.sender, f"{inc.message.kind} outside global/")
            return False
        if inc.role != "coordinator":
            # The broker is not trusted with the ACL alone: only a coordinator's
            # certificate may sign a vocabulary, a step or a model.
            self.messenger.reject("role", inc.sender, f"{inc.message.kind} signed by a {inc.role or 'non-coordinator'}")
            return False
        self.coordinator = inc.sender
        return True

    async def _on_message(self, inc: Incoming, tg: asyncio.TaskGroup) -> None:
        msg = inc.message
        if isinstance(msg, ModelCheck):
            return await self.on_model_check(inc, msg)
        if isinstance(msg, Presence):
            if inc.sender == self.cfg.id:
                return
            self._peer_info[inc.sender] = {
                "role": msg.role,
                "online": msg.online,
                "last_seen": time.time(),
                "model_version": msg.model_version,
            }
            if msg.role == "coordinator":
                if msg.online and inc.role == "coordinator":
                    await self.coordinator_model(inc.sender, msg.model)
                came_online = msg.online and not self.coordinator_online
                self.coordinator_online = msg.online
                if msg.online:
                    self.coordinator = inc.sender
                if came_online and self.needs_vocabulary and self.model is None:
                    await self._offer_vocabulary()
            return
        if isinstance(msg, Vocabulary):
            if self._from_coordinator(inc):
                await self._adopt_vocabulary(msg)
                step, self._waiting_step = self._waiting_step, None
                if step is not None and step.step == self.latest_step and step.vocab_digest == self.vocab_digest:
                    tg.create_task(self._step(step, time.time()))
            return
        if isinstance(msg, SyncStep):
            if self._from_coordinator(inc) and msg.step > self.latest_step:
                self.latest_step = msg.step
                if self.cfg.id in msg.participants:
                    tg.create_task(self._step(msg, time.time()))
            return
        if isinstance(msg, GlobalModel):
            if self._from_coordinator(inc) and msg.final:
                meta = {
                    "model_version": msg.model_version,
                    "step": msg.round,
                    "final": True,
                    "vocab_digest": self.vocab_digest,
                }
                await asyncio.to_thread(checkpoint.save, self.model_path, msg.weights, meta)
                self.held_version = msg.model_version
                # The step records first: "finished" in status means they are written.
                await self._flush_history()
                self.state = "finished"
                self.history.append({"event": "finished", "model_version": msg.model_version})
                sdnotify.status(f"{self.fed}: training finished (model version {msg.model_version})")
            return

    async def _offer_vocabulary(self) -> None:
        if self.coordinator is None:
            return
        offer = await asyncio.to_thread(make_offer, self.task)
        terms = offer.terms
        n = await self.messenger.send(topics.direct(self.fed, self.cfg.id, self.coordinator, "vocab_offer"), offer)
        self.offers_sent += 1
        self.state = "vocabulary offered"
        self.history.append({"event": "vocab_offer", "terms": len(terms), "bytes": n})
        log.info("offered %d terms (%d bytes) to %s", len(terms), n, self.coordinator)

    async def _adopt_vocabulary(self, msg: Vocabulary) -> None:
        if not self.needs_vocabulary:
            return
        if msg.digest == self.vocab_digest:
            return  # a re-broadcast of the one we have
        if self.cfg.id not in msg.contributors:
            log.warning("the vocabulary of %s does not include this agent's offer; using it anyway", self.coordinator)

        def adopt() -> torch.nn.Module:
            with self.agent.thread_lock:
                vocabulary_task(self.task).set_vocabulary(list(msg.terms))
                return self.task.build_model()

        self.model = await asyncio.to_thread(adopt)
        self.held_version = None
        self.vocab_digest = msg.digest
        self.vocabulary_size = len(msg.terms)
        self.state = "vocabulary agreed"
        self.history.append({"event": "vocabulary", "terms": len(msg.terms), "digest": msg.digest})
        log.info("adopted the common vocabulary: %d terms (digest %s)", len(msg.terms), msg.digest[:12])

    async def _step(self, msg: SyncStep, received_at: float) -> None:
        async with self._compute_lock:
            if msg.step != self.latest_step:
                return  # a newer step was announced meanwhile
            if self.model is None or msg.vocab_digest != self.vocab_digest:
                self._waiting_step = msg
                log.warning(
                    "step %d: vocabulary %s, this agent has %s; not taking part",
                    msg.step,
                    msg.vocab_digest[:12] or "-",
                    self.vocab_digest[:12] or "none",
                )
                self.state = "vocabulary mismatch"
                return
            if msg.weights is None and self.held_version != msg.model_version:
                log.warning(
                    "step %d: version %d announced without weights, this agent holds %s",
                    msg.step,
                    msg.model_version,
                    self.held_version,
                )
                return
            if msg.validate:
                await self._validate(msg)
                return
            self.state = f"computing step {msg.step}"
            model = self.model
            started = time.perf_counter()

            cpu = [0.0]

            def work() -> tuple[dict[str, np.ndarray], int, float]:
                with self.agent.thread_lock:
                    c0 = time.thread_time()
                    if msg.weights is not None:
                        load_weights(model, msg.weights)
                    out = compute_gradient(self.task, model, msg.model_version)
                    cpu[0] = time.thread_time() - c0
                    return out

            try:
                grads, n, loss = await asyncio.to_thread(work)
            except Exception:
                log.exception("gradient of step %d failed", msg.step)
                self.state = "gradient failed"
                return
            took = time.perf_counter() - started
            computed_at = time.time()
            self.compute_seconds += took
            self.agent.metrics.training_seconds(took)
            self.held_version = msg.model_version
            if msg.step != self.latest_step:
                log.info("step %d superseded while computing; gradient dropped", msg.step)
                return
            if self.coordinator is None:
                return
            # Without the all-zero slices (the terms its batch lacks) when the
            # coordinator decodes that: the same gradient, bit for bit, in fewer bytes.
            out = SyncGradient(msg.step, msg.model_version, n, loss, grads, sliced=msg.sliced_gradients)
            await self.messenger.send(
                topics.direct(self.fed, self.cfg.id, self.coordinator, "sync_gradient"), out, round_=msg.step
            )
            self.steps_done += 1
            self.last_loss = loss
            self.state = f"gradient of step {msg.step} sent"
            self.pending_history.append(
                {
                    "event": "gradient",
                    "time": time.time(),
                    "step": msg.step,
                    "model_version": msg.model_version,
                    "loss": loss,
                    "num_samples": n,
                    "compute_s": round(took, 5),
                    "compute_cpu_s": round(cpu[0], 5),
                    "received_t": received_at,
                    "computed_t": computed_at,
                    "sent_t": time.time(),
                }
            )
            if len(self.pending_history) >= HISTORY_BATCH:
                await self._flush_history()

    async def _validate(self, msg: SyncStep) -> None:
        """An epoch's end: the step's model on this node's held-out documents."""
        self.state = f"validating (step {msg.step})"
        model = self.model
        assert model is not None

        def work() -> tuple[float, int]:
            with self.agent.thread_lock:
                if msg.weights is not None:
                    load_weights(model, msg.weights)
                measure = getattr(self.task, "validation_loss", None)
                if measure is None:
                    raise NotImplementedError(f"{type(self.task).__name__} has no validation_loss()")
                loss, n = measure(model)
                return float(loss), int(n)

        try:
            loss, n = await asyncio.to_thread(work)
        except Exception:
            log.exception("validation of step %d failed", msg.step)
            self.state = "validation failed"
            return
        self.held_version = msg.model_version
        if msg.step != self.latest_step or self.coordinator is None:
            return
        out = SyncValidation(msg.step, msg.model_version, float(loss), int(n))
        await self.messenger.send(
            topics.direct(self.fed, self.cfg.id, self.coordinator, "sync_validation"), out, round_=msg.step
        )
        self.state = f"validation of step {msg.step} sent"
        self.pending_history.append(
            {
                "event": "validation",
                "time": time.time(),
                "step": msg.step,
                "model_version": msg.model_version,
                "val_loss": float(loss),
                "num_docs": int(n),
            }
        )

    async def _flush_history(self) -> None:
        # One fsync per batch of steps instead of one per step: a step is a round trip
        # of a few milliseconds, and losing the last records in a crash loses nothing
        # the coordinator's checkpoint and history do not hold.
        records, self.pending_history = self.pending_history, []
        if records:

            def write() -> None:
                for r in records:
                    self.history.append(r)

            await asyncio.to_thread(write)

    def mode_status(self) -> dict[str, Any]:
        return {
            **self.connection_status(),
            "phase": self.state,
            "round_state": self.state,
            "step": self.latest_step,
            "round": self.latest_step,
            "steps_computed": self.steps_done,
            "model_version": self.held_version,
            "last_loss": self.last_loss,
            "last_metrics": {"loss": self.last_loss} if self.last_loss is not None else {},
            "vocabulary_size": self.vocabulary_size,
            "vocab_digest": self.vocab_digest or None,
            "vocab_offers_sent": self.offers_sent,
            "compute_seconds": round(self.compute_seconds, 4),
            "peers": dict(sorted(self.peers.items())),
            "rejected": dict(self.messenger.rejected),
            "bytes_in": self.messenger.bytes_in,
            "bytes_out": self.messenger.bytes_out,
            "messages_out": self.messenger.messages_out,
        }
