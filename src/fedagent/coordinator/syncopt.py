"""Sync-Opt steps: the coordinator mode of a ``mode = "syncopt"`` federation (gFedNTM Algorithm 1).

Two stages, each a pure machine fed from one event queue:

1. **Vocabulary** (tasks with ``term_counts``): agents send ``VocabOffer`` (terms and
   counts only); the :class:`~fedagent.coordinator.vocabstage.VocabStage` a FedAvg
   coordinator uses too agrees once, writes the vocabulary to the state directory and
   broadcasts it (retained when it fits in one message, so an agent that restarts gets
   it again). Tasks without a vocabulary skip this stage and start once enough agents
   are online.
2. **Steps**: the model is built by the task on the agreed vocabulary, the optimizer is
   the task's (``make_optimizer``) and lives here; :class:`~fedagent.protocols.syncopt.
   SyncOptMachine` decides, this daemon broadcasts ``SyncStep``, feeds gradients in,
   runs ``optimizer.step()`` on the aggregate in a worker thread, checkpoints (weights
   and optimizer state, atomically) and finally publishes the model.

A restart resumes from the vocabulary file and the last checkpoint: the steps after it
are recomputed (the mini-batch of a step is fixed by the model version it starts
from), and a step number once broadcast is never reused.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedagent.coordinator.core import CoordinatorCore
from fedagent.coordinator.vocabstage import VocabStage, has_vocabulary, vocab_config
from fedagent.errors import ConfigError, FedagentError
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import Timer, keep_freed_memory
from fedagent.protocols import syncopt as S
from fedagent.protocols import topics
from fedagent.protocols.messages import GlobalModel, SyncGradient, SyncStep, SyncValidation, VocabOffer, Vocabulary
from fedagent.storage import checkpoint
from fedagent.storage.checkpoint import OPTIMIZER_PREFIX
from fedagent.storage.statefile import atomic_write, read_bytes
from fedagent.tasks.base import get_weights

log = logging.getLogger("fedagent.coordinator.syncopt")

STEP_RESERVATION = 100
BEST_PREFIX = "best/"  # the best epoch's weights in a checkpoint taken mid-run (early stopping)


@dataclass(frozen=True, slots=True)
class _VocabWakeup:
    pass


@dataclass(frozen=True, slots=True)
class _StartWakeup:
    pass


def check_sync_task(task: Any, where: str) -> None:
    missing = [m for m in ("step_loss", "make_optimizer") if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(
            f"{where}: task {type(task).__name__} cannot run mode 'syncopt': it has no "
            f"{', '.join(missing)}() (see fedagent.tasks.base.SyncTask)"
        )


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Adam's moments (any optimizer's tensor state) as named arrays plus the scalar rest,
    so a checkpoint holds them without pickle."""
    sd = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                arrays[f"{OPTIMIZER_PREFIX}{idx}/{k}"] = v.detach().cpu().numpy().copy()
            else:
                scalars[f"{idx}/{k}"] = v
    return arrays, scalars


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, arrays: dict[str, np.ndarray], scalars: dict[str, Any]
) -> None:
    sd = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for key, arr in arrays.items():
        idx, _, k = key[len(OPTIMIZER_PREFIX) :].partition("/")
        state.setdefault(int(idx), {})[k] = torch.from_numpy(np.array(arr, copy=True))
    for key, v in scalars.items():
        idx, _, k = key.partition("/")
        state.setdefault(int(idx), {})[k] = v
    sd["state"] = state
    optimizer.load_state_dict(sd)


