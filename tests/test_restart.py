"""kill -9 of the coordinator mid-federation: it restarts from its checkpoint with a
round number it never used, aggregates no round twice, loses no model version and
waits for no deadline (RELIABILITY T4, coordinator side)."""

from __future__ import annotations

import json
import signal

from test_federation import wait_for

from fedagent.demo import Federation


def test_coordinator_killed_and_restarted_continues(tmp_path):
    fed = Federation(tmp_path, agents=2, rounds=12, alpha=0.5, round_timeout=20)
    try:
        fed.prepare()
        fed.start_all()
        coord = fed.procs[0]
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 3, 90, "three rounds", fed)
        coord.popen.send_signal(signal.SIGKILL)
        coord.popen.wait(10)
        fed.procs.remove(coord)
        fed.spawn("coordinator")
        done = wait_for(
            lambda: (lambda s: s if s and s["phase"] == "done" else None)(fed.status("coordinator")),
            120,
            "the restarted coordinator to finish",
            fed,
        )
        assert done["completed_rounds"] == 12 and done["model_version"] == 12
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = [json.loads(line) for line in hist.read_text().splitlines()]
        aggregated = [r["round"] for r in records if r["event"] == "round"]
        assert len(aggregated) == 12 and aggregated == sorted(set(aggregated))  # no round twice
        versions = [r["model_version"] for r in records if r["event"] == "round"]
        assert versions == list(range(1, 13))  # no version lost or repeated
        # A reused round number would be ignored by agents and time out: none did.
        assert not [r for r in records if r["event"] == "abandoned"]
    finally:
        fed.close()


def test_agent_killed_and_restarted_rejoins_without_double_counting(tmp_path):
    fed = Federation(tmp_path, agents=3, rounds=10, alpha=0.5, round_timeout=20)
    try:
        fed.prepare()
        fed.start_all()
        victim = next(p for p in fed.procs if p.name == "agent-2")
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 2, 90, "two rounds", fed)
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(10)
        fed.procs.remove(victim)
        # The Last Will tells the coordinator at once; quorum (3) is lost, so it waits.
        wait_for(
            lambda: fed.status("coordinator")["peers"]["agent-2"]["online"] is False,
            30,
            "agent-2 marked offline by its Last Will",
            fed,
        )
        fed.spawn("agent-2")
        done = wait_for(
            lambda: (lambda s: s if s and s["phase"] == "done" else None)(fed.status("coordinator")),
            120,
            "the federation to finish",
            fed,
        )
        assert done["completed_rounds"] == 10
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = [json.loads(line) for line in hist.read_text().splitlines() if '"round"' in line]
        rounds = [r for r in records if r["event"] == "round"]
        assert [r["model_version"] for r in rounds] == list(range(1, 11))
        # Every participant list names an agent at most once (nothing applied twice), and
        # the restarted agent is back in the last rounds.
        assert all(len(r["participants"]) == len(set(r["participants"])) for r in rounds)
        assert "agent-2" in rounds[-1]["participants"]
    finally:
        fed.close()
