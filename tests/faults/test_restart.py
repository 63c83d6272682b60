"""kill -9 of the coordinator mid-federation: it restarts from its checkpoint with a
round number it never used, aggregates no round twice, loses no model version and
waits for no deadline (the coordinator side; the agent side below)."""

from __future__ import annotations

import json
import signal

from netfed import coordinator_in, running, wait_for


def test_coordinator_killed_and_restarted_continues(tmp_path):
    with running(tmp_path, agents=2, rounds=12, alpha=0.5, round_timeout=20) as fed:
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 3, 90, "three rounds", fed)
        fed.restart("coordinator")  # kill -9 and start again
        done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the restarted coordinator to finish", fed)
        assert done["completed_rounds"] == 12 and done["model_version"] == 12
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = [json.loads(line) for line in hist.read_text().splitlines()]
        aggregated = [r["round"] for r in records if r["event"] == "round"]
        assert len(aggregated) == 12 and aggregated == sorted(set(aggregated))  # no round twice
        versions = [r["model_version"] for r in records if r["event"] == "round"]
        assert versions == list(range(1, 13))  # no version lost or repeated
        # A reused round number would be ignored by agents and time out: none did.
        assert not [r for r in records if r["event"] == "abandoned"]


def test_agent_killed_and_restarted_rejoins_without_double_counting(tmp_path):
    with running(tmp_path, agents=3, rounds=10, alpha=0.5, round_timeout=20) as fed:
        victim = fed.proc("agent-2")
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 2, 90, "two rounds", fed)
        fed.stop(victim, signal.SIGKILL)
        fed.procs.remove(victim)
        # The Last Will tells the coordinator at once; quorum (3) is lost, so it waits.
        wait_for(
            lambda: fed.status("coordinator")["peers"]["agent-2"]["online"] is False,
            30,
            "agent-2 marked offline by its Last Will",
            fed,
        )
        fed.spawn("agent-2")
        done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
        assert done["completed_rounds"] == 10
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = [json.loads(line) for line in hist.read_text().splitlines() if '"round"' in line]
        rounds = [r for r in records if r["event"] == "round"]
        assert [r["model_version"] for r in rounds] == list(range(1, 11))
        # Every participant list names an agent at most once (nothing applied twice), and
        # the restarted agent is back in the last rounds.
        assert all(len(r["participants"]) == len(set(r["participants"])) for r in rounds)
        assert "agent-2" in rounds[-1]["participants"]
