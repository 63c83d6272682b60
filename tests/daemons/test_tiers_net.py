"""Two tiers over real processes: a hub broker and coordinator, two site brokers, a site
aggregator per site (``fedagent aggregator``) and 3 + 2 agents, against a flat
federation of the same five agents (same shards, same seeds, same settings).

The weight cap is off in both: it caps an agent at a multiple of the median count of
the agents its tier sees, a site's agents in one case and all of them in the other.

Tolerance: the final models agree within 1e-5 (measured: 1.5e-7 to 1.8e-7; the site means are
rounded to float32 once more, the sums run in another order, and three rounds of
training carry the difference on). Every agent trains the same shard from the same
model with the round's number as its seed in both runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from netfed import running, wait_for

from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED
from fedagent.local.tiers import TieredFederation
from fedagent.storage.history import read_records

ROUNDS = 3
ALPHA = 0.3
SITES = [3, 2]
TOL = 1e-5
#: Secure rounds quantise each (weighted) update to 2^24 levels in ±1 at each tier (measured: 5.6e-7).
SECURE_TOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tiered = TieredFederation(
        tmp_path_factory.mktemp("tiers"),
        sites=SITES,
        rounds=ROUNDS,
        alpha=ALPHA,
        transfer={"compression": "none"},
        site_rounds={"weight_cap": 0},
    )
    try:
        tiered.prepare()
        tiered.start_all()
        done = wait_for(lambda: _done(tiered), 240, "the tiered federation to finish", tiered)
        # Each site's status once its agents have evaluated the final model.
        sites = {
            s: wait_for(lambda s=s: _evaluated(tiered, s), 120, f"{s}'s agents to evaluate the final model", tiered)
            for s in tiered.site_ids
        }
        agents = {a: tiered.status(a) for a in tiered.agent_ids}
        # `fedagent peers` as an operator runs it, against the hub and a site aggregator.
        peers = {stem: _peers_cli(tiered, stem) for stem in ("coordinator", "site-1")}
        weights, meta = tiered.final_weights()
        site_history = {s: _history(tiered, s) for s in tiered.site_ids}
    finally:
        tiered.close()
    n = sum(SITES)
    rounds = {
        "rounds": ROUNDS,
        "min_agents": n,
        "expected_agents": n,
        "min_updates": 1,
        "round_timeout": 60.0,
        "local_epochs": LOCAL_EPOCHS,
        "lr": LR,
        "batch_size": BATCH,
        "seed": SEED,
        "weight_cap": 0,
    }

    def configure(fed):
        fed.write_coordinator("digits", {"seed": SEED}, rounds, transfer={"compression": "none"})

    with running(
        tmp_path_factory.mktemp("flat"),
        agents=n,
        rounds=ROUNDS,
        alpha=ALPHA,
        agent_broker_by_mdns=False,
        configure=configure,
    ) as flat:
        wait_for(lambda: (s := flat.status("coordinator")) and s["phase"] == "done", 240, "the flat run", flat)
        flat_done = wait_for(lambda: _evaluated(flat, "coordinator"), 120, "the final model's evaluations", flat)
        flat_weights, _ = flat.final_weights()
    return {
        "done": done,
        "sites": sites,
        "agents": agents,
        "weights": weights,
        "meta": meta,
        "site_history": site_history,
        "peers": peers,
        "flat_done": flat_done,
        "flat_weights": flat_weights,
    }


def _done(fed: TieredFederation):
    s = fed.status("coordinator")
    return s if s and s["phase"] == "done" else None


def _evaluated(fed, stem: str):
    s = fed.status(stem)
    held = s.get("held_out") if s else None
    return s if held and held.get("model_version") == ROUNDS and held.get("metrics") else None


def _peers_cli(fed: TieredFederation, stem: str) -> tuple[dict, str]:
    """``fedagent peers --json`` and ``fedagent peers`` asked of ``stem``'s control socket."""
    from click.testing import CliRunner

    from fedagent.cli import main

    args = ["peers", "--socket", str(fed.socket(stem))]
    runner = CliRunner()
    as_json = runner.invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    drawn = runner.invoke(main, args, env={"COLUMNS": "200"})
    assert drawn.exit_code == 0, drawn.output
    return json.loads(as_json.output), drawn.output


def _history(fed: TieredFederation, stem: str) -> list[dict]:
    return list(read_records(fed.work / "state" / stem / "coordinator" / fed.fed / "history.jsonl"))


