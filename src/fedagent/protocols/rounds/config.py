"""The configuration of FedAvg rounds (:class:`RoundConfig`), checked when it is made:
every combination that could not work (a quorum no round could reach, differential
privacy or secure aggregation beside what they exclude) is refused with the reason."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fedagent.protocols import secagg as SA
from fedagent.protocols.aggregation import Strategy, check_server_lr
from fedagent.protocols.downlink import check_mode as check_downlink
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.serveropt import check_momentum, default_momentum


@dataclass(frozen=True, slots=True)
class NormBound:
    """How far one update may move the model: its L2 distance from the round's global
    model is scaled down to at most ``multiplier`` × the median of the distances
    accepted over the last ``window`` rounds (never below ``floor``). Until ``warmup``
    distances are known, a round's bound comes from its own updates, once they are all
    in (the machine folds them only then, replayed by its caller)."""

    multiplier: float = 3.0
    window: int = 10
    floor: float = 0.0
    warmup: int = 3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ValueError(f"the norm bound's multiplier must be at least 1, not {self.multiplier!r}")
        if self.window < 1 or self.warmup < 1:
            raise ValueError("the norm bound's window and warm-up must be at least 1")
        if not (math.isfinite(self.floor) and self.floor >= 0):
            raise ValueError(f"the norm bound's floor must be a non-negative number, not {self.floor!r}")


@dataclass(frozen=True, slots=True)
class RoundConfig:
    rounds: int = 10
    min_agents: int = 2  # quorum: no round starts with fewer agents online
    expected_agents: int = 0  # start at once when this many are online (0 = unknown)
    start_grace: float = 5.0  # after quorum, wait this long for more agents to show up
    agents_per_round: int = 0  # sample this many per round (0 = every online agent)
    min_updates: int = 1  # aggregate at the deadline only with at least this many
    round_timeout: float = 120.0
    max_norm: float | None = None  # reject updates whose L2 norm exceeds this
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    strategy: Strategy = field(default_factory=Strategy)
    lr_schedule: str = "constant"  # "constant" | "cosine": lr·½(1+cos(π(r−1)/rounds)) in round r
    server_lr: float = 1.0  # the global model moves this many times the aggregate's step (aggregation.server_step)
    # server momentum β (FedAvgM; protocols/serveropt.py): 0 = none; None = the default,
    # serveropt.default_momentum: 0.7, or 0 for differentially private rounds. Read `momentum`.
    server_momentum: float | None = None
    # how round starts carry the model once a round has been aggregated: "none" whole,
    # "int8" as the int8 step from the previous version (protocols/downlink.py)
    downlink: str = "none"
    dp: DPConfig | None = None  # differential privacy ("central" or "distributed"), see protocols/dp.py
    secure: SA.SecAggParams | None = None  # secure aggregation (protocols/secagg/)
    secure_stage_timeout: float = 0.0  # each key/share/unmask stage of a secure round (0: auto)
    # An update's weight (its num_samples) is at most what its agent announced in its
    # presence and at most this many times the median the round's agents announced (0: off).
    weight_cap: float = 0.0
    # Each update's distance from the global model is scaled down to an adaptive bound
    # (None: off); in secure rounds, the unmasked mean update (single ones are hidden).
    # Inert where updates are bounded otherwise: robust aggregators, clip_norm,
    # differential privacy.
    norm_bound: NormBound | None = None
    # While an agent that reads only whole models is online, at most one round start in
    # this many carries the whole model (it takes part in those rounds only); 1: every one.
    whole_model_every: int = 1

    @property
    def stage_timeout(self) -> float:
        return self.secure_stage_timeout or min(30.0, self.round_timeout / 6)

    @property
    def bounds_norms(self) -> bool:
        """Whether the adaptive norm bound applies: updates are folded by a streaming
        strategy, without a privacy clip or masks that bound (or hide) them already."""
        return self.norm_bound is not None and self.strategy.streams and self.dp is None and self.secure is None

    @property
    def bounds_secure_mean(self) -> bool:
        """Whether the adaptive norm bound applies to a secure round's unmasked mean (the
        single updates are hidden; outside differential privacy, which clips them)."""
        return self.norm_bound is not None and self.secure is not None and self.dp is None

    @property
    def caps_weights(self) -> bool:
        """Whether update weights (sample counts) are capped: FedAvg weights by samples
        (``fedavg``, ``drop_above``), outside privacy rounds (a secure round caps the
        samples that weigh 1 instead, :meth:`Influence.max_weight`)."""
        return self.weight_cap > 0 and self.strategy.name in ("fedavg", "drop_above") and self.dp is None

    @property
    def momentum(self) -> float:
        """The server momentum β these rounds take: ``server_momentum``, or when it is
        None the default for them (none under differential privacy)."""
        if self.server_momentum is None:
            return default_momentum(private=self.dp is not None)
        return self.server_momentum

    def lr_for(self, round_: int) -> float:
        if self.lr_schedule == "constant":
            return self.train.lr
        return self.train.lr * 0.5 * (1.0 + math.cos(math.pi * (min(round_, self.rounds) - 1) / self.rounds))

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', not {self.lr_schedule!r}")
        check_server_lr(self.server_lr)
        if self.server_momentum is not None:
            check_momentum(self.server_momentum)
        check_downlink(self.downlink)
        if self.rounds < 1 or self.min_agents < 1 or self.min_updates < 1:
            raise ValueError("rounds, min_agents and min_updates must be at least 1")
        if self.min_updates > self.min_agents:
            raise ValueError("min_updates cannot exceed min_agents: a round could never aggregate")
        if self.agents_per_round and self.agents_per_round < self.min_updates:
            raise ValueError("agents_per_round is below min_updates: no round could aggregate")
        if not (self.round_timeout > 0 and self.start_grace >= 0):
            raise ValueError("round_timeout must be positive and start_grace non-negative")
        if not (math.isfinite(self.weight_cap) and (self.weight_cap == 0 or self.weight_cap >= 1)):
            raise ValueError(f"weight_cap must be 0 (off) or at least 1, not {self.weight_cap!r}")
        if type(self.whole_model_every) is not int or self.whole_model_every < 1:
            raise ValueError(f"whole_model_every must be a positive integer, not {self.whole_model_every!r}")
        # A round may be aggregated from as few as min_updates: the robust aggregator's
        # precondition must hold there, or a Byzantine minority could win such a round.
        self.strategy.check_preconditions(self.min_updates)
        if self.dp is not None:
            if self.dp.mode == "local":
                raise ValueError("privacy mode 'local' is for gossip; a FedAvg round takes 'central' or 'distributed'")
            if self.strategy.name != "fedavg" or self.strategy.clip_norm is not None:
                raise ValueError(
                    f"differential privacy averages clipped updates with equal weight: it replaces aggregation "
                    f"{self.strategy.name!r}{' with clip_norm' if self.strategy.clip_norm is not None else ''} "
                    "(set aggregation = 'fedavg' and no clip_norm; [privacy] clip_norm is the bound)"
                )
            if self.dp.mode == "distributed" and self.dp.adaptive and self.secure is None:
                raise ValueError(
                    "adaptive clipping with distributed DP needs secure aggregation: each agent's "
                    "clipped-or-not bit travels, noised, inside the masked sum (set [rounds] "
                    "secure_aggregation = true, or a fixed clip_norm)"
                )
            if self.train.compression != "none":
                raise ValueError(
                    f"compression = {self.train.compression!r} applies to streamed updates, and differential "
                    "privacy takes whole updates (their norm is needed first): drop one of them"
                )
            if self.train.stream:
                object.__setattr__(self, "train", replace(self.train, stream=False))
        if self.secure is not None:
            check_secure(self)
            if self.train.stream:
                object.__setattr__(self, "train", replace(self.train, stream=False))
        if not self.strategy.streams:
            # A robust aggregator or clip_norm needs each update whole: the round tells
            # the agents so (an agent never guesses the coordinator's strategy).
            if self.train.compression != "none":
                raise ValueError(
                    f"compression = {self.train.compression!r} applies to streamed updates, and "
                    f"aggregation {self.strategy.name!r}"
                    f"{' with clip_norm' if self.strategy.clip_norm is not None else ''} "
                    f"takes whole updates: drop one of them"
                )
            if self.train.stream:
                object.__setattr__(self, "train", replace(self.train, stream=False))


def check_secure(cfg: RoundConfig) -> None:
    """Refuse (ValueError) what cannot be combined with secure aggregation: the
    coordinator sees only the sum, so nothing that reads one update can run."""
    st = cfg.strategy
    if st.robust:
        raise ValueError(
            f"secure aggregation hides each update, and aggregation {st.name!r} reads every update "
            "(a median, trimmed mean or Krum needs them one by one): use aggregation = 'fedavg'"
        )
    if st.name != "fedavg":
        raise ValueError(
            f"secure aggregation weighs updates by their samples; aggregation {st.name!r} weighs or drops "
            "them by a metric the sum no longer shows: use aggregation = 'fedavg'"
        )
    if st.clip_norm is not None or cfg.max_norm is not None:
        raise ValueError(
            "secure aggregation hides each update's norm: clip_norm and max_norm cannot be checked by the "
            "coordinator (clip on the agents instead: the privacy clipping stage runs before masking)"
        )
    if cfg.train.compression != "none":
        raise ValueError(
            f"compression = {cfg.train.compression!r} cannot be combined with secure aggregation: masked "
            "values are uniform 32-bit integers (nothing to compress), and top-k updates with different "
            "supports cannot be summed under masks; the quantisation (secure_bits) is the compression"
        )
    if cfg.dp is not None and cfg.dp.mode != "distributed":
        raise ValueError(
            "secure aggregation combines with differential privacy in mode 'distributed' only: central DP "
            "clips each update at the coordinator, which sees only the sum (set [privacy] mode = 'distributed')"
        )
    if cfg.secure_stage_timeout < 0 or cfg.stage_timeout * 3 > cfg.round_timeout:
        raise ValueError(
            "secure_stage_timeout must be at most a third of round_timeout (the survivor list and the "
            "unmasking each get one after the masked inputs; keys, shares and training share the rest), "
            "or 0 for min(30 s, round_timeout / 6)"
        )
