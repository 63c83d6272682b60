"""Distributed differential privacy across tiers, with the pure machines and the agents'
secure-round clients in memory: the hub's ``[privacy]`` calibrates the noise shares for
every selected site's agents (the cohort, from the sites' announcements), each site
passes the calibration down in its own round start, its agents clip and add their share
before masking, the site adds nothing and accounts nothing, and the hub charges one
release of the whole cohort per round.

What is measured: the noise in the total the hub unmasks, as the unmasked sum minus the
sum of the agents' clipped updates (known here), per coordinate over 4,080 coordinates
and three rounds. Its variance should be z²·C²·k/N for k of N shares; the sample variance
of m values has a relative standard deviation √(2/m) (1.3 % for m = 12,240), and the test
allows 6 % (over 4 of those), with fixed seeds. The quantisation of the two secure rounds
adds about 10⁻¹¹ of variance, far below that."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest

from fedagent import config
from fedagent.errors import CodecError, ConfigError
from fedagent.protocols import dp
from fedagent.protocols import secagg as S
from fedagent.protocols.codec import Limits
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import (
    AgentOffline,
    AgentOnline,
    Rejected,
    RoundAbandoned,
    RoundAggregated,
    RoundConfig,
    SecAggReceived,
    SendSecAgg,
    StartRound,
)
from fedagent.protocols.tiers import (
    Announce,
    PartialResult,
    SiteMachine,
    SiteRoundFailed,
    TierConfig,
    UpperRoundMachine,
    UpstreamRound,
    check_site,
    check_upper,
)

W0 = {"w": np.zeros((50, 80), np.float32), "b": np.zeros(80, np.float32), "steps": np.zeros(1, np.int64)}
COORDS = 50 * 80 + 80
SITES = {"site-a": {"a1": 10, "a2": 35, "a3": 7}, "site-b": {"b1": 120, "b2": 3, "b3": 50, "b4": 20}}
N = sum(len(m) for m in SITES.values())
Z, CLIP = 1.0, 0.5
PARAMS = S.SecAggParams(clip=1.0, bits=20)
DP = dp.DPConfig(mode="distributed", noise_multiplier=Z, clip_norm=CLIP)
ROUNDS = 3
TOL = 0.06  # relative, on the measured noise variance (module docstring)


def det_bytes(seed: int):
    rng = np.random.default_rng(seed)
    return lambda n: rng.bytes(n)


def trained(agent: str, weights, round_: int):
    """An update of norm about 5 (clipped to CLIP): float tensors move, counters do not."""
    seed = int.from_bytes(hashlib.sha256(f"{agent}/{round_}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return {
        k: (v + rng.normal(0, 0.08, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in weights.items()
    }


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def pump(machine, clients, pending, now, dead=(), cmds=()):
    """Every secure-round message between ``machine`` and its members' clients until none
    is left, starting with the machine's ``cmds`` (``dead`` members answer nothing);
    returns the machine's other commands."""
    out = []

    def carry(cs):
        for c in cs:
            if isinstance(c, SendSecAgg):
                if c.to not in dead:
                    pending.append((c.to, clients[c.to].on_message(c.message)))
            else:
                out.append(c)

    carry(cmds)
    while pending:
        member, msgs = pending.pop(0)
        for msg in msgs:
            carry(machine.handle(SecAggReceived(member, msg), now))
    return out


def hub_config(budget: float | None = None, **kw) -> RoundConfig:
    base = dict(
        rounds=ROUNDS,
        min_agents=2,
        expected_agents=2,
        min_updates=2,
        server_momentum=0.0,
        secure=PARAMS,
        dp=dp.DPConfig(mode="distributed", noise_multiplier=Z, clip_norm=CLIP, epsilon_budget=budget),
    )
    base.update(kw)
    return RoundConfig(**base)


