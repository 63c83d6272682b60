"""How much one member can move the global model, and how long one that spoils rounds
sits out (pure code, the round machine's collaborators).

A member holds a valid certificate, so everything it sends is validly signed; what it
claims is still only its word. Two claims decide its influence on a FedAvg mean:

* its **weight**, the ``num_samples`` it reports with its update. :class:`Influence`
  caps it at what the agent announced in its presence and at ``weight_cap`` × the median
  of what the round's agents announced (the counts frozen when the round starts), so a
  member claiming 10^9 samples weighs at most ``weight_cap`` median agents;
* its **distance** from the global model (the L2 norm of its delta). Each update is
  scaled down to at most ``multiplier`` × the median of the distances accepted over the
  last ``window`` rounds (never below ``floor``). A median of many honest updates is
  not moved by one member; until ``warmup`` distances are known, a round's bound comes
  from its own updates, once they are all in.

A streamed update is folded chunk by chunk and its distance is known only at its end.
Parts are folded while the running distance stays within the round's bound; an update
that crosses it (or any update of a round still warming up) is *held back*: nothing more
of it is folded, and once it has ended well the round machine asks its caller to replay
it from the round's journal (:class:`~fedagent.protocols.rounds.events.Refold`), taking
out the prefix folded at full weight and folding the whole update scaled to the bound.
The same replay takes out what was folded of an update that fails after its first parts
(a digest mismatch, a transfer cut off, a round deadline), so such an update no longer
spoils the round. Memory stays the streaming path's: nothing of an update is kept.

:class:`Bench` keeps the agents whose updates failed after parts of them were folded
out of the next rounds, for a number that doubles with each offence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from fedagent.protocols.aggregation import Plan, StrategyAggregator
from fedagent.protocols.compression import float_values
from fedagent.protocols.rounds.config import NormBound
from fedagent.protocols.streaming import UpdatePart

#: Rounds an agent sits out at most, however often it offends.
MAX_BENCH = 64


def lower_median(values: Iterable[float]) -> float:
    """The lower median (of an even count, the smaller middle value: one member out of
    two cannot raise it)."""
    s = sorted(values)
    if not s:
        raise ValueError("no values")
    return s[(len(s) - 1) // 2]


class Bounded(Protocol):
    """What :class:`Influence` reads of a machine's configuration (rounds' or a buffer's)."""

    @property
    def weight_cap(self) -> float: ...
    @property
    def norm_bound(self) -> NormBound | None: ...
    @property
    def caps_weights(self) -> bool: ...
    @property
    def bounds_norms(self) -> bool: ...
    @property
    def bounds_secure_mean(self) -> bool: ...


