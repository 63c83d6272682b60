"""What a site aggregator's machine is told from upstream, and what it asks its caller
to do besides the round machine's own commands."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedagent.protocols.messages import TrainConfig

Weights = dict[str, np.ndarray]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UpstreamRound:
    """The upstream tier started ``round`` from model ``model_version`` and selected
    this site aggregator for it; ``deadline_s``: the seconds it waits for updates.
    ``everyone``: the round start named no one but selected every member the upstream
    tier counted online when it started it, which this site was only if its presence
    there said online (it had its quorum)."""

    round: int
    model_version: int
    weights: Weights
    train: TrainConfig
    deadline_s: float
    everyone: bool = False


@dataclass(frozen=True, slots=True)
class UpstreamClosed:
    """The upstream tier's ``round`` ended (aggregated or abandoned): a site round still
    running for it has nothing left to send to."""

    round: int


@dataclass(frozen=True, slots=True)
class UpstreamDown:
    """The connection to the upstream tier is lost: a partial result is held, not sent."""


@dataclass(frozen=True, slots=True)
class UpstreamUp:
    """The connection to the upstream tier is back: a held partial result goes up if its
    upstream round may still be open."""


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PartialResult:
    """The site's update for upstream round ``round``: the weighted mean of its agents'
    updates (``weights``, a whole model) and ``num_samples``, the sum of their (capped)
    sample counts, so that the upstream mean over sites is the mean over agents."""

    round: int
    base_version: int
    num_samples: int
    weights: Weights
    metrics: dict[str, float]
    site_round: int
    participants: tuple[str, ...]
    # participant -> its share of the site's mean (as RoundAggregated.weights_used)
    weights_used: dict[str, float] = field(default_factory=dict)
    bounded: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SiteRoundFailed:
    """No partial result for upstream round ``round``: ``reason`` says why (no quorum
    before the site's deadline, too few updates, the upstream round closed first)."""

    round: int
    site_round: int
    reason: str


@dataclass(frozen=True, slots=True)
class Announce:
    """What the site aggregator's presence upstream says: ``num_samples``, the sum of
    the counts its online agents announced (0 while fewer than its quorum are online: it
    is then not a participant upstream), and how many they are."""

    num_samples: int
    agents: int


@dataclass(frozen=True, slots=True)
class PartialDropped:
    """A partial result held while the upstream tier was out of reach is not sent:
    ``reason`` says why (its upstream round closed, or its deadline passed)."""

    round: int
    site_round: int
    reason: str
