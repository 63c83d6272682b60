"""Differential privacy of model updates, as pure code (numpy; accounting by dp-accounting).

Three places a federation can add noise, all with the same two knobs, a clipping bound
``C`` and a noise multiplier ``z``:

* **central** (DP-FedAvg, McMahan et al. 2018): the coordinator clips every agent's
  update (its difference from the round's global model) to L2 norm ``C``, sums them
  unweighted, adds Gaussian noise of standard deviation ``z·C`` to the sum and divides by
  the number of updates. The coordinator sees the clear updates; observers of the
  models it publishes (every agent, anyone holding a checkpoint) see only noised sums.
* **distributed**: every agent clips its own update to ``C`` and adds its share of the
  noise, standard deviation ``z·C/√n`` for the ``n`` agents selected, so the sum of the
  round carries ``z·C`` although no single party added it. Under secure aggregation the
  coordinator then never sees an un-noised sum; without it the coordinator sees each
  update with only its share of the noise (weaker, stated in docs/privacy.md).
* **local** (gossip): an agent clips the change since the last model it sent and adds
  noise ``z·C`` to what it sends to its neighbours, and accounts for itself.

Adaptive clipping follows Andrew et al., "Differentially Private Learning with Adaptive
Clipping" (NeurIPS 2021): the bound tracks the ``target_quantile`` of the update norms,
``C ← C·exp(−η·(b̄ − γ))`` with ``b̄`` the noised fraction of updates that were not
clipped. The count is released too, with noise ``σ_b``; the update's noise multiplier is
lowered so that the two releases together cost what ``z`` alone would (the paper's
``z_Δ = (z⁻² − (2σ_b)⁻²)^(−½)``), and the accountant composes both releases as they are.

Privacy accounting is never computed here by hand: :class:`Accountant` composes
``dp_accounting`` events (a Poisson-sampled Gaussian per round, RDP accountant) and asks
it for ε at the configured δ; :func:`calibrate` asks dp-accounting for the noise
multiplier that reaches a target ε in a given number of rounds.

The noise comes from a ``numpy.random.Generator`` the caller passes in: tests pass a
seeded one, the daemons one seeded by the operating system.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from fedagent.protocols.aggregation import Plan, UpdateRejected

Weights = dict[str, np.ndarray]

MODES = ("central", "distributed", "local")


def _dpa() -> Any:
    """dp-accounting, imported on first use: it pulls scipy, so it lives in the
    ``privacy`` extra and a federation without DP never imports it."""
    from fedagent.extras import require

    dpa = require("dp_accounting", "privacy", "differential privacy accounting")
    # Its RDP code logs a warning for every fractional order whose series converges
    # slowly (the order is then left out, which only loosens ε): not the operator's news.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dpa


# ---- configuration -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DPConfig:
    """``[privacy]`` as the pure code sees it (see docs/privacy.md for each key)."""

    mode: str = "central"
    noise_multiplier: float = 1.0  # z: noise std is z·C on a round's sum (per release for "local")
    clip_norm: float = 1.0  # C, or its starting value with adaptive clipping
    delta: float = 1e-5
    epsilon_budget: float | None = None  # the federation stops before ε would pass this
    adaptive: bool = False
    target_quantile: float = 0.5  # γ
    clip_lr: float = 0.2  # η
    count_stddev: float | None = None  # σ_b; None: expected updates per round / 20 (the paper's choice)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"privacy mode must be one of {MODES}, not {self.mode!r}")
        for name in ("noise_multiplier", "clip_norm", "clip_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"privacy {name} must be a positive number, not {v!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy delta must be in (0, 1), not {self.delta!r}")
        if self.epsilon_budget is not None and not (math.isfinite(self.epsilon_budget) and self.epsilon_budget > 0):
            raise ValueError(f"privacy epsilon_budget must be a positive number, not {self.epsilon_budget!r}")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"privacy target_quantile must be in (0, 1), not {self.target_quantile!r}")
        if self.count_stddev is not None and not (math.isfinite(self.count_stddev) and self.count_stddev > 0):
            raise ValueError(f"privacy count_stddev must be a positive number, not {self.count_stddev!r}")
        if self.adaptive and self.count_stddev is not None and 2 * self.count_stddev <= self.noise_multiplier:
            raise ValueError(
                f"adaptive clipping: count_stddev {self.count_stddev:g} is too small for noise_multiplier "
                f"{self.noise_multiplier:g} (needs 2·count_stddev > noise_multiplier; or leave count_stddev out)"
            )
        if self.adaptive and self.mode == "local":
            raise ValueError(
                "adaptive clipping needs the norms of many agents' updates: it works with mode = 'central', "
                "or 'distributed' under secure aggregation, not 'local' (use a fixed clip_norm)"
            )

    def count_std(self, expected_updates: int) -> float:
        """σ_b: as configured, else the paper's expected updates / 20, but at least z so
        that the count never takes more than a quarter of the budget (z_Δ ≤ 1.155·z)."""
        if self.count_stddev is not None:
            return self.count_stddev
        return max(max(expected_updates, 1) / 20.0, self.noise_multiplier)

    def update_noise_multiplier(self, expected_updates: int) -> float:
        """The multiplier of the update's noise: ``z`` itself, or with adaptive clipping the
        part of the budget the count's release leaves (Andrew et al. 2021, section 3.1)."""
        if not self.adaptive:
            return self.noise_multiplier
        two_sb = 2.0 * self.count_std(expected_updates)
        if two_sb <= self.noise_multiplier:
            raise ValueError(
                f"adaptive clipping: count_stddev {two_sb / 2:.3g} is too small for noise_multiplier "
                f"{self.noise_multiplier:.3g} (needs 2·count_stddev > noise_multiplier)"
            )
        return (self.noise_multiplier**-2 - two_sb**-2) ** -0.5


