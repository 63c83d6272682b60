"""The Sync-Opt step machine of the coordinator (gFedNTM Algorithm 1, stage 2), pure.

``SyncOptMachine.handle(event, now) -> list[Command]`` like the round machine: the
daemon feeds it what happened with the monotonic time and carries out its commands;
no clock, socket, thread or torch here. One step:

1. ``StartStep``: broadcast W(e) (only its version when every participant already
   holds it, e.g. a step repeated after a fault), with a deadline;
2. collect one gradient per participant: checked against the parameters (names,
   shapes, dtypes, finite), added to a streaming aggregate at once (never N gradients
   in memory); late, duplicate and stale gradients are refused naming the sender;
3. ``ApplyGradient``: the aggregate G(e) (default: the sample-weighted mean, which is
   exactly the gradient of the mean loss over the union of the mini-batches); the
   daemon applies the optimizer (torch lives there) and answers ``OptimizerApplied``
   with W(e+1);
4. ``StepDone`` (checkpoint, history) with the relative change ||W(e+1)−W(e)||/||W(e)||,
   then the next ``StartStep`` — or ``Finished`` after ``steps`` steps or when the
   relative change falls below ``tol``.

Early stopping (``patience`` > 0, gFedNTM Sec. 4.1: the rule of the package the paper's
authors train with). Every ``epoch_steps`` steps the machine sends ``StartValidation``
(the new weights, a step number of its own) instead of the next step; every participant
evaluates them on its own held-out documents and answers one scalar and a count
(``ValidationReceived``); their sample-weighted mean (:func:`pooled_validation_loss`,
summed in the participants' order) feeds :class:`PatienceStop`. ``EpochDone`` reports the
epoch; when the rule stops, ``Finished`` carries the best epoch's weights and version.

Order. ``aggregation = "ordered"`` sums the gradients in the participants' (sorted) order
from zero, Σ n_ℓ G_ℓ / Σ n_ℓ, holding a gradient that arrives before its predecessors
until they are in: the aggregate no longer depends on the order the network delivered
the gradients in, so in float64 a federated run repeats an in-process one bit for bit
(the streaming ``"weighted"`` mean keeps one model's worth of sums but its last bits
depend on the arrival order).

Faults. Exactness (federated = centralized on the union of the mini-batches) holds only
when every participant contributes to every step. When a participant is missing at the
step deadline (silent, or its presence went offline):

* ``on_fault = "continue"`` (default): the step is aggregated from the gradients that
  arrived if there are at least ``min_gradients``; the missing agents are dropped from
  the participants (named in ``StepDone.missing``) and taken back, with the full
  weights, at the first step after their presence says online again. If a participant goes offline mid-step the machine does
  not wait for the deadline. The run is flagged inexact from then on.
* ``on_fault = "abort"``: the machine waits until the deadline (a reconnecting agent's
  gradient may still arrive: QoS 1 redelivers) and then ends training with ``Aborted``;
  the last checkpoint is the model before the faulty step. For runs that must be exact.

A step with too few gradients under "continue" is repeated with the same weights and a
new step number (stale gradients of the old number are refused), like an abandoned
round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from fedagent.protocols.aggregation import UpdateRejected, check_update

Weights = dict[str, np.ndarray]

FAULT_POLICIES = ("continue", "abort")


class GradientAggregator(Protocol):
    """A streaming aggregate of one step's gradients (pluggable)."""

    @property
    def count(self) -> int: ...

    def add(self, sender: str, gradient: Mapping[str, np.ndarray], num_samples: int) -> None: ...

    def result(self) -> Weights: ...


