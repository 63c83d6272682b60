"""Site aggregators as pure machines: a tree of tiers driven in memory against a flat
federation of the same agents, whose updates are the same function of the model they
start from.

Tolerance: every compared value is within 2e-6 of the flat run's (values of order 1 in
float32, whose spacing there is 1.2e-7): a site's mean is rounded to float32 once more
before the upstream tier averages it, and the sums run in another order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.rounds import (
    AgentOnline,
    LateUpdate,
    Rejected,
    RequestWakeup,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
    Wakeup,
)
from fedagent.protocols.tiers import (
    Announce,
    PartialResult,
    SiteMachine,
    SiteRoundFailed,
    TierConfig,
    UpperRoundMachine,
    UpstreamClosed,
    UpstreamRound,
    check_site,
    check_upper,
)

TOL = 2e-6
W0 = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)}


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def trained(agent: str, weights, round_: int):
    """What ``agent`` sends for a round from ``weights``: the same function in every run."""
    seed = int.from_bytes(hashlib.sha256(f"{agent}/{round_}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return {k: (v * 0.9 + rng.normal(0, 0.3, v.shape)).astype(v.dtype) for k, v in weights.items()}


def loss(agent: str) -> float:
    return float(int(hashlib.sha256(agent.encode()).hexdigest()[:4], 16) % 100) / 10


@dataclass
class Tier:
    """A site aggregator (or a region) and its members: agents (name -> samples) or tiers."""

    name: str
    members: list[Tier | tuple[str, int]]
    rounds: RoundConfig = field(default_factory=lambda: RoundConfig(min_agents=1))
    machine: SiteMachine | None = None

    def agents(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.members:
            out.update(m.agents() if isinstance(m, Tier) else dict([m]))
        return out


def is_site(name: str) -> bool:
    return name.startswith(("site", "region"))


def build(tier: Tier, now: float) -> Announce:
    """Bring the tree below ``tier`` online; returns its last announcement upstream."""
    nested = any(isinstance(m, Tier) for m in tier.members)
    tier.machine = SiteMachine(TierConfig(tier.rounds), is_aggregator=is_site if nested else None)
    last = None
    for m in tier.members:
        if isinstance(m, Tier):
            ann = build(m, now)
            cmds = tier.machine.handle(AgentOnline(m.name, ann.num_samples), now)
        else:
            cmds = tier.machine.handle(AgentOnline(m[0], m[1]), now)
        last = (of(cmds, Announce) or [last])[-1]
    assert last is not None
    return last


def answer(tier: Tier, start: StartRound, now: float) -> PartialResult | None:
    """``tier`` is selected for the upstream ``start``: its site round, answered by its
    members; returns its partial result."""
    m = tier.machine
    assert m is not None
    up = UpstreamRound(start.round, start.model_version, start.weights, start.train, start.deadline_s, start.everyone)
    cmds = m.handle(up, now)
    (own,) = of(cmds, StartRound)
    assert own.deadline_s <= start.deadline_s * 0.75 + 1e-9  # it ends before the upstream round
    out: list = []
    members = {x.name if isinstance(x, Tier) else x[0]: x for x in tier.members}
    for name in own.selected:
        member = members[name]
        now += 0.01
        if isinstance(member, Tier):
            res = answer(member, own, now)
            if res is None:
                continue
            ev = UpdateReceived(name, own.round, own.model_version, res.num_samples, res.weights, res.metrics)
        else:
            w = trained(name, own.weights, start.round)
            ev = UpdateReceived(name, own.round, own.model_version, member[1], w, {"loss": loss(name)})
        out += m.handle(ev, now)
    results = of(out, PartialResult)
    return results[0] if results else None


def run_tiers(top: RoundConfig, tiers: list[Tier], rounds: int):
    hub = UpperRoundMachine(top, dict(W0), is_aggregator=is_site)
    cmds: list = []
    for t in tiers:
        ann = build(t, 0.0)
        cmds += hub.handle(AgentOnline(t.name, ann.num_samples), 0.0)
    models = []
    now = 1.0
    while len(models) < rounds:
        (start,) = of(cmds, StartRound)
        cmds = []
        for name in start.selected:
            tier = next(t for t in tiers if t.name == name)
            res = answer(tier, start, now)
            now += 1.0
            if res is not None:
                cmds += hub.handle(
                    UpdateReceived(name, start.round, start.model_version, res.num_samples, res.weights, res.metrics),
                    now,
                )
        (agg,) = of(cmds, RoundAggregated)
        models.append(agg)
    return models


def run_flat(top: RoundConfig, agents: dict[str, int], rounds: int):
    hub = RoundMachine(top, dict(W0))
    cmds: list = []
    for a, n in agents.items():
        cmds += hub.handle(AgentOnline(a, n), 0.0)
    models = []
    now = 1.0
    while len(models) < rounds:
        (start,) = of(cmds, StartRound)
        cmds = []
        for a in start.selected:
            now += 0.01
            w = trained(a, start.weights, start.round)
            cmds += hub.handle(
                UpdateReceived(a, start.round, start.model_version, agents[a], w, {"loss": loss(a)}), now
            )
        (agg,) = of(cmds, RoundAggregated)
        models.append(agg)
    return models


def assert_same(tiered, flat):
    assert len(tiered) == len(flat)
    for t, f in zip(tiered, flat, strict=True):
        assert t.model_version == f.model_version
        for k in W0:
            np.testing.assert_allclose(t.weights[k], f.weights[k], rtol=0, atol=TOL)
        assert t.metrics["loss"] == pytest.approx(f.metrics["loss"], rel=1e-9)


def two_sites() -> list[Tier]:
    return [
        Tier("site-a", [("a1", 10), ("a2", 35), ("a3", 7)]),
        Tier("site-b", [("b1", 120), ("b2", 3)]),
    ]


def test_two_tiers_equal_flat_fedavg():
    # The server step (learning rate, momentum) runs once, at the top, in both.
    top = dict(rounds=5, min_agents=2, expected_agents=2, server_lr=1.5, server_momentum=0.5)
    tiers = two_sites()
    flat_agents = {a: n for t in tiers for a, n in t.agents().items()}
    tiered = run_tiers(RoundConfig(**top), tiers, 5)
    flat = run_flat(RoundConfig(**{**top, "expected_agents": len(flat_agents)}), flat_agents, 5)
    assert_same(tiered, flat)
    # Sanity: the model moved, and the sites weighed what their agents weigh.
    assert not np.allclose(tiered[-1].weights["w"], W0["w"])
    assert tiered[0].weights_used == pytest.approx({"site-a": 52 / 175, "site-b": 123 / 175})


def test_three_levels_equal_flat_fedavg():
    tiers = [
        Tier(
            "region-1",
            [Tier("site-1a", [("a1", 10), ("a2", 30)]), Tier("site-1b", [("c1", 5), ("c2", 5), ("c3", 50)])],
            RoundConfig(min_agents=2),
        ),
        Tier("region-2", [Tier("site-2a", [("d1", 200), ("d2", 1)])], RoundConfig(min_agents=1)),
    ]
    top = dict(rounds=4, min_agents=2, expected_agents=2, server_lr=1.0, server_momentum=0.7)
    flat_agents = {a: n for t in tiers for a, n in t.agents().items()}
    tiered = run_tiers(RoundConfig(**top), tiers, 4)
    flat = run_flat(RoundConfig(**{**top, "expected_agents": len(flat_agents)}), flat_agents, 4)
    assert_same(tiered, flat)


def test_upper_weight_cap_does_not_clip_an_honest_large_site():
    # Five agents of 100 samples at one site, one of 100 at the other: with a weight cap of
    # 2 × the median announcement, a flat-style cap would hold the large site to 200 samples.
    tiers = [Tier("site-a", [(f"a{i}", 100) for i in range(5)]), Tier("site-b", [("b1", 100)])]
    top = dict(rounds=2, min_agents=2, expected_agents=2, weight_cap=2.0, server_momentum=0.0)
    flat_agents = {a: n for t in tiers for a, n in t.agents().items()}
    tiered = run_tiers(RoundConfig(**top), tiers, 2)
    flat = run_flat(RoundConfig(**{**top, "expected_agents": 6}), flat_agents, 2)
    assert_same(tiered, flat)
    assert tiered[0].bounded == {}
    assert tiered[0].weights_used == pytest.approx({"site-a": 5 / 6, "site-b": 1 / 6})


def test_a_site_claiming_more_than_it_announced_is_capped_at_its_announcement():
    hub = UpperRoundMachine(
        RoundConfig(min_agents=2, expected_agents=2, weight_cap=2.0), dict(W0), is_aggregator=is_site
    )
    hub.handle(AgentOnline("site-a", 500), 0.0)
    (start,) = of(hub.handle(AgentOnline("site-b", 100), 0.0), StartRound)
    hub.handle(UpdateReceived("site-a", start.round, 0, 10**9, trained("x", W0, 1), {}), 1.0)
    (agg,) = of(
        hub.handle(UpdateReceived("site-b", start.round, 0, 100, trained("y", W0, 1), {}), 1.0), RoundAggregated
    )
    assert agg.weights_used == pytest.approx({"site-a": 500 / 600, "site-b": 100 / 600})
    assert agg.bounded == {"site-a": {"samples": 1e9, "weight": 500.0}}


def test_member_protections_apply_at_the_site():
    # The weight cap of the site holds an agent claiming 10^6 samples to 2 × the median;
    # the site's partial result weighs what its agents weigh after the cap.
    site = SiteMachine(TierConfig(RoundConfig(min_agents=3, weight_cap=2.0)))
    for a in ("a1", "a2", "a3"):
        site.handle(AgentOnline(a, 10), 0.0)
    (own,) = of(site.handle(UpstreamRound(4, 3, dict(W0), _train(), 60.0), 0.0), StartRound)
    assert own.round == 1 and own.model_version == 3 and own.selected == ("a1", "a2", "a3")
    site.handle(UpdateReceived("a1", 1, 3, 10**6, trained("a1", W0, 4), {}), 1.0)
    site.handle(UpdateReceived("a2", 1, 3, 10, trained("a2", W0, 4), {}), 1.0)
    cmds = site.handle(UpdateReceived("a3", 1, 3, 10, trained("a3", W0, 4), {}), 1.0)
    (res,) = of(cmds, PartialResult)
    assert res.round == 4 and res.base_version == 3 and res.num_samples == 30
    assert res.bounded == {"a1": {"samples": 1e6, "weight": 10.0}}
    assert site.status()["last"] == {"round": 4, "sent": True, "num_samples": 30, "agents": 3}


def _train():
    from fedagent.protocols.messages import TrainConfig

    return TrainConfig(epochs=2, lr=0.01, batch_size=16, compression="fp16")


def test_site_round_takes_the_upstream_training_and_its_own_transfer_settings():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=1, round_timeout=30.0), upload_share=0.5))
    site.handle(AgentOnline("a1", 10), 0.0)
    (own,) = of(site.handle(UpstreamRound(1, 0, dict(W0), _train(), 100.0), 5.0), StartRound)
    assert (own.train.epochs, own.train.lr, own.train.batch_size) == (2, 0.01, 16)
    assert own.train.compression == "none"  # the site's own, not the upstream tier's
    assert own.deadline_s == 30.0  # min(its round_timeout, half of the upstream 100 s)
    site2 = SiteMachine(TierConfig(RoundConfig(min_agents=1, round_timeout=300.0), upload_share=0.25))
    site2.handle(AgentOnline("a1", 10), 0.0)
    (own,) = of(site2.handle(UpstreamRound(1, 0, dict(W0), _train(), 100.0), 5.0), StartRound)
    assert own.deadline_s == 75.0


def test_site_without_quorum_starts_when_one_is_there_or_fails_at_its_deadline():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, round_timeout=60.0)))
    site.handle(AgentOnline("a1", 10), 0.0)
    cmds = site.handle(UpstreamRound(1, 0, dict(W0), _train(), 40.0), 0.0)
    assert cmds == [RequestWakeup(30.0)]
    (own,) = of(site.handle(AgentOnline("a2", 10), 10.0), StartRound)
    assert own.selected == ("a1", "a2") and own.deadline_s == pytest.approx(20.0)  # what is left of the 30 s
    # Next upstream round: one agent left, no quorum until the site's deadline.
    site.handle(UpdateReceived("a1", 1, 0, 10, trained("a1", W0, 1), {}), 11.0)
    assert of(site.handle(UpdateReceived("a2", 1, 0, 10, trained("a2", W0, 1), {}), 12.0), PartialResult)
    from fedagent.protocols.rounds import AgentOffline

    site.handle(AgentOffline("a2"), 13.0)
    assert site.handle(UpstreamRound(2, 1, dict(W0), _train(), 40.0), 20.0) == [RequestWakeup(50.0)]
    assert site.handle(Wakeup(), 49.0) == []
    (failed,) = site.handle(Wakeup(), 50.0)
    assert isinstance(failed, SiteRoundFailed) and failed.round == 2 and "no quorum" in failed.reason


def test_abandoned_site_round_is_reported_and_not_restarted():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, min_updates=2)))
    site.handle(AgentOnline("a1", 10), 0.0)
    site.handle(AgentOnline("a2", 10), 0.0)
    (own,) = of(site.handle(UpstreamRound(7, 2, dict(W0), _train(), 40.0), 0.0), StartRound)
    site.handle(UpdateReceived("a1", own.round, 2, 10, trained("a1", W0, 7), {}), 1.0)
    cmds = site.handle(Wakeup(), 30.0)
    (failed,) = of(cmds, SiteRoundFailed)
    assert failed.round == 7 and "abandoned" in failed.reason
    assert not of(cmds, StartRound) and site.machine is None
    # a2's update comes after the site round closed: late, not refused
    (late,) = site.handle(UpdateReceived("a2", own.round, 2, 10, trained("a2", W0, 7), {}), 31.0)
    assert isinstance(late, LateUpdate)
    # The next upstream round gets a new site round number.
    (own2,) = of(site.handle(UpstreamRound(8, 2, dict(W0), _train(), 40.0), 32.0), StartRound)
    assert own2.round > own.round


def test_upstream_round_closed_first_ends_the_site_round():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=1)))
    site.handle(AgentOnline("a1", 10), 0.0)
    site.handle(UpstreamRound(3, 0, dict(W0), _train(), 40.0), 0.0)
    assert site.handle(UpstreamClosed(2), 1.0) == []
    (failed,) = site.handle(UpstreamClosed(3), 1.0)
    assert isinstance(failed, SiteRoundFailed) and "closed" in failed.reason


def test_sampling_per_tier():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, agents_per_round=2, seed=3)))
    for i in range(6):
        site.handle(AgentOnline(f"a{i}", 10), 0.0)
    (own,) = of(site.handle(UpstreamRound(1, 0, dict(W0), _train(), 40.0), 0.0), StartRound)
    assert len(own.selected) == 2


def test_announcements_follow_the_agents_online():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=1)))
    assert site.handle(AgentOnline("a1", 10), 0.0) == [Announce(10, 1)]
    assert site.handle(AgentOnline("a2", 5), 0.0) == [Announce(15, 2)]
    assert site.handle(AgentOnline("a2", 5), 0.0) == []


def test_a_site_below_its_quorum_announces_no_samples():
    from fedagent.protocols.rounds import AgentOffline

    site = SiteMachine(TierConfig(RoundConfig(min_agents=2)))
    assert site.handle(AgentOnline("a1", 10), 0.0) == [Announce(0, 1)]
    assert site.handle(AgentOnline("a2", 5), 0.0) == [Announce(15, 2)]
    assert site.handle(AgentOffline("a2"), 0.0) == [Announce(0, 1)]


@pytest.mark.parametrize(
    "cfg, words",
    [
        (RoundConfig(server_lr=2.0), "server_lr 1"),
        (RoundConfig(server_momentum=0.9), "momentum"),
        (RoundConfig(dp=DPConfig(mode="central", clip_norm=1.0, noise_multiplier=1.0)), "top tier"),
        (RoundConfig(lr_schedule="cosine"), "upstream round"),
    ],
)
def test_site_refuses_what_belongs_to_the_top(cfg, words):
    with pytest.raises(ValueError, match=words):
        check_site(cfg)


@pytest.mark.parametrize(
    "cfg, words",
    [
        (RoundConfig(strategy=Strategy("median"), min_updates=1), "robust"),
        (RoundConfig(strategy=Strategy("fedavg", clip_norm=1.0)), "clip"),
    ],
)
def test_upper_tier_refuses_protections_that_belong_to_the_sites(cfg, words):
    with pytest.raises(ValueError, match=words):
        check_upper(cfg)


def test_upload_share_checked():
    with pytest.raises(ValueError, match="upload_share"):
        TierConfig(RoundConfig(), upload_share=1.0)


def test_demo_spreads_agents_over_sites():
    from fedagent.errors import FedagentError
    from fedagent.local.demo.tiers import split

    assert split(4, 2) == [2, 2] and split(5, 2) == [3, 2] and split(7, 3) == [3, 2, 2]
    with pytest.raises(FedagentError, match="one agent per site"):
        split(1, 2)


# ---- the announcement's totals -----------------------------------------------------------
_POOL = [f"a{i}" for i in range(6)]
_joins = st.tuples(st.just("join"), st.sampled_from(_POOL), st.integers(1, 1000), st.integers(0, 5))
_leaves = st.tuples(st.just("leave"), st.sampled_from(_POOL))
# A site round in which these agents send their last update (they leave with it).
_rounds = st.tuples(st.just("round"), st.frozensets(st.sampled_from(_POOL)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(_joins, _leaves, _rounds), max_size=40), st.integers(1, 3))
def test_announced_totals_are_the_sums_over_the_agents_online(ops, quorum):
    """Joins, leaves, re-joins with other counts, and agents leaving with their last update
    of a site round: what the site announces (and its status says) is the plain sum of
    what its agents online announced, after every event."""
    from fedagent.protocols.rounds import AgentOffline

    site = SiteMachine(TierConfig(RoundConfig(min_agents=quorum, round_timeout=60.0)))
    online: dict[str, tuple[int, int]] = {}  # what the site should count: samples, agents
    departed: set[str] = set()
    upstream = 0
    now = 0.0
    for op in ops:
        now += 1.0
        if op[0] == "join":
            _, agent, samples, agents = op
            out = site.handle(AgentOnline(agent, samples, agents=agents), now)
            if agent not in departed:
                online[agent] = (samples, max(1, agents))
        elif op[0] == "leave":
            out = site.handle(AgentOffline(op[1]), now)
            online.pop(op[1], None)
            departed.discard(op[1])
        else:
            if len(online) < quorum:
                continue
            upstream += 1
            out = site.handle(UpstreamRound(upstream, upstream, dict(W0), _train(), 40.0), now)
            (own,) = of(out, StartRound)
            for a in own.selected:
                w = trained(a, W0, upstream)
                out += site.handle(UpdateReceived(a, own.round, upstream, 10, w, {}, a in op[1]), now)
            assert of(out, PartialResult)
            for a in op[1] & set(own.selected):
                online.pop(a)
                departed.add(a)
        samples = sum(n for n, _ in online.values())
        agents = sum(k for _, k in online.values())
        assert site.online == {a: n for a, (n, _) in online.items()}
        assert site.samples == site.status()["samples"] == samples
        for ann in of(out, Announce):
            assert ann == Announce(samples if len(online) >= quorum else 0, agents)
        if of(out, Announce):
            assert site._announced == (samples if len(online) >= quorum else 0, agents)


# ---- which upstream rounds are the site's ------------------------------------------------
def test_a_newer_upstream_round_ends_the_one_being_answered():
    # The upstream tier's result of round 5 never reached the site (lost with a
    # connection): its round start of 6 says 5 is over all the same.
    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, round_timeout=60.0)))
    for a in ("a1", "a2"):
        site.handle(AgentOnline(a, 10), 0.0)
    (own,) = of(site.handle(UpstreamRound(5, 2, dict(W0), _train(), 40.0), 0.0), StartRound)
    site.handle(UpdateReceived("a1", own.round, 2, 10, trained("a1", W0, 5), {}), 1.0)
    w6 = trained("hub", W0, 6)
    cmds = site.handle(UpstreamRound(6, 3, w6, _train(), 40.0), 2.0)
    (failed,) = of(cmds, SiteRoundFailed)
    assert (failed.round, failed.site_round) == (5, own.round) and "round 6 started" in failed.reason
    (nxt,) = of(cmds, StartRound)
    assert nxt.round == own.round + 1 and nxt.model_version == 3
    assert site.status()["upstream_round"] == 6
    # Round 5's outstanding update is not taken; round 6's result is made of round 6's updates.
    (late,) = site.handle(UpdateReceived("a2", own.round, 2, 10, trained("a2", W0, 5), {}), 3.0)
    assert isinstance(late, Rejected) and late.reason == "stale"
    out: list = []
    for a in ("a1", "a2"):
        out += site.handle(UpdateReceived(a, nxt.round, 3, 10, trained(a, w6, 6), {}), 4.0)
    (res,) = of(out, PartialResult)
    assert (res.round, res.base_version, res.site_round) == (6, 3, nxt.round)
    mean = (trained("a1", w6, 6)["w"] + trained("a2", w6, 6)["w"]) / 2
    np.testing.assert_allclose(res.weights["w"], mean, rtol=0, atol=TOL)


def test_a_round_for_the_sites_online_is_not_taken_by_a_site_that_said_offline():
    from fedagent.protocols.rounds import AgentOffline

    def everyone(round_: int) -> UpstreamRound:
        return UpstreamRound(round_, round_, dict(W0), _train(), 40.0, everyone=True)

    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, round_timeout=60.0)))
    assert site.handle(AgentOnline("a1", 10), 0.0) == [Announce(0, 1)]  # offline upstream
    # The upstream tier's round selects the sites it counted online: not this one. No
    # round, no wait, and no failure reported at the site's deadline.
    assert site.handle(everyone(1), 1.0) == []
    assert site.status()["phase"] == "idle" and site.status()["upstream_round"] is None
    assert site.handle(Wakeup(), 31.0) == [] and site.status()["last"] is None
    # Its quorum back, it is online upstream and in the next such round.
    assert site.handle(AgentOnline("a2", 10), 32.0) == [Announce(20, 2)]
    (own,) = of(site.handle(everyone(2), 33.0), StartRound)
    assert own.selected == ("a1", "a2")
    # Below its quorum in the middle of that round: the round is still its own, and
    # fails truthfully when it cannot be answered.
    site.handle(AgentOffline("a2"), 34.0)
    (failed,) = of(site.handle(Wakeup(), 33.0 + 30.0), SiteRoundFailed)
    assert failed.round == 2 and failed.site_round == own.round
    assert site.status()["last"] == {"round": 2, "sent": False, "reason": failed.reason}
    # A round that names the site is its own whatever it said: it was selected by name.
    assert site.handle(UpstreamRound(3, 3, dict(W0), _train(), 40.0), 70.0) == [RequestWakeup(100.0)]
    (failed,) = site.handle(Wakeup(), 100.0)
    assert isinstance(failed, SiteRoundFailed) and failed.round == 3 and "no quorum" in failed.reason