# ---- clipping and noise --------------------------------------------------------------
def delta_norm(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``update − reference`` over the floating tensors."""
    sq = 0.0
    for name, ref in reference.items():
        if ref.dtype.kind == "f":
            sq += float(np.square(np.asarray(update[name], np.float64) - ref).sum())
    return math.sqrt(sq)


def clipped_delta(
    reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray], bound: float
) -> tuple[dict[str, np.ndarray], float]:
    """``update − reference`` scaled down to L2 norm at most ``bound`` (float64, floating
    tensors only: an integer tensor cannot carry noise, so it is never released) and the
    norm it had before."""
    norm = delta_norm(reference, update)
    scale = 1.0 if norm <= bound else bound / norm
    out = {
        name: (np.asarray(update[name], np.float64) - ref) * scale
        for name, ref in reference.items()
        if ref.dtype.kind == "f"
    }
    return out, norm


def add_gaussian(values: dict[str, np.ndarray], std: float, rng: np.random.Generator) -> None:
    """Add N(0, std²) to every coordinate, in place (float64 arrays)."""
    if std <= 0:
        return
    for v in values.values():
        v += rng.normal(0.0, std, size=v.shape)


def rebuild(reference: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> Weights:
    """``reference + delta`` in the reference's dtypes; non-floating tensors stay the reference's."""
    out: Weights = {}
    for name, ref in reference.items():
        out[name] = (ref + delta[name]).astype(ref.dtype) if name in delta else np.array(ref, copy=True)
    return out


def noise_share(
    reference: Mapping[str, np.ndarray],
    update: Mapping[str, np.ndarray],
    clip: float,
    std: float,
    rng: np.random.Generator,
) -> tuple[Weights, float]:
    """Distributed DP, the agent's stage before its update leaves (and before masking,
    under secure aggregation): clip the update's difference from the round's global model
    to ``clip`` and add this agent's share of the round's noise. Returns the weights to
    send and the norm the difference had."""
    delta, norm = clipped_delta(reference, update, clip)
    add_gaussian(delta, std, rng)
    return rebuild(reference, delta), norm


# Probability, per round, that any coordinate of any agent's noised update falls outside
# the secure-aggregation quantisation range :func:`quantisation_range` chooses.
RANGE_MISS = 1e-9


def quantisation_range(clip: float, std: float, coordinates: int, agents: int, miss: float = RANGE_MISS) -> float:
    """The per-coordinate range ``[-R, R]`` a noised update must fit for quantisation
    (secure aggregation) to leave it uncut: a clipped update's coordinate is at most
    ``clip`` in magnitude (its whole L2 norm), the noise ``N(0, std²)`` exceeds ``k·std``
    with probability ``2·(1 − Φ(k))``; ``k`` is chosen so that across ``coordinates``
    values of ``agents`` updates (a union bound) any one falls outside with probability
    at most ``miss``. ``R = clip + k·std``."""
    if std <= 0:
        return clip
    per_value = miss / (2.0 * max(coordinates, 1) * max(agents, 1))
    k = -NormalDist().inv_cdf(per_value)
    return clip + k * std


# The slot an agent's noised clipped-or-not bit takes in its masked update (adaptive
# clipping under secure aggregation): a one-value tensor whose name sorts after every
# model tensor, so it is the last value of the flattened vector.
COUNT_KEY = "~dp/unclipped"


def count_share(norm: float, clip: float, std: float, rng: np.random.Generator) -> np.ndarray:
    """An agent's term of the centred count: ``bᵢ − ½`` (``bᵢ = 1`` when its update was not
    clipped) plus its share of the count's noise, as the one-value tensor ``COUNT_KEY``."""
    return np.array([(1.0 if norm <= clip else 0.0) - 0.5 + rng.normal(0.0, std)])


