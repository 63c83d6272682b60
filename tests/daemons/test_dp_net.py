"""Central DP-FedAvg over the network: a real Mosquitto with mutual TLS, a coordinator and
three agent processes; the privacy budget stops the federation before its rounds are
done, and ε is the same in `fedagent status`, the Prometheus endpoint and the history."""

from __future__ import annotations

import json
import subprocess
import sys

from netfed import coordinator_in, running, scrape, value, wait_for

from fedagent.local.report import find_histories, write_report
from fedagent.protocols import dp

Z = 3.0  # noise multiplier
BUDGET = 2.6  # ε at δ = 1e-5: three rounds fit (2.54), a fourth would make it 2.99
ROUNDS = 20  # configured; the budget ends it sooner


def test_the_privacy_budget_stops_the_federation_cleanly(tmp_path):
    fits = max(k for k in range(1, ROUNDS) if dp.epsilon_for(Z, k, 1e-5) <= BUDGET)
    assert fits == 3  # the budget, not the round count, must end this run
    privacy = {"mode": "central", "noise_multiplier": Z, "clip_norm": 1.0, "epsilon_budget": BUDGET}
    with running(tmp_path, agents=3, rounds=ROUNDS, alpha=1.0, agent_broker_by_mdns=False, privacy=privacy) as fed:
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the budget to stop the federation", fed)
        assert done["completed_rounds"] == fits
        assert "privacy budget reached" in done["stop_reason"]
        p = done["privacy"]
        assert p["mode"] == "central" and p["delta"] == 1e-5 and p["epsilon_budget"] == BUDGET
        assert p["epsilon"] <= BUDGET
        assert abs(p["epsilon"] - dp.epsilon_for(Z, fits, 1e-5)) < 1e-9
        # The agents are told the model is final (the federation ends, nobody waits on).
        wait_for(
            lambda: all((fed.status(a) or {}).get("round_state") == "finished" for a in fed.agent_ids),
            60,
            "the agents to adopt the final model",
            fed,
        )
        samples = scrape(done["metrics_url"])
        assert abs(value(samples, "fedagent_dp_epsilon") - p["epsilon"]) < 1e-9
        assert value(samples, "fedagent_dp_epsilon_budget") == BUDGET
        human = subprocess.run(
            [sys.executable, "-m", "fedagent", "status", "--config", str(fed.config_path("coordinator"))],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert f"ε = {p['epsilon']:.3f}" in human and "privacy budget reached" in human.replace("\n", " ")
        history_file = next((fed.work / "state" / "coordinator").rglob("history.jsonl"))
        history = [json.loads(x) for x in history_file.read_text().splitlines()]
        rounds = [h for h in history if h.get("event") == "round"]
        assert len(rounds) == fits
        assert [h["privacy"]["epsilon"] for h in rounds] == sorted(h["privacy"]["epsilon"] for h in rounds)
        assert any(h.get("event") == "stopped" and "privacy budget" in h["reason"] for h in history)
        md = write_report(find_histories(fed.work / "state"), tmp_path / "report").read_text()
        assert f"ε = {p['epsilon']:.3f} spent at δ = 1e-05 of a budget of {BUDGET:g}" in md
        assert "| stopped early | privacy budget reached" in md and "malformed" not in md


def test_distributed_dp_agents_noise_their_own_updates(tmp_path):
    """Each agent clips and noises its update before it leaves; the coordinator adds no
    noise and charges each round with the shares that arrived."""
    z, rounds = 0.5, 3
    privacy = {"mode": "distributed", "noise_multiplier": z, "clip_norm": 1.0}
    with running(tmp_path, agents=3, rounds=rounds, alpha=1.0, agent_broker_by_mdns=False, privacy=privacy) as fed:
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the federation to finish", fed)
        assert done["completed_rounds"] == rounds and done["privacy"]["mode"] == "distributed"
        history_file = next((fed.work / "state" / "coordinator").rglob("history.jsonl"))
        history = [json.loads(x) for x in history_file.read_text().splitlines()]
        arrived = [len(h["participants"]) for h in history if h.get("event") == "round"]
        expected = dp.Accountant(1e-5)
        for k in arrived:
            expected.spend(dp.Release(1.0, (z * (k / 3) ** 0.5,)))
        assert abs(done["privacy"]["epsilon"] - expected.epsilon) < 1e-9
        for aid in fed.agent_ids:
            s = wait_for(lambda aid=aid: fed.status(aid), 30, f"{aid}'s status", fed)
            assert s["dp_noised_updates"] == s["rounds_trained"] >= 1
