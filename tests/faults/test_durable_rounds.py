"""A coordinator stopped mid-round (kill -9, or a clean SIGTERM) with two of three updates
received and acknowledged: restarted, it takes the same round up again from its round
journal, accepts the third agent's update for that round, and aggregates each update
exactly once. Real processes over Mosquitto."""

from __future__ import annotations

import json
import os
import signal
import time
import tomllib

import pytest
import tomli_w
from netfed import coordinator_in, running, wait_for

from fedagent.local.federation import SEED, Federation

# Long enough local training (~3 s per round here) that agent-3 is paused before it
# has sent its update.
EPOCHS = 240


def configure(fed: Federation) -> None:
    fed.write_coordinator(
        "digits",
        {"seed": SEED},
        {
            "rounds": 2,
            "min_agents": 3,
            "expected_agents": 3,
            "min_updates": 1,
            "round_timeout": 300,
            "local_epochs": EPOCHS,
            "lr": 0.05,
            "batch_size": 32,
            "seed": SEED,
        },
    )
    # agent-3 is paused for the whole restart: a long keep-alive keeps it in the round
    # (its heartbeat timeout is the keep-alive), as a slow agent would be.
    path = fed.config_path("agent-3")
    doc = tomllib.loads(path.read_text())
    doc.setdefault("broker", {})["keepalive"] = 300
    path.write_text(tomli_w.dumps(doc))


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_restarted_coordinator_finishes_the_round_in_flight(tmp_path, sig):
    with running(
        tmp_path, configure=configure, agents=3, rounds=2, alpha=0.5, round_timeout=300, agent_broker_by_mdns=False
    ) as fed:
        t_start = time.monotonic()
        slow = fed.proc("agent-3")
        wait_for(
            lambda: (lambda s: s and s["phase"] == "training" and s["round"] == 1 and "agent-3" not in s["received"])(
                fed.status("coordinator")
            ),
            120,
            "round 1 in progress",
            fed,
        )
        os.killpg(slow.popen.pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: (fed.status("coordinator") or {}).get("received") == ["agent-1", "agent-2"],
                120,
                "the updates of agent-1 and agent-2",
                fed,
            )
            before = fed.status("coordinator")
            assert before["round"] == 1 and before["journal"]["round"] == 1 and before["journal"]["frames"] >= 2
            stopped = time.monotonic()
            old = fed.proc("coordinator")
            fed.restart("coordinator", sig)
            # SIGTERM: a clean stop (exit 0), not the harness's fallback kill after 10 s.
            assert old.popen.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            exited_in = time.monotonic() - stopped
            resumed = wait_for(
                lambda: (lambda s: s if s and s["round"] == 1 and s["received"] == ["agent-1", "agent-2"] else None)(
                    fed.status("coordinator")
                ),
                120,
                "the restarted coordinator to hold round 1 with both updates",
                fed,
            )
            resumed_in = time.monotonic() - stopped
            assert resumed["phase"] == "training" and resumed["model_version"] == 0
        finally:
            os.killpg(slow.popen.pid, signal.SIGCONT)
        done = wait_for(lambda: coordinator_in(fed, "done"), 180, "the federation to finish", fed)
        finished_in = time.monotonic() - t_start
        assert done["completed_rounds"] == 2 and done["model_version"] == 2
        coord_dir = fed.work / "state" / "coordinator" / "coordinator" / fed.fed
        history = records(coord_dir / "history.jsonl")
        aggregated = [r for r in history if r["event"] == "round"]
        # Versions contiguous, each round once, nothing abandoned: the restart cost no round.
        assert [(r["round"], r["model_version"]) for r in aggregated] == [(1, 1), (2, 2)]
        assert not [r for r in history if r["event"] == "abandoned"]
        first = aggregated[0]
        assert first["participants"] == ["agent-1", "agent-2", "agent-3"]
        assert sorted(first["agg_weights"]) == first["participants"]
        assert sum(first["agg_weights"].values()) == pytest.approx(1.0)
        # Every agent sent round 1 once: the two updates in the aggregate came from the
        # journal, not from a second sending.
        for aid in fed.agent_ids:
            sent = [
                r
                for r in records(fed.work / "state" / aid / "agent" / fed.fed / "history.jsonl")
                if r["event"] == "update"
            ]
            assert [r["round"] for r in sent] == [1, 2], aid
        assert not [r for r in done["recent_rejections"] if r.get("round") == 1]
        log = (fed.work / "logs" / "coordinator.log").read_text()
        assert "resuming round 1 from model version 0" in log
        print(
            f"{signal.Signals(sig).name}: old coordinator gone {exited_in:.1f}s after the signal; the restarted one "
            f"held round 1 with 2 of 3 updates {resumed_in:.1f}s after it; 2 rounds done in {finished_in:.1f}s"
        )
