"""Many agents in one process over the real broker (mutual TLS, one certificate and
connection each) with the real coordinator process: rounds complete with everyone."""

from __future__ import annotations

from fedagent.experiments.swarm import run_federation


def test_thirty_agents_in_one_process_complete_rounds(tmp_path):
    r = run_federation(tmp_path, agents=30, params=2000, rounds=2, compression="int8", timeout=120)
    assert not r.errors, r.errors[:3]
    rounds = [x for x in r.rounds if x.get("event") == "round"]
    assert len(rounds) == 2, r.coordinator_log
    for x in rounds:
        assert len(x["participants"]) == 30
    assert "rejected" not in r.coordinator_log, r.coordinator_log
