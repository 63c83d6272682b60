"""Aggregation of model updates: pure numpy, no I/O.

The coordinator feeds updates one at a time as they arrive, so it never holds more
than the running sum plus the update being added (streaming aggregation): peak
memory stays near two models whatever the number of agents.

The robust aggregators (coordinate-wise ``median``, ``trimmed_mean``, multi-``krum``)
are order statistics or pairwise distances over *all* updates of a round, so they
cannot be streamed: only when one of them is chosen are the round's updates buffered,
which costs n × the model size (10 agents × a 44.8 MB model = 448 MB, plus one
float64 stack of the largest tensor while it is aggregated). Norm clipping
(``clip_norm``) bounds each update's distance from the global model and combines with
every strategy, but the distance is only known once the whole update is there: with
either, agents send whole updates and the chunk-by-chunk path
(:mod:`fedagent.protocols.streaming`) is left to fedavg / metric / blur / drop_above.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

Weights = dict[str, np.ndarray]
#: Elements :meth:`WeightedMean.fold` works on at a time (a float64 scratch of 512 KiB).
_FOLD_BLOCK = 1 << 16


class UpdateRejected(ValueError):
    """An update that must not enter the aggregate; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_update(
    reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray], *, max_norm: float | None = None
) -> None:
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
        raise UpdateRejected("norm", f"norm {sq**0.5:.3g} above bound {max_norm:.3g}")