class SyncOptMode:
    title = "Sync-Opt coordinator"

    def __init__(self, core: CoordinatorCore) -> None:
        cfg = core.cfg
        if cfg.mode != "syncopt":
            raise ConfigError(f"{cfg.path}: the Sync-Opt coordinator needs mode = 'syncopt'")
        self.core = core
        self.cfg = cfg
        self.settings = cfg.syncopt
        # Every step allocates and frees buffers of the model's size (5 gradients in, the
        # weights out): kept by the allocator, they are not fresh zeroed pages each time
        # (measured: 50-52 instead of 56-59 ms of CPU per step at 5 agents, V = 5000).
        keep_freed_memory()
        self.fed = core.fed
        # A gradient or validation answer replayed after a restart names a step number
        # the restarted coordinator never reuses (STEP_RESERVATION) and is refused as
        # stale by the step machine: one journal write a second instead of one per frame.
        core.messenger.lazy_durable_kinds = frozenset({SyncGradient.kind, SyncValidation.kind})
        self.ckpt_path = core.ckpt_path
        self.step_path = core.dir / "last_step_started"
        self.history = core.history
        self.machine_config = self.settings.machine_config()
        self.task: Any = core.task
        check_sync_task(self.task, str(cfg.path))
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.machine: S.SyncOptMachine | None = None
        self.phase = "waiting"
        self.vocab_timer = Timer(core.queue, _VocabWakeup())
        self.vocab: VocabStage | None = None
        if has_vocabulary(self.task):
            self.vocab = VocabStage(
                core.dir / "vocabulary.json",
                vocab_config(self.settings, str(cfg.path)),
                core.messenger,
                core.fed,
                self.vocab_timer,
                core.history,
                lambda sender, reason, detail: self._note_rejection(sender, 0, reason, detail),
            )
        if self.vocab is None or self.vocab.agreed:
            self._build()
        else:
            self.phase = "vocabulary"
            # Before going online: agents offer their vocabularies when they see us.
            self._warm_up()
        self.timer = Timer(core.queue, S.Wakeup())
        self.start_timer = Timer(core.queue, _StartWakeup())
        self.online: dict[str, int] = {}
        self.quorum_since: float | None = None
        self.step_started_at: float | None = None
        self.timings = {"optimizer_s": 0.0, "steps": 0, "step_s": 0.0}
        self.last_step_seconds: float | None = None
        self.pending_history: list[dict[str, Any]] = []
        self.last_optimizer_s = 0.0
        self.step_started_t = self.last_gradient_t = 0.0
        self.finished_reason: str | None = None

    # -- vocabulary and model ------------------------------------------------------------
    @property
    def vocabulary(self) -> Vocabulary | None:
        return self.vocab.vocabulary if self.vocab is not None else None

    def _build(self) -> None:
        """The model on the agreed vocabulary, its optimizer, the step machine; resumed
        from the checkpoint when there is one."""
        if self.vocabulary is not None:
            self.task.set_vocabulary(list(self.vocabulary.terms))
        torch.manual_seed(self.settings.seed)
        model = self.task.build_model()
        optimizer = self.task.make_optimizer(model.parameters())
        if self.settings.float64:
            wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float64})
            if wrong:
                raise ConfigError(
                    f"{self.cfg.path}: [syncopt] float64 = true needs a float64 model (the task built {', '.join(wrong)}); "
                    'set [task] dtype = "float64" on the coordinator and on every agent'
                )
        weights = get_weights(model)
        param_names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        meta: dict[str, Any] = {}
        best: tuple[int, dict[str, np.ndarray]] | None = None
        resumed = checkpoint.load(self.ckpt_path)
        if resumed is not None:
            saved, meta = resumed
            if meta.get("vocab_digest", "") != self.vocab_digest:
                raise FedagentError(f"{self.ckpt_path} was trained on another vocabulary; move it away")
            opt_arrays = {k: v for k, v in saved.items() if k.startswith(OPTIMIZER_PREFIX)}
            best_arrays = {k[len(BEST_PREFIX) :]: v for k, v in saved.items() if k.startswith(BEST_PREFIX)}
            weights = {k: v for k, v in saved.items() if not k.startswith((OPTIMIZER_PREFIX, BEST_PREFIX))}
            best_version = meta.get("best_version")
            if best_version is not None and best_arrays:
                best = (int(best_version), best_arrays)
            elif best_version is not None and int(best_version) == int(meta.get("model_version", 0)):
                best = (int(best_version), weights)  # the checkpointed model is the best one
            self._load_into(model, weights)
            weights = get_weights(model)
            load_optimizer_state(optimizer, opt_arrays, meta.get("optimizer", {}))
            log.info(
                "resuming from %s: model version %s after step %s",
                self.ckpt_path,
                meta.get("model_version"),
                meta.get("step"),
            )
        started = read_bytes(self.step_path, 64)
        last_started = int(started) if started and started.strip().isdigit() else 0
        self.model, self.optimizer = model, optimizer
        self.reserved_step = last_started
        stopper = None
        saved_rule = meta.get("stopper")
        if self.machine_config.patience > 0 and isinstance(saved_rule, dict):
            c = self.machine_config
            stopper = S.PatienceStop(
                patience=c.patience,
                delta=c.delta,
                max_epochs=c.max_epochs,
                best=float(saved_rule["best"]),
                best_epoch=int(saved_rule["best_epoch"]),
                epochs=int(saved_rule["epochs"]),
                bad_epochs=int(saved_rule["bad_epochs"]),
                stopped=bool(saved_rule["stopped"]),
            )
        self.machine = S.SyncOptMachine(
            self.machine_config,
            weights,
            param_names,
            # A final checkpoint holds the kept model; a mid-run one the last step's.
            model_version=int(
                meta.get("model_version", 0)
                if meta.get("final")
                else meta.get("trained_version", meta.get("model_version", 0))
            ),
            steps_done=int(meta.get("steps_done", 0)),
            last_step=max(int(meta.get("step", 0)), last_started),
            stopper=stopper,
            best=best,
        )
        # A fault before the restart keeps the run inexact; the restart itself does not
        # break exactness (the steps after the checkpoint are recomputed identically).
        self.machine.exact = bool(meta.get("exact", True))
        self.phase = "done" if self.machine.phase is S.Phase.DONE else "waiting"

    def _warm_up(self) -> None:
        """The first optimizer step in a process imports much of torch (seconds on a
        small machine): pay for it before the agents' offers come in, not after the merge."""
        try:
            p = torch.nn.Parameter(torch.zeros(2))
            opt = self.task.make_optimizer([p])
            p.grad = torch.ones(2)
            opt.step()
        except Exception as exc:  # noqa: BLE001 - only a warm-up; the real step reports errors
            log.debug("optimizer warm-up failed: %s", exc)

    @staticmethod
    def _load_into(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
        state = model.state_dict()
        if state.keys() != weights.keys():
            raise FedagentError("the checkpoint's tensors do not match the model")
        with torch.no_grad(), warnings.catch_warnings():
            # Decoded tensors are read-only views of the received bytes; copy_ only reads them.
            warnings.simplefilter("ignore", UserWarning)
            for name, t in state.items():
                t.copy_(torch.from_numpy(weights[name]))

    @property
    def vocab_digest(self) -> str:
        return self.vocabulary.digest if self.vocabulary is not None else ""

    # -- Mode ----------------------------------------------------------------------------
    def model_version(self) -> int:
        return self.machine.model_version if self.machine is not None else 0

    async def on_connect(self) -> None:
        if self.vocab is not None and self.vocab.agreed:
            await self.vocab.publish()

    async def start(self, now: float) -> None:
        if self.vocab is not None:
            self.vocab.start(now)

    async def on_presence(self, agent: str, online: bool, samples: int, now: float) -> None:
        if online:
            self.online[agent] = samples
        else:
            self.online.pop(agent, None)
        if self.machine is not None and self.machine.phase is not S.Phase.WAITING:
            await self._run_machine(S.AgentOnline(agent) if online else S.AgentOffline(agent), now)
        elif self.machine is not None:
            await self._maybe_begin(now)

    async def on_message(self, inc: Incoming, now: float) -> None:
        msg = inc.message
        if isinstance(msg, (VocabOffer, SyncGradient, SyncValidation)) and inc.role != "agent":
            # Only an agent's certificate takes part: a coordinator's (or any other role's)
            # vocabulary, gradient or validation loss is not an agent's word.
            self.core.messenger.reject("role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-agent'}")
            return
        if isinstance(msg, VocabOffer):
            if self.vocab is not None:
                # An agent that restarted after the agreement offers again: the stage answers it.
                await self._vocab_agreed(await self.vocab.offer(inc.sender, msg.terms, msg.counts, now))
            return
        if isinstance(msg, SyncGradient):
            if self.machine is None:
                self._note_rejection(inc.sender, msg.step, "stale", "no step in progress (vocabulary stage)")
                return
            await self._run_machine(
                S.GradientReceived(inc.sender, msg.step, msg.base_version, msg.num_samples, msg.loss, msg.gradient), now
            )
            return
        if isinstance(msg, SyncValidation):
            if self.machine is None:
                self._note_rejection(inc.sender, msg.step, "stale", "no validation in progress (vocabulary stage)")
                return
            await self._run_machine(
                S.ValidationReceived(inc.sender, msg.step, msg.base_version, msg.loss, msg.num_docs), now
            )
            return
        log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)

    async def on_item(self, item: Any, now: float) -> None:
        if isinstance(item, _VocabWakeup):
            if self.vocab is not None:
                await self._vocab_agreed(await self.vocab.wakeup(now))
        elif isinstance(item, _StartWakeup):
            if self.machine is not None:
                await self._maybe_begin(now)
        elif self.machine is not None:
            await self._run_machine(item, now)

    def recovered_frames(self) -> Iterator[tuple[str, bytes]]:
        # A step is short and its gradients are not journaled: a restart starts a new step.
        return iter(())

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return []

    def close(self) -> None:
        for t in (self.timer, self.vocab_timer, self.start_timer):
            t.cancel()

    async def _vocab_agreed(self, agreed: Vocabulary | None) -> None:
        """Once the vocabulary is agreed (and saved and published by the stage), the model
        is built on it and the steps start with the agents whose offers made it."""
        if agreed is None:
            return
        t0 = time.perf_counter()
        await asyncio.to_thread(self._build)
        log.info(
            "model built on the vocabulary in %.2fs; starting Sync-Opt with %d agents",
            time.perf_counter() - t0,
            len(agreed.contributors),
        )
        await self._run_machine(S.Begin(agreed.contributors), time.monotonic())

    async def _maybe_begin(self, now: float) -> None:
        """Tasks without a vocabulary (or a resumed run): start once enough agents are online."""
        assert self.machine is not None
        if self.machine.phase is not S.Phase.WAITING:
            return
        s, n = self.settings, len(self.online)
        if self.vocab is not None and self.vocab.resumed and self.vocabulary is not None:
            # Resumed after the vocabulary stage: the same agents as before.
            expected = [a for a in self.vocabulary.contributors]
            if all(a in self.online for a in expected) or (
                self.quorum_since is not None and now >= self.quorum_since + s.start_grace
            ):
                await self._run_machine(S.Begin(tuple(expected)), now)
                return
        if n < s.min_agents:
            self.quorum_since = None
            return
        if self.quorum_since is None:
            self.quorum_since = now
        if (
            s.expected_agents and n >= s.expected_agents and self.vocabulary is None
        ) or now >= self.quorum_since + s.start_grace:
            await self._run_machine(S.Begin(tuple(sorted(self.online))), now)
        else:
            self.start_timer.request(self.quorum_since + s.start_grace)

    async def _run_machine(self, ev: S.Event, now: float) -> None:
        assert self.machine is not None
        pending = list(self.machine.handle(ev, now))
        while pending:
            cmd = pending.pop(0)
            more = await self._execute(cmd)
            pending.extend(more)

    def _note_rejection(self, sender: str, step: int, reason: str, detail: str) -> None:
        self.core.reject(sender, reason, detail, step=step)

    # -- commands ------------------------------------------------------------------------
    async def _reserve(self, step: int) -> None:
        """Step numbers are reserved in blocks: a restart continues after the block, so a
        number once broadcast is never reused, at one fsync per block."""
        if step > self.reserved_step:
            self.reserved_step = step + STEP_RESERVATION
            await asyncio.to_thread(atomic_write, self.step_path, str(self.reserved_step).encode())

    async def _broadcast_step(self, cmd: S.StartStep | S.StartValidation, **flags: bool) -> None:
        await self.core.messenger.send(
            topics.broadcast(self.fed, "sync_step"),
            SyncStep(
                cmd.step, cmd.model_version, cmd.participants, cmd.deadline_s, self.vocab_digest, cmd.weights, **flags
            ),
            round_=cmd.step,
        )

    async def _execute(self, cmd: S.Command) -> list[S.Command]:
        assert self.machine is not None and self.model is not None and self.optimizer is not None
        if isinstance(cmd, S.StartStep):
            self.phase = "steps"
            self.step_started_at = time.monotonic()
            self.step_started_t = time.time()
            await self._reserve(cmd.step)
            self.core.metrics.round_started(cmd.step)
            if cmd.step == 1 or cmd.step % 50 == 0:
                sdnotify.status(f"Sync-Opt step {cmd.step}: {len(cmd.participants)} agents")
            # Gradients may come without their all-zero slices (lossless).
            await self._broadcast_step(cmd, sliced_gradients=True)
        elif isinstance(cmd, S.StartValidation):
            self.phase = "validating"
            await self._reserve(cmd.step)
            sdnotify.status(f"Sync-Opt: validating epoch {cmd.epoch}")
            await self._broadcast_step(cmd, validate=True)
        elif isinstance(cmd, S.EpochDone):
            self.pending_history.append(
                {
                    "event": "epoch",
                    "time": time.time(),
                    "epoch": cmd.epoch,
                    "step": cmd.step,
                    "model_version": cmd.model_version,
                    "val_loss": cmd.loss,
                    "improved": cmd.improved,
                    "best_epoch": cmd.best_epoch,
                    "best_val_loss": cmd.best_loss,
                    "documents": cmd.documents,
                    "participants": list(cmd.participants),
                    "missing": list(cmd.missing),
                }
            )
            log.info(
                "epoch %d: validation loss %.6g%s (best: epoch %d)",
                cmd.epoch,
                cmd.loss,
                " (improved)" if cmd.improved else "",
                cmd.best_epoch,
            )
            if not cmd.final:
                # The stop state and the best epoch's weights survive a restart.
                await self._checkpoint(self.machine.weights, cmd.step, False)
        elif isinstance(cmd, S.ApplyGradient):
            self.last_gradient_t = time.time()
            t0 = time.perf_counter()
            new = await asyncio.to_thread(self._apply, cmd.gradient)
            self.last_optimizer_s = time.perf_counter() - t0
            self.timings["optimizer_s"] += self.last_optimizer_s
            return self.machine.handle(S.OptimizerApplied(cmd.step, new), time.monotonic())
        elif isinstance(cmd, S.StepDone):
            took = time.monotonic() - (self.step_started_at or time.monotonic())
            self.last_step_seconds = took
            self.timings["steps"] += 1
            self.timings["step_s"] += took
            self.core.metrics.round_completed(took, {"loss": cmd.loss})
            self.core.metrics.set_model_version(cmd.model_version)
            self.pending_history.append(
                {
                    "event": "step",
                    "time": time.time(),
                    "step": cmd.step,
                    "model_version": cmd.model_version,
                    "loss": cmd.loss,
                    "rel_change": cmd.rel_change,
                    "samples": cmd.samples,
                    "participants": list(cmd.participants),
                    "missing": list(cmd.missing),
                    "seconds": round(took, 5),
                    "optimizer_s": round(self.last_optimizer_s, 5),
                    "started_t": self.step_started_t,
                    "last_gradient_t": self.last_gradient_t,
                    "bytes_in": self.core.messenger.bytes_in,
                    "bytes_out": self.core.messenger.bytes_out,
                }
            )
            if not cmd.final and self.machine.steps_done % self.settings.checkpoint_every == 0:
                await self._checkpoint(cmd.weights, cmd.step, False)
            if cmd.missing:
                log.warning(
                    "step %d aggregated without %s: the run is no longer exact", cmd.step, ", ".join(cmd.missing)
                )
            log.debug("step %d: loss %.4f, relative change %.3g", cmd.step, cmd.loss, cmd.rel_change)
        elif isinstance(cmd, S.StepRepeated):
            log.warning("step %d repeated: %s", cmd.step, cmd.reason)
            self.history.append({"event": "repeated", "step": cmd.step, "reason": cmd.reason})
        elif isinstance(cmd, S.Rejected):
            self._note_rejection(cmd.sender, cmd.step, cmd.reason, cmd.detail)
        elif isinstance(cmd, S.RequestWakeup):
            self.timer.request(cmd.at)
        elif isinstance(cmd, S.Finished):
            self.phase = "done"
            self.finished_reason = cmd.reason
            log.info(
                "Sync-Opt finished (%s) after %d steps: model version %d", cmd.reason, cmd.steps_done, cmd.model_version
            )
            sdnotify.status(f"finished: model version {cmd.model_version}")
            # The final checkpoint holds the model training ends with (early stopping: the
            # best epoch's, which may be older than the last step's).
            await self._checkpoint(cmd.weights, self.machine.step, True, model_version=cmd.model_version)
            self.history.append(
                {
                    "event": "finished",
                    "reason": cmd.reason,
                    "model_version": cmd.model_version,
                    "steps_done": cmd.steps_done,
                    "exact": self.machine.exact,
                    **self._timing_summary(),
                }
            )
            await self.core.messenger.send(
                topics.broadcast(self.fed, "model"),
                GlobalModel(cmd.model_version, self.machine.step, True, cmd.weights),
                round_=self.machine.step,
            )
        elif isinstance(cmd, S.Aborted):
            self.phase = "aborted"
            log.error("Sync-Opt aborted at step %d: %s", cmd.step, cmd.reason)
            self.history.append({"event": "aborted", "step": cmd.step, "reason": cmd.reason})
            await self._checkpoint(self.machine.weights, cmd.step, False)
        return []

    def _apply(self, gradient: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The optimizer step on the aggregated gradient (worker thread)."""
        assert self.model is not None and self.optimizer is not None
        params = dict(self.model.named_parameters())
        for name, g in gradient.items():
            # The aggregate is a fresh array owned by nobody else: no copy needed.
            params[name].grad = torch.from_numpy(g)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Copies: the next optimizer step updates the parameters in place, while these
        # weights are still being broadcast and compared with the next ones.
        return get_weights(self.model)

    async def _checkpoint(
        self, weights: dict[str, np.ndarray], step: int, final: bool, model_version: int | None = None
    ) -> None:
        """``model_version``: that of ``weights`` when they are not the last step's (the
        best epoch's model at the end of an early-stopped run)."""
        assert self.machine is not None and self.optimizer is not None
        arrays, scalars = optimizer_state(self.optimizer)
        m = self.machine
        if not final and m.best_weights is not None and m.best_version != m.model_version:
            arrays.update({BEST_PREFIX + k: v for k, v in m.best_weights.items()})
        meta = {
            "model_version": m.model_version if model_version is None else model_version,
            "trained_version": m.model_version,
            "best_version": m.best_version,
            "stopper": m.stopper_state(),
            "step": step,
            "steps_done": self.machine.steps_done,
            "federation": self.fed,
            "final": final,
            "loss": self.machine.last_loss,
            "exact": self.machine.exact,
            "vocab_digest": self.vocab_digest,
            "optimizer": scalars,
            "mode": "syncopt",
        }
        await asyncio.to_thread(checkpoint.save, self.ckpt_path, {**weights, **arrays}, meta)
        # Step records are written with the checkpoint that covers them: steps after the
        # last checkpoint are recomputed after a crash, and so are their records.
        records, self.pending_history = self.pending_history, []
        await asyncio.to_thread(self._append_history, records)

    def _append_history(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.history.append(r)

    def _timing_summary(self) -> dict[str, float]:
        n = max(1, self.timings["steps"])
        return {"mean_step_s": self.timings["step_s"] / n, "mean_optimizer_s": self.timings["optimizer_s"] / n}

    # -- status --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        m = self.machine.status() if self.machine is not None else {}
        vs = self.vocab.status() if self.vocab is not None else {}
        last_loss = m.get("last_loss")
        early: dict[str, Any] = {k: m[k] for k in ("epochs", "best_epoch", "best_version", "last_val_loss") if k in m}
        return {
            **early,
            "phase": self.phase,
            "step": m.get("step", 0),
            "steps_done": m.get("steps_done", 0),
            "steps": self.settings.steps,
            "model_version": m.get("model_version", 0),
            "participants": m.get("participants", []),
            "received": m.get("received", []),
            "last_loss": last_loss,
            "rel_change": m.get("rel_change"),
            "exact": m.get("exact", True),
            "vocabulary_size": len(self.vocabulary.terms) if self.vocabulary is not None else None,
            "vocabulary_offers": vs.get("vocabulary_offers", []),
            "finished_reason": self.finished_reason,
            "round": m.get("step", 0),
            "metrics": {"loss": last_loss} if last_loss is not None else {},
            "last_step_seconds": self.last_step_seconds,
            "timings": self._timing_summary(),
        }

    def refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_round_limits(self.cfg.syncopt.min_agents, self.cfg.syncopt.step_timeout)
        if self.machine is not None:
            m.set_model_version(self.machine.model_version)
            m.round_started(self.machine.step)
