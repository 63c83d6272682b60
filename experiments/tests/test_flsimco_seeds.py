"""experiments/scripts/flsimco_seeds.py --reuse: which earlier runs it takes, and what it refuses."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fedagent_experiments.flsimco import STRATEGIES, Setup

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


def test_verdict_says_what_the_interval_leaves_room_for(seeds_script):
    v = seeds_script.verdict
    assert v([-0.2, -0.21, -0.19, -0.2], 2.0, "FedAvg", "lower").startswith("**holds**: the whole interval [-0.2")
    assert v([0.2, 0.21, 0.19, 0.2], 2.0, "FedAvg", "lower").startswith("**the opposite holds**")
    shown = v([-0.1, 0.05, -0.08, 0.02, -0.04], 2.0, "FedAvg", "lower")
    assert shown.startswith("**not shown**: the interval [-0.")
    assert "lower by at most 0." in shown and "% of FedAvg's 2.0000" in shown
    assert "seeds would show it" in shown
    other = v([0.1, -0.05, 0.08, -0.02, 0.04], 2.0, "FedAvg", "lower")
    assert other.startswith("**does not hold**: the mean difference is on the other side")


def test_seeds_to_show(seeds_script):
    # sd 1, mean 1: t(n-1)/sqrt(n) < 1 first at n = 7 (2.447 / 2.646 = 0.925; n = 6: 2.571 / 2.449 > 1)
    assert seeds_script.seeds_to_show(1.0, 1.0) == 7
    assert seeds_script.seeds_to_show(-1.0, 1.0) == 7
    assert seeds_script.seeds_to_show(0.0, 1.0) is None
    assert seeds_script.seeds_to_show(1e-6, 1.0) is None
    # beyond the table the quantile approaches the normal one
    assert abs(seeds_script.t95(11) - 2.201) < 0.003
    assert abs(seeds_script.t95(200) - 1.9719) < 0.001


def test_report_again_names_what_was_made_and_what_reused(seeds_script, tmp_path, capsys):
    setup = replace(Setup(), rounds=4)
    rec = record_of(seeds_script, setup, [0, 1, 2])
    rec.update(
        jobs=1,
        wall_s=90.0,
        reused=[[seed, s] for seed in (0, 1) for s in STRATEGIES],
        reused_from="old/results.json",
        earlier_wall_s=600.0,
    )
    write(tmp_path / "results.json", rec)
    seeds_script.report_again(tmp_path)
    capsys.readouterr()
    text = (tmp_path / "report.md").read_text()
    assert "--seeds 3 --first-seed 0 --rounds 4 --jobs 1 --reuse old/results.json" in text
    assert "3 runs made here in 1.5 min" in text
    assert "6 runs (seeds 0-1, all three strategies) reused as they are from `old/results.json`" in text
    assert "made earlier in 10.0 min" in text
    assert (tmp_path / "loss.png").stat().st_size > 0