class WeightedMean:
    """Running weighted mean of weight dicts (FedAvg's aggregate), kept as the sum of
    ``w · (θ − reference)``.

    Summing differences to the reference (the round's global model) instead of the
    weights themselves keeps the sums small and centred, so ``compact=True`` can hold
    them in float32 for float32 tensors — one model's worth of memory instead of two —
    and lose nothing that matters: the error of a float32 sum of deltas is relative to
    the deltas, not to the weights. Values can be folded in a slice (or a set of flat
    indices) at a time (:meth:`fold`) and counted once the whole update is known good
    (:meth:`count_in`); :meth:`add` does both for a whole update. :meth:`result` turns
    the sums into the mean *in place* (no third model-sized buffer), so it can be taken once.

    The tensors named in ``values`` (a model's buffers) are summed as ``w · θ`` instead,
    in float64: their mean is then a convex combination of the agents' values computed
    from the values alone, so a buffer that is non-negative on every agent (a running
    variance, a counter) is non-negative in the mean, whatever the global model held.
    """

    def __init__(
        self, reference: Mapping[str, np.ndarray], *, compact: bool = False, values: frozenset[str] = frozenset()
    ) -> None:
        self._ref = reference
        self._dtypes = {k: v.dtype for k, v in reference.items()}
        # Scratch buffers of folds done, for the next (see _take_scratch).
        self._spares: dict[np.dtype, list[np.ndarray]] = {}
        self._values = values & reference.keys()
        self._sum = {
            k: np.zeros(
                v.shape,
                dtype=np.float32
                if compact and v.dtype in (np.float32, np.float16) and k not in self._values
                else np.float64,
            )
            for k, v in reference.items()
        }
        self.total_weight = 0.0
        self.count = 0
        self._taken = False

    def fold(
        self, name: str, start: int, values: np.ndarray, indices: np.ndarray | None, weight: float, *, delta: bool
    ) -> None:
        """Add ``weight ·`` (values − reference, unless ``delta``) to a flat slice from
        ``start`` (``indices`` None) or at ``indices`` (sorted, unique, in range)."""
        acc = self._sum[name].reshape(-1)
        ref = np.asarray(self._ref[name]).reshape(-1)
        w = acc.dtype.type(weight)
        if name in self._values:
            self._fold_values(acc, ref, start, values, indices, w, delta=delta)
            return
        if indices is not None:
            v = values.astype(acc.dtype, copy=False)
            if not delta:
                v = v - ref[indices].astype(acc.dtype, copy=False)
            acc[indices] += v * w  # indices are unique: no lost update
            return
        # A contiguous slice: block by block through one small scratch buffer, the same
        # operations in the same precision as on whole arrays, but without three
        # model-sized temporaries (measured: 5x less CPU on a 44.8 MB float32 update).
        values = values.reshape(-1)
        size = values.size
        if size == 0:
            return
        step = min(size, _FOLD_BLOCK)
        scratch = self._take_scratch(acc.dtype)
        # A sum past the dtype's range becomes inf without a warning: the round machine
        # checks the aggregate and abandons such a round.
        with np.errstate(over="ignore", invalid="ignore"):
            for s in range(0, size, step):
                e = min(size, s + step)
                t = scratch[: e - s]
                if delta:
                    t[...] = values[s:e]
                else:
                    np.subtract(values[s:e], ref[start + s : start + e], out=t, dtype=acc.dtype)
                t *= w
                a = acc[start + s : start + e]
                a += t
        self._give_scratch(scratch)

    def _take_scratch(self, dtype: np.dtype) -> np.ndarray:
        """A fold's scratch buffer (:data:`_FOLD_BLOCK` elements of ``dtype``): one an
        earlier fold gave back, else a new one. A coordinator daemon's malloc serves every
        block of 64 KiB or more as fresh pages (``node.runtime.release_large_frees``),
        each zeroed by the kernel: a new scratch for every tensor of every update was
        128 page faults each time. Folds in several threads each take their own
        (``list.pop`` and ``append`` are atomic); one ended by an exception leaves its
        buffer to the collector."""
        spares = self._spares.get(dtype)
        if spares:
            try:
                return spares.pop()
            except IndexError:  # another thread took the last one meanwhile
                pass
        return np.empty(_FOLD_BLOCK, dtype=dtype)

    def _give_scratch(self, scratch: np.ndarray) -> None:
        self._spares.setdefault(scratch.dtype, []).append(scratch)

    @staticmethod
    def _fold_values(
        acc: np.ndarray,
        ref: np.ndarray,
        start: int,
        values: np.ndarray,
        indices: np.ndarray | None,
        w: np.floating,
        *,
        delta: bool,
    ) -> None:
        """``acc += w · θ`` for a tensor summed from its values (float64; a buffer is small)."""
        where = indices if indices is not None else slice(start, start + values.size)
        theta = values.reshape(-1).astype(np.float64)
        if delta:
            theta = theta + ref[where]
        with np.errstate(over="ignore", invalid="ignore"):
            acc[where] += theta * w

    def count_in(self, weight: float) -> None:
        self.total_weight += weight
        self.count += 1

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        if not (weight > 0 and np.isfinite(weight)):
            raise UpdateRejected("weight", f"weight must be positive, got {weight!r}")
        for name in self._sum:
            self.fold(name, 0, np.asarray(update[name]).reshape(-1), None, weight, delta=False)
        self.count_in(weight)

    def mean_delta(self) -> dict[str, np.ndarray]:
        """Σ w·(θ − reference) / Σ w, computed in the sums' own buffers (once)."""
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError("no update to aggregate")
        if self._taken:
            raise ValueError("the aggregate was already taken")
        self._taken = True
        for acc in self._sum.values():
            acc /= acc.dtype.type(self.total_weight)
        return self._sum

    def result(self) -> Weights:
        return self.cast_delta(self.mean_delta())

    def cast_delta(self, deltas: Mapping[str, np.ndarray]) -> Weights:
        """reference + deltas, in each tensor's dtype (integers rounded; a 0-d tensor, e.g.
        a BatchNorm counter, stays an array). Reuses the delta buffers."""
        out: Weights = {}
        for name, d in deltas.items():
            dtype = self._dtypes[name]
            if name not in self._values:  # those sums are of the values themselves
                d += np.asarray(self._ref[name]).astype(d.dtype, copy=False)
            out[name] = np.asarray(np.rint(d) if dtype.kind in "iub" else d).astype(dtype, copy=False)
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


def check_server_lr(step: float) -> None:
    """A server step must be a finite number in (0, 100]."""
    if not (isinstance(step, int | float) and math.isfinite(step) and 0 < step <= 100):
        raise ValueError(f"server_lr must be in (0, 100], not {step!r}")


