"""FLSimCo for real: an RSU (coordinator) over Mosquitto with mutual TLS, and vehicles as
agent processes that join, train, announce their last update and leave, while new ones
drive in between rounds. Checks membership per round and eq. 11's weights as recorded
by the RSU against the speeds the vehicles were given."""

from __future__ import annotations

import pytest
from fedagent_experiments.flsimco import Setup, run_strategy

from fedagent.tasks.flsimco import DEFAULT_CAMERA

pytestmark = pytest.mark.procs

CAMERA = DEFAULT_CAMERA["exposure"] * DEFAULT_CAMERA["focal"] / DEFAULT_CAMERA["pixel"]


@pytest.mark.timeout(300)
def test_vehicles_join_and_leave_between_rounds_blur_weighted(tmp_path):
    setup = Setup(rounds=3, coverage=2, stay=2, shards=4, alpha=1.0, local_epochs=1, batch_size=32)
    res = run_strategy(setup, "blur", tmp_path, time_limit=240)
    rounds = [r for r in res["records"] if r["event"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and not [r for r in res["records"] if r["event"] == "abandoned"]
    speeds = {a["id"]: a["speed"] for a in res["arrivals"]}
    # The first two vehicles stay 1 and 2 rounds, later ones 2: a new vehicle every round.
    assert [sorted(r["participants"]) for r in rounds] == [
        ["vehicle-001", "vehicle-002"],
        ["vehicle-002", "vehicle-003"],
        ["vehicle-003", "vehicle-004"],
    ]
    for r in rounds:
        levels = {v: CAMERA * speeds[v] for v in r["participants"]}
        total = sum(levels.values())
        expected = {v: (total - lv) / ((len(levels) - 1) * total) for v, lv in levels.items()}
        assert r["agg_weights"] == pytest.approx(expected, rel=1e-6)
        assert r["aggregation"] == "blur" and r["metrics"]["blur_level"] > 0
    # Vehicles that left said so in their own history, after the rounds they were given.
    left = {x["vehicle"]: x["rounds_trained"] for x in res["left"]}
    assert left["vehicle-001"] == 1 and left["vehicle-002"] == 2
    assert res["evals"], "vehicles evaluate every global model they receive"
