"""The merge rules of gossip learning, as pure functions of the models they combine: the
mass-weighted mean (push-sum, and the thesis's and the plain average's merges with
masses of 1), the outer step a period's training is taken with, and the screening
merges (coordinate-wise median, trimmed mean, multi-Krum) that a Byzantine neighbour
cannot steer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedagent.protocols.aggregation import (
    WeightedMean,
    coordinate_median,
    extrapolate,
    krum_scores,
    pairwise_sq_distances,
    trimmed_mean,
)

Weights = dict[str, np.ndarray]


def mass_weighted_mean(items: Sequence[tuple[Mapping[str, np.ndarray], float]], names: tuple[str, ...]) -> Weights:
    """Weighted mean over ``names`` (float64 accumulation, original dtypes back)."""
    items = [(w, m) for w, m in items if m > 0]
    if len(items) == 1:
        return {k: items[0][0][k] for k in names}
    acc = WeightedMean({k: items[0][0][k] for k in names})
    # Masses come from peers (any finite positive float): scaled to sum to 1 first, so
    # a claimed mass of 1e300 times a weight of 1e38 cannot overflow to inf.
    top = max(m for _, m in items)
    for w, m in items:
        if m / top > 0:  # a mass 1e-300 beside 1e300 counts for nothing
            acc.add(w, m / top)
    return acc.result()


def outer_step(
    start: Mapping[str, np.ndarray],
    trained: Mapping[str, np.ndarray],
    scale: float,
    fixed: frozenset[str] = frozenset(),
) -> Weights:
    """``start + scale x (trained - start)`` for every floating parameter but the ``fixed``
    ones (buffers; computed in float64, the parameter's dtype back); other tensors as
    trained. ``scale`` 1 returns ``trained`` unchanged."""
    if scale == 1.0:
        return dict(trained)
    with np.errstate(over="ignore"):  # an overflow is inf, refused by the caller
        return extrapolate(start, trained, scale, fixed)


def distance(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], names: tuple[str, ...]) -> float:
    sq = 0.0
    for k in names:
        d = np.asarray(a[k], dtype=np.float64) - np.asarray(b[k], dtype=np.float64)
        sq += float(np.square(d).sum())
    return math.sqrt(sq)


def screen(
    aggregation: str, own: Mapping[str, np.ndarray], others: Sequence[Mapping[str, np.ndarray]], byzantine: int
) -> Weights:
    """The screening merge over ``own`` and ``others`` (same names, shapes, dtypes as
    ``own``, already validated): per floating coordinate the median, or the mean after
    dropping the ``byzantine`` largest and smallest values; or multi-Krum, the mean of
    the n − f models with the lowest Krum scores. Non-floating tensors keep ``own``'s
    values (step counters and the like are not the peers' to set)."""
    models = [own, *others]
    n = len(models)
    if n <= 2 * byzantine or (aggregation == "krum" and n <= 2 * byzantine + 2):
        raise ValueError(f"{aggregation} over {n} models cannot tolerate {byzantine} Byzantine ones")
    floats = [k for k, v in own.items() if np.asarray(v).dtype.kind == "f"]
    chosen = list(range(n))
    if aggregation == "krum":
        scores = krum_scores(pairwise_sq_distances(models, floats), byzantine)
        chosen = sorted(int(i) for i in np.argsort(scores, kind="stable")[: n - byzantine])
    out: Weights = {}
    for name in floats:
        ref = np.asarray(own[name])
        stack = np.stack([np.asarray(models[i][name], np.float64) for i in chosen])
        if aggregation == "median":
            agg = coordinate_median(stack)
        elif aggregation == "trimmed_mean":
            agg = trimmed_mean(stack, byzantine)
        elif aggregation == "krum":
            agg = stack.mean(axis=0)
        else:
            raise ValueError(f"not a screening aggregation: {aggregation!r}")
        out[name] = agg.astype(ref.dtype)
    return out