def floating_pairs(
    reference: Mapping[str, np.ndarray],
    aggregate: Mapping[str, np.ndarray],
    out: Weights,
    fixed: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """``(name, aggregate tensor, reference tensor)`` for the floating tensors, for a
    server step to move; every other tensor (counters) and those named in ``fixed`` (a
    model's buffers and frozen parameters) go into ``out`` as the aggregate has them."""
    for name, agg in aggregate.items():
        ref = np.asarray(reference[name])
        if ref.dtype.kind != "f" or name in fixed:
            out[name] = agg
            continue
        yield name, agg, ref


def server_step(
    reference: Mapping[str, np.ndarray], aggregate: Weights, step: float, fixed: frozenset[str] = frozenset()
) -> Weights:
    """The next global model when the server moves ``step`` times as far as the
    aggregate did: ``reference + step · (aggregate − reference)`` for every floating
    tensor (computed in float64, stored in the tensor's dtype); other tensors (counters)
    and the ``fixed`` ones (buffers: a variance extrapolated can turn negative) are the
    aggregate's. ``step = 1`` is the aggregate itself (plain FedAvg).

    With ``n`` equally weighted agents each training on its own data from the same
    model, the mean of their updates is ``1/n`` of what one model taking all of their
    steps would move; ``step = n`` restores that (exactly so in the limit of one local
    step a round: centralized SGD on the union of the data)."""
    check_server_lr(step)
    if step == 1:
        return aggregate
    return extrapolate(reference, aggregate, step, fixed)


def extrapolate(
    reference: Mapping[str, np.ndarray],
    moved: Mapping[str, np.ndarray],
    scale: float,
    fixed: frozenset[str] = frozenset(),
) -> Weights:
    """``reference + scale · (moved − reference)`` for every floating tensor but the
    ``fixed`` ones (in float64, stored in the tensor's dtype); other tensors as ``moved``
    has them. No check of ``scale``: :func:`server_step` and the gossip outer step bound
    it themselves."""
    out: Weights = {}
    for name, agg, ref in floating_pairs(reference, moved, out, fixed):
        step = ref.astype(np.float64) + scale * (np.asarray(agg, np.float64) - ref)
        out[name] = step.astype(ref.dtype, copy=False)
    return out


# ---- robust aggregation (Byzantine agents) -------------------------------------------
ROBUST = ("median", "trimmed_mean", "krum")


def clip_to(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray], bound: float) -> Weights:
    """``update`` moved towards ``reference`` so that its L2 distance (over every
    floating tensor) is at most ``bound``; other tensors are left as they are."""
    sq = 0.0
    for name, ref in reference.items():
        if ref.dtype.kind == "f":
            sq += float(np.square(np.asarray(update[name], np.float64) - ref).sum())
    dist = math.sqrt(sq)
    if dist <= bound:
        return dict(update)
    scale = bound / dist
    out: Weights = {}
    for name, ref in reference.items():
        if ref.dtype.kind == "f":
            delta = np.asarray(update[name], np.float64) - ref
            out[name] = (ref + delta * scale).astype(ref.dtype)
        else:
            out[name] = update[name]
    return out


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """Median over axis 0 (the updates) of each coordinate (Yin et al. 2018)."""
    return np.median(stack, axis=0)


def trimmed_mean(stack: np.ndarray, k: int) -> np.ndarray:
    """Per coordinate, the mean after dropping the ``k`` largest and ``k`` smallest
    values (Yin et al. 2018, β = k/n)."""
    n = stack.shape[0]
    if not 0 <= 2 * k < n:
        raise ValueError(f"cannot trim {k} from each end of {n} values")
    if k == 0:
        return stack.mean(axis=0)
    part = np.partition(stack, (k, n - k - 1), axis=0)
    return part[k : n - k].mean(axis=0)


def krum_scores(flat_sq_dists: np.ndarray, f: int) -> np.ndarray:
    """Krum score of each update (Blanchard et al. 2017): the sum of its squared
    distances to its n − f − 2 nearest other updates."""
    n = flat_sq_dists.shape[0]
    closest = n - f - 2
    if closest < 1:
        raise ValueError(f"Krum needs n > 2f + 2 (n = {n}, f = {f})")
    scores = np.empty(n)
    for i in range(n):
        others = np.delete(flat_sq_dists[i], i)
        scores[i] = np.sort(others)[:closest].sum()
    return scores


