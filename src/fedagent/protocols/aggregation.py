"""Aggregation of model updates: pure numpy, no I/O.

The coordinator feeds updates one at a time as they arrive, so it never holds more
than the running sum plus the update being added (streaming aggregation): peak
memory stays near two models whatever the number of agents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

Weights = dict[str, np.ndarray]


class UpdateRejected(ValueError):
    """An update that must not enter the aggregate; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_update(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray],
                 *, max_norm: float | None = None) -> None:
    """Refuse an update whose tensors don't match ``reference`` or aren't finite."""
    if update.keys() != reference.keys():
        missing = sorted(set(reference) - set(update))
        extra = sorted(set(update) - set(reference))
        raise UpdateRejected("names", f"missing {missing[:3]}, unexpected {extra[:3]}")
    sq = 0.0
    for name, ref in reference.items():
        arr = update[name]
        if arr.shape != ref.shape:
            raise UpdateRejected("shape", f"{name}: {arr.shape} != {ref.shape}")
        if arr.dtype != ref.dtype:
            raise UpdateRejected("dtype", f"{name}: {arr.dtype} != {ref.dtype}")
        if arr.dtype.kind == "f":
            if not np.isfinite(arr).all():
                raise UpdateRejected("non-finite", f"{name} contains NaN or Inf")
            if max_norm is not None:
                sq += float(np.square(arr, dtype=np.float64).sum())
    if max_norm is not None and sq > max_norm * max_norm:
        raise UpdateRejected("norm", f"norm {sq ** 0.5:.3g} above bound {max_norm:.3g}")


class WeightedMean:
    """Running sample-weighted mean of weight dicts (FedAvg's aggregate)."""

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self._dtypes = {k: v.dtype for k, v in reference.items()}
        self._sum = {k: np.zeros(v.shape, dtype=np.float64) for k, v in reference.items()}
        self.total_weight = 0.0
        self.count = 0

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        if not (weight > 0 and np.isfinite(weight)):
            raise UpdateRejected("weight", f"weight must be positive, got {weight!r}")
        for name, acc in self._sum.items():
            acc += np.asarray(update[name], dtype=np.float64) * weight
        self.total_weight += weight
        self.count += 1

    def result_float(self) -> dict[str, np.ndarray]:
        """The mean in float64, before casting back to each tensor's dtype."""
        if self.count == 0:
            raise ValueError("no update to aggregate")
        return {name: acc / self.total_weight for name, acc in self._sum.items()}

    def result(self) -> Weights:
        return self.cast(self.result_float())

    def cast(self, means: Mapping[str, np.ndarray]) -> Weights:
        """float64 means back to each tensor's dtype (integers rounded; a 0-d tensor,
        e.g. a BatchNorm counter, stays an array)."""
        out: Weights = {}
        for name, mean in means.items():
            dtype = self._dtypes[name]
            out[name] = np.asarray(np.rint(mean) if dtype.kind in "iub" else mean, dtype=dtype)
        return out


def weighted_mean(updates: list[tuple[Mapping[str, np.ndarray], float]]) -> Weights:
    """Non-streaming convenience over :class:`WeightedMean`."""
    if not updates:
        raise ValueError("no update to aggregate")
    acc = WeightedMean(updates[0][0])
    for w, n in updates:
        acc.add(w, n)
    return acc.result()


