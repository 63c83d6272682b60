"""scripts/flsimco_seeds.py --reuse: which earlier runs it takes, and what it refuses."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fedagent.experiments.flsimco import STRATEGIES, Setup

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "flsimco_seeds.py"


@pytest.fixture(scope="module")
def seeds_script():
    spec = importlib.util.spec_from_file_location("flsimco_seeds", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["flsimco_seeds"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("flsimco_seeds", None)


def fake_run(mod, setup: Setup, seed: int, strategy: str) -> dict:
    """A run record shaped like the script's, with the schedule's own counts."""
    sched = mod.rounds_of(replace(setup, seed=seed))
    return {
        "seed": seed,
        "strategy": strategy,
        "heldout": [4.0 - 0.1 * r for r in range(setup.rounds + 1)],
        "aggregated": sum(map(len, sched)),
        "dropped": 0,
        "fast_visits": sum(v["speed"] > setup.threshold for rnd in sched for v in rnd),
        "seconds": 1.0,
    }


def write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record))
    return path


def record_of(mod, setup: Setup, seeds: list[int], *, with_setting: bool = True) -> dict:
    runs = {s: {str(seed): fake_run(mod, setup, seed, s) for seed in seeds} for s in STRATEGIES}
    rec = {"seeds": seeds, "rounds": setup.rounds, "wall_s": 60.0, "runs": runs}
    if with_setting:
        rec["setting"] = mod.setting(setup)
    return rec


def test_reuse_takes_the_runs_of_the_requested_seeds(seeds_script, tmp_path):
    setup = replace(Setup(), rounds=4)
    path = write(tmp_path / "results.json", record_of(seeds_script, setup, [0, 1, 2]))
    old, found = seeds_script.reusable(path, setup, [1, 2, 3, 4])
    assert sorted(found) == sorted((seed, s) for seed in (1, 2) for s in STRATEGIES)
    assert old["wall_s"] == 60.0


def test_reuse_accepts_a_file_from_before_the_setting_was_recorded(seeds_script, tmp_path):
    setup = replace(Setup(), rounds=4)
    path = write(tmp_path / "results.json", record_of(seeds_script, setup, [0], with_setting=False))
    _, found = seeds_script.reusable(path, setup, [0])
    assert len(found) == len(STRATEGIES)


def test_reuse_refuses_other_rounds(seeds_script, tmp_path):
    setup = replace(Setup(), rounds=4)
    path = write(tmp_path / "results.json", record_of(seeds_script, setup, [0]))
    with pytest.raises(seeds_script.ReuseRefused, match="4 rounds, this report 6"):
        seeds_script.reusable(path, replace(setup, rounds=6), [0])


def test_reuse_refuses_another_setting(seeds_script, tmp_path):
    setup = replace(Setup(), rounds=4)
    path = write(tmp_path / "results.json", record_of(seeds_script, setup, [0]))
    with pytest.raises(seeds_script.ReuseRefused, match="another setting.*alpha"):
        seeds_script.reusable(path, replace(setup, alpha=0.1), [0])


def test_reuse_refuses_a_run_that_does_not_fit_the_schedule(seeds_script, tmp_path):
    # An old file has no recorded setting: a changed threshold shows in the visits above it.
    setup = replace(Setup(), rounds=4)
    rec = record_of(seeds_script, setup, [0], with_setting=False)
    rec["runs"]["fedavg"]["0"]["fast_visits"] += 1
    path = write(tmp_path / "results.json", rec)
    with pytest.raises(seeds_script.ReuseRefused, match="seed 0 fedavg: .* visits above the threshold"):
        seeds_script.reusable(path, setup, [0])
    rec = record_of(seeds_script, setup, [0], with_setting=False)
    rec["runs"]["blur"]["0"]["heldout"].pop()
    path = write(tmp_path / "results.json", rec)
    with pytest.raises(seeds_script.ReuseRefused, match="4 held-out losses, not 5"):
        seeds_script.reusable(path, setup, [0])


def test_reuse_refuses_an_unreadable_file(seeds_script, tmp_path):
    path = tmp_path / "results.json"
    path.write_text("{not json")
    with pytest.raises(seeds_script.ReuseRefused, match="cannot read"):
        seeds_script.reusable(path, Setup(), [0])


def test_seed_ranges(seeds_script):
    assert seeds_script.seed_ranges([3, 0, 1, 2, 4, 7, 9, 8]) == "0-4, 7-9"
    assert seeds_script.seed_ranges([5]) == "5"


def test_reuse_recomputes_round_one_and_refuses_a_mismatch(seeds_script):
    # Two rounds of the schedule; the check trains round 1 again (4 vehicles, 2 epochs).
    setup = replace(Setup(), rounds=2)
    made = seeds_script.run(replace(setup, seed=0), "fedavg", stop_after=1)["heldout"]
    assert len(made) == 2 and made[1] < made[0]
    found = {(0, "fedavg"): {"heldout": [*made, 1.0]}}
    assert seeds_script.check_reproduced(setup, found) == ["seed 0 fedavg: round 1 reproduced (largest difference 0)"]
    found = {(0, "fedavg"): {"heldout": [made[0], made[1] + 1e-3, 1.0]}}
    with pytest.raises(seeds_script.ReuseRefused, match="seed 0 fedavg: round 1 recomputed"):
        seeds_script.check_reproduced(setup, found)