class SumBuffers:
    """The float64 sums and scratch arrays of one step's aggregate, kept for the next.

    A fresh model-sized float64 array every step costs the page faults of memory the
    allocator returns to the system when it is freed (at 770,200 parameters, about a
    fifth of the aggregation's CPU): a machine hands its aggregates one set of buffers,
    reused step after step. One aggregate at a time uses them (a machine has one step
    open at a time); what :meth:`_Float64Sum.mean` returns is never one of them."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, str], np.ndarray] = {}

    def get(self, name: str, role: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float64 array of ``shape`` for tensor ``name`` (``role``: "sum" or
        "scratch"); its contents are whatever the last step left."""
        key = (name, role)
        a = self._arrays.get(key)
        if a is None or a.shape != shape:
            a = self._arrays[key] = np.empty(shape, dtype=np.float64)
        return a


class _Float64Sum:
    """Σ w_ℓ G_ℓ in float64, summed in the order :meth:`add` is called, from zero.

    Each gradient costs one cast into a scratch buffer, one in-place multiply and one
    in-place add (no model-sized temporaries; with ``buffers``, not even the sums are
    allocated anew each step): the coordinator folds every gradient of every step on
    its event loop, so this is on a step's critical path. Casting to float64 is exact,
    so the cast and the multiply are bit for bit ``g.astype(float64) * w``, as are
    ``np.multiply(g, w, dtype=float64)`` (the first gradient without buffers)."""

    def __init__(self, dtypes: Mapping[str, np.dtype], buffers: SumBuffers | None = None) -> None:
        self._dtypes = dict(dtypes)
        self._buffers = buffers
        self._sum: dict[str, np.ndarray] | None = None
        self._scratch: dict[str, np.ndarray] | None = None

    def add(self, gradient: Mapping[str, np.ndarray], weight: float) -> None:
        buffers = self._buffers
        if self._sum is None:
            if buffers is None:
                self._sum = {k: np.multiply(gradient[k], weight, dtype=np.float64) for k in self._dtypes}
                return
            self._sum = {}
            for k in self._dtypes:
                g = gradient[k]
                acc = self._sum[k] = buffers.get(k, "sum", g.shape)
                np.copyto(acc, g)
                acc *= weight
            return
        if self._scratch is None:
            self._scratch = {
                k: np.empty_like(v) if buffers is None else buffers.get(k, "scratch", v.shape)
                for k, v in self._sum.items()
            }
        for k, acc in self._sum.items():
            tmp = self._scratch[k]
            np.copyto(tmp, gradient[k])
            tmp *= weight
            acc += tmp

    def mean(self, total: float) -> Weights:
        """Σ w G / ``total`` cast to each tensor's dtype (the sums are divided in place:
        take it once). The arrays returned are new (never the reused buffers)."""
        if self._sum is None:
            raise ValueError("no gradient to aggregate")
        out: Weights = {}
        for k, v in self._sum.items():
            v /= total
            out[k] = v.astype(self._dtypes[k], copy=self._buffers is not None)
        self._sum = self._scratch = None
        return out


class SampleWeightedMean:
    """Σ n_ℓ G_ℓ / Σ n_ℓ: with G_ℓ the gradient of the mean loss over ℓ's n_ℓ samples,
    this is the gradient of the mean loss over the concatenated batch. Summed in float64
    in the order the gradients arrive (the last bits depend on that order; see
    :class:`OrderedWeightedMean`)."""

    def __init__(self, reference: Mapping[str, np.ndarray], buffers: SumBuffers | None = None) -> None:
        self._sum = _Float64Sum({k: np.asarray(v).dtype for k, v in reference.items()}, buffers)
        self._total = 0.0
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def _weight(self, num_samples: int) -> float:
        return float(num_samples)

    def add(self, sender: str, gradient: Mapping[str, np.ndarray], num_samples: int) -> None:
        w = self._weight(num_samples)
        if not (w > 0 and math.isfinite(w)):
            raise UpdateRejected("weight", f"weight must be positive, got {w!r}")
        self._sum.add(gradient, w)
        self._total += w
        self._count += 1

    def result(self) -> Weights:
        if self._count == 0 or self._total <= 0:
            raise ValueError("no gradient to aggregate")
        return self._sum.mean(self._total)


