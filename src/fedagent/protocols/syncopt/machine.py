"""The Sync-Opt step machine of the coordinator (the package's docstring says what one
step is, and what early stopping, order and faults do). How a step's gradients are
combined is :mod:`~fedagent.protocols.syncopt.gradients`; when training stops early is
:mod:`~fedagent.protocols.syncopt.earlystop`."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fedagent.protocols.aggregation import UpdateRejected, check_update
from fedagent.protocols.syncopt.config import SyncOptConfig
from fedagent.protocols.syncopt.earlystop import PatienceStop, pooled_validation_loss
from fedagent.protocols.syncopt.events import (
    Aborted,
    AgentOffline,
    AgentOnline,
    ApplyGradient,
    Begin,
    Command,
    EpochDone,
    Event,
    Finished,
    GradientReceived,
    OptimizerApplied,
    Phase,
    Rejected,
    RequestWakeup,
    StartStep,
    StartValidation,
    StepDone,
    StepRepeated,
    ValidationReceived,
    Wakeup,
)
from fedagent.protocols.syncopt.gradients import (
    AGGREGATORS,
    AggregatorFactory,
    GradientAggregator,
    SumBuffers,
    relative_change,
)

Weights = dict[str, np.ndarray]


class SyncOptMachine:
    """See the module docstring. ``weights`` is the whole model state that travels;
    ``param_names`` the trained parameters, i.e. the tensors a gradient has."""

    def __init__(
        self,
        config: SyncOptConfig,
        weights: Weights,
        param_names: tuple[str, ...],
        *,
        model_version: int = 0,
        steps_done: int = 0,
        last_step: int = 0,
        aggregator: AggregatorFactory | None = None,
        stopper: PatienceStop | None = None,
        best: tuple[int, Weights] | None = None,
    ) -> None:
        """``model_version``/``steps_done``/``last_step`` resume from a checkpoint: a step
        number once started is never reused; so do ``stopper`` (the early-stopping state)
        and ``best`` (the best epoch's model version and weights)."""
        missing = [n for n in param_names if n not in weights]
        if missing or not param_names:
            raise ValueError(f"param_names must name tensors of the weights (missing {missing[:3]})")
        self.config = config
        self.weights = weights
        self.param_names = tuple(param_names)
        self._reference = {n: weights[n] for n in self.param_names}
        if aggregator is None:
            builtin, buffers = AGGREGATORS[config.aggregation], SumBuffers()

            def aggregator(reference: Mapping[str, np.ndarray], order: tuple[str, ...]) -> GradientAggregator:
                return builtin(reference, order, buffers)

        self._aggregator = aggregator
        self.model_version = model_version
        self.steps_done = steps_done
        self.step = last_step
        if stopper is None and config.patience > 0:
            stopper = PatienceStop(patience=config.patience, delta=config.delta, max_epochs=config.max_epochs)
        self.stopper = stopper
        self.best_version: int | None = best[0] if best is not None else None
        self.best_weights: Weights | None = best[1] if best is not None else None
        self.participants: tuple[str, ...] = ()  # expected in the current/next step
        self.online: set[str] = set()
        self.dropped: set[str] = set()  # participants lost to a fault
        self.returning: set[str] = set()  # dropped ones announced online again since
        self.holders: set[str] = set()  # agents that received W(model_version)
        self.received: dict[str, tuple[int, float]] = {}
        self.deadline = math.inf
        self.exact = True
        self.last_loss: float | None = None
        self.last_rel_change: float | None = None
        self.last_val_loss: float | None = None
        self.converged = False
        self._acc: GradientAggregator | None = None
        self._missing_in_step: tuple[str, ...] = ()
        more = steps_done < config.steps and not (stopper is not None and stopper.stopped)
        self.phase = Phase.WAITING if more or self._validation_due() else Phase.DONE

    # -- public ------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, Begin):
            if self.phase is not Phase.WAITING:
                return []
            if not event.participants:
                raise ValueError("Sync-Opt needs at least one participant")
            self.participants = tuple(sorted(set(event.participants)))
            self.online |= set(self.participants)
            return self._start(now)
        if isinstance(event, AgentOnline):
            self.online.add(event.agent)
            # A restarted agent has lost the weights it held.
            self.holders.discard(event.agent)
            if event.agent in self.dropped:
                self.returning.add(event.agent)
            return []
        if isinstance(event, AgentOffline):
            self.online.discard(event.agent)
            self.holders.discard(event.agent)
            if self.phase in (Phase.COLLECTING, Phase.VALIDATING) and event.agent in self.participants:
                return self._maybe_aggregate(now)
            return []
        if isinstance(event, GradientReceived):
            return self._on_gradient(event, now)
        if isinstance(event, ValidationReceived):
            return self._on_validation(event, now)
        if isinstance(event, OptimizerApplied):
            return self._on_applied(event, now)
        if isinstance(event, Wakeup):
            if self.phase in (Phase.COLLECTING, Phase.VALIDATING):
                waiting = self.phase
                out = self._maybe_aggregate(now)
                if self.phase is waiting and not any(isinstance(c, RequestWakeup) for c in out):
                    # Woken early (by the deadline of an earlier step, which the daemon's
                    # one timer kept because it was sooner): ask again for this step's
                    # deadline, or a silent participant stalls the step for ever.
                    out.append(RequestWakeup(self.deadline))
                return out
            return []
        raise TypeError(f"not a Sync-Opt event: {event!r}")

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {
            "phase": self.phase.value,
            "step": self.step,
            "steps_done": self.steps_done,
            "steps": self.config.steps,
            "model_version": self.model_version,
            "participants": list(self.participants),
            "received": sorted(self.received),
            "last_loss": self.last_loss,
            "rel_change": self.last_rel_change,
            "exact": self.exact,
        }
        if self.stopper is not None:
            out["epochs"] = self.stopper.epochs
            out["best_epoch"] = self.stopper.best_epoch + 1
            out["best_version"] = self.best_version
            out["last_val_loss"] = self.last_val_loss
        return out

    def stopper_state(self) -> dict[str, float | int | bool] | None:
        """The early-stopping state for a checkpoint (None: early stopping is off)."""
        r = self.stopper
        if r is None:
            return None
        return {
            "best": r.best,
            "best_epoch": r.best_epoch,
            "epochs": r.epochs,
            "bad_epochs": r.bad_epochs,
            "stopped": r.stopped,
        }

    # -- steps -------------------------------------------------------------------------
    def _validation_due(self) -> bool:
        r = self.stopper
        return r is not None and not r.stopped and self.steps_done >= (r.epochs + 1) * self.config.epoch_steps

    def _kept(self) -> tuple[int, Weights]:
        """The model training ends with: the best validated epoch's, else the last."""
        if self.best_weights is not None and self.best_version is not None:
            return self.best_version, self.best_weights
        return self.model_version, self.weights

    def _open(self, now: float) -> bool:
        """A new step number and deadline for the current participants; True when every
        one of them already holds W(model_version)."""
        # Agents lost to a fault come back once they announce themselves online again (a
        # silent agent that never went offline stays out: it would stall every step).
        back = {a for a in self.returning if a in self.online}
        self.returning.clear()
        if back:
            self.dropped -= back
            self.participants = tuple(sorted(set(self.participants) | back))
        self.step += 1
        self.received = {}
        self.deadline = now + self.config.step_timeout
        everyone_holds = all(a in self.holders for a in self.participants)
        self.holders |= set(self.participants)
        return everyone_holds

    def _start(self, now: float) -> list[Command]:
        if self._validation_due():
            assert self.stopper is not None
            everyone_holds = self._open(now)
            self.phase = Phase.VALIDATING
            return [
                StartValidation(
                    self.step,
                    self.model_version,
                    self.stopper.epochs + 1,
                    self.participants,
                    self.config.step_timeout,
                    None if everyone_holds else self.weights,
                ),
                RequestWakeup(self.deadline),
            ]
        everyone_holds = self._open(now)
        self.phase = Phase.COLLECTING
        self._acc = self._aggregator(self._reference, self.participants)
        return [
            StartStep(
                self.step,
                self.model_version,
                self.participants,
                self.config.step_timeout,
                None if everyone_holds else self.weights,
            ),
            RequestWakeup(self.deadline),
        ]

    def _on_gradient(self, ev: GradientReceived, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            return [Rejected(ev.sender, ev.step, reason, detail)]

        if self.phase is not Phase.COLLECTING or ev.step != self.step:
            return reject("stale", f"gradient for step {ev.step}, current step {self.step} ({self.phase.value})")
        if ev.sender not in self.participants:
            return reject("unselected", f"{ev.sender} is not a participant of step {self.step}")
        if ev.sender in self.received:
            return reject("duplicate", f"second gradient from {ev.sender} for step {self.step}")
        if ev.base_version != self.model_version:
            return reject("stale", f"computed at version {ev.base_version}, current {self.model_version}")
        if ev.num_samples <= 0:
            return reject("weight", "num_samples must be positive")
        if not math.isfinite(ev.loss):
            return reject("non-finite", "loss is NaN or Inf")
        try:
            check_update(self._reference, ev.gradient, max_norm=self.config.max_norm)
            assert self._acc is not None
            self._acc.add(ev.sender, ev.gradient, ev.num_samples)
        except UpdateRejected as exc:
            return reject(exc.reason, exc.detail)
        self.received[ev.sender] = (ev.num_samples, float(ev.loss))
        return self._maybe_aggregate(now)

    def _on_validation(self, ev: ValidationReceived, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            return [Rejected(ev.sender, ev.step, reason, detail)]

        if self.phase is not Phase.VALIDATING or ev.step != self.step:
            return reject("stale", f"validation loss for step {ev.step}, current step {self.step} ({self.phase.value})")
        if ev.sender not in self.participants:
            return reject("unselected", f"{ev.sender} is not a participant of step {self.step}")
        if ev.sender in self.received:
            return reject("duplicate", f"second validation loss from {ev.sender} for step {self.step}")
        if ev.base_version != self.model_version:
            return reject("stale", f"evaluated version {ev.base_version}, current {self.model_version}")
        if ev.num_docs < 0:
            return reject("weight", "num_docs must be non-negative")
        # A non-finite loss is accepted: the pooled loss is then infinite, a non-improvement.
        self.received[ev.sender] = (int(ev.num_docs), float(ev.loss))
        return self._maybe_aggregate(now)

    def _missing(self) -> list[str]:
        return [a for a in self.participants if a not in self.received]

    def _maybe_aggregate(self, now: float) -> list[Command]:
        validating = self.phase is Phase.VALIDATING
        missing = self._missing()
        if not missing:
            return self._epoch_done(now) if validating else self._aggregate()
        cfg = self.config
        offline = [a for a in missing if a not in self.online]
        if now < self.deadline and (cfg.on_fault == "abort" or len(offline) < len(missing)):
            return []
        # A fault: at the deadline, or under "continue" every missing participant is offline.
        what = "validation loss" if validating else "gradient"
        if cfg.on_fault == "abort":
            self.phase = Phase.ABORTED
            self._acc = None
            return [
                Aborted(
                    self.step,
                    self.model_version,
                    f"step {self.step}: no {what} from {', '.join(missing)} by the deadline",
                )
            ]
        self.exact = False
        self.dropped |= set(missing)
        self.participants = tuple(a for a in self.participants if a not in missing)
        if validating and self.received:
            return self._epoch_done(now, missing=tuple(missing))
        if not validating:
            assert self._acc is not None
            if self._acc.count >= cfg.min_gradients:
                return self._aggregate(missing=tuple(missing))
        need = 1 if validating else cfg.min_gradients
        reason = f"{len(self.received)} {what}s (need {need}); missing {', '.join(missing)}"
        out: list[Command] = [StepRepeated(self.step, self.model_version, reason)]
        if not self.participants:
            self.phase = Phase.ABORTED
            return out + [Aborted(self.step, self.model_version, "no participant left")]
        return out + self._start(now)

    def _aggregate(self, missing: tuple[str, ...] = ()) -> list[Command]:
        assert self._acc is not None
        gradient = self._acc.result()
        self._acc = None
        self._missing_in_step = missing
        self.phase = Phase.APPLYING
        return [ApplyGradient(self.step, self.model_version, gradient)]

    def _epoch_done(self, now: float, missing: tuple[str, ...] = ()) -> list[Command]:
        rule = self.stopper
        assert rule is not None
        # Summed in the participants' order: the same number whatever the arrival order.
        losses = {a: (self.received[a][1], self.received[a][0]) for a in sorted(self.received)}
        try:
            loss = pooled_validation_loss(losses)
        except ValueError as exc:
            self.phase = Phase.ABORTED
            return [Aborted(self.step, self.model_version, f"early stopping: {exc}")]
        improved = rule.observe(loss)
        self.last_val_loss = loss
        if improved:
            self.best_version, self.best_weights = self.model_version, self.weights
        final = rule.stopped or self.converged or self.steps_done >= self.config.steps
        out: list[Command] = [
            EpochDone(
                rule.epochs,
                self.step,
                self.model_version,
                loss,
                improved,
                rule.best_epoch + 1,
                rule.best,
                tuple(sorted(self.received)),
                sum(n for n, _ in self.received.values()),
                missing,
                final,
            )
        ]
        if not final:
            return out + self._start(now)
        self.phase = Phase.DONE
        if rule.bad_epochs >= rule.patience:
            reason = "early stopped"
        elif rule.epochs >= rule.max_epochs:
            reason = "max epochs"
        elif self.converged:
            reason = "converged"
        else:
            reason = "max steps"
        version, weights = self._kept()
        return out + [Finished(version, self.steps_done, reason, weights)]

    def _on_applied(self, ev: OptimizerApplied, now: float) -> list[Command]:
        if self.phase is not Phase.APPLYING or ev.step != self.step:
            raise ValueError(f"OptimizerApplied for step {ev.step} while {self.phase.value} step {self.step}")
        check_update(self.weights, ev.weights)  # the daemon's own output: a bug if this fails
        old = self.weights
        self.weights = ev.weights
        self._reference = {n: ev.weights[n] for n in self.param_names}
        self.model_version += 1
        self.steps_done += 1
        self.holders = set()
        total = sum(n for n, _ in self.received.values())
        self.last_loss = sum(n * loss for n, loss in self.received.values()) / total
        self.last_rel_change = relative_change(ev.weights, old, self.param_names)
        converged = self.converged = self.config.tol > 0 and self.last_rel_change < self.config.tol
        # At an epoch's end the model is validated first; the validation decides the end.
        final = (converged or self.steps_done >= self.config.steps) and not self._validation_due()
        out: list[Command] = [
            StepDone(
                self.step,
                self.model_version,
                ev.weights,
                self.last_loss,
                self.last_rel_change,
                tuple(sorted(self.received)),
                total,
                self._missing_in_step,
                final,
            )
        ]
        self._missing_in_step = ()
        if final:
            self.phase = Phase.DONE
            version, weights = self._kept()
            return out + [Finished(version, self.steps_done, "converged" if converged else "max steps", weights)]
        return out + self._start(now)