def run(hub: UpperRoundMachine, *, dead: frozenset[str] = frozenset(), rounds: int = ROUNDS):
    """Hub rounds over both sites, each agent clipping and noising as its site's round
    start says; ``dead`` agents share their keys, then send nothing. Returns, per hub
    round, (its commands, the noise in its unmasked total, the shares in it); and the
    sites' machines."""
    sites, agents, upstream = {}, {}, {}
    cmds = []
    for i, (site, members) in enumerate(SITES.items()):
        sites[site] = SiteMachine(TierConfig(RoundConfig(min_agents=len(members), min_updates=2, secure=PARAMS)))
        announce = None
        for a, n in members.items():
            announce = (of(sites[site].handle(AgentOnline(a, n), 0.0), Announce) or [announce])[-1]
            agents[a] = S.SecAggAgent(a, random_bytes=det_bytes(len(agents)))
        assert announce.agents == len(members)
        upstream[site] = S.SecAggAgent(site, random_bytes=det_bytes(100 + i))
        cmds += hub.handle(AgentOnline(site, announce.num_samples, agents=announce.agents), 0.0)
    rng = np.random.default_rng(2026)
    results = []
    now = 1.0
    for _ in range(rounds):
        (start,) = of(cmds, StartRound)
        t = start.train
        # The hub's round start says what the shares are calibrated for: all sites' agents.
        assert t.dp_cohort == N and t.dp_clip == CLIP
        assert t.dp_noise_std == pytest.approx(Z * CLIP / math.sqrt(N))
        assert start.secagg is not None and start.secagg.max_weight == N
        pending = [(s, upstream[s].on_round_start(start.round, start.selected, start.secagg)) for s in start.selected]
        pending += [(c.to, upstream[c.to].on_message(c.message)) for c in start.secagg_first]
        out = pump(hub, upstream, pending, now)
        clipped_sum = np.zeros(COORDS)
        shares = 0
        for site in start.selected:
            m = sites[site]
            (own,) = of(
                m.handle(UpstreamRound(start.round, start.model_version, start.weights, t, 60.0), now), StartRound
            )
            # ... and each site passes it down unchanged, and adds no noise of its own.
            assert own.train.dp_cohort == N and own.train.dp_noise_std == t.dp_noise_std
            assert own.secagg is not None and own.secagg.max_weight == 1  # every agent weighs 1
            assert m.privacy == {"noise_added": 0.0, "cohort": N, "share_std": t.dp_noise_std, "clip_norm": CLIP}
            pending = []
            for a in own.selected:
                pending.append((a, agents[a].on_round_start(own.round, own.selected, own.secagg)))
            for a in own.selected:
                if a in dead:
                    continue
                update = trained(a, own.weights, start.round)
                clipped, norm = dp.clipped_delta(own.weights, update, CLIP)
                assert norm > CLIP  # every update is clipped: the clip bounds what the sum shows
                clipped_sum += S.flatten(clipped)[1]
                noised, _ = dp.noise_share(own.weights, update, CLIP, own.train.dp_noise_std, rng)
                shares += 1
                delta = S.Delta(noised, own.weights)
                msgs = agents[a].on_trained(own.round, delta, base_version=own.model_version, num_samples=5, metrics={})
                pending.append((a, msgs))
            site_out = pump(m, agents, pending, now, dead)
            for a in sorted(dead & set(own.selected)):
                # its presence goes offline: the stage it holds up closes without it
                site_out += pump(m, agents, [], now, dead, m.handle(AgentOffline(a), now))
            (res,) = of(site_out, PartialResult)
            # The site's mean weighs its agents (each weighing 1), not their samples.
            assert res.num_samples == len(own.selected) - len(dead & set(own.selected))
            out += pump(
                hub,
                upstream,
                [
                    (
                        site,
                        upstream[site].on_trained(
                            start.round,
                            S.Delta(res.weights, start.weights),
                            base_version=res.base_version,
                            num_samples=res.num_samples,
                            metrics={},
                        ),
                    )
                ],
                now,
            )
        aggs = of(out, RoundAggregated)
        noise = None
        if aggs:
            total = (S.flatten(aggs[0].weights)[1] - S.flatten(start.weights)[1]) * shares
            noise = total - clipped_sum
        results.append((out, noise, shares))
        cmds = out
        now += 1.0
    return results, sites


