"""Aggregation of model updates: pure numpy, no I/O.

The coordinator feeds updates one at a time as they arrive, so it never holds more
than the running sum plus the update being added (streaming aggregation): peak
memory stays near two models whatever the number of agents.
"""

from __future__ import annotations

from collections.abc import Mapping

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

    def result(self) -> Weights:
        if self.count == 0:
            raise ValueError("no update to aggregate")
        out: Weights = {}
        for name, acc in self._sum.items():
            mean = acc / self.total_weight
            dtype = self._dtypes[name]
            if dtype.kind in "iub":
                mean = np.rint(mean)
            out[name] = mean.astype(dtype)
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
