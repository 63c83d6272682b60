"""One Byzantine agent process over the real broker: three honest
digits agents and one that sends ×10 sign-flipped updates (the test-only task
tests/byzantine_task.py), a coordinator aggregating with the coordinate-wise median
(byzantine = 1). Real Mosquitto with mTLS, signed messages, mDNS, processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from netfed import coordinator_in, running, wait_for

from fedagent.local.federation import SEED
from fedagent.tasks.base import load_task, set_weights

HONEST = 3
ROUNDS = 4


@pytest.mark.slow
def test_median_holds_against_a_sign_flipping_agent_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    settings = {
        "rounds": ROUNDS,
        "min_agents": HONEST + 1,
        "expected_agents": HONEST + 1,
        "min_updates": HONEST + 1,
        "round_timeout": 60.0,
        "local_epochs": 2,
        "lr": 0.05,
        "batch_size": 32,
        "seed": SEED,
        "aggregation": "median",
        "byzantine": 1,
    }

    def configure(fed) -> None:
        fed.write_coordinator("digits", {"seed": SEED}, settings)

    with running(tmp_path, configure=configure, agents=HONEST, rounds=ROUNDS, alpha=5.0) as fed:
        fed.add_agent(
            "mallory", "byzantine_task:make", {"shard": 0, "shards": HONEST, "alpha": 5.0, "seed": SEED}, broker=""
        )
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the federation to finish", fed)
        assert done["completed_rounds"] == ROUNDS
        weights, meta = fed.final_weights()
        # Mallory's updates were valid, signed and aggregated: the median outvoted them.
        assert "mallory" in meta["participants"]
        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, weights)
        accuracy = task.evaluate(model)["accuracy"]
        assert accuracy > 0.75, accuracy
        history = (fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl").read_text()
        assert all(r["aggregation"] == "median" for r in map(json.loads, history.splitlines()) if r["event"] == "round")