def weighted_metrics(items: list[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """Sample-weighted mean of each metric reported by every participant."""
    if not items:
        return {}
    keys = set(items[0][0])
    for m, _ in items[1:]:
        keys &= set(m)
    total = sum(n for _, n in items)
    return {k: sum(float(m[k]) * n for m, n in items) / total for k in sorted(keys)}


# ---- strategies: how much each accepted update weighs ------------------------------
STRATEGIES = ("fedavg", "metric", "blur", "drop_above")


@dataclass(frozen=True, slots=True)
class Strategy:
    """How a round's updates are weighted, from what agents report with them.

    ``fedavg``      weight = ``num_samples`` (McMahan et al.).
    ``metric``      weight = the reported metric ``key`` (any positive quantity).
    ``blur``        FLSimCo eq. 11: weight_n = Σ_m L_m − L_n with L = the reported metric
                    ``key`` (default ``blur_level``): the blurrier a vehicle's images, the
                    less its model counts. One participant gets weight 1; if every L is 0
                    the weights are equal.
    ``drop_above``  FedAvg over the updates whose metric ``key`` is at most ``threshold``
                    (FLSimCo's baseline 2: drop models of vehicles above 100 km/h).
                    Dropped updates are counted, not aggregated.

    Everything is computed from running sums, so the coordinator still holds one
    accumulator per term, never the N updates: eq. 11 expands to
    ``(S·Σθ_n − Σ L_n θ_n) / ((N−1)·S)`` with ``S = Σ L_n``.
    """

    name: str = "fedavg"
    key: str = ""
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"aggregation must be one of {STRATEGIES}, not {self.name!r}")
        if self.name in ("metric", "drop_above") and not self.key:
            raise ValueError(f"aggregation {self.name!r} needs the metric it reads (weight_key)")
        if self.name == "drop_above" and (self.threshold is None or not math.isfinite(self.threshold)):
            raise ValueError("aggregation 'drop_above' needs a finite threshold (drop_above)")

    @property
    def metric(self) -> str:
        return self.key or ("blur_level" if self.name == "blur" else "")


class StrategyAggregator:
    """Streaming aggregate of one round under a :class:`Strategy`.

    ``add`` raises :class:`UpdateRejected` for an update that lacks the metric the
    strategy reads or reports an unusable value; it returns False for an update the
    strategy drops on purpose (``drop_above``)."""

    def __init__(self, strategy: Strategy, reference: Mapping[str, np.ndarray]) -> None:
        self.strategy = strategy
        self._plain = WeightedMean(reference)               # Σ w θ (fedavg/metric) or Σ θ (blur)
        self._by_level = WeightedMean(reference) if strategy.name == "blur" else None   # Σ L θ
        self.levels: dict[str, float] = {}                   # blur: sender -> L
        self.weights: dict[str, float] = {}                  # sender -> weight in the aggregate
        self.dropped: dict[str, float] = {}                  # sender -> the value that dropped it

    @property
    def count(self) -> int:
        return self._plain.count

    def _value(self, metrics: Mapping[str, float]) -> float:
        key = self.strategy.metric
        if key not in metrics:
            raise UpdateRejected("metadata", f"aggregation {self.strategy.name!r} needs the metric {key!r}")
        v = float(metrics[key])
        if not math.isfinite(v) or v < 0:
            raise UpdateRejected("metadata", f"{key} = {v!r}: must be finite and non-negative")
        return v

    def add(self, sender: str, update: Mapping[str, np.ndarray], num_samples: int,
            metrics: Mapping[str, float]) -> bool:
        s = self.strategy
        if s.name == "fedavg":
            self._plain.add(update, float(num_samples))
            self.weights[sender] = float(num_samples)
        elif s.name == "metric":
            v = self._value(metrics)
            if v <= 0:
                raise UpdateRejected("metadata", f"{s.metric} = {v!r}: a weight must be positive")
            self._plain.add(update, v)
            self.weights[sender] = v
        elif s.name == "drop_above":
            v = self._value(metrics)
            assert s.threshold is not None
            if v > s.threshold:
                self.dropped[sender] = v
                return False
            self._plain.add(update, float(num_samples))
            self.weights[sender] = float(num_samples)
        else:                                               # blur, eq. 11
            v = self._value(metrics)
            self._plain.add(update, 1.0)
            if v > 0:
                assert self._by_level is not None
                self._by_level.add(update, v)
            self.levels[sender] = v
        return True

    def result(self) -> Weights:
        if self.strategy.name != "blur":
            return self._plain.result()
        n, total = len(self.levels), sum(self.levels.values())
        if n == 1 or total == 0:
            self.weights = {a: 1.0 / n for a in self.levels}
            return self._plain.result()
        self.weights = {a: (total - lv) / ((n - 1) * total) for a, lv in self.levels.items()}
        assert self._by_level is not None
        # With Σθ = n·plain and ΣLθ = S·level (the two running means):
        # Σ_n (S − L_n) θ_n / ((n−1)·S) = (n·plain − level) / (n − 1).
        level = self._by_level.result_float()
        return self._plain.cast({name: (n * plain - level[name]) / (n - 1)
                                 for name, plain in self._plain.result_float().items()})