def pairwise_sq_distances(updates: list[Mapping[str, np.ndarray]], names: list[str]) -> np.ndarray:
    """Squared L2 distances between whole updates, accumulated tensor by tensor so no
    flattened copy of every model is ever made."""
    n = len(updates)
    d = np.zeros((n, n))
    for name in names:
        stack = np.stack([np.asarray(u[name], np.float64).reshape(-1) for u in updates])
        sq = np.einsum("ij,ij->i", stack, stack)
        d += sq[:, None] + sq[None, :] - 2.0 * (stack @ stack.T)
    np.maximum(d, 0.0, out=d)  # rounding can make a tiny distance negative
    np.fill_diagonal(d, 0.0)
    return d


def robust_preconditions(name: str, n: int, f: int, trim: float, krum_m: int) -> None:
    """Raise ValueError when aggregator ``name`` cannot tolerate ``f`` Byzantine
    updates among as few as ``n``."""
    if f < 0:
        raise ValueError("byzantine must be non-negative")
    if name == "median" and not 2 * f < n:
        raise ValueError(
            f"the coordinate median tolerates f < n/2 Byzantine updates; byzantine = {f} "
            f"needs at least {2 * f + 1} updates per round but min_updates is {n}"
        )
    if name == "trimmed_mean":
        if not 0 <= trim < 0.5:
            raise ValueError(f"trimmed_mean needs 0 <= trim < 0.5 (2·β·n < n), not {trim}")
        if math.floor(trim * n) < f:
            raise ValueError(
                f"trimmed_mean with trim = {trim} drops {math.floor(trim * n)} values at each end "
                f"of {n} updates (min_updates), fewer than byzantine = {f}: raise trim or min_updates"
            )
    if name == "krum":
        if not n > 2 * f + 2:
            raise ValueError(
                f"Krum needs n > 2f + 2: byzantine = {f} needs at least {2 * f + 3} updates per "
                f"round but min_updates is {n}: raise min_updates (and min_agents) or lower byzantine"
            )
        if krum_m and not 1 <= krum_m <= n - f:
            raise ValueError(f"multi-Krum selects 1 <= m <= n - f updates (n = {n}, f = {f}), not krum_m = {krum_m}")


def robust_aggregate(
    name: str,
    reference: Mapping[str, np.ndarray],
    updates: list[Mapping[str, np.ndarray]],
    *,
    f: int = 0,
    trim: float = 0.1,
    krum_m: int = 0,
) -> tuple[Weights, list[int]]:
    """Aggregate ``updates`` with ``name``; returns the model (reference dtypes) and the
    indices of the updates that entered it (all of them except for Krum)."""
    n = len(updates)
    if n == 0:
        raise ValueError("no update to aggregate")
    robust_preconditions(name, n, f, trim, krum_m)
    chosen = list(range(n))
    if name == "krum":
        floats = [k for k, v in reference.items() if v.dtype.kind == "f"]
        scores = krum_scores(pairwise_sq_distances(updates, floats), f)
        m = krum_m or n - f
        chosen = sorted(int(i) for i in np.argsort(scores, kind="stable")[:m])
    out: Weights = {}
    k = math.floor(trim * n)
    for tname, ref in reference.items():
        stack = np.stack([np.asarray(updates[i][tname], np.float64) for i in chosen])
        if name == "median":
            agg = coordinate_median(stack)
        elif name == "trimmed_mean":
            agg = trimmed_mean(stack, k)
        else:
            agg = stack.mean(axis=0)
        out[tname] = np.asarray(np.rint(agg) if ref.dtype.kind in "iub" else agg, dtype=ref.dtype)
    return out, chosen