class PlainMean(SampleWeightedMean):
    """Every participant counts the same, whatever its batch size."""

    def _weight(self, num_samples: int) -> float:
        return 1.0


class OrderedWeightedMean:
    """Σ n_ℓ G_ℓ / Σ n_ℓ summed in float64 in the fixed order of ``order`` (not the
    arrival order), from zero, then cast to each tensor's dtype: the arithmetic of an
    in-process Sync-Opt step that loops over the nodes in that order
    (``fedagent.tasks.ntm.federated_step``). A gradient that arrives before its
    predecessors is held (at most ``len(order) − 1`` of them) until they are in or known
    to be missing."""

    def __init__(
        self, reference: Mapping[str, np.ndarray], order: tuple[str, ...], buffers: SumBuffers | None = None
    ) -> None:
        self._sum = _Float64Sum({k: np.asarray(v).dtype for k, v in reference.items()}, buffers)
        self._order = tuple(order)
        self._next = 0  # index in ``order`` of the next gradient to fold
        self._held: dict[str, tuple[Mapping[str, np.ndarray], int]] = {}
        self._total = 0
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def add(self, sender: str, gradient: Mapping[str, np.ndarray], num_samples: int) -> None:
        if sender not in self._order[self._next :] or sender in self._held:
            raise ValueError(f"{sender} is not awaited in this aggregate")
        self._held[sender] = (gradient, int(num_samples))
        self._count += 1
        self._fold(skip_absent=False)

    def _fold(self, *, skip_absent: bool) -> None:
        while self._next < len(self._order):
            who = self._order[self._next]
            if who not in self._held:
                if not skip_absent:
                    return
                self._next += 1
                continue
            gradient, n = self._held.pop(who)
            self._sum.add(gradient, n)
            self._total += n
            self._next += 1

    def result(self) -> Weights:
        # Whoever has not sent a gradient by now is missing (a fault): fold past them.
        self._fold(skip_absent=True)
        if self._total <= 0:
            raise ValueError("no gradient to aggregate")
        return self._sum.mean(self._total)


AggregatorFactory = Callable[[Mapping[str, np.ndarray], tuple[str, ...]], GradientAggregator]


def _weighted(
    reference: Mapping[str, np.ndarray], order: tuple[str, ...], buffers: SumBuffers | None = None
) -> GradientAggregator:
    return SampleWeightedMean(reference, buffers)


def _mean(
    reference: Mapping[str, np.ndarray], order: tuple[str, ...], buffers: SumBuffers | None = None
) -> GradientAggregator:
    return PlainMean(reference, buffers)


#: The built-in aggregates; the machine passes them its :class:`SumBuffers`.
AGGREGATORS: dict[str, Callable[[Mapping[str, np.ndarray], tuple[str, ...], SumBuffers | None], GradientAggregator]] = {
    "weighted": _weighted,
    "mean": _mean,
    "ordered": OrderedWeightedMean,
}


def relative_change(new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray], names: tuple[str, ...]) -> float:
    """||W_new − W_old|| / ||W_old|| over the trained parameters (float64 sums).

    One float64 difference per tensor and ``einsum`` dot products: numpy's own loop, not a
    BLAS dot, which spins threads that fight the agents for the cores (140 ms instead of
    6 ms per step on a busy 2-core machine), and no squared copies (this runs on the
    coordinator between the last gradient and the next broadcast)."""
    num = den = 0.0
    for n in names:
        a = np.ravel(old[n])
        d = np.subtract(np.ravel(new[n]), a, dtype=np.float64)
        num += float(np.einsum("i,i->", d, d))
        den += float(np.einsum("i,i->", a, a, dtype=np.float64))
    if den == 0.0:
        return math.inf if num > 0 else 0.0
    return math.sqrt(num / den)


