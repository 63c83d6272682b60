"""kill -9 of the coordinator mid-federation: it restarts from its checkpoint, resumes
the unfinished round with the updates its persistent session kept, aggregates no round
twice and loses no model version (RELIABILITY T4, coordinator side)."""

from __future__ import annotations

import json
import signal

from fedagent.demo import Federation
from test_federation import wait_for


def test_coordinator_killed_and_restarted_continues(tmp_path):
    fed = Federation(tmp_path, agents=2, rounds=12, alpha=0.5, round_timeout=20)
    try:
        fed.prepare()
        fed.start_all()
        coord = fed.procs[0]
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 3, 90,
                 "three rounds", fed)
        coord.popen.send_signal(signal.SIGKILL)
        coord.popen.wait(10)
        fed.procs.remove(coord)
        fed.spawn("coordinator")
        done = wait_for(lambda: (lambda s: s if s and s["phase"] == "done" else None)(fed.status("coordinator")),
                        120, "the restarted coordinator to finish", fed)
        assert done["completed_rounds"] == 12 and done["model_version"] == 12
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = [json.loads(line) for line in hist.read_text().splitlines()]
        aggregated = [r["round"] for r in records if r["event"] == "round"]
        assert len(aggregated) == 12 and aggregated == sorted(set(aggregated))   # no round twice
        versions = [r["model_version"] for r in records if r["event"] == "round"]
        assert versions == list(range(1, 13))                                    # no version lost or repeated
        # The resumed round completed from redelivered or fresh updates; nothing timed out.
        assert not [r for r in records if r["event"] == "abandoned"]
    finally:
        fed.close()
