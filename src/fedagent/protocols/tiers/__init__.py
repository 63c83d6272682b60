"""Tiers of aggregation, as pure code: site aggregators between agents and the hub.

A site aggregator (:class:`SiteMachine`) is a coordinator for the agents of its site
broker and, towards its upstream tier, one participant whose update is its site's
weighted mean, weighing the sum of its agents' (capped) sample counts: the upstream
FedAvg over sites is then FedAvg over all agents. The site tier averages plainly; the
server learning rate and momentum, the privacy accountant and the model's publication
stay at the top. The member protections (weight cap, norm bound, robust aggregators)
apply at the tier that sees individual updates; a tier whose members are site
aggregators runs an :class:`UpperRoundMachine`, whose weight cap holds a site to its own
announcement. Tiers nest (hub → region → site): a region is a site aggregator whose
members are site aggregators.

:mod:`.config` (what each tier takes), :mod:`.events` (upstream events, the site's
commands), :mod:`.site` (the site aggregator), :mod:`.upper` (the upper tier's round
machine).
"""

from __future__ import annotations

from fedagent.protocols.tiers.config import TierConfig, check_site, check_upper
from fedagent.protocols.tiers.events import (
    Announce,
    PartialDropped,
    PartialResult,
    SiteRoundFailed,
    UpstreamClosed,
    UpstreamDown,
    UpstreamRound,
    UpstreamUp,
)
from fedagent.protocols.tiers.site import SiteMachine
from fedagent.protocols.tiers.upper import UpperInfluence, UpperRoundMachine

__all__ = [
    "Announce",
    "PartialDropped",
    "PartialResult",
    "SiteMachine",
    "SiteRoundFailed",
    "TierConfig",
    "UpperInfluence",
    "UpperRoundMachine",
    "UpstreamClosed",
    "UpstreamDown",
    "UpstreamRound",
    "UpstreamUp",
    "check_site",
    "check_upper",
]
