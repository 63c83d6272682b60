"""A site aggregator, as pure code: a coordinator for the agents of its site and, towards
its upstream tier (the hub, or a region), one participant whose update is its site's
weighted mean.

When the upstream tier starts round r from model v, the site starts a round of its own
from v for its agents (at once if a quorum is online, else as soon as one is), with the
upstream round's training settings, and sends the upstream tier its partial result when
its own round closes: its quorum, sampling, deadline and member protections are its
own (:class:`~.config.TierConfig`), its deadline at most ``1 − upload_share`` of the
upstream one so that the result arrives in time. The partial result is the weighted mean
of the accepted updates with weight Σ (capped) samples, so the upstream tier's FedAvg
over sites is FedAvg over all agents: Σ_s N_s·(Σ_{i∈s} n_i θ_i / N_s) / Σ_s N_s =
Σ_i n_i θ_i / Σ_i n_i.

Each site round is a one-round :class:`~fedagent.protocols.rounds.RoundMachine` built
for it (plain averaging: server learning rate 1, no momentum), under a round number of
the site's own that only grows; what outlives a round is kept here and handed to the
next one (the agents online and what they announced, the benched agents, the norm
bound's recent distances). A region is a site aggregator whose members are site
aggregators (``is_aggregator``): its rounds then run on an
:class:`~fedagent.protocols.tiers.upper.UpperRoundMachine`. Tiers nest by configuration.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from fedagent.protocols import rounds as R
from fedagent.protocols import secagg as SA
from fedagent.protocols.fingerprint import Roles
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.bounds import Bench
from fedagent.protocols.rounds.secure import LateAnswers
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart
from fedagent.protocols.tiers.config import TierConfig, check_upper
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
from fedagent.protocols.tiers.upper import UpperRoundMachine

Weights = dict[str, np.ndarray]
Event = R.Event | UpstreamRound | UpstreamClosed | UpstreamDown | UpstreamUp
Command = R.Command | PartialResult | SiteRoundFailed | PartialDropped | Announce

#: Site rounds remembered after they closed: an update for one of them is late, not wrong.
CLOSED_KEPT = 16


class SiteMachine:
    def __init__(
        self,
        config: TierConfig,
        *,
        is_aggregator: Callable[[str], bool] | None = None,
        replays: bool = False,
        roles: Roles | None = None,
        last_round: int = 0,
        verify_statement: SA.KeyVerifier | None = None,
    ) -> None:
        """``is_aggregator``: which members are site aggregators themselves (a region);
        None: all are agents. ``replays``: the caller carries out the round machine's
        :class:`~fedagent.protocols.rounds.Refold` (as a coordinator does: the norm bound
        needs it). ``last_round``: the site's latest round number (after a restart).
        ``verify_statement``: checks an agent's signature in a secure site round (as the
        round machine's)."""
        if is_aggregator is not None:
            check_upper(config.rounds)
        self.config = config
        self.is_aggregator = is_aggregator
        self.replays = replays
        self.roles = roles
        self.verify_statement = verify_statement
        self.site_round = last_round
        # Changed only by _join and _leave, which keep the two totals below: the site
        # announces them on every join and leave, and summing them there cost O(N) a
        # change, O(N²) while N agents connect.
        self.online: dict[str, int] = {}  # agent -> samples it announced
        self._agents_of: dict[str, int] = {}  # member online -> the agents it stands for (a site: its own)
        self._reads_steps: dict[str, bool] = {}
        self._samples_total = 0  # Σ online.values()
        self._agents_total = 0  # Σ _agents_of.values()
        self.departed: set[str] = set()  # left with their last update; ignored until their goodbye
        self.bench = Bench()
        self.norm_history: list[list[float]] = []
        self.machine: R.RoundMachine | None = None  # the site round in progress
        self.upstream: UpstreamRound | None = None  # the upstream round being answered
        self.deadline = math.inf  # of the site round for it (quorum included)
        self._closed: deque[int] = deque(maxlen=CLOSED_KEPT)
        self._announced: tuple[int, int] | None = None
        self.last: PartialResult | SiteRoundFailed | None = None
        self._top = 0  # the site round's W, when it is a secure one
        self.upstream_end = math.inf  # when the upstream round being answered stops waiting
        self._answering = 0  # the latest upstream round started (upstream_end is its, if answered)
        self.down_since: float | None = None  # the upstream connection lost at, if it is
        # A partial result made while the upstream tier was out of reach, with the time its
        # upstream round stops waiting: sent when the connection is back, if still open.
        self.held: tuple[PartialResult, float] | None = None
        # The distributed DP of the upstream round answered last (its agents' noise shares,
        # calibrated upstream), or None: what the status and history say of it.
        self.privacy: dict[str, float] | None = None
        # The members of the secure site round that ended last: their answers that come
        # after it are not refusals (the machine and its model are gone by then).
        self._late_answers: LateAnswers | None = None

    # -- public ------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, UpstreamRound):
            return self._on_upstream(event, now)
        if isinstance(event, UpstreamClosed):
            out = self._drop_held(f"upstream round {event.round} closed", upto=event.round)
            if self.upstream is not None and self.upstream.round == event.round:
                return out + self._fail(f"upstream round {event.round} closed before the site's", now)
            return out
        if isinstance(event, UpstreamDown):
            if self.down_since is None:
                self.down_since = now
            return []
        if isinstance(event, UpstreamUp):
            self.down_since = None
            return self._release_held(now)
        if isinstance(event, R.AgentOnline):
            if event.agent in self.departed:
                return []
            self._join(event.agent, event.num_samples, event.agents, event.reads_steps)
            return self._announce() + self._forward(event, now) + self._maybe_open(now)
        if isinstance(event, R.AgentOffline):
            self._leave(event.agent)
            self.departed.discard(event.agent)
            return self._announce() + self._forward(event, now)
        if isinstance(event, R.Wakeup):
            if self.held is not None and now >= self.held[1]:
                return self._drop_held("its deadline passed while the upstream tier was out of reach")
            # Woken for something sooner: the held result's deadline is asked for again.
            keep: list[Command] = [R.RequestWakeup(self.held[1])] if self.held is not None else []
            if self.machine is None and self.upstream is not None and now >= self.deadline:
                return keep + self._fail(
                    f"no quorum before the site's deadline ({len(self.online)} of {self.config.rounds.min_agents} "
                    "agents online)",
                    now,
                )
            return keep + self._forward(event, now)
        if (
            isinstance(event, R.SecAggReceived)
            and self._late_answers is not None
            and self._late_answers.late(event.sender, getattr(event.message, "round", None))
        ):
            return []
        if self.machine is None:
            return self._no_round(event)
        return self._forward(event, now)

    def refold(self, sender: str, part: UpdatePart) -> None:
        """A part replayed for the site round's :class:`~fedagent.protocols.rounds.Refold`."""
        if self.machine is not None:
            self.machine.refold(sender, part)

    @property
    def samples(self) -> int:
        """What the site announces upstream: its online agents' announced samples."""
        return self._samples_total

    def _join(self, agent: str, samples: int, agents: int, reads_steps: bool) -> None:
        """``agent`` is online with what it announced (again: its new figures replace the old)."""
        self._leave(agent)
        agents = max(1, agents)
        self.online[agent] = samples
        self._agents_of[agent] = agents
        self._reads_steps[agent] = reads_steps
        self._samples_total += samples
        self._agents_total += agents

    def _leave(self, agent: str) -> None:
        samples = self.online.pop(agent, None)
        if samples is None:
            return
        self._samples_total -= samples
        self._agents_total -= self._agents_of.pop(agent)
        self._reads_steps.pop(agent, None)

    @property
    def online_upstream(self) -> bool:
        """Whether the site's presence upstream says online: its last announcement, made
        with its quorum online, counts samples (the upstream tier selects it then)."""
        return self._announced is not None and self._announced[0] > 0

    def hold(self, result: PartialResult, now: float) -> list[Command]:
        """``result`` could not be sent (the connection broke while it went): held like
        one made while the upstream tier was out of reach."""
        if self.down_since is None:
            self.down_since = now
        if result.round != self._answering:
            # A newer upstream round started meanwhile: this one's is over.
            return [PartialDropped(result.round, result.site_round, "not sent: its upstream round is over")]
        return self._hold(result, self.upstream_end)

    def resume(self, upstream: UpstreamRound, site_round: int, selected: tuple[str, ...], now: float) -> list[Command]:
        """Take site round ``site_round`` up again after a restart (from the round journal),
        under the same number and selection, for ``upstream`` (as saved when it started;
        ``deadline_s``: what is left of it). The caller then feeds the journaled updates
        like any others. Refused (ValueError) for a secure site round: its keys and shares
        died with the process."""
        if self.machine is not None or self.upstream is not None or not selected:
            raise ValueError(f"cannot resume site round {site_round}: a round is in progress")
        if self.config.rounds.secure is not None:
            raise ValueError(f"cannot resume secure site round {site_round}: its keys died with the process")
        left = self.config.budget(upstream.deadline_s)
        if left <= 0:
            raise ValueError(f"cannot resume site round {site_round}: upstream round {upstream.round} is over")
        self.upstream = upstream
        self._answering = upstream.round
        self.upstream_end = now + upstream.deadline_s
        self.deadline = now + left
        self.site_round = max(self.site_round, site_round)
        machine = self._build(upstream, len(selected), left, last_round=site_round)
        self.machine = machine
        return self._translate(machine.resume(site_round, tuple(selected), now), now)

    def status(self) -> dict[str, object]:
        up = self.upstream
        last = self.last
        held = self.held
        return {
            "upstream_down_since": self.down_since,
            "held": None
            if held is None
            else {
                "round": held[0].round,
                "site_round": held[0].site_round,
                "num_samples": held[0].num_samples,
                "agents": len(held[0].participants),
                "until": held[1],
            },
            "upstream_round": up.round if up is not None else None,
            "site_round": self.site_round,
            "phase": "training" if self.machine is not None else ("quorum" if up is not None else "idle"),
            "agents": dict(sorted(self.online.items())),
            "samples": self.samples,
            "privacy": None if self.privacy is None else dict(self.privacy),
            "round": self.machine.status() if self.machine is not None else None,
            "last": None
            if last is None
            else (
                {
                    "round": last.round,
                    "sent": held is None or held[0] is not last,
                    "num_samples": last.num_samples,
                    "agents": len(last.participants),
                }
                if isinstance(last, PartialResult)
                else {"round": last.round, "sent": False, "reason": last.reason}
            ),
        }

    # -- upstream ----------------------------------------------------------------------
    def _on_upstream(self, ev: UpstreamRound, now: float) -> list[Command]:
        out: list[Command] = []
        if self.upstream is not None:
            if ev.round <= self.upstream.round:
                return []  # a redelivered round start
            # The upstream tier runs one round at a time: the one being answered is over
            # (its result never reached the site). Its work would go up as this round's.
            out += self._fail(f"upstream round {ev.round} started before the site's round ended", now)
        if self.held is not None and ev.round <= self.held[0].round:
            return out  # answered already: its result waits for the connection
        out += self._drop_held(f"upstream round {ev.round} started", upto=ev.round - 1)
        self._answering = max(self._answering, ev.round)
        if ev.everyone and not self.online_upstream:
            # Selected by count, not by name, while this site said offline upstream (below
            # its quorum): the round is not its own. The upstream tier does not wait for
            # it, and would discard its update as late; a failure of it would be reported
            # for a round the site was never in.
            return out
        self.upstream = ev
        self.upstream_end = now + ev.deadline_s
        self.deadline = now + self.config.budget(ev.deadline_s)
        t = ev.train
        self.privacy = (
            None
            if t.dp_clip is None
            else {"noise_added": 0.0, "cohort": float(t.dp_cohort), "share_std": t.dp_noise_std, "clip_norm": t.dp_clip}
        )
        why = self._refuses_privacy(t)
        if why:
            return out + self._fail(why, now)
        out += self._maybe_open(now)
        if self.machine is None and self.upstream is not None:
            out.append(R.RequestWakeup(self.deadline))  # the quorum's deadline
        return out

    def _refuses_privacy(self, train: TrainConfig) -> str:
        """Why this site cannot answer an upstream round carrying distributed DP, or ''.
        Its agents add the shares of the noise; the site adds none and accounts nothing,
        so its round must hide each agent's update (it carries a small part of the noise)."""
        if train.dp_clip is None:
            return ""
        if self.config.rounds.secure is None:
            return (
                "the upstream round carries distributed differential privacy, which needs [rounds] "
                "secure_aggregation = true on this site aggregator: without it the site would see each "
                "agent's update with only its share of the noise (set it, or drop [privacy] on the hub)"
            )
        if train.dp_count_std:
            return "the upstream round asks for adaptive clipping, which does not cross tiers"
        if train.dp_cohort < 1:
            return "the upstream round carries distributed differential privacy without its cohort (an earlier release)"
        return ""

    def _maybe_open(self, now: float) -> list[Command]:
        """Start the site round for the upstream round being answered, with every agent
        online, once there is a quorum (and time left before the site's deadline)."""
        up = self.upstream
        cfg = self.config.rounds
        if up is None or self.machine is not None or len(self.online) < cfg.min_agents:
            return []
        left = self.deadline - now
        if left <= 0:
            return []
        agents = sorted(self.online)
        # One round; every agent online is there already: the round starts when the last
        # one is fed in.
        try:
            machine = self._build(up, len(agents), left, last_round=self.site_round)
        except ValueError as exc:
            # e.g. a secure round's three stages no longer fit in what is left of the time
            return self._fail(f"no site round in the {left:.1f}s left: {exc}", now)
        self.machine = machine
        cmds: list[R.Command] = []
        for a in agents:
            cmds = machine.handle(R.AgentOnline(a, self.online[a], self._reads_steps[a], self._agents_of[a]), now)
        # The wake-ups asked for while the quorum grew are moot: the last agent started it.
        return self._translate(cmds, now)

    def _build(self, up: UpstreamRound, agents: int, left: float, *, last_round: int) -> R.RoundMachine:
        """The one-round machine of a site round for ``up``: the upstream's training
        settings with the site's own transfer settings (compression is per tier), no
        server step of its own."""
        cfg = self.config.rounds
        train = replace(
            up.train, compression=cfg.train.compression, topk_ratio=cfg.train.topk_ratio, stream=cfg.train.stream
        )
        rc = self._round_config(cfg, train, agents, left)
        weights = dict(up.weights)
        carried = {**self._carried(up), "last_round": last_round}
        machine = (
            R.RoundMachine(rc, weights, **carried)
            if self.is_aggregator is None
            else UpperRoundMachine(rc, weights, is_aggregator=self.is_aggregator, **carried)
        )
        machine.bench = self.bench
        return machine

    @staticmethod
    def _round_config(cfg: R.RoundConfig, train: TrainConfig, agents: int, left: float) -> R.RoundConfig:
        if train.dp_clip is not None:
            # The upstream round's noise shares are calibrated for dp_cohort agents: no more
            # take part, so that no site's mean outweighs W upstream. No norm bound on the
            # unmasked mean: scaling a site's noised sum would take noise out of the total
            # that every other agent's privacy is counted on.
            limit = min(cfg.agents_per_round or train.dp_cohort, train.dp_cohort)
            cfg = replace(cfg, agents_per_round=limit, norm_bound=None)
        return replace(
            cfg,
            rounds=1,
            expected_agents=agents,
            start_grace=left,
            round_timeout=left,
            train=train,
            lr_schedule="constant",
            server_lr=1.0,
            server_momentum=0.0,
            downlink="none",
        )

    def _carried(self, up: UpstreamRound) -> dict[str, Any]:
        """What the site round's machine starts from, beside its configuration and model."""
        return {
            "model_version": up.model_version,
            "last_round": self.site_round,
            "norm_history": self.norm_history,
            "replays": self.replays,
            "roles": self.roles,
            "verify_statement": self.verify_statement,
        }

    # -- the site round ----------------------------------------------------------------
    def _forward(self, event: R.Event, now: float) -> list[Command]:
        if self.machine is None:
            return []
        return self._translate(self.machine.handle(event, now), now)

    def _translate(self, cmds: list[R.Command], now: float) -> list[Command]:
        """The site round's commands, with its aggregate turned into the partial result
        and its end into the site's: what the one-round machine would do next (finish, or
        start the round again) is not the site's to do."""
        out: list[Command] = []
        m = self.machine
        for c in cmds:
            if isinstance(c, R.RoundAggregated):
                assert m is not None and self.upstream is not None
                return out + self._partial(m, c)
            if isinstance(c, R.RoundAbandoned):
                out.append(c)
                return out + self._fail(f"site round {c.round} abandoned: {c.reason}", now, ended=c.round)
            if isinstance(c, R.Finished):
                continue
            if isinstance(c, R.StartRound):
                self._top = c.secagg.max_weight if c.secagg is not None else 0
            out.append(c)
        return out

    def _partial(self, m: R.RoundMachine, agg: R.RoundAggregated) -> list[Command]:
        up = self.upstream
        assert up is not None
        res = m.secure_result
        if self._top and res is not None:
            # A secure round weighs each agent min(n, W)/W: the site's mean weighs Σ min(n, W).
            total = max(1, round(res.weight_sum * self._top))
        else:
            total = sum(m.received[a][0] for a in agg.participants)
        result = PartialResult(
            up.round,
            up.model_version,
            total,
            agg.weights,
            dict(agg.metrics),
            agg.round,
            agg.participants,
            dict(agg.weights_used),
            dict(agg.bounded),
        )
        self._close(m, agg.round)
        self.last = result
        if self.down_since is not None:
            return [agg, *self._hold(result, self.upstream_end)]
        return [agg, result]

    # -- a result held while the upstream tier is out of reach ---------------------------
    def _hold(self, result: PartialResult, until: float) -> list[Command]:
        # One at a time: a newer upstream round means the held one's round has closed.
        self.held = (result, until)
        return [R.RequestWakeup(until)] if math.isfinite(until) else []

    def _release_held(self, now: float) -> list[Command]:
        held = self.held
        if held is None:
            return []
        if now >= held[1]:
            return self._drop_held("its deadline passed while the upstream tier was out of reach")
        self.held = None
        return [held[0]]

    def _drop_held(self, why: str, *, upto: float = math.inf) -> list[Command]:
        """Drop the held result if its upstream round is ``upto`` or older: sent now, it
        would come late (the upstream tier refuses it, or has counted without it)."""
        held = self.held
        if held is None or held[0].round > upto:
            return []
        self.held = None
        return [PartialDropped(held[0].round, held[0].site_round, f"not sent: {why}")]

    def _fail(self, reason: str, now: float, *, ended: int | None = None) -> list[Command]:
        """No partial result for the upstream round being answered; ``ended``: the site
        round that ended (default: the one in progress, if any)."""
        up = self.upstream
        assert up is not None
        m = self.machine
        site_round = ended if ended is not None else (m.round if m is not None else self.site_round)
        if m is not None:
            self._close(m, site_round)
        else:
            self.upstream = None
            self.deadline = math.inf
        failed = SiteRoundFailed(up.round, site_round, reason)
        self.last = failed
        return [failed]

    def _close(self, m: R.RoundMachine, ended: int) -> None:
        # The machine may have started its round again after abandoning it (never sent):
        # numbers only grow past that one too.
        self.site_round = max(self.site_round, m.round)
        self._closed.append(ended)
        self.norm_history = m.norm_state()
        m.secure.end()
        self._late_answers = m.secure.late_answers
        # Agents that sent their last update are gone for the site too, until their goodbye.
        for a in m.departed:
            self.departed.add(a)
            self._leave(a)
        self.machine = None
        self.upstream = None
        self.deadline = math.inf

    def _no_round(self, event: R.Event) -> list[Command]:
        """An update or secure-aggregation message while no site round runs."""
        if isinstance(event, R.UpdateReceived | UpdateHead):
            if event.round in self._closed:
                return [R.LateUpdate(event.sender, event.round, f"update for site round {event.round}, which ended")]
            return [
                R.Rejected(event.sender, event.round, "stale", f"no site round in progress (last {self.site_round})")
            ]
        if isinstance(event, R.SecAggReceived):
            msg = event.message
            return [R.Rejected(event.sender, getattr(msg, "round", 0), "stale", f"{msg.kind} outside a site round")]
        if isinstance(event, UpdatePart | UpdateEnd | R.Refolded):
            return []
        raise TypeError(f"not a site event: {event!r}")

    def _announce(self) -> list[Command]:
        # Below its quorum a site could not answer a round: it announces no samples (its
        # upstream presence says offline), so that the upstream tier neither waits for it
        # nor starts a round counting it with a part of its agents.
        ready = len(self.online) >= self.config.rounds.min_agents
        # A region stands for its sites' agents, a site for its own.
        now = (self._samples_total if ready else 0, self._agents_total)
        if now == self._announced:
            return []
        self._announced = now
        return [Announce(*now)]