def with_slots(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> Weights:
    """``reference`` with a zero tensor for each name only ``update`` has (the count slot)."""
    out = dict(reference)
    for name, v in update.items():
        if name not in out:
            out[name] = np.zeros_like(v)
    return out


def values_outside(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray], bound: float) -> int:
    """How many coordinates of ``update − reference`` (floating tensors) exceed ``bound``
    in magnitude: the values a quantisation range of ``±bound`` would cut."""
    return sum(
        int(np.count_nonzero(np.abs(np.asarray(update[name], np.float64) - ref) > bound))
        for name, ref in reference.items()
        if ref.dtype.kind == "f"
    )


# ---- adaptive clipping ---------------------------------------------------------------
@dataclass(slots=True)
class ClipBound:
    """The current clipping bound; with ``adaptive`` it follows the noised quantile."""

    config: DPConfig
    value: float = 0.0
    released: float | None = None  # the noised fraction of unclipped updates the bound last moved by

    def __post_init__(self) -> None:
        if not self.value:
            self.value = float(self.config.clip_norm)

    def update(self, unclipped: int, updates: int, expected: int, rng: np.random.Generator) -> float | None:
        """After a round of ``updates`` of which ``unclipped`` had a norm ≤ the bound:
        release the noised fraction and move the bound geometrically. Returns the
        released fraction (None when the bound is fixed)."""
        cfg = self.config
        if not cfg.adaptive or updates <= 0:
            return None
        # Centred as in the paper: each agent adds b − ½ ∈ {−½, ½}, so one agent more or
        # less moves the sum by at most ½ (the accountant's multiplier is 2·σ_b).
        noised = (unclipped - updates / 2.0) + rng.normal(0.0, cfg.count_std(expected))
        return self.move(noised, updates)

    def move(self, noised: float, updates: int) -> float | None:
        """Move the bound from ``noised``, the centred count Σ(bᵢ − ½) of ``updates`` with
        its noise already on (distributed: each agent added its share under the masks)."""
        cfg = self.config
        if not cfg.adaptive or updates <= 0:
            return None
        frac = noised / updates + 0.5
        self.value *= math.exp(-cfg.clip_lr * (frac - cfg.target_quantile))
        self.released = float(frac)
        return self.released


