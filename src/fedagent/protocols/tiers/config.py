"""What each tier of a federation may be configured with, checked when it is made.

A **site tier** (:class:`~fedagent.protocols.tiers.site.SiteMachine`) averages its
members' updates plainly: the model moves once, at the top, so its rounds take the
server learning rate 1 and no momentum and no privacy accounting of their own (the top's
configuration carries them; under distributed DP a site passes the top's calibration
down to its agents, adds no noise and accounts nothing). Secure aggregation is per tier: a site's secure round hides
each agent's update from the site aggregator, an upper tier's hides each site's mean from
the hub (docs/privacy.md, across tiers). Its learning rate and training
settings are the upstream round's, so that every agent trains as it would in a flat
federation.

An **upper tier** (a hub or a region, whose members are site aggregators) averages
site means: a robust aggregator or a norm bound over them would no longer be FedAvg
over the agents, and they belong to the tier that sees individual updates. The top
tier may account distributed DP (``[privacy] mode = "distributed"``, under secure
aggregation at every tier, with a fixed clip): ε once, for the whole cohort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedagent.protocols.rounds import RoundConfig


@dataclass(frozen=True, slots=True)
class TierConfig:
    """A site aggregator's rounds: ``rounds`` is its own quorum (``min_agents``,
    ``min_updates``), deadline cap (``round_timeout``), sampling (``agents_per_round``),
    aggregation and member protections (``strategy``, ``weight_cap``, ``norm_bound``,
    ``max_norm``), and compression (``train.compression``). ``upload_share``: the part
    of the upstream round's deadline kept for the partial result to travel up; a site's
    round ends at most ``(1 − upload_share)`` × the upstream deadline after it starts.
    ``rounds.rounds`` is ignored: a site runs one round per upstream round."""

    rounds: RoundConfig
    upload_share: float = 0.25

    def __post_init__(self) -> None:
        if not (math.isfinite(self.upload_share) and 0 < self.upload_share < 1):
            raise ValueError(f"upload_share must be between 0 and 1 (exclusive), not {self.upload_share!r}")
        check_site(self.rounds)

    def budget(self, upstream_deadline: float) -> float:
        """Seconds a site round may last when the upstream round gives ``upstream_deadline``."""
        return min(self.rounds.round_timeout, upstream_deadline * (1.0 - self.upload_share))


def check_site(cfg: RoundConfig) -> None:
    """Refuse (ValueError) what a site tier's rounds cannot take: the global model moves
    at the top only, once, by the plain mean of its members' means."""
    if cfg.server_lr != 1.0:
        raise ValueError(
            f"a site aggregator averages plainly (server_lr 1, not {cfg.server_lr!r}): the server "
            "learning rate is the top tier's, applied once to the mean over all agents"
        )
    if cfg.server_momentum not in (None, 0.0):
        raise ValueError(
            f"a site aggregator takes no server momentum (not {cfg.server_momentum!r}): the momentum is "
            "the top tier's; a second one at a site would move the model twice"
        )
    if cfg.dp is not None:
        raise ValueError(
            "differential privacy is accounted once, at the top tier: set [privacy] on the hub's "
            "coordinator, not on a site aggregator (its agents add the noise shares the hub's round "
            "starts calibrate; the site adds none and accounts nothing)"
        )
    if cfg.lr_schedule != "constant":
        raise ValueError(
            "a site's agents train with the learning rate of the upstream round (its schedule is the "
            "top tier's): set lr_schedule on the hub"
        )


def check_upper(cfg: RoundConfig) -> None:
    """Refuse (ValueError) what a tier whose members are site aggregators cannot take:
    its mean must be FedAvg over the sites' agents, which a robust aggregator, a clip or a
    norm bound over site means would change (they apply at the sites)."""
    st = cfg.strategy
    if st.name != "fedavg" or st.clip_norm is not None:
        raise ValueError(
            f"a tier of site aggregators averages their means by samples (aggregation 'fedavg' without "
            f"clip_norm, not {st.name!r}): robust aggregation and clipping apply at the sites, which see "
            "the individual updates"
        )
    if cfg.norm_bound is not None:
        raise ValueError(
            "the norm bound applies at the sites, which see the individual updates: a site mean's "
            "distance depends on its size, and bounding it would weigh large sites less"
        )
    dp = cfg.dp
    if dp is not None:
        if dp.mode != "distributed":
            raise ValueError(
                f"[privacy] mode = {dp.mode!r} cannot run over site aggregators: a central clip would bound a "
                "site's mean as if it were one agent's update (the guarantee would be per site); use "
                "mode = 'distributed' (the agents clip and add their noise shares)"
            )
        if cfg.secure is None:
            raise ValueError(
                "distributed differential privacy across tiers needs [rounds] secure_aggregation = true on "
                "this tier (and on every site aggregator): a site's mean carries only its agents' part of "
                "the noise, which the hub must not see"
            )
        if dp.adaptive:
            raise ValueError(
                "adaptive_clip across tiers is not available: the agents' clipped-or-not count would have "
                "to travel through every tier's secure round; use a fixed [privacy] clip_norm"
            )
