"""The FedAvg round machine of the coordinator, as pure code (the package's docstring
says what it guarantees): the lifecycle of rounds (quorum, selection, deadlines), the
intake of whole updates, and the aggregation. Streamed updates and the replays at a
round's end are :class:`~fedagent.protocols.rounds.intake.StreamedUpdates`' (a mixin:
they work on the round's own state). Its collaborators do the rest:
:class:`~fedagent.protocols.rounds.serverstep.ServerStep` moves the global model,
:class:`~fedagent.protocols.rounds.privacy.PrivacyBudget` charges and limits
differential privacy, :class:`~fedagent.protocols.rounds.secure.SecureRounds` runs the
secure-aggregation path."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from fedagent.protocols import secagg as SA
from fedagent.protocols.aggregation import StrategyAggregator, UpdateRejected, check_update, weighted_metrics
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.dp import Accountant, ClipBound, DPAggregator
from fedagent.protocols.fingerprint import Roles
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.bounds import Bench, Influence, Replay, scaled
from fedagent.protocols.rounds.config import RoundConfig
from fedagent.protocols.rounds.events import (
    AgentOffline,
    AgentOnline,
    Command,
    Event,
    Finished,
    LateUpdate,
    Phase,
    Refolded,
    Rejected,
    RequestWakeup,
    RoundAbandoned,
    RoundAggregated,
    SecAggReceived,
    SendSecAgg,
    StartRound,
    UpdateReceived,
    Wakeup,
)
from fedagent.protocols.rounds.intake import StreamedUpdates
from fedagent.protocols.rounds.privacy import PrivacyBudget
from fedagent.protocols.rounds.secure import SecureRounds
from fedagent.protocols.rounds.serverstep import ServerStep
from fedagent.protocols.serveropt import VelocityStore
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

Weights = dict[str, np.ndarray]

#: Abandoned rounds remembered: an update for one of them is late, not wrong.
ABANDONED_KEPT = 16
#: Seconds a stream may make no progress, once every other update of its round is in,
#: before it is dropped (or as long as the others took, if that is longer).
STALL_GRACE = 1.0


class RoundMachine(StreamedUpdates):
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
        replays: bool = False,
        norm_history: Sequence[Sequence[float]] = (),
        roles: Roles | None = None,
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
        unchecked (the agents check them in any case). ``roles``: what the model's
        fingerprint says of its tensors (buffers, frozen parameters, the layers kept on
        the agents): without it every floating tensor is a trainable parameter.

        ``replays``: the caller carries out :class:`Refold` (it can read every update of
        the round in flight back, from its journal): an update that fails after parts of
        it were folded is then taken out of the sums instead of spoiling the round, and a
        streamed update still arriving at the deadline is dropped. The norm bound needs
        it (ValueError without). ``norm_history``: the distances of recent rounds
        (:meth:`norm_state`), so that a restart does not warm the bound up again."""
        if config.bounds_norms and not replays:
            raise ValueError("the norm bound needs a caller that replays updates (replays=True)")
        self.config = config
        self.weights = weights
        self.roles = roles or Roles()
        self.server_step = ServerStep(
            weights,
            server_lr=config.server_lr,
            momentum=config.momentum,
            downlink=config.downlink,
            velocity=velocity,
            store=velocity_store,
            roles=self.roles,
        )
        self.model_version = model_version
        self.completed = completed_rounds
        self.round = last_round  # number of the latest round started
        self.phase = Phase.WAITING if completed_rounds < config.rounds else Phase.DONE
        self.online: dict[str, int] = {}  # agent -> samples it announced
        self._whole_only: set[str] = set()  # agents that read only whole models (of self.online)
        self.selected: tuple[str, ...] = ()
        self._selected_set: frozenset[str] = frozenset()  # the same, for the per-update lookups
        # The round selected every agent counted online at its start: its round start
        # names none of them (protocols/messages/rounds.py), so an agent that came
        # online just after it may take itself for selected (see _joined_late).
        self.everyone = False
        self.received: dict[str, tuple[int, dict[str, float]]] = {}
        self._outstanding: set[str] = set()
        self.deadline = math.inf
        self.quorum_since: float | None = None
        self.last_metrics: dict[str, float] = {}
        self._acc: StrategyAggregator | DPAggregator | None = None
        self.departing: set[str] = set()  # sent their last update this round
        self.departed: set[str] = set()  # left; ignored as online until their goodbye
        self.replays = replays
        self.influence = Influence(config, norm_history)  # weight cap and norm bound
        self.bench = Bench()  # agents that spoiled updates sit out rounds
        self._abandoned: deque[int] = deque(maxlen=ABANDONED_KEPT)
        self._since_whole = 0  # round starts since the last one that carried the whole model
        self._whole_round = True  # the round being started carries the whole model
        self._opened_at = 0.0
        self._others_done_at: float | None = None  # when only streams still arriving were owed
        self._rng = random.Random(config.seed)
        self._round_q = 1.0  # the fraction of the online agents selected for the round
        self._cohort = 0  # the agents the round's noise shares are calibrated for (distributed DP)
        self.stop_reason = ""
        self.budget: PrivacyBudget | None = None
        if config.dp is not None:
            self.budget = PrivacyBudget(config.dp, privacy_state, rng if rng is not None else np.random.default_rng())
        self.secure = SecureRounds(config, verify_statement)
        self._init_intake()

    # -- what the collaborators hold ---------------------------------------------------
    @property
    def velocity(self) -> Weights:
        """The server momentum's velocity the global model was made with (empty without
        momentum, or while a store keeps it)."""
        return self.server_step.velocity

    @property
    def delta(self) -> ModelDelta | None:
        """The global model as the int8 step from the version before, or None."""
        return self.server_step.delta

    @property
    def accountant(self) -> Accountant | None:
        return self.budget.accountant if self.budget is not None else None

    @property
    def clip(self) -> ClipBound | None:
        return self.budget.clip if self.budget is not None else None

    @property
    def secagg(self) -> SA.SecAggServer | None:
        """The secure round in progress, if any."""
        return self.secure.server

    @property
    def secure_result(self) -> SA.Unmasked | None:
        return self.secure.result

    @property
    def secure_params(self) -> SA.SecAggParams | None:
        return self.secure.params

    @property
    def aggregated_ahead(self) -> bool:
        """The last secure round aggregated had no key stage (its keys came ahead)."""
        return self.secure.aggregated_ahead

    # -- public ------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, AgentOnline):
            if event.agent in self.departed:
                return []
            self.online[event.agent] = event.num_samples
            self.influence.announce(event.agent, event.num_samples)
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
        if isinstance(event, Refolded):
            return self._on_refolded(event, now)
        if isinstance(event, SecAggReceived):
            if self.secure.late_answers.late(event.sender, getattr(event.message, "round", None)):
                return []
            if self.secagg is None:
                msg = event.message
                return [Rejected(event.sender, getattr(msg, "round", 0), "stale", f"{msg.kind} outside a secure round")]
            return self._secure(self.secagg.handle(SA.Received(event.sender, event.message), now), now)
        if isinstance(event, Wakeup):
            if self._replaying:
                return []  # the round ends with the replay's Refolded
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

    def privacy_state(self) -> dict[str, object] | None:
        """What a checkpoint keeps so that a restart goes on spending from here."""
        return self.budget.state() if self.budget is not None else None

    def norm_state(self) -> list[list[float]]:
        """The distances of recent rounds the norm bound is the median of (a checkpoint
        keeps them)."""
        return self.influence.state()

    def privacy(self) -> dict[str, float] | None:
        """ε spent at δ, the budget and the current clip bound and noise (status, history)."""
        return self.budget.report() if self.budget is not None else None

    def _over_budget(self, selected: int, q: float, answered: int | None = None) -> str:
        """Why the next round must not run (its release would pass the budget), or ''."""
        return self.budget.over_budget(selected, q, answered) if self.budget is not None else ""

    def _distributed_admit(self, survivors: int) -> str:
        """Secure rounds under distributed DP, before any mask comes off: why a sum of
        ``survivors`` updates must not be unmasked (its noise would take ε past the
        budget), or ''. Refused, the round is abandoned and nothing of it is learned."""
        server = self.secagg
        inputs = {a: m.num_samples for a, m in server.inputs.items()} if server is not None else {}
        shares = self.noise_shares(inputs) if len(inputs) == survivors else survivors
        return self._over_budget(self._cohort, self._round_q, shares)

    # -- what distributed DP's noise is counted in (a tier of site aggregators differs) --
    def noise_cohort(self, agents: Sequence[str]) -> int:
        """The agents a round of these members calibrates its noise shares for: one each."""
        return len(agents)

    def noise_shares(self, contributors: Mapping[str, int]) -> int:
        """The noise shares the sum of these contributors (member → its sample count)
        carries: one each."""
        return len(contributors)

    def sampling_fraction(self, selected: int, population: int) -> float:
        """The sampling fraction the accountant is given for a round of ``selected`` of
        ``population`` members."""
        return selected / population

    def dp_weight(self, train: TrainConfig) -> int:
        """A private secure round's W: each agent's noised update weighs 1."""
        return 1

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
            # with the updates held back to be folded at the round's end (bounded, or a
            # round still learning its norm bound): they are in, and count
            "received": sorted(set(self.received) | {a for a, r in self._replay.items() if r.count}),
            "metrics": dict(self.last_metrics),
            "privacy": self.privacy(),
            "stop_reason": self.stop_reason,
            "bounds": {**self.influence.status(), "benched": self.bench.status()},
            "waiting": self.waiting(),
        }

    def waiting(self) -> dict[str, object] | None:
        """What the machine waits for: a quorum (``need`` agents online, ``online`` the
        ones there are) before a round, or the updates of the selected agents still
        online during one; None when it waits for nothing (done, or starting now)."""
        if self.phase is Phase.WAITING:
            if len(self.online) < self.config.min_agents:
                return {"for": "quorum", "need": self.config.min_agents, "online": sorted(self.online)}
            return None
        if self.phase is Phase.TRAINING:
            if self.secagg is not None:
                return {"for": "secure aggregation", "agents": sorted(self.selected)}
            owed = sorted(a for a in self._outstanding if a in self.online)
            gone = sorted(a for a in self._outstanding if a not in self.online)
            return {"for": "updates", "agents": owed, "offline": gone}
        return None

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
        benched = self.bench.benched(self.round + 1)
        if benched and len(agents) - len(benched & set(agents)) >= cfg.min_agents:
            agents = [a for a in agents if a not in benched]
        self._whole_round = self._whole_due()
        if not self._whole_round:
            # Agents that read only whole models sit out the rounds whose start is a step
            # (unless the quorum needs them): one member claiming to be such an agent must
            # not turn every broadcast into a whole model.
            steps_only = [a for a in agents if a not in self._whole_only]
            if len(steps_only) >= cfg.min_agents:
                agents = steps_only
        population = len(agents)
        limit = cfg.agents_per_round
        if cfg.secure is not None:  # more inputs than this would wrap the masked sum
            limit = min(limit or cfg.secure.max_agents, cfg.secure.max_agents)
        if limit and limit < len(agents):
            agents = sorted(self._rng.sample(agents, limit))
        if not self._whole_round and any(a in self._whole_only for a in agents):
            # The quorum needed an agent that cannot rebuild a step: a step would leave it
            # unable to train (and the round waiting for it until its deadline).
            self._whole_round = True
        q = self.sampling_fraction(len(agents), population)
        why = self._over_budget(self.noise_cohort(agents), q)
        if why:
            self.phase = Phase.DONE
            self.stop_reason = why
            return [Finished(self.model_version, self.weights, why)]
        self._round_q = q
        self.round += 1
        # Every agent online, none sampled out, benched or left out of a step (a secure
        # round names its cohort: every member needs it for its masks).
        everyone = cfg.secure is None and len(agents) == len(self.online)
        return self._open_round(tuple(agents), now, everyone=everyone)

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
        self._whole_round = True
        return self._open_round(selected, now, resumed=True)

    def _whole_due(self) -> bool:
        """Whether the next round start carries the whole model for the agents that read
        nothing else (at most one round start in ``whole_model_every``)."""
        return bool(self.whole_model_only()) and (
            self.delta is None or self._since_whole + 1 >= self.config.whole_model_every
        )

    def _open_round(
        self, agents: tuple[str, ...], now: float, *, resumed: bool = False, everyone: bool = False
    ) -> list[Command]:
        cfg = self.config
        self.phase = Phase.TRAINING
        self.selected = tuple(agents)
        self._selected_set = frozenset(self.selected)
        self.everyone = everyone
        self._outstanding = set(agents)  # selected, not yet answered
        self.received = {}
        self.deadline = now + cfg.round_timeout
        self._opened_at = now
        self._others_done_at = None
        self.influence.open(agents, self.online)
        self._open_intake()
        whole = resumed or self.delta is None or self._whole_round
        self._since_whole = 0 if whole else self._since_whole + 1
        train = replace(cfg.train, lr=cfg.lr_for(self.round))
        self._cohort = self.noise_cohort(agents)
        if self.budget is not None:
            self._acc = self.budget.aggregator(self.weights, self._cohort)
            train = self.budget.train(train, self._cohort)
        else:
            self._acc = StrategyAggregator(cfg.strategy, self.weights, compact=True, values=self.roles.buffers)
        setup = None
        wake = self.deadline
        first: tuple[SendSecAgg, ...] = ()
        if cfg.secure is not None:
            # The secure round ends itself (every stage has a deadline); the round's own
            # deadline is the masked inputs'.
            setup, first, wake = self.secure.open(
                self.round,
                agents,
                self.online,
                self.weights,
                train,
                now=now,
                last=self.completed + 1 >= cfg.rounds,
                seed=self._rng.randbytes(16),
                admit=self._distributed_admit,
                max_weight=self.influence.max_weight,
                dp_weight=self.dp_weight(train),
            )
            self.deadline = math.inf
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
                None if resumed or self._whole_round else self.delta,
                everyone,
            ),
            RequestWakeup(wake),
        ]

    # -- collecting --------------------------------------------------------------------
    def _admit(self, sender: str, round_: int, base_version: int, now: float) -> list[Command] | None:
        """The checks every update passes first, whole or streamed (its header): the
        round, the selection, one update per agent, the model it was trained from. None:
        it may be read on; otherwise what is done instead (discarded as late, refused, or
        refused and counted out of the round)."""
        if self.phase is not Phase.TRAINING or round_ != self.round:
            return self._late(sender, round_) or [
                Rejected(
                    sender,
                    round_,
                    "stale",
                    f"update for round {round_}, current round {self.round} ({self.phase.value})",
                )
            ]
        if sender not in self._selected_set:
            return self._joined_late(sender, round_) or [
                Rejected(sender, round_, "unselected", f"{sender} was not selected for round {self.round}")
            ]
        if sender in self.received or sender in self.inflight or sender in self._replay:
            return [Rejected(sender, round_, "duplicate", f"second update from {sender} for round {self.round}")]
        if self._replaying:
            return [Rejected(sender, round_, "stale", f"round {self.round} is being aggregated")]
        if base_version != self.model_version:
            refusal = Rejected(
                sender, round_, "stale", f"trained from version {base_version}, current {self.model_version}"
            )
            return self._counted_out(sender, refusal, now)
        return None

    def _late(self, sender: str, round_: int) -> list[Command] | None:
        """An update for a round that was abandoned: discarded, not refused (its agent did
        nothing wrong); None for any other round."""
        if round_ in self._abandoned:
            return [LateUpdate(sender, round_, f"update for round {round_}, which was abandoned")]
        return None

    def _joined_late(self, sender: str, round_: int) -> list[Command] | None:
        """An update from an agent the round did not select, in a round that selected
        every agent online: when the agent is online now it came online after the round
        started and read the round start as its own. Discarded, not refused: it did
        nothing wrong, and it takes part from the next round on. None otherwise."""
        if self.everyone and sender in self.online:
            return [LateUpdate(sender, round_, f"{sender} came online after round {round_} started")]
        return None

    def expects(self, sender: str) -> bool:
        """Whether frames of an update from ``sender`` may be read during the round in
        flight: a selected agent's, or in a round that selected every agent online, an
        online agent's (one that came online late: its update is discarded, not held
        against it, see _joined_late)."""
        return sender in self._selected_set or (self.everyone and sender in self.online)

    def _counted_out(self, sender: str, refusal: Rejected | None = None, now: float | None = None) -> list[Command]:
        """``sender``'s update for the round in progress is refused (``refusal``, or
        refused already before its header was read): it sends no other, so the round no
        longer waits for it. Given ``now``, the round ends if it waited for nothing else
        (it may aggregate without it); without, the caller looks at the round's end itself."""
        out: list[Command] = [] if refusal is None else [refusal]
        if sender not in self._outstanding:
            return out
        self._outstanding.discard(sender)
        return out if now is None else out + self._maybe_finish(now)

    def _on_update(self, ev: UpdateReceived, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            return [Rejected(ev.sender, ev.round, reason, detail)]

        def refuse(reason: str, detail: str) -> list[Command]:
            return self._counted_out(ev.sender, Rejected(ev.sender, ev.round, reason, detail), now)

        if self.config.secure is not None:
            return reject("secure", "plain update in a federation with secure aggregation (never aggregated)")
        instead = self._admit(ev.sender, ev.round, ev.base_version, now)
        if instead is not None:
            return instead
        if ev.num_samples <= 0:
            return refuse("weight", "num_samples must be positive")
        samples = self.influence.samples(ev.sender, ev.num_samples)
        try:
            check_update(self.weights, ev.weights, max_norm=self.config.max_norm)
            assert self._acc is not None
            if self.influence.bounds_norms:
                assert isinstance(self._acc, StrategyAggregator)
                if not self._add_bounded(ev, samples):
                    return self._maybe_finish(now)
            else:
                self._acc.add(ev.sender, ev.weights, samples, ev.metrics)
        except UpdateRejected as exc:
            return refuse(exc.reason, exc.detail)
        self.received[ev.sender] = (samples, dict(ev.metrics))
        self._outstanding.discard(ev.sender)
        if ev.leaving:
            self.departing.add(ev.sender)
        return self._maybe_finish(now)

    def _add_bounded(self, ev: UpdateReceived, samples: int) -> bool:
        """A whole update under the norm bound: folded scaled to the round's bound, or
        while the bound warms up held for a replay at the round's end. False: it is held
        (counted once replayed)."""
        assert isinstance(self._acc, StrategyAggregator)
        plan = self._acc.plan(samples, ev.metrics)
        if plan.dropped is not None:
            self._acc.dropped[ev.sender] = plan.dropped
            return True
        sq = 0.0
        for name, ref in self.weights.items():
            if ref.dtype.kind == "f":
                sq += float(np.square(np.asarray(ev.weights[name], np.float64) - ref).sum())
        norm = math.sqrt(sq)
        bound = self.influence.bound
        if bound is None:
            self._replay[ev.sender] = Replay(None, plan, 0, None, norm, True, samples, dict(ev.metrics), ev.leaving)
            self._outstanding.discard(ev.sender)
            return False
        weighed = scaled(plan, self.influence.scale(norm, bound))
        for name in self.weights:
            self._acc.fold(weighed, name, 0, np.asarray(ev.weights[name]).reshape(-1), None, delta=False)
        self._acc.commit(ev.sender, plan)
        self.influence.accepted(ev.sender, norm, bound)
        self.bench.forgive(ev.sender)
        return True

    # -- whether the round can end ----------------------------------------------------
    def _maybe_finish(self, now: float) -> list[Command]:
        if self.secagg is not None or self._replaying:
            return []  # a secure round ends by its own stages; a replay ends with Refolded
        out: list[Command] = []
        if self.replays and self.inflight and now < self.deadline:
            # Set-based and stopping at the first agent still owed: O(1) per update in the
            # usual case instead of a scan of every selected agent (O(N²) per round).
            if any(a in self.online and a not in self.inflight for a in self._outstanding):
                return []
            # Only streams still arriving are owed. One that makes no progress for as long
            # as the others took (at least STALL_GRACE) is dropped: a member that stops
            # half-way through its update holds the round that long, not to its deadline.
            since = self._others_done_at
            if since is None:
                since = self._others_done_at = now
            grace = max(STALL_GRACE, since - self._opened_at)
            out += self._drop_inflight(now, lambda fl: now - max(fl.last_at, since) >= grace)
            if self.inflight:
                due = min(max(fl.last_at, since) + grace for fl in self.inflight.values())
                return out + [RequestWakeup(min(due, self.deadline))]
        else:
            waiting = any(a in self.online for a in self._outstanding)
            if waiting and now < self.deadline:
                return []
            if self.inflight:
                if not self.replays:
                    if any(fl.folded for fl in self.inflight.values()):
                        return []  # half-folded updates still arriving: wait for their end
                elif now >= self.deadline:
                    out += self._drop_inflight(now)
        assert self._acc is not None
        held = [r for r in self._replay.values() if r.count]
        reason = ""
        if self._acc.count + len(held) >= self.config.min_updates:
            if isinstance(self._acc, DPAggregator) and self._acc.config.mode == "distributed":
                # Fewer noise shares than selected: the sum may carry too little noise to
                # be published within the budget (it is then dropped, not published).
                reason = self._over_budget(self._cohort, self._round_q, self._acc.count)
            if not reason:
                if self._replay:
                    return out + self._refold()
                return out + self._aggregate(now)
        else:
            reason = (
                "deadline passed" if now >= self.deadline else "selected agents left"
            ) + f" with {self._acc.count + len(held)} of {len(self.selected)} updates (need {self.config.min_updates})"
            if self._acc.dropped:
                reason += f", {len(self._acc.dropped)} dropped by {self.config.strategy.name}"
        return out + self._abandon(reason, now)

    # -- aggregating -------------------------------------------------------------------
    def _aggregate(self, now: float) -> list[Command]:
        assert self._acc is not None
        acc = self._acc
        new, velocity = self.server_step.propose(self.weights, acc.result(), self.model_version)
        overflow = [k for k, v in new.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if overflow:
            # Every update was finite, but their weighted sum left the tensor's range
            # (e.g. float32 values near 3.4e38): no model is better than an infinite one.
            reason = (
                f"the aggregate of {', '.join(sorted(acc.weights))} is not finite in "
                f"{', '.join(overflow[:3])}{' ...' if len(overflow) > 3 else ''} (the updates' values "
                "overflow their dtype); the global model is kept"
            )
            self.server_step.drop()
            return self._abandon(reason, now)
        self._adopt(new, velocity)
        self.last_metrics = weighted_metrics([(m, n) for n, m in self.received.values()])
        participants = tuple(sorted(acc.weights))
        total = sum(acc.weights.values())
        used = {a: acc.weights[a] / total for a in participants}
        if isinstance(acc, DPAggregator):
            assert self.budget is not None
            self.budget.clip.update(acc.unclipped, acc.count, len(self.selected), self.budget.rng)
        bounded = self.influence.aggregated(participants)
        return self._published(participants, used, dict(acc.dropped), acc.count, now, bounded)

    # -- secure rounds -----------------------------------------------------------------
    def _secure(self, cmds: list[SA.ServerCommand], now: float) -> list[Command]:
        out: list[Command] = []
        for c in cmds:
            if isinstance(c, SA.Unmasked):
                self._bench_spoilers(c.offenders)
                out += self._aggregate_secure(c, now)
            elif isinstance(c, SA.Failed):
                reason = f"secure aggregation: {c.reason}"
                benched = self._bench_spoilers(c.culprits)
                if benched:
                    reason += f" (sitting out: {', '.join(f'{a} {n}' for a, n in sorted(benched.items()))})"
                out += self._abandon(reason, now)
            else:
                out.append(self.secure.command(c, self.round))
        return out

    def _bench_spoilers(self, spoilers: Mapping[str, str]) -> dict[str, int]:
        """The agents that spoiled their part in a secure round sit out rounds; returns
        how many each."""
        return {a: self.bench.offend(a, self.round) for a in sorted(spoilers)}

    def after_unmask(self, mean: np.ndarray, result: SA.Unmasked) -> np.ndarray:
        """Hook: the unmasked mean update (flat, :func:`~fedagent.protocols.secagg.flatten`
        order) before it is added to the model. The identity here; a privacy stage
        (noise, accounting) applies itself to the sum at this point."""
        return mean

    def _bounded_mean(self, mean: np.ndarray) -> np.ndarray:
        """The unmasked mean update scaled to the adaptive bound on secure rounds' means
        (when it applies)."""
        if not self.config.bounds_secure_mean:
            return mean
        factor = self.influence.bound_mean(float(np.linalg.norm(mean)))
        return mean if factor == 1.0 else mean * factor

    def _aggregate_secure(self, res: SA.Unmasked, now: float) -> list[Command]:
        """The unmasked mean update becomes the next model: global + mean of the deltas
        (floating tensors; the others keep the global model's values)."""
        new, count = self.secure.aggregate(
            self.weights, res, lambda mean: self._bounded_mean(self.after_unmask(mean, res))
        )
        self._adopt(*self.server_step.propose(self.weights, new, self.model_version))
        self.received = {a: (c.num_samples, dict(c.metrics)) for a, c in res.contributors.items()}
        for a, c in res.contributors.items():
            if c.leaving:
                self.departing.add(a)
        self.last_metrics = weighted_metrics([(m, n) for n, m in self.received.values()])
        used = self.secure.aggregated(res)
        if self.budget is not None and count is not None:
            # Distributed DP (check_secure allows no other): the agents noised their
            # updates before masking; adaptive clipping moves by the noised count.
            self.budget.clip.move(count, len(res.contributors))
        for a in res.contributors:
            if a not in res.offenders:
                self.bench.forgive(a)
        bounded = self.influence.aggregated(res.contributors) if self.config.bounds_secure_mean else None
        shares = self.noise_shares({a: c.num_samples for a, c in res.contributors.items()})
        return self._published(tuple(sorted(res.contributors)), used, {}, shares, now, bounded)

    # -- the end of a round ------------------------------------------------------------
    def _adopt(self, new: Weights, velocity: Weights) -> None:
        """The server step's results become the global model and velocity: the next version."""
        self.weights = self.server_step.adopt(self.weights, new, velocity, self.model_version)
        self.model_version += 1
        self.completed += 1

    def _published(
        self,
        participants: tuple[str, ...],
        used: dict[str, float],
        dropped: dict[str, float],
        answered: int,
        now: float,
        bounded: dict[str, dict[str, float]] | None = None,
    ) -> list[Command]:
        """The round's aggregate is the global model: its release is charged to the
        privacy budget, and the next round starts, or training ends (the configured
        rounds are done, or the budget allows no further release)."""
        final = self.completed >= self.config.rounds
        why = ""
        if self.budget is not None:
            self.budget.charge(self._cohort, answered, self._round_q)
            if not final:
                # The next round's selection is not known yet: judged as this one's.
                why = self.budget.over_budget(self._cohort, self._round_q)
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
                dropped,
                self.privacy(),
                self.velocity,
                bounded or {},
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

    def _abandon(self, reason: str, now: float, *, at_once: bool = False) -> list[Command]:
        """The round ends without an aggregate, and a new one (with a new number) starts
        from the same model once a quorum is there (``at_once``: the agents are, as
        they were a moment ago)."""
        out: list[Command] = [RoundAbandoned(self.round, self.model_version, reason)]
        self._abandoned.append(self.round)
        self._end_round()
        self.phase = Phase.WAITING
        self.quorum_since = -math.inf if at_once else None
        return out + self._maybe_start(now)

    def _end_round(self) -> None:
        self.secure.end()
        self._acc = None
        self._close_intake()
        self.deadline = math.inf
        for agent in self.departing:
            if self.online.pop(agent, None) is not None:
                self.departed.add(agent)
        self.departing.clear()
