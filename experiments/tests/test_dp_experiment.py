"""The accuracy-against-ε experiment, at a toy size: it runs the round machine with DP,
spends exactly the ε it was calibrated for, and writes its report and plot."""

from __future__ import annotations

import json
import math

from fedagent_experiments.dp_digits import Setup, run_experiment, within


def test_dp_digits_experiment_writes_its_report(tmp_path) -> None:
    setup = Setup(clients=30, per_round=10, rounds=4, epsilons=(3.0, math.inf), seeds=(0,))
    lines: list[str] = []
    md = run_experiment(tmp_path, setup, log=lines.append)
    text = md.read_text()
    assert "| 3 |" in text and "| ∞ (no DP) |" in text
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    (private,) = [r for r in runs if r["epsilon_target"] == 3.0]
    assert private["rounds"] == 4 and 2.99 <= private["epsilon_spent"] <= 3.0
    assert any(x.startswith("epsilon 3 seed 0: accuracy") for x in lines)


def test_within_two_points_picks_the_smallest_close_epsilon() -> None:
    rows = [
        {"epsilon_target": 1.0, "accuracy": 0.5},
        {"epsilon_target": 3.0, "accuracy": 0.89},
        {"epsilon_target": 8.0, "accuracy": 0.93},
        {"epsilon_target": math.inf, "accuracy": 0.94},
    ]
    stats, best = within(rows)
    assert best == 8.0 and stats[3.0] == (0.89, 0.0)
    assert within(rows[:1] + rows[3:])[1] is None