def test_two_tiers_train_the_flat_model(runs):
    done, flat = runs["done"], runs["flat_done"]
    assert done["completed_rounds"] == ROUNDS and flat["completed_rounds"] == ROUNDS
    w, f = runs["weights"], runs["flat_weights"]
    assert w.keys() == f.keys()
    worst = max(float(np.abs(w[k].astype(np.float64) - f[k]).max()) for k in w)
    assert worst <= TOL, f"tiered and flat models differ by {worst:.3g}"
    # The agents' own evaluations of the final model: at their sites, and flat.
    held = [runs["sites"][s]["held_out"] for s in runs["sites"]]
    acc = sum(h["metrics"]["accuracy"] * h["samples"] for h in held) / sum(h["samples"] for h in held)
    assert acc == pytest.approx(flat["held_out"]["metrics"]["accuracy"], abs=1e-3)
    print(
        f"largest difference {worst:.3g}; accuracy {acc:.4f} tiered, {flat['held_out']['metrics']['accuracy']:.4f} flat"
    )


def test_each_site_sends_one_partial_result_a_round(runs):
    for site, count in zip(runs["site_history"], SITES, strict=True):
        lines = [r for r in runs["site_history"][site] if r.get("event") == "site_round"]
        assert [r["upstream_round"] for r in lines] == list(range(1, ROUNDS + 1))
        assert all(len(r["participants"]) == count for r in lines)
        assert all(r["num_samples"] == sum(runs["sites"][site]["tier"]["agents"].values()) for r in lines)
    # The hub weighed the sites as their agents: its participants are the site aggregators.
    assert sorted(runs["meta"]["participants"]) == ["site-1-up", "site-2-up"]


def test_agents_know_only_their_site(runs):
    for site, ids in (("site-1", ["agent-1", "agent-2", "agent-3"]), ("site-2", ["agent-4", "agent-5"])):
        for a in ids:
            s = runs["agents"][a]
            assert s["coordinator"] == site
            assert s["model_version"] == ROUNDS  # the hub's final model, passed on by the site


def test_status_shows_the_tree(runs):
    from rich.console import Console

    from fedagent.cli.render import render_status

    hub = runs["done"]["tier"]
    assert hub["role"] == "hub"
    assert {n: (s["agents"], s["state"]) for n, s in hub["sites"].items()} == {
        "site-1-up": (3, "idle"),
        "site-2-up": (2, "idle"),
    }
    site = runs["sites"]["site-1"]["tier"]
    assert site["role"] == "site" and sorted(site["agents"]) == ["agent-1", "agent-2", "agent-3"]
    assert site["upstream"]["connection"] == "connected" and site["upstream"]["coordinator"] == "coordinator"
    assert site["last_partial_result"] == {"round": ROUNDS, "sent": True, "num_samples": site["samples"], "agents": 3}
    console = Console(record=True, width=160)
    render_status(runs["done"], console)
    render_status(runs["sites"]["site-1"], console)
    text = console.export_text()
    assert "sites (site aggregators)" in text and "site-2-up" in text
    assert "upstream tier" in text and "agents of this site" in text and "agent-3" in text


def test_peers_shows_the_tree(runs):
    (hub, hub_text), (site, site_text) = runs["peers"]["coordinator"], runs["peers"]["site-1"]
    # machine-readable: the peer table and the tier, as `status` has it
    assert hub["tier"]["role"] == "hub"
    assert {n: s["agents"] for n, s in hub["tier"]["sites"].items()} == {"site-1-up": 3, "site-2-up": 2}
    assert hub["peers"]["site-1-up"]["role"] == "aggregator" and hub["peers"]["site-1-up"]["online"]
    assert site["tier"]["role"] == "site" and site["tier"]["upstream"]["coordinator"] == "coordinator"
    assert sorted(site["tier"]["agents"]) == ["agent-1", "agent-2", "agent-3"]
    lines = hub_text.splitlines()
    assert lines[0].startswith("coordinator hub of") and "2 sites" in lines[0]
    for name, agents in (("site-1-up", 3), ("site-2-up", 2)):
        line = next(ln for ln in lines if name in ln)
        assert line[:4] in ("├── ", "└── ") and f"{agents} agents" in line and "online" in line and "idle" in line
    lines = site_text.splitlines()
    assert lines[0].startswith("site-1 site aggregator in")
    up = next(ln for ln in lines if "upstream:" in ln)
    assert "coordinator" in up and "connected" in up and "site-1-up" in up
    for agent in ("agent-1", "agent-2", "agent-3"):
        line = next(ln for ln in lines if agent in ln)
        assert line[4:8] in ("├── ", "└── ") and "samples" in line and "online" in line


