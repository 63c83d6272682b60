"""Many agents in one process over the real broker (mutual TLS, one certificate and
connection each) with the real coordinator process: rounds complete with everyone."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.swarm import _Children, run_federation

pytestmark = pytest.mark.procs


def test_thirty_agents_in_one_process_complete_rounds(tmp_path):
    r = run_federation(tmp_path, agents=30, params=2000, rounds=2, compression="int8", timeout=120)
    assert not r.errors, r.errors[:3]
    rounds = [x for x in r.rounds if x.get("event") == "round"]
    assert len(rounds) == 2, r.coordinator_log
    for x in rounds:
        assert len(x["participants"]) == 30
    assert "rejected" not in r.coordinator_log, r.coordinator_log


def test_agents_split_over_two_processes_complete_rounds_and_each_side_is_measured(tmp_path):
    r = run_federation(tmp_path, agents=20, params=2000, rounds=3, procs=2, timeout=120, connect_limit=120)
    assert not r.errors, r.errors[:3]
    rounds = [x for x in r.rounds if x.get("event") == "round"]
    assert len(rounds) == 3, r.coordinator_log
    for x in rounds:
        assert sorted(x["participants"]) == [f"a{i:04d}" for i in range(20)]
    assert r.procs == 2
    # One CPU figure per round after the first, for every side, over a positive wall time.
    assert len(r.round_wall) == len(r.round_cpu) == len(r.round_cpu_broker) == len(r.round_cpu_agents) == 2
    assert all(w > 0 for w in r.round_wall)
    # The agents ran in the children (their CPU, not this process's, is the swarm's): they
    # verified round starts and signed updates, and the busiest child used at most all of it.
    assert sum(r.round_cpu_agents) > 0
    for busiest, total in zip(r.round_cpu_swarm_max, r.round_cpu_agents, strict=True):
        assert 0 <= busiest <= total
    # Mosquitto held one socket per agent, plus the coordinator's and its listener's.
    assert r.broker_fds >= 22
    assert r.broker_rss_peak >= r.broker_rss_idle > 0


def test_more_connections_than_one_process_can_watch_is_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="use procs >= 4"):
        run_federation(tmp_path, agents=3001, procs=2)
    assert list(tmp_path.iterdir()) == []


def test_each_swarm_child_leads_a_session_of_its_own(tmp_path):
    """A session is one scheduling group under the kernel's autogroup scheduling: the
    children must not share one (nor this process's) CPU share between them."""
    spec = {"broker": "mqtts://127.0.0.1:1", "ca": str(tmp_path), "certs": str(tmp_path), "whole": False}

    async def start_and_stop() -> tuple[list[int], list[int]]:
        children = _Children()
        try:
            await children.start(tmp_path, [[], []], {**spec, "max_chunk": 2**20, "wave_limit": 5.0}, 120)
            return children.pids, [os.getsid(pid) for pid in children.pids]
        finally:
            await children.stop()
            children.kill()
            assert children.errors == [] and children.error_count == 0

    pids, sessions = asyncio.run(start_and_stop())
    assert sessions == pids and os.getsid(0) not in sessions