# ---- strategies: how much each accepted update weighs ------------------------------
STRATEGIES = ("fedavg", "metric", "blur", "drop_above") + ROBUST


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
    byzantine: int = 0  # f: Byzantine updates the robust aggregators must tolerate
    trim: float = 0.1  # trimmed_mean: β, the fraction dropped at each end
    krum_m: int = 0  # multi-Krum: updates averaged (0 = n − f)
    clip_norm: float | None = None  # every update's distance from the global model capped at this

    @property
    def robust(self) -> bool:
        return self.name in ROBUST

    @property
    def streams(self) -> bool:
        """Whether updates can be folded as they arrive (see StrategyAggregator.streams)."""
        return not self.robust and self.clip_norm is None

    def check_preconditions(self, min_updates: int) -> None:
        """Refuse (ValueError) a configuration whose robust aggregator would not hold
        with as few updates as a round may be aggregated from."""
        if self.robust:
            robust_preconditions(self.name, min_updates, self.byzantine, self.trim, self.krum_m)

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"aggregation must be one of {STRATEGIES}, not {self.name!r}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a positive number, not {self.clip_norm!r}")
        if type(self.byzantine) is not int or self.byzantine < 0:
            raise ValueError(f"byzantine must be a non-negative integer, not {self.byzantine!r}")
        if self.byzantine and not self.robust:
            raise ValueError(
                f"byzantine = {self.byzantine} needs a robust aggregation ({', '.join(ROBUST)}); "
                f"{self.name!r} has no Byzantine tolerance"
            )
        if self.name in ("metric", "drop_above") and not self.key:
            raise ValueError(f"aggregation {self.name!r} needs the metric it reads (weight_key)")
        if self.name == "drop_above" and (self.threshold is None or not math.isfinite(self.threshold)):
            raise ValueError("aggregation 'drop_above' needs a finite threshold (drop_above)")

    @property
    def metric(self) -> str:
        return self.key or ("blur_level" if self.name == "blur" else "")


@dataclass(frozen=True, slots=True)
class Plan:
    """How one update enters the aggregate, decided from its metadata before its tensors."""

    weight: float  # in the main sum (fedavg/metric/drop_above), 1 for blur
    level: float = 0.0  # blur: L_n, the weight in the second sum
    dropped: float | None = None  # drop_above: the metric that dropped it


