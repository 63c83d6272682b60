"""Faults at a site aggregator, as traces of the pure machine: a restart in the middle of
a site round (taken up again from its journal), and the upstream tier out of reach (the
site's result held until the connection is back, or dropped once its upstream round is
over)."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.protocols.rounds import (
    AgentOnline,
    LateUpdate,
    RequestWakeup,
    RoundAggregated,
    RoundConfig,
    StartRound,
    UpdateReceived,
    Wakeup,
)
from fedagent.protocols.tiers import (
    PartialDropped,
    PartialResult,
    SiteMachine,
    SiteRoundFailed,
    TierConfig,
    UpstreamClosed,
    UpstreamDown,
    UpstreamRound,
    UpstreamUp,
)
from tests.protocols.test_tiers import W0, _train, of, trained

AGENTS = {"a1": 10, "a2": 20, "a3": 30}


def site_online(**kw) -> SiteMachine:
    site = SiteMachine(TierConfig(RoundConfig(min_agents=3, round_timeout=60.0)), **kw)
    for a, n in AGENTS.items():
        site.handle(AgentOnline(a, n), 0.0)
    return site


def upstream(round_: int = 5, deadline: float = 40.0) -> UpstreamRound:
    return UpstreamRound(round_, 2, dict(W0), _train(), deadline)


def update(agent: str, own: StartRound) -> UpdateReceived:
    return UpdateReceived(agent, own.round, own.model_version, AGENTS[agent], trained(agent, W0, 5), {"loss": 1.0})


def answered(site: SiteMachine, own: StartRound, now: float, agents=tuple(AGENTS)) -> list:
    out: list = []
    for a in agents:
        out += site.handle(update(a, own), now)
    return out


def uninterrupted() -> PartialResult:
    site = site_online()
    (own,) = of(site.handle(upstream(), 0.0), StartRound)
    (res,) = of(answered(site, own, 1.0), PartialResult)
    return res


def assert_same(a: PartialResult, b: PartialResult) -> None:
    def key(r: PartialResult) -> tuple:
        return (r.round, r.base_version, r.num_samples, r.participants)

    assert key(a) == key(b)
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])


# ---- a restart mid-round -----------------------------------------------------------------
def test_restarted_site_resumes_its_round_and_sends_the_same_result():
    site = site_online()
    (own,) = of(site.handle(upstream(), 0.0), StartRound)
    answered(site, own, 1.0, ("a1", "a2"))  # journaled; then the process dies
    # The restarted site: its round numbers from its state file, the upstream round as
    # saved, with what is left of its deadline.
    again = SiteMachine(TierConfig(RoundConfig(min_agents=3, round_timeout=60.0)), last_round=own.round)
    cmds = again.resume(upstream(deadline=30.0), own.round, own.selected, 100.0)
    (start,) = of(cmds, StartRound)
    assert (start.round, start.selected, start.resumed) == (own.round, own.selected, True)
    assert of(cmds, RequestWakeup) == [RequestWakeup(100.0 + 30.0 * 0.75)]  # its share of what is left
    assert again.status()["phase"] == "training" and again.status()["upstream_round"] == 5
    # The agents' presences come back; the journal's updates, then the outstanding agent's.
    for a, n in AGENTS.items():
        assert not of(again.handle(AgentOnline(a, n), 100.5), StartRound)
    out = answered(again, start, 101.0)
    (res,) = of(out, PartialResult)
    assert_same(res, uninterrupted())
    assert of(out, RoundAggregated)[0].round == own.round
    # The next site round gets a new number.
    (nxt,) = of(again.handle(upstream(6), 110.0), StartRound)
    assert nxt.round == own.round + 1


def test_resumed_round_whose_upstream_round_closed_is_dropped_not_sent():
    site = site_online()
    (own,) = of(site.handle(upstream(), 0.0), StartRound)
    again = SiteMachine(TierConfig(RoundConfig(min_agents=3, round_timeout=60.0)), last_round=own.round)
    (start,) = of(again.resume(upstream(deadline=30.0), own.round, own.selected, 100.0), StartRound)
    again.handle(update("a1", start), 100.5)
    # The hub closed round 5 while the site was down: the queued result says so.
    (failed,) = of(again.handle(UpstreamClosed(5), 101.0), SiteRoundFailed)
    assert failed.round == 5 and "closed" in failed.reason
    out = answered(again, start, 102.0, ("a2", "a3"))
    assert not of(out, PartialResult) and all(isinstance(c, LateUpdate) for c in out)


def test_resume_refused_when_it_cannot_be_taken_up():
    from tests.protocols.test_tiers_secure import PARAMS

    secure = SiteMachine(TierConfig(RoundConfig(min_agents=3, min_updates=2, secure=PARAMS)), last_round=4)
    with pytest.raises(ValueError, match="keys"):
        secure.resume(upstream(), 4, ("a1", "a2", "a3"), 0.0)
    site = SiteMachine(TierConfig(RoundConfig(min_agents=3)), last_round=4)
    with pytest.raises(ValueError, match="over"):
        site.resume(upstream(deadline=0.0), 4, ("a1", "a2", "a3"), 0.0)
    assert site.machine is None and site.upstream is None


# ---- the upstream tier out of reach ------------------------------------------------------
def test_cut_off_site_runs_its_round_and_sends_the_result_when_back():
    site = site_online()
    (own,) = of(site.handle(upstream(deadline=40.0), 0.0), StartRound)
    assert site.handle(UpstreamDown(), 2.0) == []
    out = answered(site, own, 3.0)  # the agents are on the site broker: the round goes on
    assert of(out, RoundAggregated) and not of(out, PartialResult)
    assert RequestWakeup(40.0) in out  # when its upstream round stops waiting
    st = site.status()
    assert st["upstream_down_since"] == 2.0
    assert st["held"] == {"round": 5, "site_round": own.round, "num_samples": 60, "agents": 3, "until": 40.0}
    assert site.handle(Wakeup(), 20.0) == [RequestWakeup(40.0)]  # woken early: asked again
    (res,) = site.handle(UpstreamUp(), 30.0)
    assert_same(res, uninterrupted())
    assert site.status()["held"] is None and site.status()["upstream_down_since"] is None
    assert site.handle(Wakeup(), 40.0) == []


def test_held_result_dropped_when_its_upstream_round_closes():
    site = site_online()
    (own,) = of(site.handle(upstream(), 0.0), StartRound)
    site.handle(UpstreamDown(), 1.0)
    answered(site, own, 2.0)
    assert site.handle(UpstreamClosed(4), 3.0) == []  # an older round: not this one
    (dropped,) = site.handle(UpstreamClosed(5), 3.0)
    assert dropped == PartialDropped(5, own.round, "not sent: upstream round 5 closed")
    assert site.handle(UpstreamUp(), 4.0) == []


def test_held_result_dropped_at_its_upstream_deadline_or_when_back_too_late():
    site = site_online()
    (own,) = of(site.handle(upstream(deadline=40.0), 0.0), StartRound)
    site.handle(UpstreamDown(), 1.0)
    answered(site, own, 2.0)
    (dropped,) = site.handle(Wakeup(), 40.0)
    assert isinstance(dropped, PartialDropped) and "deadline" in dropped.reason
    assert site.handle(UpstreamUp(), 41.0) == []
    # Back after the deadline, before the wake-up fired: dropped all the same.
    site = site_online()
    (own,) = of(site.handle(upstream(deadline=40.0), 0.0), StartRound)
    site.handle(UpstreamDown(), 1.0)
    answered(site, own, 2.0)
    (dropped,) = site.handle(UpstreamUp(), 45.0)
    assert isinstance(dropped, PartialDropped) and dropped.round == 5


def test_next_upstream_round_drops_the_held_result_and_runs():
    site = site_online()
    (own,) = of(site.handle(upstream(), 0.0), StartRound)
    site.handle(UpstreamDown(), 1.0)
    answered(site, own, 2.0)
    assert site.handle(upstream(5), 3.0) == []  # the same round again: answered, waiting
    cmds = site.handle(upstream(6), 50.0)
    (dropped,) = of(cmds, PartialDropped)
    assert dropped.round == 5 and "round 6 started" in dropped.reason
    (nxt,) = of(cmds, StartRound)
    assert nxt.round == own.round + 1


def test_a_result_that_could_not_go_is_held():
    site = site_online()
    (own,) = of(site.handle(upstream(deadline=40.0), 0.0), StartRound)
    (res,) = of(answered(site, own, 2.0), PartialResult)  # the link looked up
    assert site.hold(res, 3.0) == [RequestWakeup(40.0)]  # ... and the send failed
    assert site.status()["upstream_down_since"] == 3.0
    assert site.handle(UpstreamUp(), 10.0) == [res]


def test_a_result_that_failed_after_its_upstream_round_moved_on_is_dropped():
    site = site_online()
    (own,) = of(site.handle(upstream(deadline=40.0), 0.0), StartRound)
    (res,) = of(answered(site, own, 2.0), PartialResult)
    site.handle(upstream(6, deadline=40.0), 30.0)  # while the send of round 5's hung
    (dropped,) = site.hold(res, 31.0)
    assert dropped == PartialDropped(5, own.round, "not sent: its upstream round is over")
    assert site.held is None