# ---- early stopping on a validation loss ------------------------------------------
def pooled_validation_loss(losses: Mapping[str, tuple[float, int]]) -> float:
    """Σ n_ℓ L_ℓ / Σ n_ℓ from each participant's (mean validation loss, documents): the
    validation loss of the federated model over the union of the nodes' held-out
    documents, built from one scalar per node (no document leaves it)."""
    if any(int(n) < 0 for _, n in losses.values()):
        raise ValueError("a negative number of validation documents")
    total = sum(int(n) for _, n in losses.values())
    if total <= 0:
        raise ValueError("no validation documents")
    if not all(math.isfinite(float(loss)) for loss, n in losses.values() if int(n) > 0):
        return math.inf  # a diverged node makes the epoch a non-improvement
    return sum(float(loss) * int(n) for loss, n in losses.values() if int(n) > 0) / total


@dataclass(slots=True)
class PatienceStop:
    """Early stopping on a validation loss measured once per epoch, the rule of the
    ProdLDA/CombinedTM package gFedNTM's authors train with (contextualized-topic-models,
    ``CTM.fit(..., patience=5, delta=0)`` with ``num_epochs=100``): an epoch improves when
    its loss is at most ``best - delta``; training stops after ``patience`` epochs in a
    row without improvement, or after ``max_epochs``; the model kept is the best epoch's.
    A non-finite loss never improves. Pure: the caller measures, this decides."""

    patience: int = 5
    delta: float = 0.0
    max_epochs: int = 100
    best: float = math.inf
    best_epoch: int = -1
    epochs: int = 0
    bad_epochs: int = 0
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.patience < 1 or self.max_epochs < 1:
            raise ValueError("patience and max_epochs must be at least 1")
        if not (math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError("delta must be a finite non-negative number")

    def observe(self, loss: float) -> bool:
        """Record the next epoch's validation loss; True when it is the new best (the
        caller keeps that model). Sets ``stopped`` when training must end."""
        if self.stopped:
            raise RuntimeError("training already stopped")
        epoch, self.epochs = self.epochs, self.epochs + 1
        improved = math.isfinite(loss) and (self.best_epoch < 0 or loss <= self.best - self.delta)
        if improved:
            self.best, self.best_epoch, self.bad_epochs = float(loss), epoch, 0
        else:
            self.bad_epochs += 1
        self.stopped = self.bad_epochs >= self.patience or self.epochs >= self.max_epochs
        return improved


# ---- configuration -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SyncOptConfig:
    steps: int = 500  # I in Algorithm 1
    tol: float = 0.0  # stop when the relative weight change is below this (0 = never)
    step_timeout: float = 60.0  # seconds a step waits for its gradients
    on_fault: str = "continue"  # "continue" | "abort" (see the module docstring)
    min_gradients: int = 1  # "continue": aggregate a faulty step with at least this many
    max_norm: float | None = None  # refuse gradients with a larger L2 norm
    aggregation: str = "weighted"  # a key of AGGREGATORS
    # early stopping on the pooled validation loss (0 = off; see the module docstring)
    patience: int = 0
    delta: float = 0.0
    max_epochs: int = 100
    epoch_steps: int = 0  # Sync-Opt steps in one epoch (needed when patience > 0)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.min_gradients < 1:
            raise ValueError("steps and min_gradients must be at least 1")
        if self.patience < 0 or self.max_epochs < 1 or self.epoch_steps < 0:
            raise ValueError("patience and epoch_steps must be >= 0 and max_epochs >= 1")
        if self.patience > 0 and self.epoch_steps < 1:
            raise ValueError("early stopping (patience > 0) needs epoch_steps >= 1")
        if not (math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError("delta must be a finite non-negative number")
        if not (math.isfinite(self.tol) and self.tol >= 0):
            raise ValueError("tol must be a finite non-negative number")
        if not (math.isfinite(self.step_timeout) and self.step_timeout > 0):
            raise ValueError("step_timeout must be positive")
        if self.on_fault not in FAULT_POLICIES:
            raise ValueError(f"on_fault must be one of {FAULT_POLICIES}, not {self.on_fault!r}")
        if self.aggregation not in AGGREGATORS:
            raise ValueError(f"aggregation must be one of {sorted(AGGREGATORS)}, not {self.aggregation!r}")
        if self.max_norm is not None and not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError("max_norm must be positive")


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Begin:
    """Training may start with these participants (e.g. the vocabulary's contributors)."""

    participants: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AgentOnline:
    agent: str


@dataclass(frozen=True, slots=True)
class AgentOffline:
    agent: str


@dataclass(frozen=True, slots=True)
class GradientReceived:
    sender: str
    step: int
    base_version: int
    num_samples: int
    loss: float
    gradient: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class OptimizerApplied:
    step: int
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


@dataclass(frozen=True, slots=True)
class ValidationReceived:
    """A participant's mean validation loss of W(base_version) over its ``num_docs``
    held-out documents (0 documents: it has none; its loss is then ignored)."""

    sender: str
    step: int
    base_version: int
    loss: float
    num_docs: int


Event = Begin | AgentOnline | AgentOffline | GradientReceived | OptimizerApplied | ValidationReceived | Wakeup


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartStep:
    step: int
    model_version: int
    participants: tuple[str, ...]
    deadline_s: float
    weights: Weights | None = field(repr=False)  # None: every participant holds this version


@dataclass(frozen=True, slots=True)
class ApplyGradient:
    """Apply the optimizer to W(model_version) with ``gradient``; answer OptimizerApplied."""

    step: int
    model_version: int
    gradient: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class StepDone:
    step: int
    model_version: int  # the new version
    weights: Weights = field(repr=False)
    loss: float  # sample-weighted mean of the participants' losses
    rel_change: float
    participants: tuple[str, ...]  # whose gradients were aggregated
    samples: int
    missing: tuple[str, ...] = ()  # expected but absent (fault): the step is not exact
    final: bool = False


@dataclass(frozen=True, slots=True)
class StepRepeated:
    step: int
    model_version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    sender: str
    step: int
    reason: str  # stale, duplicate, unselected, names, shape, dtype, non-finite, norm, weight
    detail: str


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class StartValidation:
    """Send W(model_version) (None: every participant holds it) to be evaluated on each
    participant's held-out documents; answers are ValidationReceived for ``step``."""

    step: int
    model_version: int
    epoch: int  # 1-based: the epoch that just ended
    participants: tuple[str, ...]
    deadline_s: float
    weights: Weights | None = field(repr=False)


@dataclass(frozen=True, slots=True)
class EpochDone:
    """The pooled validation loss of the epoch's model; checkpoint with the stop state."""

    epoch: int  # 1-based
    step: int
    model_version: int
    loss: float
    improved: bool
    best_epoch: int  # 1-based; 0: none yet
    best_loss: float
    participants: tuple[str, ...]  # whose losses were pooled
    documents: int
    missing: tuple[str, ...] = ()
    final: bool = False


@dataclass(frozen=True, slots=True)
class Finished:
    model_version: int
    steps_done: int
    reason: str  # "max steps" | "converged" | "early stopped" | "max epochs"
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class Aborted:
    step: int
    model_version: int
    reason: str


Command = (
    StartStep
    | ApplyGradient
    | StepDone
    | StepRepeated
    | StartValidation
    | EpochDone
    | Rejected
    | RequestWakeup
    | Finished
    | Aborted
)


class Phase(str, Enum):
    WAITING = "waiting"  # for Begin
    COLLECTING = "collecting"
    APPLYING = "applying"  # the daemon runs the optimizer
    VALIDATING = "validating"  # collecting the participants' validation losses
    DONE = "done"
    ABORTED = "aborted"


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
