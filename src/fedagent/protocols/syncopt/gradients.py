"""How one Sync-Opt step's gradients are combined, as a stream (never N gradients in
memory): the sample-weighted mean (the gradient of the mean loss over the union of the
mini-batches), the plain mean, or the weighted mean summed in the participants' order
(bit for bit the same whatever order the network delivered them in); the float64 sums
they share step after step; and the relative change of the weights a step made."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from fedagent.protocols.aggregation import UpdateRejected

Weights = dict[str, np.ndarray]


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