def test_the_total_carries_the_calibrated_noise_and_is_charged_once_per_hub_round():
    hub = UpperRoundMachine(hub_config(), dict(W0), is_aggregator=lambda a: a.startswith("site"))
    results, sites = run(hub)
    noise = np.concatenate([n for _, n, _ in results])
    want = (Z * CLIP) ** 2  # N shares of (z·C)²/N
    got = float(np.mean(noise**2))
    print(f"noise variance in the unmasked total {got:.5f}, calibrated {want:.5f} ({got / want - 1:+.2%})")
    assert got == pytest.approx(want, rel=TOL)
    assert abs(float(np.mean(noise))) < 4 * math.sqrt(want / noise.size)
    # One release of the whole cohort per hub round, and nothing anywhere else.
    assert hub.accountant is not None and hub.accountant.releases == [dp.Release(1.0, (Z,))] * ROUNDS
    assert hub.accountant.epsilon == pytest.approx(dp.epsilon_for(Z, ROUNDS, DP.delta))
    for out, _, _ in results:
        (agg,) = of(out, RoundAggregated)
        assert agg.privacy is not None and agg.privacy["noise_shares"] == N and agg.privacy["cohort"] == N
    assert all(s.machine is None and s.privacy["noise_added"] == 0.0 for s in sites.values())
    assert all(s.status()["privacy"]["noise_added"] == 0.0 for s in sites.values())


def test_a_dropped_agent_leaves_less_noise_and_is_charged_what_was_added():
    hub = UpperRoundMachine(hub_config(), dict(W0), is_aggregator=lambda a: a.startswith("site"))
    results, _ = run(hub, dead=frozenset({"b2"}), rounds=1)
    ((out, noise, shares),) = results
    assert shares == N - 1
    want = (Z * CLIP) ** 2 * shares / N
    got = float(np.mean(noise**2))
    print(f"one agent dropped: noise variance {got:.5f}, {shares} of {N} shares {want:.5f} ({got / want - 1:+.2%})")
    assert got == pytest.approx(want, rel=2 * TOL)  # one round: √3 the spread of three
    assert hub.accountant is not None
    assert hub.accountant.releases == [dp.Release(1.0, (Z * math.sqrt(shares / N),))]


def test_a_total_that_would_overdraw_the_budget_is_never_unmasked():
    full = dp.epsilon_for(Z, 1, DP.delta)
    fewer = dp.epsilon_for(Z * math.sqrt((N - 1) / N), 1, DP.delta)
    hub = UpperRoundMachine(
        hub_config(budget=(full + fewer) / 2), dict(W0), is_aggregator=lambda a: a.startswith("site")
    )
    results, _ = run(hub, dead=frozenset({"b2"}), rounds=1)
    ((out, noise, _),) = results
    (ab,) = of(out, RoundAbandoned)
    assert noise is None and "privacy budget" in ab.reason and f"{N - 1} of {N}" in ab.reason
    assert hub.accountant is not None and hub.accountant.releases == []


def test_a_site_takes_no_more_agents_than_the_cohort():
    site = SiteMachine(TierConfig(RoundConfig(min_agents=2, min_updates=2, secure=PARAMS)))
    for a in ("a1", "a2", "a3", "a4"):
        site.handle(AgentOnline(a, 10), 0.0)
    train = TrainConfig(stream=False, dp_clip=CLIP, dp_noise_std=0.1, dp_cohort=3)
    (own,) = of(site.handle(UpstreamRound(1, 0, dict(W0), train, 60.0), 0.0), StartRound)
    assert len(own.selected) == 3


