"""The configuration of a gossip node (:class:`GossipConfig`), checked when it is made,
and how many neighbour models a screening merge needs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedagent.protocols.aggregation import ROBUST

CREATE_MODES = ("mu", "um", "rw")
MERGE_MODES = ("pushsum", "thesis", "average")
AGGREGATIONS = ("mean",) + ROBUST  # "mean": the merge above; the others: a screening merge
FREQUENT_STEPS = 10  # thesis §4.2.2: exchange every 10 local batches
INFREQUENT_STEPS = 500  # thesis §4.2.3: exchange every 500 local batches


def neighbours_needed(aggregation: str, byzantine: int) -> int:
    """Neighbour models (besides the node's own) a screening merge with ``aggregation``
    needs so that ``byzantine`` of them cannot steer it; n = this + 1 models enter it.

    median: f < n/2; trimmed mean (f dropped at each end): n >= 2f + 1; Krum: n > 2f + 2.
    At least one neighbour in every case: a merge of one's own model alone is no merge."""
    if aggregation == "krum":
        return 2 * byzantine + 2
    if aggregation in ("median", "trimmed_mean"):
        return max(1, 2 * byzantine)
    return 1


# ---- configuration -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GossipConfig:
    period_steps: int = FREQUENT_STEPS
    max_incoming: int = 2  # models kept per period; extras dropped at random
    create: str = "mu"  # "mu" | "um" | "rw" (Alg. 2.4)
    merge: str = "pushsum"  # "pushsum" (conserves the mean) | "thesis" (Alg. 3.1) | "average"
    exchange: tuple[str, ...] | None = None  # names that travel; None = all
    send_timeout: float = 30.0  # seconds without an ack before a new peer is chosen
    max_retries: int = 2  # new peers tried for one payload before folding it back
    periods: int = 0  # stop after this many exchanges (thesis GLsteps); 0 = never
    seed: int = 0
    catch_up: bool = True  # push-sum: a newcomer's first merge adopts far older models
    max_norm: float | None = None  # refuse a received model whose L2 norm exceeds this
    clip_norm: float | None = None  # cap a received model's distance from ours before it is kept
    aggregation: str = "mean"  # "mean" (merge above) | "median" | "trimmed_mean" | "krum" (screening)
    byzantine: int = 0  # screening: Byzantine neighbours tolerated among a merge's models
    fanout: int = 1  # peers the model is sent to per period
    neighbour_ttl: int = 10  # screening: periods a neighbour's latest model stays usable
    outer_step: float = 1.0  # adopt start + this x (trained - start) after each period (1: as trained)
    # tensors the outer step takes as trained, never extrapolated: the model's buffers
    # (a running variance extrapolated can turn negative) and frozen parameters
    fixed: frozenset[str] = frozenset()

    @property
    def robust(self) -> bool:
        return self.aggregation != "mean"

    def __post_init__(self) -> None:
        for name in ("max_norm", "clip_norm"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, not {v!r}")
        if self.period_steps < 1 or self.max_incoming < 1:
            raise ValueError("period_steps and max_incoming must be at least 1")
        if self.create not in CREATE_MODES:
            raise ValueError(f"create must be one of {CREATE_MODES}, not {self.create!r}")
        if self.merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {MERGE_MODES}, not {self.merge!r}")
        if self.exchange is not None:
            if not self.exchange or len(set(self.exchange)) != len(self.exchange):
                raise ValueError("exchange must name at least one parameter, each once")
        if not self.send_timeout > 0 or self.max_retries < 0 or self.periods < 0:
            raise ValueError("send_timeout must be positive, max_retries and periods non-negative")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if not (math.isfinite(self.outer_step) and self.outer_step > 0):
            raise ValueError(f"outer_step must be a positive number, not {self.outer_step!r}")
        if self.fanout < 1 or self.neighbour_ttl < 1 or self.byzantine < 0:
            raise ValueError("fanout and neighbour_ttl must be at least 1, byzantine non-negative")
        if self.byzantine and not self.robust:
            raise ValueError(
                f"byzantine = {self.byzantine} needs a screening aggregation "
                f"({', '.join(ROBUST)}): the mean tolerates no Byzantine peer (clip_norm only "
                "bounds each one's pull)"
            )
        if self.robust and (self.create != "mu" or self.merge != "pushsum"):
            raise ValueError(
                f"aggregation = {self.aggregation!r} replaces the merge: it works with "
                "create = 'mu' and the default merge only"
            )

    @classmethod
    def frequent(cls, **kw: object) -> GossipConfig:
        return cls(period_steps=FREQUENT_STEPS, **kw)  # type: ignore[arg-type]

    @classmethod
    def infrequent(cls, **kw: object) -> GossipConfig:
        return cls(period_steps=INFREQUENT_STEPS, **kw)  # type: ignore[arg-type]
