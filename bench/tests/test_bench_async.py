"""The asynchronous benchmark (bench/fedbuff.py): its agents' roles, the rows a pair of
runs gives (from recorded runs, no process), and one tiny real pair of runs, sync then
async, with a slow agent and one whose link is cut (``slow``: minutes on a shared
machine; no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from bench import fedbuff
from bench.registry import EXPECTED_ROWS, Context, check_rows
from bench.tta import Run


def test_the_slow_and_the_flaky_agents_are_distinct_and_named_as_configured():
    s = fedbuff.Setup()
    assert s.slow_ids() == ["agent-8", "agent-9", "agent-10"]
    assert s.flaky_ids() == ["agent-6", "agent-7"]
    q = fedbuff.QUICK
    assert not set(q.slow_ids()) & set(q.flaky_ids()) and len(q.slow_ids()) == len(q.flaky_ids()) == 1


def measured(mode: str, accuracies: list[float | None], seconds: float, final: float) -> fedbuff.Measured:
    """A run whose models came every ``seconds`` from t = 100, with these accuracies."""
    run = Run(f"fedagent {mode}", launched=90.0, target=0.9)
    run.rounds = [
        {"round": i + 1, "start": 100.0 + i * seconds, "end": 100.0 + (i + 1) * seconds, "accuracy": a}
        for i, a in enumerate(accuracies)
    ]
    run.bytes_to_target = 1000 * len(accuracies)
    return fedbuff.Measured(run, mode, updates=5 * len(accuracies), models=len(accuracies), final_accuracy=final)


def test_a_pair_of_runs_gives_the_time_bytes_and_final_accuracy_rows():
    sync = measured("fedavg", [0.5, 0.8, 0.92, 0.95], 10.0, 0.95)
    asyn = measured("async", [0.4, None, 0.7, 0.85, 0.91, 0.93, 0.94, 0.95], 3.0, 0.945)
    rows = fedbuff.rows_of(sync, asyn, 0)
    time_row, bytes_row, final_row = rows
    assert (time_row.value, time_row.baseline_value) == (15.0, 30.0)  # the 5th model against the 3rd round
    assert (bytes_row.value, bytes_row.baseline_value) == (8000, 4000)  # as recorded by each run
    assert math.isclose(final_row.value, 0.945) and final_row.baseline_value == 0.95
    assert "model 5" in time_row.note and "model 3" in time_row.note
    ctx = Context(quick=True, work=None, repeats=1)  # type: ignore[arg-type]
    assert EXPECTED_ROWS["async"](ctx) == 3 and not check_rows("async", ctx, rows)


def test_a_mode_that_misses_the_target_leaves_its_rows_missing():
    sync = measured("fedavg", [0.5, 0.92], 10.0, 0.92)
    asyn = measured("async", [0.4, 0.6], 3.0, 0.6)
    rows = fedbuff.rows_of(sync, asyn, 0)
    assert [r.subject for r in rows] == ["async FedAvg: final accuracy in the rounds' time (run 1)"]
    assert check_rows("async", Context(quick=True, work=None, repeats=1), rows)  # type: ignore[arg-type]


@pytest.mark.procs
@pytest.mark.slow
def test_a_tiny_pair_of_runs_measures_both_modes(tmp_path):
    setup = fedbuff.Setup(agents=3, slow=1, flaky=1, rounds=4, target=0.0, link_up=3.0, link_down=2.0, timeout=600)
    sync, asyn = fedbuff.compare(tmp_path, setup, print)
    assert sync.models == 4 and asyn.models >= 1  # async: for as long as the 4 rounds took
    assert asyn.updates >= 5 and sync.updates >= 8
    for m in (sync, asyn):
        assert m.run.reached() is not None and m.run.time_to_target > 0 and m.run.bytes_to_target > 0
        assert 0.0 <= m.final_accuracy <= 1.0
    assert "median" in asyn.staleness
    rows = fedbuff.rows_of(sync, asyn, 0)
    ctx = Context(quick=True, work=tmp_path, repeats=1)
    assert EXPECTED_ROWS["async"](ctx) == 3 and not check_rows("async", ctx, rows)