def test_refusals():
    upper = dict(rounds=3, min_agents=2, secure=PARAMS, server_momentum=0.0)
    with pytest.raises(ValueError, match="mode = 'central' cannot run over site aggregators"):
        check_upper(RoundConfig(**{**upper, "secure": None}, dp=dp.DPConfig(mode="central")))
    with pytest.raises(ValueError, match="needs \\[rounds\\] secure_aggregation = true"):
        check_upper(RoundConfig(**{**upper, "secure": None}, dp=DP))
    adaptive = dp.DPConfig(mode="distributed", noise_multiplier=Z, clip_norm=CLIP, adaptive=True)
    with pytest.raises(ValueError, match="adaptive_clip across tiers"):
        check_upper(RoundConfig(**upper, dp=adaptive))
    check_upper(RoundConfig(**upper, dp=DP))  # distributed, secure, a fixed clip: taken
    with pytest.raises(ValueError, match="accounted once, at the top tier"):
        check_site(RoundConfig(min_agents=2, secure=PARAMS, dp=DP))
    # A site aggregator without secure aggregation answers no private round: its agents'
    # updates would reach it with only their shares of the noise.
    plain = SiteMachine(TierConfig(RoundConfig(min_agents=2, min_updates=2)))
    for a in ("a1", "a2"):
        plain.handle(AgentOnline(a, 10), 0.0)
    train = TrainConfig(stream=False, dp_clip=CLIP, dp_noise_std=0.1, dp_cohort=2)
    out = plain.handle(UpstreamRound(1, 0, dict(W0), train, 60.0), 0.0)
    (failed,) = of(out, SiteRoundFailed)
    assert not of(out, StartRound) and "secure_aggregation = true on this site aggregator" in failed.reason
    # An agent among the sites of a private hub: it would weigh its samples, not one share.
    hub = UpperRoundMachine(hub_config(), dict(W0), is_aggregator=lambda a: a.startswith("site"))
    (rej,) = of(hub.handle(AgentOnline("agent-9", 10), 0.0), Rejected)
    assert rej.reason == "role" and "only site aggregators" in rej.detail and "agent-9" not in hub.online


def _hub_file(tmp_path: Path, rounds: dict, privacy: dict) -> Path:
    tls = config.TlsConfig(ca=Path("ca.crt"), cert=Path("c.crt"), key=Path("c.key"))
    text = config.render(
        node_id="coordinator",
        federation="fed-1",
        tls=tls,
        state_dir=Path("state"),
        broker="mqtts://127.0.0.1:8883",
        rounds={"rounds": 12, **rounds},
        privacy=privacy,
        tier={"sites": True},
    )
    path = tmp_path / "hub.toml"
    path.write_text(text)
    return path


def test_a_hubs_config(tmp_path):
    private = {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 0.5}
    cfg = config.load(_hub_file(tmp_path, {"secure_aggregation": True}, private), "coordinator")
    assert cfg.privacy is not None and cfg.tier.sites
    with pytest.raises(ConfigError, match="secure_aggregation = true"):
        config.load(_hub_file(tmp_path, {}, private), "coordinator")
    with pytest.raises(ConfigError, match="adaptive_clip across tiers"):
        config.load(
            _hub_file(tmp_path, {"secure_aggregation": True}, {**private, "adaptive_clip": True}), "coordinator"
        )


def test_the_round_start_says_the_cohort():
    t = TrainConfig(stream=False, dp_clip=CLIP, dp_noise_std=0.1, dp_cohort=N)
    body = t.to_body()
    assert body["dp_cohort"] == N
    assert TrainConfig(**TrainConfig.WIRE.read(body, Limits())) == t
    assert "dp_cohort" not in TrainConfig(stream=False, dp_clip=CLIP).to_body()  # unsaid: as before
    with pytest.raises(CodecError, match="dp_cohort needs dp_clip"):
        TrainConfig(dp_cohort=3)


