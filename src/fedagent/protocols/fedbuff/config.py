"""The configuration of asynchronous buffered FedAvg (:class:`BufferConfig`), checked
when it is made: what cannot work with updates that arrive one at a time, from models of
different ages, is refused with the reason."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fedagent.protocols.aggregation import Strategy, check_server_lr
from fedagent.protocols.downlink import check_mode as check_downlink
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.config import NormBound
from fedagent.protocols.serveropt import check_momentum

#: Staleness beyond which nothing is accepted, whatever the configuration says.
MAX_STALENESS = 10_000
#: The server momentum when ``[rounds] server_momentum`` is not set: none, unlike rounds
#: (0.7). Updates trained from older models already keep pushing the way earlier steps
#: went ("asynchrony begets momentum": Mitliagkas et al., 2016); measured on the
#: benchmark's CNN with three of ten agents five times slower, momentum 0.7 on top made
#: a buffer of 5 collapse (0.26 accuracy after 400 updates) where none reached 95 %
#: (docs/modes/async.md, "The choices, and why").
DEFAULT_MOMENTUM = 0.0


@dataclass(frozen=True, slots=True)
class BufferConfig:
    """``buffer_size`` updates make a model (K); an update trained from a model
    ``s`` versions older than the current one (its staleness) weighs ``(1 + s) ** −a``
    of its samples (``a = staleness_exponent``; 0.5: 1/√(1+s)) and is refused when
    ``s > max_staleness``. At most ``concurrency`` agents train at once (0: every agent
    online); a task not answered within ``task_timeout`` frees its place (its update is
    still taken later, within the staleness bound). ``versions`` models are published,
    then training ends (0: until the coordinator is stopped). ``whole``: updates travel whole (their norm is needed before any
    of them is added: ``clip_norm``, central DP), otherwise as streams of deltas.

    ``weight_cap`` and ``norm_bound`` are the member protections of FedAvg rounds
    (:class:`~fedagent.protocols.rounds.bounds.Influence`), a buffer taking the place of
    a round: an update weighs at most the samples its agent announced and ``weight_cap``
    × the lower median of what the agents the buffer knows announced; its distance (the
    norm of its delta) is scaled down to ``multiplier`` × the median distance of the
    updates of the last ``window`` buffers."""

    buffer_size: int = 5
    max_staleness: int = 20
    staleness_exponent: float = 0.5
    concurrency: int = 0
    task_timeout: float = 120.0
    versions: int = 50
    min_agents: int = 2  # no task goes out before this many agents are online
    expected_agents: int = 0  # start at once when this many are online (0: unknown)
    start_grace: float = 5.0  # after the quorum, wait this long for more agents
    train: TrainConfig = field(default_factory=lambda: TrainConfig(compression="int8"))
    seed: int = 0
    strategy: Strategy = field(default_factory=Strategy)
    lr_schedule: str = "constant"  # "cosine": lr·½(1+cos(π·v/versions)) for tasks from model v
    server_lr: float = 1.0
    server_momentum: float | None = None  # None: DEFAULT_MOMENTUM (none)
    downlink: str = "int8"  # how published models travel after the first: "int8" steps or "none"
    dp: DPConfig | None = None
    weight_cap: float = 0.0  # 0: off
    norm_bound: NormBound | None = None  # None: off

    @property
    def ends(self) -> bool:
        """Whether training ends after ``versions`` models (0: it runs until stopped)."""
        return self.versions > 0

    def last(self, version: int) -> bool:
        """Whether model ``version`` is the last one training publishes."""
        return self.ends and version >= self.versions

    def share(self, agents: int) -> int:
        """The updates one agent may add to a buffer while ``agents`` are online: half of
        it (at least one), so that no agent makes a model alone unless the buffer holds a
        single update, or as many as it takes ``agents`` to fill it when they are fewer."""
        return max(1, self.buffer_size // 2, -(-self.buffer_size // max(1, agents)))

    @property
    def caps_weights(self) -> bool:
        """Whether update weights (sample counts) are capped: FedAvg weights by samples
        (``fedavg``, ``drop_above``), outside differential privacy (equal weights)."""
        return self.weight_cap > 0 and self.strategy.name in ("fedavg", "drop_above") and self.dp is None

    @property
    def bounds_norms(self) -> bool:
        """Whether the adaptive norm bound applies: not where updates are bounded already
        (``clip_norm``, differential privacy's clip)."""
        return self.norm_bound is not None and self.strategy.streams and self.dp is None

    @property
    def bounds_secure_mean(self) -> bool:
        """(No secure aggregation here: every update is seen, and bounded, one by one.)"""
        return False

    @property
    def momentum(self) -> float:
        """The server momentum β: ``server_momentum``, or none by default (see
        :data:`DEFAULT_MOMENTUM`)."""
        return DEFAULT_MOMENTUM if self.server_momentum is None else self.server_momentum

    @property
    def whole(self) -> bool:
        """Updates travel whole: their norm is needed before any of them is added
        (``clip_norm``, central DP), or they are sent uncompressed."""
        return not self.train.stream

    def weight(self, staleness: int) -> float:
        """What an update of this staleness weighs, per sample: ``(1 + s) ** −a``."""
        return float((1.0 + staleness) ** -self.staleness_exponent)

    def lr_for(self, version: int) -> float:
        """The learning rate of a task that trains from model ``version``."""
        if self.lr_schedule == "constant":
            return self.train.lr
        return self.train.lr * 0.5 * (1.0 + math.cos(math.pi * min(version, self.versions) / self.versions))

    def __post_init__(self) -> None:
        if self.buffer_size < 1 or self.min_agents < 1:
            raise ValueError("buffer_size and min_agents must be at least 1")
        if self.versions < 0:
            raise ValueError("versions must be at least 1, or 0 for no end")
        if not 0 <= self.max_staleness <= MAX_STALENESS:
            raise ValueError(f"max_staleness must be in [0, {MAX_STALENESS}]")
        if not (math.isfinite(self.staleness_exponent) and 0 <= self.staleness_exponent <= 4):
            raise ValueError("staleness_exponent must be in [0, 4]")
        if self.concurrency < 0:
            raise ValueError("concurrency must be >= 0 (0: every agent online trains)")
        if not (self.task_timeout > 0 and self.start_grace >= 0):
            raise ValueError("task_timeout must be positive and start_grace non-negative")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', not {self.lr_schedule!r}")
        if self.lr_schedule == "cosine" and not self.versions:
            raise ValueError("lr_schedule 'cosine' decays over `versions` models: set versions (0 has no end)")
        if not (math.isfinite(self.weight_cap) and (self.weight_cap == 0 or self.weight_cap >= 1)):
            raise ValueError(f"weight_cap must be 0 (off) or at least 1, not {self.weight_cap!r}")
        check_server_lr(self.server_lr)
        if self.server_momentum is not None:
            check_momentum(self.server_momentum)
        check_downlink(self.downlink)
        st = self.strategy
        if st.robust:
            raise ValueError(
                f"aggregation {st.name!r} compares the updates of one round with each other; asynchronous "
                "updates arrive one at a time from models of different ages: use 'fedavg', 'metric', 'blur' "
                "or 'drop_above'"
            )
        train = self.train
        if self.dp is not None:
            if self.dp.mode == "local":
                raise ValueError(
                    "privacy mode 'local' is for gossip; asynchronous FedAvg takes 'central' or 'distributed'"
                )
            if st.name != "fedavg" or st.clip_norm is not None:
                raise ValueError(
                    "differential privacy adds clipped updates with equal weight: it replaces aggregation "
                    f"{st.name!r}{' with clip_norm' if st.clip_norm is not None else ''} (set aggregation = "
                    "'fedavg' and no clip_norm; [privacy] clip_norm is the bound)"
                )
            if self.dp.mode == "distributed" and self.dp.adaptive:
                raise ValueError(
                    "adaptive clipping with distributed DP needs secure aggregation (each agent's "
                    "clipped-or-not bit would reach the coordinator alone), which asynchronous FedAvg "
                    "does not run: use a fixed clip_norm"
                )
            if self.buffer_size > self.min_agents:
                raise ValueError(
                    f"under differential privacy an agent adds at most one update to a model, so a buffer of "
                    f"{self.buffer_size} updates needs at least that many agents: raise min_agents to "
                    f"{self.buffer_size} or lower buffer_size"
                )
            if self.dp.mode == "central" and train.stream:
                if train.compression != "none":
                    raise ValueError(
                        f"compression = {train.compression!r} streams updates, and central differential "
                        "privacy clips each update by its norm before any of it is added: it takes whole "
                        "updates (leave compression unset)"
                    )
                object.__setattr__(self, "train", replace(train, stream=False))
        if st.clip_norm is not None and self.train.stream:
            if self.train.compression != "none":
                raise ValueError(
                    f"compression = {self.train.compression!r} streams updates, and clip_norm needs an "
                    "update's norm before any of it is added: it takes whole updates (leave compression unset)"
                )
            object.__setattr__(self, "train", replace(self.train, stream=False))
        if self.train.stream and self.train.compression == "none":
            # A stream of raw weights is an update against the model it was trained from,
            # which the coordinator no longer holds once newer ones exist: only deltas
            # travel as streams here, and "none" means whole float32 deltas.
            object.__setattr__(self, "train", replace(self.train, stream=False))
