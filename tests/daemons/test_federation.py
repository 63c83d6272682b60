"""A real federation: Mosquitto with mutual TLS, a coordinator and three agent
processes that find it by mDNS on loopback, FedAvg on the non-IID digits task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from netfed import coordinator_in, running, scrape, value, wait_for

from fedagent.local.demo import train_reference
from fedagent.local.federation import LOCAL_EPOCHS, SEED
from fedagent.storage.history import read_records
from fedagent.tasks.base import load_task, set_weights

AGENTS = 3
ROUNDS = 6
ALPHA = 0.3


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    with running(tmp_path_factory.mktemp("fed"), agents=AGENTS, rounds=ROUNDS, alpha=ALPHA) as fed:
        yield fed


def test_agents_discover_the_coordinator_and_share_rounds(federation):
    fed = federation
    # Agents were given no broker: they must have found it by mDNS.
    statuses = wait_for(
        lambda: [
            s
            for s in (fed.status(a) for a in fed.agent_ids)
            if s and s.get("connection") == "connected" and s.get("round", 0) >= 1
        ],
        90,
        "agents in a round",
        fed,
    )
    assert statuses
    done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    assert done["completed_rounds"] == ROUNDS and done["model_version"] == ROUNDS
    # No [rounds] server_momentum in the config: the default FedAvgM step, and status says so.
    assert done["server_step"] == {"lr": 1.0, "momentum": 0.7, "default": True}
    for aid in fed.agent_ids:
        s = fed.status(aid)
        assert s["broker"] == fed.broker.uri
        assert s["coordinator"] == fed.coordinator_id
        assert s["rounds_trained"] >= ROUNDS - 1
        assert s["round"] == done["round"]


def test_status_json_against_a_running_agent(federation):
    fed = federation
    wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    out = subprocess.run(
        [sys.executable, "-m", "fedagent", "status", "--json", "--config", str(fed.config_path("agent-1"))],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    s = json.loads(out.stdout)
    assert s["role"] == "agent" and s["id"] == "agent-1"
    assert s["federation"] == fed.fed and s["mode"] == "fedavg"
    assert s["connection"] == "connected"
    assert s["model_version"] == ROUNDS
    assert {"coordinator", "agent-2", "agent-3"} <= set(s["peers"])
    assert "loss" in s["last_metrics"]
    human = subprocess.run(
        [sys.executable, "-m", "fedagent", "status", "--config", str(fed.config_path("coordinator"))],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "coordinator" in human.stdout and fed.fed in human.stdout


def test_federated_model_beats_every_local_only_model(federation):
    fed = federation
    wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    weights, meta = fed.final_weights()
    task = load_task("digits", {"seed": SEED})
    model = task.build_model()
    set_weights(model, weights)
    federated = task.evaluate(model)["accuracy"]
    epochs = ROUNDS * LOCAL_EPOCHS
    local = [
        train_reference({"shard": i, "shards": AGENTS, "alpha": ALPHA, "seed": SEED}, epochs) for i in range(AGENTS)
    ]
    assert federated > max(local), (federated, local)
    assert meta["participants"] == sorted(fed.agent_ids)
    rounds = _history(fed, "coordinator", "coordinator")
    assert [r["round"] for r in rounds if r["event"] == "round"] == list(range(1, ROUNDS + 1))


def test_status_without_a_daemon_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fedagent", "status", "--socket", str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert "no daemon" in out.stderr.lower() or "not running" in out.stderr.lower()


def test_scrape_a_running_federation(federation):
    fed = federation
    done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    c = scrape(done["metrics_url"])
    assert value(c, "fedagent_rounds_completed_total") == done["completed_rounds"]
    assert value(c, "fedagent_model_version") == done["model_version"]
    assert value(c, "fedagent_connected") == 1
    assert value(c, "fedagent_peers_online") == len(fed.agent_ids)
    assert value(c, "fedagent_bytes_total", direction="in") > 0
    assert value(c, "fedagent_round_seconds_count") == done["completed_rounds"]
    # what the alerting rules read (prometheus/)
    assert value(c, "fedagent_phase", phase="done") == 1
    assert value(c, "fedagent_agents_live") == len(fed.agent_ids) >= value(c, "fedagent_min_agents") > 0
    assert all(value(c, "fedagent_agent_silent", agent=a) == 0 for a in fed.agent_ids)
    assert value(c, "fedagent_round_timeout_seconds") == fed.round_timeout
    assert value(c, "fedagent_rounds_abandoned_total") == 0
    assert 0 < value(c, "fedagent_state_filesystem_avail_bytes") <= value(c, "fedagent_state_filesystem_size_bytes")
    a = scrape(fed.status("agent-1")["metrics_url"])
    assert 0 < value(a, "fedagent_state_filesystem_avail_bytes")
    assert value(a, "fedagent_rounds_completed_total") >= done["completed_rounds"] - 1
    assert value(a, "fedagent_training_seconds_count") >= done["completed_rounds"] - 1
    assert value(a, "fedagent_federation", federation=fed.fed) == 1
    assert 0 < value(a, "fedagent_last_metric", name="global_accuracy") <= 1


def test_report_from_the_federation_run(federation, tmp_path):
    from fedagent.local.report import find_histories, write_report

    fed = federation
    wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    histories = find_histories(fed.work / "state")
    assert len(histories) == 1 + AGENTS
    md = write_report(histories, tmp_path / "report")
    text = md.read_text()
    assert f"| rounds aggregated | {ROUNDS} |" in text
    assert (tmp_path / "report" / "metrics.png").read_bytes().startswith(b"\x89PNG")
    assert all(f"| {aid} |" in text for aid in fed.agent_ids)


def _history(fed, *parts: str) -> list[dict]:
    return read_records(fed.work.joinpath("state", *parts, fed.fed, "history.jsonl"))


def test_rounds_leave_their_critical_path_in_the_history(federation):
    """The wall-clock marks bench/tta_trace.py reads are written and in the order of the
    round; an agent scores each global model only after its update of the round that
    brought it was sent (the evaluation is not on the round's critical path)."""
    fed = federation
    wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
    rounds = [e for e in _history(fed, "coordinator", "coordinator") if e.get("event") == "round"]
    assert len(rounds) == ROUNDS
    for r in rounds:
        m = r["marks"]
        assert m["start"] <= m["broadcast"] <= m["aggregated"] <= m["checkpointed"]
        assert sorted(m["updates"]) == sorted(r["participants"])
        assert all(m["broadcast"] <= t <= m["aggregated"] for t in m["updates"].values())
        # every update frame journaled, and synced in groups (never more syncs than frames;
        # none when the round was aggregated before its first group fell due: its frames
        # are then settled by the checkpoint, or synced when the replay guard's numbers go
        # to disk, after this line is written)
        syncs = r["syncs"]
        assert syncs["frames"] >= len(r["participants"]) and 0 <= syncs["journal"] <= syncs["frames"]
    checked = 0
    for aid in fed.agent_ids:
        # The agent scores each global model in a low-priority thread after its update is
        # sent, so the final model's score may land after the coordinator is done.
        def scored_all(aid: str = aid) -> list[dict] | None:
            history = _history(fed, aid, "agent")
            versions = {e["model_version"] for e in history if e.get("event") == "global_eval"}
            return history if set(range(ROUNDS + 1)) <= versions else None

        history = wait_for(scored_all, 60, f"{aid} to score every global model", fed)
        evals = {e["model_version"]: e for e in history if e.get("event") == "global_eval"}
        for u in (e for e in history if e.get("event") == "update"):
            m = u["marks"]
            assert m["model_in"] <= m["train_start"] <= m["train_end"] <= m["sent"]
            assert evals[u["base_version"]]["started"] >= m["sent"]
            # CPU seconds of the training thread, within the training's wall time
            # (tta_trace's split of the agents' CPU per round reads them)
            assert 0 < m["train_cpu"] <= m["train_end"] - m["train_start"] + 0.01
            assert 0 < evals[u["base_version"]]["cpu"] <= evals[u["base_version"]]["seconds"] + 0.01
            checked += 1
    assert checked >= AGENTS * (ROUNDS - 1)