def test_three_tiers_hub_region_site():
    """hub → region → two sites, and a third site straight under the hub: the cohort is
    every agent below the hub (the region announces its sites' agents), the region passes
    the calibration down as a site does, its mean weighs its sites' agents, and the hub's
    total carries the calibrated noise, charged once."""
    tree = {"region-1": {"site-a": SITES["site-a"], "site-b": SITES["site-b"]}, "site-c": {"c1": 4, "c2": 9}}
    leaves = {s: m for s, m in tree["region-1"].items()} | {"site-c": tree["site-c"]}
    cohort = sum(len(m) for m in leaves.values())

    def is_tier(member: str) -> bool:
        return member.startswith(("site", "region"))

    hub = UpperRoundMachine(hub_config(rounds=1), dict(W0), is_aggregator=is_tier)
    sites = {
        s: SiteMachine(TierConfig(RoundConfig(min_agents=len(m), min_updates=2, secure=PARAMS)))
        for s, m in leaves.items()
    }
    region = SiteMachine(TierConfig(RoundConfig(min_agents=2, min_updates=2, secure=PARAMS)), is_aggregator=is_tier)
    clients: dict[str, S.SecAggAgent] = {}
    for i, a in enumerate(["region-1", *leaves, *(a for m in leaves.values() for a in m)]):
        clients[a] = S.SecAggAgent(a, random_bytes=det_bytes(500 + i))
    announced = {}
    for s, members in leaves.items():
        for a, n in members.items():
            ann = of(sites[s].handle(AgentOnline(a, n), 0.0), Announce)
            announced[s] = ann[-1] if ann else announced.get(s)
    for s in tree["region-1"]:
        ann = of(region.handle(AgentOnline(s, announced[s].num_samples, agents=announced[s].agents), 0.0), Announce)
        announced["region-1"] = ann[-1] if ann else announced.get("region-1")
    assert announced["region-1"].agents == len(SITES["site-a"]) + len(SITES["site-b"])
    cmds = []
    for member in tree:
        cmds += hub.handle(AgentOnline(member, announced[member].num_samples, agents=announced[member].agents), 0.0)
    (start,) = of(cmds, StartRound)
    assert start.train.dp_cohort == cohort and start.secagg.max_weight == cohort
    rng = np.random.default_rng(7)
    clipped_sum = np.zeros(COORDS)
    shares = 0

    def answer(machine: SiteMachine, up: StartRound) -> PartialResult:
        nonlocal clipped_sum, shares
        (own,) = of(
            machine.handle(UpstreamRound(up.round, up.model_version, up.weights, up.train, 60.0), 1.0), StartRound
        )
        assert own.train.dp_cohort == cohort and own.train.dp_noise_std == up.train.dp_noise_std
        pending = [(a, clients[a].on_round_start(own.round, own.selected, own.secagg)) for a in own.selected]
        pending += [(c.to, clients[c.to].on_message(c.message)) for c in own.secagg_first]
        for a in own.selected:
            if a in sites:  # a site under this region
                assert own.secagg.max_weight == cohort
                res = answer(sites[a], own)
                delta, n = S.Delta(res.weights, own.weights), res.num_samples
            else:
                assert own.secagg.max_weight == 1
                update = trained(a, own.weights, own.round)
                clipped, _ = dp.clipped_delta(own.weights, update, CLIP)
                clipped_sum += S.flatten(clipped)[1]
                shares += 1
                noised, _ = dp.noise_share(own.weights, update, CLIP, own.train.dp_noise_std, rng)
                delta, n = S.Delta(noised, own.weights), 5
            pending.append(
                (a, clients[a].on_trained(own.round, delta, base_version=own.model_version, num_samples=n, metrics={}))
            )
        (res,) = of(pump(machine, clients, pending, 1.0), PartialResult)
        return res

    pending = [(m, clients[m].on_round_start(start.round, start.selected, start.secagg)) for m in start.selected]
    pending += [(c.to, clients[c.to].on_message(c.message)) for c in start.secagg_first]
    out = pump(hub, clients, pending, 1.0)
    for member in start.selected:
        res = answer(region if member == "region-1" else sites[member], start)
        assert res.num_samples == (7 if member == "region-1" else 2)
        msgs = clients[member].on_trained(
            start.round, S.Delta(res.weights, start.weights), base_version=0, num_samples=res.num_samples, metrics={}
        )
        out += pump(hub, clients, [(member, msgs)], 1.0)
    (agg,) = of(out, RoundAggregated)
    assert shares == cohort
    noise = (S.flatten(agg.weights)[1] - S.flatten(start.weights)[1]) * shares - clipped_sum
    got, want = float(np.mean(noise**2)), (Z * CLIP) ** 2
    print(f"three tiers: noise variance {got:.5f}, calibrated {want:.5f} ({got / want - 1:+.2%})")
    assert got == pytest.approx(want, rel=2 * TOL)
    assert hub.accountant is not None and hub.accountant.releases == [dp.Release(1.0, (Z,))]
    assert region.privacy is not None and region.privacy["noise_added"] == 0.0