# ---- the coordinator's side of a round ---------------------------------------------------
class DPAggregator:
    """One round's aggregate under DP: every update counts once (a per-agent bound is
    what makes the sensitivity ``C``; weighting by samples would undo it).

    Central mode clips each update here and adds the noise in :meth:`result`; distributed
    mode receives updates already clipped and noised by their agents and only averages.
    Updates come whole: the norm must be known before any of it enters the sum."""

    def __init__(
        self,
        config: DPConfig,
        reference: Mapping[str, np.ndarray],
        clip: float,
        update_noise_multiplier: float,
        rng: np.random.Generator,
    ) -> None:
        self.config = config
        self._reference = reference
        self.clip = clip
        self.z = update_noise_multiplier
        self._rng = rng
        self._sum: dict[str, np.ndarray] = {
            name: np.zeros(ref.shape, np.float64) for name, ref in reference.items() if ref.dtype.kind == "f"
        }
        self.weights: dict[str, float] = {}
        self.dropped: dict[str, float] = {}
        self.norms: dict[str, float] = {}  # central: each update's norm before clipping
        self.unclipped = 0

    @property
    def count(self) -> int:
        return len(self.weights)

    @property
    def streams(self) -> bool:
        return False

    def plan(self, num_samples: int, metrics: Mapping[str, float]) -> Plan:
        raise UpdateRejected("stream", "differential privacy needs whole updates")

    def fold(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - plan() refuses first
        raise UpdateRejected("stream", "differential privacy needs whole updates")

    def commit(self, sender: str, plan: Plan) -> None:  # pragma: no cover - plan() refuses first
        raise UpdateRejected("stream", "differential privacy needs whole updates")

    def add(
        self, sender: str, update: Mapping[str, np.ndarray], num_samples: int, metrics: Mapping[str, float]
    ) -> bool:
        if self.config.mode == "central":
            delta, norm = clipped_delta(self._reference, update, self.clip)
            self.norms[sender] = norm
            if norm <= self.clip:
                self.unclipped += 1
        else:
            delta = {
                name: np.asarray(update[name], np.float64) - ref
                for name, ref in self._reference.items()
                if ref.dtype.kind == "f"
            }
        for name, s in self._sum.items():
            s += delta[name]
        self.weights[sender] = 1.0
        return True

    def noise_std(self) -> float:
        """Standard deviation of the noise this aggregator adds to the sum itself."""
        return self.z * self.clip if self.config.mode == "central" else 0.0

    def result(self) -> Weights:
        n = self.count
        if n == 0:
            raise ValueError("no update to aggregate")
        add_gaussian(self._sum, self.noise_std(), self._rng)
        for s in self._sum.values():
            s /= n
        out = rebuild(self._reference, self._sum)
        self._sum = {}
        return out


# ---- accounting ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Release:
    """One round's noised release, as the accountant composes it: sampled with
    probability ``q``, Gaussian with these noise multipliers (sensitivity 1)."""

    q: float
    multipliers: tuple[float, ...]

    def to_list(self) -> list[float]:
        return [self.q, *self.multipliers]

    @classmethod
    def from_list(cls, raw: Any) -> Release:
        if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(x, int | float) for x in raw):
            raise ValueError(f"not a privacy release record: {raw!r}")
        q, *zs = (float(x) for x in raw)
        if not (0 < q <= 1 and all(math.isfinite(z) and z > 0 for z in zs)):
            raise ValueError(f"not a privacy release record: {raw!r}")
        return cls(q, tuple(zs))