def test_a_site_aggregator_killed_mid_round(tmp_path):
    """kill -9 of a site aggregator while its site trains: it comes back on its state
    directory and takes its site round up again from its journal. Either the hub's round
    was still open and the site's result counts in it, or the hub closed it without the
    site (its history says which site was missing) and the site drops its work for it,
    logged, instead of sending it late. Its round numbers go on (its agents take its next
    round start) and its site is in the hub's rounds again."""
    # Training takes at least a second, so that a site's round is open long enough to be
    # seen and killed in (without it a hub round can take 0.1 s, and the six were seen
    # over before a status poll found site-2 in one).
    fed = TieredFederation(
        tmp_path,
        sites=[2, 2],
        rounds=6,
        alpha=ALPHA,
        round_timeout=12.0,
        transfer={"compression": "none"},
        train_seconds=1.0,
    )
    try:
        fed.prepare()
        fed.start_all()

        def site_2_training():
            s, hub = fed.status("site-2"), fed.status("coordinator")
            ok = s and hub and hub["round"] >= 2 and s["tier"]["upstream_round"] == hub["round"]
            return hub if ok else None

        hub = wait_for(site_2_training, 120, "site-2 in a round of the hub's", fed)
        killed_in = hub["round"]
        fed.restart("site-2")
        done = wait_for(lambda: _done(fed), 180, "the tiered federation to finish", fed)
        assert done["completed_rounds"] == 6
        rounds = [r for r in _history(fed, "coordinator") if r.get("event") == "round"]
        missing = {r["round"]: r.get("missing", []) for r in rounds}
        killed = next(r for r in rounds if r["round"] == killed_in)
        # Back in a later round (the first one after its restart may close without it:
        # the hub selects it as soon as it is online, before its own agents are back).
        assert any("site-2-up" in r["participants"] for r in rounds if r["round"] > killed_in), rounds
        site = _history(fed, "site-2")
        site_rounds = [r["round"] for r in site if r.get("event") == "site_round"]
        assert site_rounds == sorted(set(site_rounds))  # never a number twice, across the restart
        log = (fed.work / "logs" / "site-2.log").read_text()
        answered = [r for r in site if r.get("event") == "site_round" and r["upstream_round"] == killed_in]
        resumed = "resuming site round" in log
        if "site-2-up" in killed["participants"]:
            # sent before the kill, or resumed from its journal and sent in time: once
            assert len(answered) == 1, answered
            outcome = "resumed and counted" if resumed else "sent before the kill"
        else:
            assert missing[killed_in] == ["site-2-up"], missing
            # Resumed, then dropped at the site with a reason: the hub's round had closed.
            dropped = [r for r in site if r.get("event") in ("site_dropped", "site_failed")]
            if resumed:
                assert any(r.get("upstream_round", killed_in) == killed_in for r in dropped), site
            # Never sent late: the hub had nothing of it to refuse.
            hub_log = (fed.work / "logs" / "coordinator.log").read_text()
            assert "from site-2-up before checking them" not in hub_log
            assert not any(r.get("sender") == "site-2-up" for r in done.get("recent_rejections", []))
            reasons = "; ".join(str(r.get("reason")) for r in dropped)
            outcome = f"resumed, dropped: {reasons}" if resumed else f"not resumed: {reasons or 'no journal'}"
        print(f"site-2 killed in hub round {killed_in}: {outcome}")
    finally:
        fed.close()


def test_a_site_below_its_quorum_is_in_no_hub_round(tmp_path):
    """site-2 has one agent of the two it needs: offline upstream, it reads the hub's
    round starts for every site online (site-1 alone) as none of its own, and its history
    has nothing of them (no round run, no failure reported)."""
    fed = TieredFederation(
        tmp_path,
        sites=[2, 1],
        rounds=3,
        alpha=ALPHA,
        transfer={"compression": "none"},
        hub_rounds={"min_agents": 1, "expected_agents": 1},
        site_rounds={"min_agents": 2},
    )
    try:
        fed.prepare()
        fed.start_all()
        done = wait_for(lambda: _done(fed), 180, "the hub's rounds with site-1", fed)
        rounds = [r for r in _history(fed, "coordinator") if r.get("event") == "round"]
        site_2 = _history(fed, "site-2")
        log = (fed.work / "logs" / "site-2.log").read_text()
    finally:
        fed.close()
    assert done["completed_rounds"] == 3
    assert all(r["participants"] == ["site-1-up"] and not r.get("missing") for r in rounds), rounds
    assert [r for r in site_2 if r.get("event") in ("site_round", "site_failed")] == []
    assert "is not this site's" in log