class Influence:
    """The weight cap and the norm bound of one round (or one buffer of asynchronous
    updates), and the distances of recent rounds (buffers)."""

    def __init__(self, config: Bounded, history: Sequence[Sequence[float]] = ()) -> None:
        self.weight_cap = config.weight_cap if config.caps_weights else 0.0
        self.norm = config.norm_bound if config.bounds_norms or config.bounds_secure_mean else None
        window = self.norm.window if self.norm is not None else 1
        self._window: deque[tuple[float, ...]] = deque(
            (tuple(float(x) for x in r) for r in list(history)[-window:]), maxlen=window
        )
        self._announced: dict[str, int] = {}
        # The lower median of the positive announced counts (None: there are none), read
        # for every update's weight; taken again only after the counts changed (sorting
        # the N counts per update made a round of N updates O(N² log N)).
        self._median: float | None = None
        self._median_stale = True
        self.bound: float | None = None  # this round's, from earlier rounds (None: warming up, or off)
        self._norms: dict[str, float] = {}  # accepted this round: agent -> distance as folded
        self.bounded: dict[str, dict[str, float]] = {}  # this round: agent -> what was bounded
        self.last: dict[str, dict[str, float]] = {}  # the last aggregated round's

    @property
    def bounds_norms(self) -> bool:
        return self.norm is not None

    # -- a round -----------------------------------------------------------------------
    def open(self, agents: Iterable[str], announced: Mapping[str, int]) -> None:
        """A round starts with ``agents``; ``announced``: the samples their presence said."""
        self._announced = {a: max(0, int(announced.get(a, 0))) for a in agents}
        self._median_stale = True
        self.bound = self._window_bound()
        self._norms = {}
        self.bounded = {}

    def announce(self, agent: str, samples: int, *, joins: bool = False) -> None:
        """A selected agent's presence came during the round (after a restart the round is
        resumed before any presence): its count counts if none was known. ``joins``: an
        agent the round did not know counts too (a buffer is open to every agent)."""
        known = self._announced.get(agent)
        if (known == 0 or (known is None and joins)) and samples > 0:
            self._announced[agent] = int(samples)
            self._median_stale = True

    def samples(self, agent: str, claimed: int) -> int:
        """The weight ``agent``'s update carries for ``claimed`` samples."""
        if not self.weight_cap:
            return claimed
        used = claimed
        own = self._announced.get(agent, 0)
        if own > 0:
            used = min(used, own)
        median = self._announced_median()
        if median is not None:
            used = min(used, max(1, math.floor(self.weight_cap * median)))
        if used < claimed:
            self.bounded.setdefault(agent, {}).update(samples=float(claimed), weight=float(used))
        return used

    def _announced_median(self) -> float | None:
        if self._median_stale:
            known = [v for v in self._announced.values() if v > 0]
            self._median = lower_median(known) if known else None
            self._median_stale = False
        return self._median

    def _window_bound(self) -> float | None:
        if self.norm is None:
            return None
        norms = [n for r in self._window for n in r]
        if len(norms) < self.norm.warmup:
            return None
        return max(self.norm.floor, self.norm.multiplier * lower_median(norms))

    def final_bound(self, pending: Iterable[float]) -> float:
        """The round's bound once all its updates are in: the one from earlier rounds, or
        while warming up, from those and this round's distances (``pending``: those of
        the updates held back)."""
        assert self.norm is not None
        if self.bound is not None:
            return self.bound
        norms = [n for r in self._window for n in r] + list(self._norms.values()) + list(pending)
        if not norms:
            return self.norm.floor
        return max(self.norm.floor, self.norm.multiplier * lower_median(norms))

    @staticmethod
    def scale(norm: float, bound: float) -> float:
        """What an update of distance ``norm`` is multiplied by to be within ``bound``."""
        return 1.0 if norm <= bound else bound / norm

    def accepted(self, agent: str, norm: float, bound: float | None) -> None:
        """``agent``'s update is in the round's sums at distance min(norm, bound)."""
        if bound is not None and norm > bound:
            self.bounded.setdefault(agent, {}).update(norm=float(norm), bound=float(bound))
            norm = bound
        self._norms[agent] = float(norm)

    def max_weight(self, agents: Iterable[str], announced: Mapping[str, int]) -> int:
        """A secure round's W (the samples that weigh 1): the largest count the round's
        agents announced, at most ``weight_cap`` × their median. Each masked update is
        weighted min(n, W)/W by its own agent, so one member's claim of 10^9 samples
        weighs as much as the heaviest honest agent instead of scaling every honest
        update down to nothing."""
        counts = [max(1, int(announced.get(a, 0))) for a in agents]
        top = max(counts, default=1)
        if self.weight_cap and counts:
            top = min(top, max(1, math.floor(self.weight_cap * lower_median(counts))))
        return top

    def bound_mean(self, norm: float) -> float:
        """A secure round's unmasked mean update, at distance ``norm`` from the model, is
        scaled by the factor returned to be within the bound, from the means of recent
        secure rounds (the single updates are hidden: the mean is what is bounded, and
        one out-of-range input cannot push it beyond ``multiplier`` × a typical mean);
        its distance joins the window."""
        assert self.norm is not None
        bound = self.final_bound([norm])
        if norm > bound:
            self.bounded["(mean)"] = {"norm": float(norm), "bound": float(bound)}
        self._norms = {"(mean)": min(norm, bound)}
        return self.scale(norm, bound)

    def aggregated(self, participants: Iterable[str]) -> dict[str, dict[str, float]]:
        """The round is aggregated from ``participants``: their distances join the window;
        returns what was bounded of each."""
        parts = list(participants)
        if "(mean)" in self._norms:
            parts.append("(mean)")
        if self.norm is not None:
            self._window.append(tuple(self._norms[a] for a in parts if a in self._norms))
        self.last = {a: dict(self.bounded[a]) for a in parts if a in self.bounded}
        return dict(self.last)

    # -- what is kept and shown ----------------------------------------------------------
    def state(self) -> list[list[float]]:
        """The distances of recent rounds (a checkpoint keeps them: a restart does not
        warm up again)."""
        return [list(r) for r in self._window]

    def status(self) -> dict[str, object]:
        norms = [n for r in self._window for n in r]
        return {
            "weight_cap": self.weight_cap or None,
            "norm_bound": None
            if self.norm is None
            else {
                "bound": self.bound,
                "warming_up": self.bound is None,
                "multiplier": self.norm.multiplier,
                "median": lower_median(norms) if norms else None,
                "window_rounds": len(self._window),
            },
            "last_round": dict(self.last),
        }


def scaled(plan: Plan, factor: float) -> Plan:
    """``plan`` with its weights (both sums of blur) multiplied by ``factor``."""
    return replace(plan, weight=plan.weight * factor, level=plan.level * factor)


#: Values of a part whose squares are summed at a time, in float64 (a scratch of 128 KiB).
#: A part is up to a chunk of its stream (256 KiB of int8 values at least): float64
#: copies of a whole one were 2 MB each, half a 4.4 MB model at the coordinator's peak.
SQ_BLOCK = 1 << 14


