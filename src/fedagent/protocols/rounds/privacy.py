"""The differential privacy of FedAvg rounds, as the round machine's collaborator: the
accountant every aggregate is charged to, the clip bound (fixed, or moved round by round
by the noised fraction of unclipped updates), the noise a round's sum must carry, and
whether the budget allows the next release (:mod:`fedagent.protocols.dp` has the
mechanisms)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fedagent.protocols.dp import Accountant, ClipBound, DPAggregator, DPConfig, Release
from fedagent.protocols.messages import TrainConfig

Weights = dict[str, np.ndarray]


class PrivacyBudget:
    """What differential privacy costs, round by round. ``state``: what a checkpoint kept
    (:meth:`state`), so that a restart goes on spending from there; ``rng`` draws the
    noise."""

    def __init__(self, config: DPConfig, state: Mapping[str, object] | None, rng: np.random.Generator) -> None:
        self.config = config
        state = state or {}
        self.accountant = Accountant.from_state(config.delta, state.get("releases", []))
        clip = state.get("clip_norm")
        self.clip = ClipBound(config, float(clip) if isinstance(clip, int | float) and clip > 0 else 0.0)
        self.rng = rng
        # Distributed: the noise shares the last release carried, of how many calibrated for.
        self.shares: tuple[int, int] | None = None

    def state(self) -> dict[str, object]:
        """What a checkpoint keeps: the releases charged so far and the clip bound."""
        return {"releases": self.accountant.to_state(), "clip_norm": self.clip.value}

    def report(self) -> dict[str, float]:
        """ε spent at δ, the budget and the current clip bound and noise (status, history)."""
        dp = self.config
        out = {
            "epsilon": self.accountant.epsilon,
            "delta": dp.delta,
            "noise_multiplier": dp.noise_multiplier,
            "clip_norm": self.clip.value,
            "releases": float(len(self.accountant.releases)),
        }
        if dp.epsilon_budget is not None:
            out["epsilon_budget"] = dp.epsilon_budget
        if self.shares is not None:
            out["noise_shares"], out["cohort"] = float(self.shares[0]), float(self.shares[1])
        if self.clip.released is not None:
            # adaptive clipping: the noised fraction of unclipped updates C last moved by
            out["unclipped_fraction"] = self.clip.released
        return out

    def release(self, selected: int, answered: int, q: float) -> Release:
        """The round's release as the accountant sees it. Central: noise z_Δ·C on the sum
        (and, adaptive, the count's σ_b on a sensitivity of ½). Distributed: each of the
        ``selected`` agents added z·C/√selected, so ``answered`` of them carry z·√(answered/selected).
        Across tiers ``selected`` is the cohort the shares were calibrated for, and more
        shares than that (a site that grew after its announcement) are charged as ``selected``."""
        dp = self.config
        # Distributed: the answered shares of each noise (update, and with adaptive
        # clipping the count's) carry √(answered/selected) of it.
        f = math.sqrt(min(answered, selected) / selected) if dp.mode == "distributed" else 1.0
        zs: tuple[float, ...] = (dp.update_noise_multiplier(selected) * f,)
        if dp.adaptive:
            zs += (2.0 * dp.count_std(selected) * f,)
        return Release(q, zs)

    def over_budget(self, selected: int, q: float, answered: int | None = None) -> str:
        """Why the next round must not run (its release would pass the budget), or ''.
        ``answered``: the updates the round's sum holds, when known (distributed DP: fewer
        than ``selected`` carry less noise and cost more)."""
        dp = self.config
        if dp.epsilon_budget is None:
            return ""
        after = self.accountant.epsilon_after(self.release(selected, selected if answered is None else answered, q))
        if after <= dp.epsilon_budget:
            return ""
        if answered is not None:
            return (
                f"privacy budget: the sum of {answered} of {selected} noise shares would take epsilon from "
                f"{self.accountant.epsilon:.3f} to {after:.3f}, above the budget {dp.epsilon_budget:g}"
            )
        return (
            f"privacy budget reached: epsilon {self.accountant.epsilon:.3f} spent at delta {dp.delta:g}; "
            f"one more round would make it {after:.3f}, above the budget {dp.epsilon_budget:g}"
        )

    def aggregator(self, weights: Weights, selected: int) -> DPAggregator:
        """The aggregator of a round of ``selected`` agents: clipped updates, equal weights,
        the sum noised (central) or already noised by the agents (distributed)."""
        return DPAggregator(
            self.config, weights, self.clip.value, self.config.update_noise_multiplier(selected), self.rng
        )

    def train(self, train: TrainConfig, selected: int) -> TrainConfig:
        """The round's training settings: under distributed DP each agent clips its update
        and adds its share of the noise (and, adaptive, of the count's), calibrated for
        ``selected`` agents (the round says how many)."""
        dp = self.config
        if dp.mode != "distributed":
            return train
        root = math.sqrt(selected)
        share = dp.update_noise_multiplier(selected) * self.clip.value / root
        train = replace(train, dp_clip=self.clip.value, dp_noise_std=share, dp_cohort=selected)
        if dp.adaptive:  # (under secure aggregation: RoundConfig checks)
            train = replace(train, dp_count_std=dp.count_std(selected) / root)
        return train

    def charge(self, selected: int, answered: int, q: float) -> None:
        """An aggregate of ``answered`` of ``selected`` updates was released."""
        self.accountant.spend(self.release(selected, answered, q))
        if self.config.mode == "distributed":
            self.shares = (answered, selected)