def test_secure_aggregation_in_both_tiers(tmp_path, runs):
    """Agents mask against their site's cohort (the site aggregator unmasks its site's sum
    only) and the site aggregators against each other at the hub (which unmasks the total
    only): the model is the flat one within the quantisation error of the two rounds."""
    secure = {"secure_aggregation": True, "secure_clip": 1.0, "secure_bits": 24}
    fed = TieredFederation(
        tmp_path / "tiers",
        sites=SITES,
        rounds=ROUNDS,
        alpha=ALPHA,
        # Each secure stage gets a sixth of a round: room for 8 processes on 2 cores.
        round_timeout=120.0,
        transfer={"compression": "none"},
        hub_rounds={**secure, "min_updates": 2},
        site_rounds={**secure, "weight_cap": 0, "min_updates": 2},
    )
    try:
        fed.prepare()
        fed.start_all()
        done = wait_for(lambda: _done(fed), 240, "the secure tiered federation to finish", fed)
        weights, meta = fed.final_weights()
        hub_lines = [r for r in _history(fed, "coordinator") if r.get("event") == "round"]
        site_lines = {s: _history(fed, s) for s in fed.site_ids}
    finally:
        fed.close()
    assert done["completed_rounds"] == ROUNDS
    assert sorted(meta["participants"]) == ["site-1-up", "site-2-up"]
    # The hub unmasked sums only: its history says secure, each round's error bound.
    assert all("secure" in r for r in hub_lines)
    for s, count in zip(fed.site_ids, SITES, strict=True):
        lines = [r for r in site_lines[s] if r.get("event") == "site_round"]
        assert [r["upstream_round"] for r in lines] == [1, 2, 3]
        assert all(len(r["participants"]) == count for r in lines)  # as in the flat run
    flat = runs["flat_weights"]
    worst = max(float(np.abs(weights[k].astype(np.float64) - flat[k]).max()) for k in flat)
    print(f"secure tiers against flat: largest difference {worst:.3g}")
    assert worst <= SECURE_TOL


@pytest.mark.slow
def test_distributed_dp_across_tiers(tmp_path):
    """The hub's [privacy] over real processes, secure aggregation in both tiers: every
    hub round calibrates the shares for all five agents and is charged once, at the hub;
    the sites pass the calibration down and add nothing. (Its twin in memory, which also
    measures the noise: tests/protocols/test_tiers_dp.py.)"""
    from fedagent.protocols import dp

    secure = {"secure_aggregation": True, "min_updates": 2}
    fed = TieredFederation(
        tmp_path / "tiers",
        sites=SITES,
        rounds=2,
        alpha=ALPHA,
        round_timeout=120.0,
        transfer={"compression": "none"},
        hub_rounds=secure,
        site_rounds=secure,
        hub_privacy={"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0},
    )
    try:
        fed.prepare()
        fed.start_all()
        done = wait_for(lambda: _done(fed), 240, "the private tiered federation to finish", fed)
        sites = {s: fed.status(s) for s in fed.site_ids}
        hub_lines = [r for r in _history(fed, "coordinator") if r.get("event") == "round"]
        site_lines = {s: [r for r in _history(fed, s) if r.get("event") == "site_round"] for s in fed.site_ids}
    finally:
        fed.close()
    n = sum(SITES)
    assert done["completed_rounds"] == 2
    assert [(r["privacy"]["noise_shares"], r["privacy"]["cohort"]) for r in hub_lines] == [(n, n), (n, n)]
    assert done["privacy"]["epsilon"] == pytest.approx(dp.epsilon_for(1.0, 2, 1e-5), rel=1e-6)
    for s, count in zip(fed.site_ids, SITES, strict=True):
        assert sites[s]["tier"]["privacy"]["noise_added"] == 0 and sites[s]["tier"]["privacy"]["cohort"] == n
        assert [len(r["participants"]) for r in site_lines[s]] == [count, count]
        assert all(r["num_samples"] == count and r["privacy"]["noise_added"] == 0 for r in site_lines[s])
    print(f"epsilon {done['privacy']['epsilon']:.4f} after 2 hub rounds of {n} noise shares")
