"""The FedAvg round machine of the coordinator, as pure code.

``RoundMachine.handle(event, now) -> list[Command]``: the caller feeds it what happened
(an agent came online, an update arrived, a wake-up it asked for) with the monotonic
time, and carries out the commands it returns (broadcast a round, checkpoint and
publish an aggregate, ask for a wake-up). No clock, socket or thread is touched here,
so a whole federation can be driven in memory by a test.

Invariants this machine guards:
* round numbers only grow; an update is accepted only for the round in progress,
  only from an agent selected for it, and only once (QoS 1 may redeliver);
* an update is checked against the global model (names, shapes, dtypes, finite)
  before it touches the aggregate, and a rejection names the sender;
* a round is aggregated at most once, when every selected agent still online has
  answered, or at its deadline if at least ``min_updates`` did; otherwise the round
  is abandoned and a new one (with a new number) starts from the same model;
* membership is dynamic: agents come and go between rounds, and an agent that sends its
  last update with ``leaving`` set is not selected again (a vehicle leaving a road-side
  unit's coverage), even before its goodbye arrives;
* how updates are weighted is a :class:`~fedagent.protocols.aggregation.Strategy`
  (FedAvg by samples, by a reported metric, FLSimCo's eq. 11, or dropping updates whose
  metric is above a threshold), always aggregated as a stream;
* with differential privacy (``RoundConfig.dp``, :mod:`~fedagent.protocols.dp`) every
  update counts once and is clipped (central) or arrives clipped and noised by its agent
  (distributed); every aggregate is charged to the accountant, and no round starts whose
  release would take ε past the budget: the machine finishes instead, saying why.

Streamed updates (:mod:`~fedagent.protocols.streaming`) arrive as ``UpdateHead``, any
number of ``UpdatePart`` and one ``UpdateEnd``. All checks that need only the header
(round, sender, base version, weight, tensor names/shapes/dtypes) run before the first
value is folded; each part is checked finite before it is folded into the round's running
sums. A part cannot be taken back out of a sum without its data, and keeping the data is
what streaming avoids, so an update that fails *after* parts of it were folded (digest
mismatch, norm bound, transfer broken off, sender gone) spoils the round's sums: the round
is abandoned and restarted from the same model without that sender, which sits out one
round. Everything else about an update (and every other sender) costs nothing. A round
whose deadline passes while folded-but-unfinished updates are still arriving waits for
them to end (the intake times a silent transfer out), so a straggler mid-transfer neither
gets half-counted nor spoils a round that could aggregate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from fedagent.protocols import secagg as SA
from fedagent.protocols.aggregation import (
    Plan,
    Strategy,
    StrategyAggregator,
    UpdateRejected,
    check_server_lr,
    check_update,
    weighted_metrics,
)
from fedagent.protocols.downlink import ModelDelta, quantize_step
from fedagent.protocols.downlink import check_mode as check_downlink
from fedagent.protocols.dp import Accountant, ClipBound, DPAggregator, DPConfig, Release, quantisation_range
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.serveropt import (
    VelocityStore,
    VelocityWriter,
    check_momentum,
    check_velocity,
    default_momentum,
    momentum_step,
    momentum_step_into,
    velocity_layout,
)
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

Weights = dict[str, np.ndarray]


# ---- configuration -----------------------------------------------------------------
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

    @property
    def stage_timeout(self) -> float:
        return self.secure_stage_timeout or min(30.0, self.round_timeout / 6)

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


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgentOnline:
    agent: str
    num_samples: int = 0
    # The agent rebuilds round starts sent as int8 steps (its presence says so); agents
    # of earlier releases do not, and while one is online round starts carry the whole
    # model.
    reads_steps: bool = True


@dataclass(frozen=True, slots=True)
class AgentOffline:
    agent: str


@dataclass(frozen=True, slots=True)
class UpdateReceived:
    sender: str
    round: int
    base_version: int
    num_samples: int
    weights: Weights
    metrics: Mapping[str, float]
    leaving: bool = False  # the sender's last round: don't select it again


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


@dataclass(frozen=True, slots=True)
class SecAggReceived:
    """A secure-aggregation message from an agent (its certificate's name)."""

    sender: str
    message: SA.SecAggMessage


Event = AgentOnline | AgentOffline | UpdateReceived | Wakeup | UpdateHead | UpdatePart | UpdateEnd | SecAggReceived


@dataclass(slots=True)
class _Inflight:
    """A streamed update being folded: what it weighs and what was seen of it."""

    tid: str
    head: UpdateHead
    plan: Plan
    sq_norm: float
    folded: bool = False


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartRound:
    round: int
    model_version: int
    selected: tuple[str, ...]
    weights: Weights
    train: TrainConfig
    deadline_s: float
    resumed: bool = False  # the same round again after a restart (see RoundMachine.resume)
    secagg: SA.SecAggSetup | None = None
    # Secure-aggregation messages to send after the setup and before the model (the
    # rosters, when the keys were advertised ahead): they overtake the model.
    secagg_first: tuple[SendSecAgg, ...] = ()
    # the model as the int8 step from the previous version ([transfer] downlink), or None:
    # send ``weights``
    delta: ModelDelta | None = None


@dataclass(frozen=True, slots=True)
class RoundAggregated:
    round: int
    model_version: int
    weights: Weights
    participants: tuple[str, ...]
    metrics: dict[str, float]
    final: bool
    weights_used: dict[str, float] = field(default_factory=dict)  # participant -> aggregation weight
    dropped: dict[str, float] = field(default_factory=dict)  # sender -> the metric that dropped it
    privacy: dict[str, float] | None = None  # ε spent so far, δ, clip norm, noise (DP only)
    # The server momentum's velocity after this round (empty without momentum): the
    # checkpoint keeps it with ``weights``, which it made.
    velocity: Weights = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundAbandoned:
    round: int
    model_version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    sender: str
    round: int
    reason: str  # short code: stale, duplicate, unselected, shape, non-finite, ...
    detail: str


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    model_version: int
    weights: Weights
    reason: str = ""  # why before the configured rounds (the privacy budget)


@dataclass(frozen=True, slots=True)
class SendSecAgg:
    """Send a secure-aggregation message to one agent's inbox."""

    to: str
    message: SA.SecAggMessage


Command = StartRound | RoundAggregated | RoundAbandoned | Rejected | RequestWakeup | Finished | SendSecAgg


class Phase(str, Enum):
    WAITING = "waiting"  # for a quorum of agents
    TRAINING = "training"  # a round is in progress
    DONE = "done"


class RoundMachine:
    def __init__(
        self,
        config: RoundConfig,
        weights: Weights,
        *,
        model_version: int = 0,
        completed_rounds: int = 0,
        last_round: int = 0,
        privacy_state: Mapping[str, object] | None = None,
        velocity: Mapping[str, np.ndarray] | None = None,
        velocity_store: VelocityStore | None = None,
        rng: np.random.Generator | None = None,
        verify_statement: SA.KeyVerifier | None = None,
    ) -> None:
        """``completed_rounds``/``last_round``/``model_version`` resume from a checkpoint, and
        so do ``privacy_state`` (:meth:`privacy_state`): ε already spent and the clip bound,
        and ``velocity``: the server momentum's (ValueError if it does not fit ``weights``;
        ignored without server momentum). ``velocity_store``: where the velocity is kept
        instead (protocols/serveropt.py, :class:`~fedagent.protocols.serveropt.VelocityStore`;
        it holds the resumed velocity, if any, and ``velocity`` must then be empty): the
        step streams it a block at a time and :attr:`velocity` stays empty.
        ``rng`` draws the DP noise (default: seeded by the operating system).
        ``verify_statement`` checks an agent's signature of a statement (secure rounds: the
        survivor list), raising if it is not valid; without it signatures are passed on
        unchecked (the agents check them in any case)."""
        self.config = config
        self.weights = weights
        self.velocity: Weights = {}
        # the current model as the step from the version before (downlink = "int8"); None
        # after a restart or before the first aggregation: round starts send it whole
        self.delta: ModelDelta | None = None
        if velocity and velocity_store is not None:
            raise ValueError("a velocity is given both in memory and in a store")
        self.velocity_store = velocity_store
        self._velocity_writer: VelocityWriter | None = None  # the next velocity, until adopted
        if velocity and config.momentum > 0:
            check_velocity(weights, velocity)
            self.velocity = dict(velocity)
        self.model_version = model_version
        self.completed = completed_rounds
        self.round = last_round  # number of the latest round started
        self.phase = Phase.WAITING if completed_rounds < config.rounds else Phase.DONE
        self.online: dict[str, int] = {}  # agent -> samples it announced
        self._whole_only: set[str] = set()  # agents that read only whole models (of self.online)
        self.selected: tuple[str, ...] = ()
        self.received: dict[str, tuple[int, dict[str, float]]] = {}
        self._outstanding: set[str] = set()
        self.deadline = math.inf
        self.quorum_since: float | None = None
        self.last_metrics: dict[str, float] = {}
        self._acc: StrategyAggregator | DPAggregator | None = None
        self.departing: set[str] = set()  # sent their last update this round
        self.departed: set[str] = set()  # left; ignored as online until their goodbye
        self.inflight: dict[str, _Inflight] = {}  # sender -> its streamed update in progress
        self.ignored: set[tuple[str, str]] = set()  # (sender, tid) of streams refused at their header
        self.benched: set[str] = set()  # spoilt the last round: not selected for the next one
        self._ref_sq = 0.0  # squared norm of the global model (norm bound of deltas)
        self._rng = random.Random(config.seed)
        self._noise_rng = rng if rng is not None else np.random.default_rng()
        self.accountant: Accountant | None = None
        self.clip: ClipBound | None = None
        self._round_q = 1.0  # the fraction of the online agents selected for the round
        self.stop_reason = ""
        if config.dp is not None:
            state = privacy_state or {}
            self.accountant = Accountant.from_state(config.dp.delta, state.get("releases", []))
            clip = state.get("clip_norm")
            self.clip = ClipBound(config.dp, float(clip) if isinstance(clip, int | float) and clip > 0 else 0.0)
        self.verify_statement = verify_statement
        self.secagg: SA.SecAggServer | None = None  # the secure round in progress
        self.secure_result: SA.Unmasked | None = None  # of the last secure round aggregated
        self.secure_params: SA.SecAggParams | None = None  # of the secure round in progress (or last)
        # Keys the last secure round's survivors advertised for the round after it.
        self.ahead_keys: dict[str, SA.SecAggKeys] = {}
        self.ahead_round = 0
        self.secure_ahead = False  # the secure round in progress had no key stage
        self.aggregated_ahead = False  # ... and the last one aggregated

    # -- public ------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, AgentOnline):
            if event.agent in self.departed:
                return []
            self.online[event.agent] = event.num_samples
            if event.reads_steps:
                self._whole_only.discard(event.agent)
            else:
                self._whole_only.add(event.agent)
            return self._maybe_start(now)
        if isinstance(event, UpdatePart):
            return self._on_part(event, now)
        if isinstance(event, UpdateHead):
            return self._on_head(event, now)
        if isinstance(event, UpdateEnd):
            return self._on_end(event, now)
        if isinstance(event, AgentOffline):
            self.online.pop(event.agent, None)
            self._whole_only.discard(event.agent)
            self.departed.discard(event.agent)
            if self.phase is Phase.TRAINING and self.secagg is not None:
                return self._secure(self.secagg.handle(SA.Gone(event.agent), now), now)
            if self.phase is Phase.TRAINING:
                fl = self.inflight.get(event.agent)
                if fl is not None:
                    return self._on_end(UpdateEnd(event.agent, fl.tid, False, "sender went offline mid-transfer"), now)
                return self._maybe_finish(now)
            if len(self.online) < self.config.min_agents:
                self.quorum_since = None
            return []
        if isinstance(event, UpdateReceived):
            return self._on_update(event, now)
        if isinstance(event, SecAggReceived):
            if self.secagg is None:
                msg = event.message
                return [Rejected(event.sender, getattr(msg, "round", 0), "stale", f"{msg.kind} outside a secure round")]
            return self._secure(self.secagg.handle(SA.Received(event.sender, event.message), now), now)
        if isinstance(event, Wakeup):
            if self.phase is Phase.TRAINING and self.secagg is not None:
                out = self._secure(self.secagg.handle(SA.Tick(), now), now)
                if self.secagg is not None and not any(isinstance(c, RequestWakeup) for c in out):
                    out.append(RequestWakeup(self.secagg.deadline))
                return out
            if self.phase is Phase.TRAINING:
                out = self._maybe_finish(now)
                if self.phase is Phase.TRAINING and not any(isinstance(c, RequestWakeup) for c in out):
                    # Woken early (a wake-up asked for by an earlier round that ended
                    # sooner): ask again for this round's deadline, or it never fires.
                    out.append(RequestWakeup(self.deadline))
                return out
            return self._maybe_start(now)
        raise TypeError(f"not a round event: {event!r}")

    def _server_step(self, aggregate: Weights) -> tuple[Weights, Weights]:
        """The next global model and velocity from the round's aggregate (neither adopted
        here: protocols/serveropt.py)."""
        c = self.config
        store = self.velocity_store
        if store is None or c.momentum == 0:
            return momentum_step(self.weights, aggregate, self.velocity, lr=c.server_lr, beta=c.momentum)
        self._drop_velocity()
        writer = store.begin(velocity_layout(self.weights), self.model_version + 1)
        try:
            new = momentum_step_into(self.weights, aggregate, store, writer, lr=c.server_lr, beta=c.momentum)
        except BaseException:
            store.discard(writer)
            raise
        self._velocity_writer = writer
        return new, {}

    def _adopt(self, new: Weights, velocity: Weights) -> None:
        """The server step's results become the global model and velocity (the model
        version after this round is the next one)."""
        writer, self._velocity_writer = self._velocity_writer, None
        if writer is not None:
            assert self.velocity_store is not None
            self.velocity_store.adopt(writer)
        if self.config.downlink == "int8":
            # The model becomes what the agents rebuild from the step sent to them (the
            # previous step goes first: it is the next one's memory).
            self.delta = None
            new, self.delta = quantize_step(self.weights, new, self.model_version)
        self.weights, self.velocity = new, velocity

    def _drop_velocity(self) -> None:
        """A step's velocity that will not be adopted (its aggregate was refused)."""
        writer, self._velocity_writer = self._velocity_writer, None
        if writer is not None:
            assert self.velocity_store is not None
            self.velocity_store.discard(writer)

    def privacy_state(self) -> dict[str, object] | None:
        """What a checkpoint keeps so that a restart goes on spending from here."""
        if self.accountant is None or self.clip is None:
            return None
        return {"releases": self.accountant.to_state(), "clip_norm": self.clip.value}

    def privacy(self) -> dict[str, float] | None:
        """ε spent at δ, the budget and the current clip bound and noise (status, history)."""
        dp = self.config.dp
        if dp is None or self.accountant is None or self.clip is None:
            return None
        out = {
            "epsilon": self.accountant.epsilon,
            "delta": dp.delta,
            "noise_multiplier": dp.noise_multiplier,
            "clip_norm": self.clip.value,
            "releases": float(len(self.accountant.releases)),
        }
        if dp.epsilon_budget is not None:
            out["epsilon_budget"] = dp.epsilon_budget
        if self.clip.released is not None:
            # adaptive clipping: the noised fraction of unclipped updates C last moved by
            out["unclipped_fraction"] = self.clip.released
        return out

    def _release(self, selected: int, answered: int, q: float) -> Release:
        """The round's release as the accountant sees it. Central: noise z_Δ·C on the sum
        (and, adaptive, the count's σ_b on a sensitivity of ½). Distributed: each of the
        ``selected`` agents added z·C/√selected, so ``answered`` of them carry z·√(answered/selected)."""
        dp = self.config.dp
        assert dp is not None
        # Distributed: the answered shares of each noise (update, and with adaptive
        # clipping the count's) carry √(answered/selected) of it.
        f = math.sqrt(answered / selected) if dp.mode == "distributed" else 1.0
        zs: tuple[float, ...] = (dp.update_noise_multiplier(selected) * f,)
        if dp.adaptive:
            zs += (2.0 * dp.count_std(selected) * f,)
        return Release(q, zs)

    def _over_budget(self, selected: int, q: float, answered: int | None = None) -> str:
        """Why the next round must not run (its release would pass the budget), or ''.
        ``answered``: the updates the round's sum holds, when known (distributed DP: fewer
        than ``selected`` carry less noise and cost more)."""
        dp = self.config.dp
        if dp is None or dp.epsilon_budget is None or self.accountant is None:
            return ""
        after = self.accountant.epsilon_after(self._release(selected, selected if answered is None else answered, q))
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

    def _distributed_admit(self, survivors: int) -> str:
        """Secure rounds under distributed DP, before any mask comes off: why a sum of
        ``survivors`` updates must not be unmasked (its noise would take ε past the
        budget), or ''. Refused, the round is abandoned and nothing of it is learned."""
        return self._over_budget(len(self.selected), self._round_q, survivors)

    def whole_model_only(self) -> list[str]:
        """Online agents that cannot rebuild an int8 step: round starts carry the whole
        model while there is one."""
        return sorted(a for a in self._whole_only if a in self.online)

    def status(self) -> dict[str, object]:
        return {
            "phase": self.phase.value,
            "round": self.round,
            "completed_rounds": self.completed,
            "rounds": self.config.rounds,
            "model_version": self.model_version,
            "online": sorted(self.online),
            "whole_model_only": self.whole_model_only(),
            "selected": list(self.selected),
            "received": sorted(self.received),
            "metrics": dict(self.last_metrics),
            "privacy": self.privacy(),
            "stop_reason": self.stop_reason,
        }

    # -- starting ----------------------------------------------------------------------
    def _maybe_start(self, now: float) -> list[Command]:
        if self.phase is not Phase.WAITING:
            return []
        cfg = self.config
        n = len(self.online)
        if n < cfg.min_agents:
            self.quorum_since = None
            return []
        if self.quorum_since is None:
            self.quorum_since = now
        enough = cfg.expected_agents and n >= cfg.expected_agents
        if not enough and now < self.quorum_since + cfg.start_grace:
            return [RequestWakeup(self.quorum_since + cfg.start_grace)]
        return self._start(now)

    def _start(self, now: float) -> list[Command]:
        cfg = self.config
        agents = sorted(self.online)
        if self.benched and len(agents) - len(self.benched & set(agents)) >= cfg.min_agents:
            agents = [a for a in agents if a not in self.benched]
        self.benched = set()
        population = len(agents)
        limit = cfg.agents_per_round
        if cfg.secure is not None:  # more inputs than this would wrap the masked sum
            limit = min(limit or cfg.secure.max_agents, cfg.secure.max_agents)
        if limit and limit < len(agents):
            agents = sorted(self._rng.sample(agents, limit))
        q = len(agents) / population
        why = self._over_budget(len(agents), q)
        if why:
            self.phase = Phase.DONE
            self.stop_reason = why
            return [Finished(self.model_version, self.weights, why)]
        self._round_q = q
        self.round += 1
        return self._open_round(tuple(agents), now)

    def resume(self, round_: int, selected: tuple[str, ...], now: float) -> list[Command]:
        """Take round ``round_`` up again after a restart, under the same number, from the
        model this machine was built with (the checkpoint it started from), with the same
        selection. The caller then feeds it the updates it had already received (from its
        journal) like any others, and the outstanding agents' updates are accepted when
        they come. The selected agents count as online until their presence says
        otherwise: the round waits for them rather than aggregating without them."""
        if self.phase is not Phase.WAITING or round_ != self.round or not selected:
            raise ValueError(
                f"cannot resume round {round_}: the machine is {self.phase.value} after round {self.round}"
            )
        for agent in selected:
            self.online.setdefault(agent, 0)
        # The population the round was sampled from is not known after a restart: with
        # differential privacy it counts as sampling everyone (q = 1), which spends at
        # least as much of the budget as the round really did. The budget was checked
        # when the round first started.
        self._round_q = 1.0
        return self._open_round(selected, now, resumed=True)

    def _open_round(self, agents: tuple[str, ...], now: float, *, resumed: bool = False) -> list[Command]:
        cfg = self.config
        self.phase = Phase.TRAINING
        self.selected = tuple(agents)
        self._outstanding = set(agents)  # selected, not yet answered
        self.received = {}
        self.deadline = now + cfg.round_timeout
        train = replace(cfg.train, lr=cfg.lr_for(self.round))
        if cfg.dp is not None:
            assert self.clip is not None
            self._acc = DPAggregator(
                cfg.dp, self.weights, self.clip.value, cfg.dp.update_noise_multiplier(len(agents)), self._noise_rng
            )
            if cfg.dp.mode == "distributed":
                root = math.sqrt(len(agents))
                share = cfg.dp.update_noise_multiplier(len(agents)) * self.clip.value / root
                train = replace(train, dp_clip=self.clip.value, dp_noise_std=share)
                if cfg.dp.adaptive:  # (under secure aggregation: RoundConfig checks)
                    train = replace(train, dp_count_std=cfg.dp.count_std(len(agents)) / root)
        else:
            self._acc = StrategyAggregator(cfg.strategy, self.weights, compact=True)
        self.inflight = {}
        self.ignored = set()
        if cfg.max_norm is not None:
            self._ref_sq = sum(
                float(np.square(w, dtype=np.float64).sum()) for w in self.weights.values() if w.dtype.kind == "f"
            )
        setup = None
        wake = self.deadline
        first: tuple[SendSecAgg, ...] = ()
        if cfg.secure is not None:
            # The secure round ends itself (every stage has a deadline); the round's own
            # deadline is the masked inputs'.
            # DP-FedAvg weighs every update equally (its noise is calibrated so): W = 1.
            top = 1 if cfg.dp is not None else max(1, *(self.online[a] for a in agents))
            params = cfg.secure
            admit = None
            size = SA.layout_size(self.weights)
            if cfg.dp is not None and train.dp_clip is not None:
                # Distributed DP: the noised update must fit the quantisation range whole
                # (a coordinate cut there would no longer carry its Gaussian noise).
                wide = quantisation_range(train.dp_clip, train.dp_noise_std, size, len(agents))
                if train.dp_count_std:
                    # ... and so must the noised clipped-or-not bit, one value more
                    size += 1
                    wide = max(wide, quantisation_range(0.5, train.dp_count_std, size, len(agents)))
                params = replace(params, clip=min(max(params.clip, wide), SA.MAX_CLIP))
                admit = self._distributed_admit
            self.secure_params = params
            # Every selected agent advertised keys for this round with its masked input
            # of the last one: no key stage. Anyone else in the cohort: a key stage for all.
            ahead = self.ahead_round == self.round and set(agents) <= set(self.ahead_keys)
            keys, self.ahead_keys, self.ahead_round = self.ahead_keys, {}, 0
            self.secure_ahead = ahead
            last = self.completed + 1 >= cfg.rounds
            setup = SA.SecAggSetup(
                params, self._rng.randbytes(16), top, next_round=0 if last else self.round + 1, ahead=ahead
            )
            self.secagg = SA.SecAggServer(
                self.round,
                agents,
                setup,
                size,
                now=now,
                stage_timeout=cfg.stage_timeout,
                # after the inputs: the survivor list's signatures, then the shares
                input_deadline=now + cfg.round_timeout - 2 * cfg.stage_timeout,
                online=set(self.online),
                admit=admit,
                verify=self.verify_statement,
                ahead=keys if ahead else None,
            )
            self.deadline = math.inf
            first = tuple(SendSecAgg(c.to, c.message) for c in self.secagg.start() if isinstance(c, SA.Send))
            wake = self.secagg.deadline
        return [
            StartRound(
                self.round,
                self.model_version,
                self.selected,
                self.weights,
                train,
                cfg.round_timeout,
                resumed,
                setup,
                first,
                None if resumed or self.whole_model_only() else self.delta,
            ),
            RequestWakeup(wake),
        ]

    # -- collecting --------------------------------------------------------------------
    def _on_update(self, ev: UpdateReceived, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            return [Rejected(ev.sender, ev.round, reason, detail)]

        if self.config.secure is not None:
            return reject("secure", "plain update in a federation with secure aggregation (never aggregated)")
        if self.phase is not Phase.TRAINING or ev.round != self.round:
            return reject("stale", f"update for round {ev.round}, current round {self.round} ({self.phase.value})")
        if ev.sender not in self.selected:
            return reject("unselected", f"{ev.sender} was not selected for round {self.round}")
        if ev.sender in self.received or ev.sender in self.inflight:
            return reject("duplicate", f"second update from {ev.sender} for round {self.round}")
        if ev.base_version != self.model_version:
            return reject("stale", f"trained from version {ev.base_version}, current {self.model_version}")
        if ev.num_samples <= 0:
            return reject("weight", "num_samples must be positive")
        try:
            check_update(self.weights, ev.weights, max_norm=self.config.max_norm)
            assert self._acc is not None
            self._acc.add(ev.sender, ev.weights, ev.num_samples, ev.metrics)
        except UpdateRejected as exc:
            return reject(exc.reason, exc.detail)
        self.received[ev.sender] = (ev.num_samples, dict(ev.metrics))
        self._outstanding.discard(ev.sender)
        if ev.leaving:
            self.departing.add(ev.sender)
        return self._maybe_finish(now)

    # -- streamed updates ----------------------------------------------------------------
    def _on_head(self, ev: UpdateHead, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            self.ignored.add((ev.sender, ev.tid))
            return [Rejected(ev.sender, ev.round, reason, detail)]

        if self.config.secure is not None:
            return reject("secure", "plain update in a federation with secure aggregation (never aggregated)")
        if self.phase is not Phase.TRAINING or ev.round != self.round:
            return reject("stale", f"update for round {ev.round}, current round {self.round} ({self.phase.value})")
        if ev.sender not in self.selected:
            return reject("unselected", f"{ev.sender} was not selected for round {self.round}")
        if ev.sender in self.received or ev.sender in self.inflight:
            return reject("duplicate", f"second update from {ev.sender} for round {self.round}")
        if ev.base_version != self.model_version:
            return reject("stale", f"trained from version {ev.base_version}, current {self.model_version}")
        names = {t.name: t for t in ev.tensors}
        if names.keys() != self.weights.keys():
            missing = sorted(set(self.weights) - set(names))
            extra = sorted(set(names) - set(self.weights))
            return reject("names", f"missing {missing[:3]}, unexpected {extra[:3]}")
        for name, ref in self.weights.items():
            t = names[name]
            if t.shape != ref.shape:
                return reject("shape", f"{name}: {t.shape} != {ref.shape}")
            if t.dtype != ref.dtype.name:
                return reject("dtype", f"{name}: {t.dtype} != {ref.dtype}")
        assert self._acc is not None
        try:
            plan = self._acc.plan(ev.num_samples, ev.metrics)
        except UpdateRejected as exc:
            return reject(exc.reason, exc.detail)
        if plan.dropped is not None:
            # Counted as dropped, never folded: its parts are ignored.
            self._acc.dropped[ev.sender] = plan.dropped
            self.ignored.add((ev.sender, ev.tid))
            self.received[ev.sender] = (ev.num_samples, dict(ev.metrics))
            self._outstanding.discard(ev.sender)
            if ev.leaving:
                self.departing.add(ev.sender)
            return self._maybe_finish(now)
        self.inflight[ev.sender] = _Inflight(ev.tid, ev, plan, self._ref_sq)
        return []

    def _on_part(self, ev: UpdatePart, now: float) -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            return []  # refused at its header, or from an ended round
        vals = ev.values
        if vals.dtype.kind == "f" and not np.isfinite(vals).all():
            return self._on_end(
                UpdateEnd(ev.sender, ev.tid, False, f"{ev.name} contains NaN or Inf"), now, reason="non-finite"
            )
        # The bound covers floating tensors only, as check_update's does.
        if self.config.max_norm is not None and self.weights[ev.name].dtype.kind == "f":
            ref = self.weights[ev.name].reshape(-1)
            where = slice(ev.start, ev.start + vals.size) if ev.indices is None else ev.indices
            g = ref[where].astype(np.float64)
            new = g + vals if ev.delta else vals.astype(np.float64)
            fl.sq_norm += float(np.square(new).sum() - np.square(g).sum())
        assert self._acc is not None
        self._acc.fold(fl.plan, ev.name, ev.start, vals, ev.indices, delta=ev.delta)
        fl.folded = True
        return []

    def _on_end(self, ev: UpdateEnd, now: float, *, reason: str = "transfer") -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            self.ignored.discard((ev.sender, ev.tid))
            return []
        del self.inflight[ev.sender]
        head = fl.head
        if ev.ok and self.config.max_norm is not None and fl.sq_norm > self.config.max_norm**2:
            ev, reason = (
                UpdateEnd(
                    ev.sender,
                    ev.tid,
                    False,
                    f"norm {max(fl.sq_norm, 0.0) ** 0.5:.3g} above bound {self.config.max_norm:.3g}",
                ),
                "norm",
            )
        if not ev.ok:
            out: list[Command] = [Rejected(ev.sender, head.round, reason, ev.reason)]
            if not fl.folded:
                return out + self._maybe_finish(now)
            # Parts of it are in the sums and cannot be taken out: the round is spoilt.
            self.benched = {ev.sender}
            detail = (
                f"update from {ev.sender} failed after parts of it were aggregated ({ev.reason}); "
                f"round restarted without it"
            )
            out.append(RoundAbandoned(self.round, self.model_version, detail))
            self._end_round()
            self.phase = Phase.WAITING
            self.quorum_since = -math.inf
            return out + self._maybe_start(now)
        assert self._acc is not None
        self._acc.commit(ev.sender, fl.plan)
        self.received[ev.sender] = (head.num_samples, dict(head.metrics))
        self._outstanding.discard(ev.sender)
        if head.leaving:
            self.departing.add(ev.sender)
        return self._maybe_finish(now)

    def _maybe_finish(self, now: float) -> list[Command]:
        if self.secagg is not None:
            return []  # a secure round ends by its own stages
        # Set-based and stopping at the first agent still owed: O(1) per update in the
        # usual case instead of a scan of every selected agent (O(N²) per round).
        waiting = any(a in self.online for a in self._outstanding)
        if waiting and now < self.deadline:
            return []
        if any(fl.folded for fl in self.inflight.values()):
            return []  # half-folded updates still arriving: wait for their end
        assert self._acc is not None
        reason = ""
        if self._acc.count >= self.config.min_updates:
            if isinstance(self._acc, DPAggregator) and self._acc.config.mode == "distributed":
                # Fewer noise shares than selected: the sum may carry too little noise to
                # be published within the budget (it is then dropped, not published).
                reason = self._over_budget(len(self.selected), self._round_q, self._acc.count)
            if not reason:
                return self._aggregate(now)
        else:
            reason = (
                "deadline passed" if now >= self.deadline else "selected agents left"
            ) + f" with {len(self.received)} of {len(self.selected)} updates (need {self.config.min_updates})"
            if self._acc.dropped:
                reason += f", {len(self._acc.dropped)} dropped by {self.config.strategy.name}"
        out: list[Command] = [RoundAbandoned(self.round, self.model_version, reason)]
        self._end_round()
        self.phase = Phase.WAITING
        self.quorum_since = None
        return out + self._maybe_start(now)

    def _aggregate(self, now: float) -> list[Command]:
        assert self._acc is not None
        acc = self._acc
        new, velocity = self._server_step(acc.result())
        overflow = [k for k, v in new.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if overflow:
            # Every update was finite, but their weighted sum left the tensor's range
            # (e.g. float32 values near 3.4e38): no model is better than an infinite one.
            reason = (
                f"the aggregate of {', '.join(sorted(acc.weights))} is not finite in "
                f"{', '.join(overflow[:3])}{' ...' if len(overflow) > 3 else ''} (the updates' values "
                "overflow their dtype); the global model is kept"
            )
            self._drop_velocity()
            out: list[Command] = [RoundAbandoned(self.round, self.model_version, reason)]
            self._end_round()
            self.phase = Phase.WAITING
            self.quorum_since = None
            return out + self._maybe_start(now)
        self._adopt(new, velocity)
        self.model_version += 1
        self.completed += 1
        self.last_metrics = weighted_metrics([(m, n) for n, m in self.received.values()])
        participants = tuple(sorted(acc.weights))
        total = sum(acc.weights.values())
        used = {a: acc.weights[a] / total for a in participants}
        final = self.completed >= self.config.rounds
        why = ""
        if isinstance(acc, DPAggregator):
            assert self.accountant is not None and self.clip is not None
            self.accountant.spend(self._release(len(self.selected), acc.count, self._round_q))
            self.clip.update(acc.unclipped, acc.count, len(self.selected), self._noise_rng)
            if not final:
                # The next round's selection is not known yet: judged as this one's.
                why = self._over_budget(len(self.selected), self._round_q)
                final = bool(why)
        out = [
            RoundAggregated(
                self.round,
                self.model_version,
                self.weights,
                participants,
                dict(self.last_metrics),
                final,
                used,
                dict(acc.dropped),
                self.privacy(),
                self.velocity,
            )
        ]
        self._end_round()
        if final:
            self.phase = Phase.DONE
            self.stop_reason = why
            out.append(Finished(self.model_version, self.weights, why))
        else:
            self.phase = Phase.WAITING
            # Agents are still online: the next round starts at once.
            self.quorum_since = -math.inf
            out += self._maybe_start(now)
        return out

    # -- secure rounds -----------------------------------------------------------------
    def _secure(self, cmds: list[SA.ServerCommand], now: float) -> list[Command]:
        out: list[Command] = []
        for c in cmds:
            if isinstance(c, SA.Send):
                out.append(SendSecAgg(c.to, c.message))
            elif isinstance(c, SA.Refused):
                out.append(Rejected(c.sender, self.round, c.reason, c.detail))
            elif isinstance(c, SA.Wake):
                out.append(RequestWakeup(c.at))
            elif isinstance(c, SA.Unmasked):
                out += self._aggregate_secure(c, now)
            elif isinstance(c, SA.Failed):
                out.append(RoundAbandoned(self.round, self.model_version, f"secure aggregation: {c.reason}"))
                self._end_round()
                self.phase = Phase.WAITING
                self.quorum_since = None
                out += self._maybe_start(now)
        return out

    def after_unmask(self, mean: np.ndarray, result: SA.Unmasked) -> np.ndarray:
        """Hook: the unmasked mean update (flat, :func:`~fedagent.protocols.secagg.flatten`
        order) before it is added to the model. The identity here; a privacy stage
        (noise, accounting) applies itself to the sum at this point."""
        return mean

    def _aggregate_secure(self, res: SA.Unmasked, now: float) -> list[Command]:
        """The unmasked mean update becomes the next model: global + mean of the deltas
        (floating tensors; the others keep the global model's values)."""
        layout, base = SA.flatten(self.weights)
        mean = res.mean
        count = None
        if mean.size == base.size + 1:
            # Adaptive clipping under distributed DP: the last value is the noised count's
            # mean; times the weight sum (each weighs 1) it is the noised Σ(bᵢ − ½).
            count, mean = float(mean[-1]) * res.weight_sum, mean[:-1]
        mean = self.after_unmask(mean, res)
        new = dict(self.weights)
        new.update(SA.unflatten(layout, base + mean, self.weights))
        self._adopt(*self._server_step(new))
        self.model_version += 1
        self.completed += 1
        self.secure_result = res
        self.received = {a: (c.num_samples, dict(c.metrics)) for a, c in res.contributors.items()}
        for a, c in res.contributors.items():
            if c.leaving:
                self.departing.add(a)
        self.last_metrics = weighted_metrics([(m, n) for n, m in self.received.values()])
        participants = tuple(sorted(res.contributors))
        assert self.secagg is not None
        setup = self.secagg.setup
        self.ahead_keys, self.ahead_round = dict(self.secagg.next_keys), setup.next_round
        self.aggregated_ahead = self.secure_ahead
        used = {a: setup.ratio(res.contributors[a].num_samples) / res.weight_sum for a in participants}
        final = self.completed >= self.config.rounds
        why = ""
        if self.config.dp is not None:
            # Distributed DP (check_secure allows no other): the agents noised their
            # updates before masking; the release is charged as for a plain round.
            assert self.accountant is not None and self.clip is not None
            self.accountant.spend(self._release(len(self.selected), len(res.contributors), self._round_q))
            if count is not None:
                self.clip.move(count, len(res.contributors))
            if not final:
                why = self._over_budget(len(self.selected), self._round_q)
                final = bool(why)
        out: list[Command] = [
            RoundAggregated(
                self.round,
                self.model_version,
                self.weights,
                participants,
                dict(self.last_metrics),
                final,
                used,
                privacy=self.privacy(),
                velocity=self.velocity,
            )
        ]
        self._end_round()
        if final:
            self.phase = Phase.DONE
            self.stop_reason = why
            out.append(Finished(self.model_version, self.weights, why))
        else:
            self.phase = Phase.WAITING
            self.quorum_since = -math.inf
            out += self._maybe_start(now)
        return out

    def _end_round(self) -> None:
        self.secagg = None
        self._acc = None
        self.inflight = {}
        self.deadline = math.inf
        for agent in self.departing:
            if self.online.pop(agent, None) is not None:
                self.departed.add(agent)
        self.departing.clear()
