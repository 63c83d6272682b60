"""The round machine of a tier whose members include site aggregators (a hub, a
region): FedAvg rounds in which a site aggregator is one participant weighing what its
agents weigh together.

Only the weight cap differs from a flat federation. A site aggregator announces the sum
of its agents' sample counts, so ``weight_cap`` × the median of the members'
announcements would clip an honest site that is larger than its peers (a site of 200
agents next to three of 10) and the hub's mean would no longer be FedAvg over the
agents. A site aggregator's update is therefore capped at its own announcement only;
individual agents of the same tier are capped as in a flat federation, against the
median of the *agents'* announcements (the sites' totals would raise it). A site
aggregator is trusted with its site's weight as a coordinator is trusted with its
agents': its certificate's role says what it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import AgentOnline, Command, Event, Rejected, RoundConfig, RoundMachine
from fedagent.protocols.rounds.bounds import Influence, lower_median
from fedagent.protocols.tiers.config import check_upper

Weights = dict[str, np.ndarray]


class UpperInfluence(Influence):
    """:class:`~fedagent.protocols.rounds.bounds.Influence` with the site aggregators'
    weight capped at their own announcement (module docstring)."""

    def __init__(
        self, config: RoundConfig, history: Sequence[Sequence[float]], is_aggregator: Callable[[str], bool]
    ) -> None:
        super().__init__(config, history)
        self.is_aggregator = is_aggregator

    def announce(self, agent: str, samples: int, *, joins: bool = False) -> None:
        # A site's total grows while its agents join, and its round may start from an
        # announcement sent just before the upstream round: the latest one counts.
        if agent in self._announced and samples > 0 and self.is_aggregator(agent):
            self._announced[agent] = int(samples)
            self._median_stale = True
        else:
            super().announce(agent, samples, joins=joins)

    def samples(self, agent: str, claimed: int) -> int:
        if not self.weight_cap:
            return claimed
        own = self._announced.get(agent, 0)
        used = min(claimed, own) if own > 0 else claimed
        if not self.is_aggregator(agent):
            known = [v for a, v in self._announced.items() if v > 0 and not self.is_aggregator(a)]
            if known:
                used = min(used, max(1, math.floor(self.weight_cap * lower_median(known))))
        if used < claimed:
            self.bounded.setdefault(agent, {}).update(samples=float(claimed), weight=float(used))
        return used

    def max_weight(self, agents: Iterable[str], announced: Mapping[str, int]) -> int:
        """A secure round's W: the largest announcement, never capped against the median
        of the sites' (as their weight); the agents of a mixed tier are capped as in a
        flat federation."""
        members = list(agents)
        sites = [max(1, int(announced.get(a, 0))) for a in members if self.is_aggregator(a)]
        rest = [a for a in members if not self.is_aggregator(a)]
        top = super().max_weight(rest, announced) if rest else 1
        return max([top, *sites])


class UpperRoundMachine(RoundMachine):
    """A :class:`~fedagent.protocols.rounds.RoundMachine` whose members include site
    aggregators (``is_aggregator`` says which, from their certificates' role). The
    configuration is checked for an upper tier (:func:`~.config.check_upper`).

    **Distributed DP across tiers** (its ``[privacy]`` here, at the top, or the noise of
    the upstream round it answers, in a region): the agents below add the noise shares,
    calibrated for the cohort of every selected site's agents (the sum of their
    announcements), and a site's mean weighs the agents whose shares it carries (W is
    the cohort). Only site aggregators take part: an agent of this tier would mask its
    update weighing its samples, not one share. No sampling amplification is claimed
    (q = 1): a site is selected with all of its agents, so an agent's inclusion is tied to
    its site-mates', which the Poisson analysis does not cover."""

    def __init__(
        self, config: RoundConfig, weights: Weights, *, is_aggregator: Callable[[str], bool], **kwargs: Any
    ) -> None:
        check_upper(config)
        super().__init__(config, weights, **kwargs)
        self.influence = UpperInfluence(config, kwargs.get("norm_history", ()), is_aggregator)
        self.is_aggregator = is_aggregator
        self.site_agents: dict[str, int] = {}  # site aggregator -> the agents it announced

    @property
    def private(self) -> bool:
        """The rounds carry distributed DP's noise (accounted here, or upstream)."""
        return self.config.dp is not None or self.config.train.dp_clip is not None

    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, AgentOnline):
            if self.is_aggregator(event.agent):
                self.site_agents[event.agent] = max(1, event.agents)
            elif self.private:
                return [
                    Rejected(
                        event.agent,
                        0,
                        "role",
                        "distributed differential privacy across tiers weighs each site by its agents' noise "
                        "shares: only site aggregators take part here (connect agents to a site aggregator)",
                    )
                ]
        return super().handle(event, now)

    def noise_cohort(self, agents: Sequence[str]) -> int:
        return sum(self.site_agents.get(a, 1) if self.is_aggregator(a) else 1 for a in agents)

    def noise_shares(self, contributors: Mapping[str, int]) -> int:
        # A site's count under DP is the number of its agents whose updates (and noise
        # shares) its mean holds (each weighed 1 there); trusted as its weight is.
        return sum(max(1, n) if self.is_aggregator(a) else 1 for a, n in contributors.items())

    def sampling_fraction(self, selected: int, population: int) -> float:
        return 1.0 if self.private else super().sampling_fraction(selected, population)

    def dp_weight(self, train: TrainConfig) -> int:
        # W = the cohort: a site's mean of k agents weighs k/W, so the unmasked sum over
        # sites is the sum of every agent's noised update (each weighing 1, as flat). A
        # site never takes more agents than the cohort, so no site's weight is cut.
        return max(1, train.dp_cohort)