@functools.lru_cache(maxsize=256)
def _rdp(r: Release) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The accountant's orders and the RDP of one ``r`` at each. Computing it is the slow
    part (~0.3 s for a sampled Gaussian) and RDP composes by addition, so each distinct
    release is computed once."""
    dpa = _dpa()
    acc = dpa.rdp.RdpAccountant()
    acc.compose(_event(dpa, r), 1)
    # dp-accounting keeps these as attributes without a public getter (pinned < 0.7).
    return tuple(float(o) for o in acc._orders), tuple(float(x) for x in acc._rdp)


def _event(dpa: Any, r: Release) -> Any:
    gaussians = [dpa.GaussianDpEvent(z) for z in r.multipliers]
    inner = gaussians[0] if len(gaussians) == 1 else dpa.ComposedDpEvent(gaussians)
    return inner if r.q >= 1.0 else dpa.PoissonSampledDpEvent(r.q, inner)


@dataclass(slots=True)
class Accountant:
    """ε spent so far at ``delta``: dp-accounting's RDP accountant over the releases.

    The releases are kept as records (``to_state``) so a restarted coordinator goes on
    from what it had spent, never from zero."""

    delta: float
    releases: list[Release] = field(default_factory=list)
    _epsilon: float = 0.0

    def _compute(self, releases: Sequence[Release]) -> float:
        if not releases:
            return 0.0
        counts: dict[Release, int] = {}
        for r in releases:
            counts[r] = counts.get(r, 0) + 1
        orders: tuple[float, ...] = ()
        total = None
        for r, count in counts.items():
            orders, rdp = _rdp(r)
            total = count * np.array(rdp) if total is None else total + count * np.array(rdp)
        eps, _ = _dpa().rdp.rdp_privacy_accountant.compute_epsilon(orders, total, self.delta)
        return float(eps)

    @property
    def epsilon(self) -> float:
        return self._epsilon

    def spend(self, release: Release) -> float:
        self.releases.append(release)
        self._epsilon = self._compute(self.releases)
        return self._epsilon

    def epsilon_after(self, release: Release) -> float:
        """ε if ``release`` happened next (nothing is recorded)."""
        return self._compute([*self.releases, release])

    def to_state(self) -> list[list[float]]:
        return [r.to_list() for r in self.releases]

    @classmethod
    def from_state(cls, delta: float, raw: Any) -> Accountant:
        if not isinstance(raw, list):
            raise ValueError("privacy releases must be a list")
        acc = cls(delta, [Release.from_list(x) for x in raw])
        acc._epsilon = acc._compute(acc.releases)
        return acc


def epsilon_for(noise_multiplier: float, rounds: int, delta: float, q: float = 1.0) -> float:
    """ε after ``rounds`` identical releases of a Gaussian with ``noise_multiplier``."""
    acc = Accountant(delta)
    return acc._compute([Release(q, (noise_multiplier,))] * rounds)


@functools.lru_cache(maxsize=64)
def calibrate(target_epsilon: float, rounds: int, delta: float, q: float = 1.0) -> float:
    """The smallest noise multiplier whose ``rounds`` releases stay within ``target_epsilon``
    (dp-accounting's calibration search over the RDP accountant)."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0) or rounds < 1:
        raise ValueError("calibrate: target_epsilon must be positive and rounds at least 1")
    dpa = _dpa()
    return float(
        dpa.calibrate_dp_mechanism(
            dpa.rdp.RdpAccountant,
            lambda z: dpa.SelfComposedDpEvent(_event(dpa, Release(q, (z,))), rounds),
            target_epsilon,
            delta,
            dpa.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )


# ---- local DP: what a gossip agent sends ------------------------------------------------
class LocalRelease:
    """Local differential privacy of one gossip agent's outgoing models.

    Each model sent is ``r + clip(w − r, C) + N(0, (z·C)²)`` where ``w`` is the agent's own
    model and ``r`` the last model it released (at first the task's seeded initial model,
    which every agent builds alike): ``r`` is public already, so only the clipped change
    carries private data. Two data sets of this agent give clipped changes at most ``2C``
    apart (a replacement, not an addition: local DP protects the whole data set), so
    each release is a Gaussian mechanism of multiplier ``z/2``, composed by the
    accountant over every release (retries and fan-out included). Models sent back to
    their origin (push-sum returns) are another agent's release and cost nothing."""

    def __init__(
        self,
        config: DPConfig,
        reference: Mapping[str, np.ndarray],
        rng: np.random.Generator,
        releases: Any = None,
    ) -> None:
        if config.mode != "local":
            raise ValueError("LocalRelease is for privacy mode 'local'")
        self.config = config
        self.reference = {k: np.array(v, copy=True) for k, v in reference.items()}
        self._rng = rng
        self.accountant = Accountant.from_state(config.delta, releases or [])

    @property
    def cost(self) -> Release:
        return Release(1.0, (self.config.noise_multiplier / 2.0,))

    def over_budget(self) -> str:
        """Why the next release must not happen, or ''."""
        budget = self.config.epsilon_budget
        if budget is None:
            return ""
        after = self.accountant.epsilon_after(self.cost)
        if after <= budget:
            return ""
        return (
            f"privacy budget reached: epsilon {self.accountant.epsilon:.3f} spent at delta {self.config.delta:g}; "
            f"one more model sent would make it {after:.3f}, above the budget {budget:g}"
        )

    def release(self, weights: Mapping[str, np.ndarray]) -> Weights:
        """The noised model to send for ``weights`` (a subset of the reference's names);
        the release is accounted and becomes the next reference."""
        ref = {k: self.reference[k] for k in weights}
        delta, _ = clipped_delta(ref, weights, self.config.clip_norm)
        add_gaussian(delta, self.config.noise_multiplier * self.config.clip_norm, self._rng)
        out = rebuild(ref, delta)
        self.reference.update(out)
        self.accountant.spend(self.cost)
        return out

    def status(self) -> dict[str, float]:
        out = {
            "epsilon": self.accountant.epsilon,
            "delta": self.config.delta,
            "noise_multiplier": self.config.noise_multiplier,
            "clip_norm": self.config.clip_norm,
            "releases": float(len(self.accountant.releases)),
        }
        if self.config.epsilon_budget is not None:
            out["epsilon_budget"] = self.config.epsilon_budget
        return out