class StrategyAggregator:
    """Streaming aggregate of one round under a :class:`Strategy`.

    ``add`` raises :class:`UpdateRejected` for an update that lacks the metric the
    strategy reads or reports an unusable value; it returns False for an update the
    strategy drops on purpose (``drop_above``). Streamed updates use the same steps
    one at a time: :meth:`plan` from the metadata, :meth:`fold` per slice of values,
    :meth:`commit` when the update is known good."""

    def __init__(
        self,
        strategy: Strategy,
        reference: Mapping[str, np.ndarray],
        *,
        compact: bool = False,
        values: frozenset[str] = frozenset(),
    ) -> None:
        """``values``: the tensors averaged from their values (:class:`WeightedMean`)."""
        self.strategy = strategy
        self._reference = reference
        self._buffer: list[tuple[str, Mapping[str, np.ndarray]]] = []  # robust aggregators only
        # A robust aggregator never reads the running sums: not allocating them saves
        # one model's worth of memory next to the n buffered updates.
        self._plain = (
            None if strategy.robust else WeightedMean(reference, compact=compact, values=values)
        )  # Σ w Δ or Σ Δ (blur)
        self._by_level = (
            WeightedMean(reference, compact=compact, values=values) if strategy.name == "blur" else None
        )  # Σ L Δ
        self.levels: dict[str, float] = {}  # blur: sender -> L
        self.weights: dict[str, float] = {}  # sender -> weight in the aggregate
        self.dropped: dict[str, float] = {}  # sender -> the value that dropped it

    @property
    def _sums(self) -> WeightedMean:
        """The running sums; only a robust aggregator has none (it buffers whole updates)."""
        assert self._plain is not None, f"aggregation {self.strategy.name!r} keeps no running sums"
        return self._plain

    @property
    def count(self) -> int:
        return len(self._buffer) if self.strategy.robust else self._sums.count

    def _value(self, metrics: Mapping[str, float]) -> float:
        key = self.strategy.metric
        if key not in metrics:
            raise UpdateRejected("metadata", f"aggregation {self.strategy.name!r} needs the metric {key!r}")
        v = float(metrics[key])
        if not math.isfinite(v) or v < 0:
            raise UpdateRejected("metadata", f"{key} = {v!r}: must be finite and non-negative")
        return v

    @property
    def streams(self) -> bool:
        """Whether updates may be folded slice by slice (:meth:`plan`/:meth:`fold`/
        :meth:`commit`): not for a robust aggregator (it needs every whole update) nor
        with ``clip_norm`` (the update's norm must be known before any of it is folded)."""
        return self.strategy.streams

    def plan(self, num_samples: int, metrics: Mapping[str, float]) -> Plan:
        s = self.strategy
        if not s.streams:
            raise UpdateRejected(
                "stream",
                f"aggregation {s.name!r}{' with clip_norm' if s.clip_norm is not None else ''} needs whole updates",
            )
        return self._plan(num_samples, metrics)

    def _plan(self, num_samples: int, metrics: Mapping[str, float]) -> Plan:
        s = self.strategy
        if s.name == "fedavg":
            return Plan(float(num_samples))
        if s.name == "metric":
            v = self._value(metrics)
            if v <= 0:
                raise UpdateRejected("metadata", f"{s.metric} = {v!r}: a weight must be positive")
            return Plan(v)
        if s.name == "drop_above":
            v = self._value(metrics)
            assert s.threshold is not None
            return Plan(float(num_samples), dropped=v if v > s.threshold else None)
        return Plan(1.0, level=self._value(metrics))

    def fold(
        self, plan: Plan, name: str, start: int, values: np.ndarray, indices: np.ndarray | None, *, delta: bool
    ) -> None:
        self._sums.fold(name, start, values, indices, plan.weight, delta=delta)
        if plan.level:  # negative when a replay takes an update back out
            assert self._by_level is not None
            self._by_level.fold(name, start, values, indices, plan.level, delta=delta)

    def commit(self, sender: str, plan: Plan) -> None:
        self._sums.count_in(plan.weight)
        if self.strategy.name == "blur":
            if plan.level > 0:
                assert self._by_level is not None
                self._by_level.count_in(plan.level)
            self.levels[sender] = plan.level
        else:
            self.weights[sender] = plan.weight

    def add(
        self, sender: str, update: Mapping[str, np.ndarray], num_samples: int, metrics: Mapping[str, float]
    ) -> bool:
        s = self.strategy
        if s.clip_norm is not None:
            update = clip_to(self._reference, update, s.clip_norm)
        if s.robust:
            self._buffer.append((sender, update))
            self.weights[sender] = 1.0
            return True
        plan = self._plan(num_samples, metrics)
        if plan.dropped is not None:
            self.dropped[sender] = plan.dropped
            return False
        if not (plan.weight > 0 and math.isfinite(plan.weight)):
            raise UpdateRejected("weight", f"weight must be positive, got {plan.weight!r}")
        for name in self._sums._sum:
            self.fold(plan, name, 0, np.asarray(update[name]).reshape(-1), None, delta=False)
        self.commit(sender, plan)
        return True

    def result(self) -> Weights:
        s = self.strategy
        if s.robust:
            senders = [a for a, _ in self._buffer]
            model, chosen = robust_aggregate(
                s.name, self._reference, [u for _, u in self._buffer], f=s.byzantine, trim=s.trim, krum_m=s.krum_m
            )
            kept = {senders[i] for i in chosen}
            self.weights = {a: 1.0 for a in senders if a in kept}
            # Krum's unselected updates are reported like drop_above's drops.
            self.dropped = {a: 0.0 for a in senders if a not in kept}
            self._buffer = []
            return model
        if self.strategy.name != "blur":
            return self._sums.result()
        n, total = len(self.levels), sum(self.levels.values())
        if n == 1 or total == 0:
            self.weights = {a: 1.0 / n for a in self.levels}
            return self._sums.result()
        self.weights = {a: (total - lv) / ((n - 1) * total) for a, lv in self.levels.items()}
        assert self._by_level is not None
        # Σ_n (S − L_n) θ_n / ((n−1)·S) is an affine combination (weights sum to 1), so in
        # differences to the reference: (n·mean(Δ) − mean_L(Δ)) / (n − 1), in place.
        level = self._by_level.mean_delta()
        plain = self._sums.mean_delta()
        for name, d in plain.items():
            d *= d.dtype.type(n)
            d -= level[name]
            d /= d.dtype.type(n - 1)
        return self._sums.cast_delta(plain)