def _blocks(part: UpdatePart, ref: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The part's values and the global model's values where they go (``ref``, the
    tensor), a block at a time (int8 steps decoded a block at a time too)."""
    data = part.data.reshape(-1)
    flat = ref.reshape(-1)
    for s in range(0, data.size, SQ_BLOCK):
        e = min(data.size, s + SQ_BLOCK)
        where = slice(part.start + s, part.start + e) if part.indices is None else part.indices[s:e]
        yield float_values(data[s:e], part.scale), flat[where]


def part_sq_distance(ref: np.ndarray, part: UpdatePart) -> float:
    """Squared L2 distance a part's values add to their update's distance from ``ref``
    (the global model's tensor): the values themselves when they are deltas. In float64,
    a block at a time."""
    total = 0.0
    scratch = np.empty(min(part.size, SQ_BLOCK), np.float64)
    for vals, g in _blocks(part, ref):
        t = scratch[: vals.size]
        if part.delta:
            np.copyto(t, vals)
        else:
            np.subtract(vals, g, out=t, dtype=np.float64)
        np.square(t, out=t)
        total += float(t.sum())
    return total


def part_sq_norm_change(ref: np.ndarray, part: UpdatePart) -> float:
    """What a part adds to its update's squared L2 norm (``max_norm``): the squares of
    the values it brings (the global model's plus the deltas, when they are deltas)
    less those of the global model's values they replace. In float64, a block at a time."""
    total = 0.0
    n = min(part.size, SQ_BLOCK)
    new, old = np.empty(n, np.float64), np.empty(n, np.float64)
    for vals, g in _blocks(part, ref):
        a, b = new[: vals.size], old[: vals.size]
        np.copyto(b, g)
        if part.delta:
            np.add(b, vals, out=a)
        else:
            np.copyto(a, vals)
        total += float(np.square(a, out=a).sum() - np.square(b, out=b).sum())
    return total


@dataclass(slots=True)
class Replay:
    """An update to replay once every update it is aggregated with is in: its first
    ``prefix`` values were folded at the plan's weight; the whole update goes in at
    ``scale`` × that weight (0: taken out; None: decided by the bound once every update
    is in)."""

    tid: str | None  # the stream's transfer id; None: a whole update
    plan: Plan
    prefix: int
    scale: float | None
    norm: float = 0.0
    count: bool = True  # an accepted update (counted in once replayed); False: only taken out
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    leaving: bool = False
    done: int = 0  # values replayed so far
    commit: Plan | None = None  # what it counts for in the mean, when not ``plan`` (a buffer's staleness damping)

    def fold(self, acc: StrategyAggregator, part: UpdatePart, *, delta: bool) -> None:
        """One part of the update, replayed in the order its parts came: what was folded
        of it at full weight is taken out, and the part folded at the scale."""
        assert self.scale is not None
        vals = part.values
        n = vals.size
        lo, hi = self.done, self.done + n
        self.done = hi
        cut = min(max(self.prefix - lo, 0), n)  # values of this part in the folded prefix
        for a, b, factor in ((0, cut, self.scale - 1.0), (cut, n, self.scale)):
            if b <= a or factor == 0.0:
                continue
            if part.indices is None:
                start, idx = part.start + a, None
            else:
                start, idx = 0, part.indices[a:b]
            acc.fold(scaled(self.plan, factor), part.name, start, vals[a:b], idx, delta=delta)


class Bench:
    """Agents that spoiled an update after parts of it were folded sit out rounds: one
    round after a first offence, then 2, 4, ... up to :data:`MAX_BENCH`; each update of
    theirs accepted later forgives one offence."""

    def __init__(self) -> None:
        self._offences: dict[str, int] = {}
        self._until: dict[str, int] = {}  # agent -> last round it sits out

    def offend(self, agent: str, round_: int) -> int:
        """``agent`` spoiled its update of ``round_``: the rounds it now sits out."""
        k = self._offences.get(agent, 0) + 1
        self._offences[agent] = k
        rounds = min(MAX_BENCH, 2 ** (k - 1))
        self._until[agent] = max(self._until.get(agent, 0), round_ + rounds)
        return rounds

    def forgive(self, agent: str) -> None:
        k = self._offences.get(agent, 0)
        if k > 1:
            self._offences[agent] = k - 1
        elif k:
            del self._offences[agent]

    def benched(self, round_: int) -> set[str]:
        """The agents that sit out round ``round_``."""
        for a in [a for a, until in self._until.items() if until < round_]:
            del self._until[a]
        return set(self._until)

    def status(self) -> dict[str, dict[str, int]]:
        return {a: {"until_round": u, "offences": self._offences.get(a, 0)} for a, u in sorted(self._until.items())}
