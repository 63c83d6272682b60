"""bench/scale.py's rows and plot, from rows shaped like a measured run (the
measurement itself, many agents over the broker, runs in bench/tests/test_swarm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scale as scale_bench
from bench import scaling
from bench.registry import Context, check_rows


def _row(n: int, round_s: float, procs: int = 1, state_on: str = "/tmp") -> dict:
    return {
        "agents": n,
        "procs": procs,
        "state_on": state_on,
        "params": 1000,
        "rounds": 3,
        "errors": 0,
        "round_median_s": round_s,
        "round_max_s": round_s * 1.2,
        "coordinator_cpu_per_update_ms": 2.2,
        "coordinator_core_share": 0.1,
        "broker_cpu_per_update_ms": 0.2,
        "broker_core_share": 0.01,
        "swarm_cpu_per_agent_ms": 1.8,
        "swarm_core_share": 0.08,
        "swarm_busiest_core_share": 0.05,
        "coordinator_peak_rss_mb": 300.0 + n / 1000,
        "broker_peak_rss_mb": 10.0 + n * 0.03,
        "broker_fds": n + 8,
        "connect_s": n / 30,
    }


def test_scale_section_makes_the_rows_it_declares_and_reports_a_failed_case(monkeypatch, tmp_path):
    ctx = Context(quick=False, work=tmp_path, repeats=1, log=lambda s: None)
    measured = [_row(10, 0.2), _row(100, 2.0), _row(1000, 25.0)]
    monkeypatch.setattr(scale_bench, "measure", lambda *a, **k: measured)
    rows = scaling.scale(ctx)
    assert check_rows("scale", ctx, rows) == []
    assert [r.ratio for r in rows[:3]] == pytest.approx([1.0, 10.0, 125.0])
    assert "Mosquitto 0.01" in rows[2].note and "1008 open files" in rows[5].note
    assert "failures" not in ctx.shared

    # The 1,000-agent case failed: its rows are not measurements, and the run says why.
    ctx = Context(quick=False, work=tmp_path, repeats=1, log=lambda s: None)
    failed = {"agents": 1000, "procs": 1, "params": 1000, "rounds": 0, "failed": "not connected"}
    monkeypatch.setattr(scale_bench, "measure", lambda *a, **k: measured[:2] + [failed])
    rows = scaling.scale(ctx)
    problems = check_rows("scale", ctx, rows)
    assert any("1000 agents" in p and "not a measurement" in p for p in problems), problems
    assert ctx.shared["failures"] == ["scale 1000 agents: 0 rounds; not connected"]


def test_scale_plot_draws_every_group(tmp_path: Path):
    rows = [_row(n, n / 50) for n in (10, 100, 1000)]
    rows += [_row(n, n / 40, procs=2, state_on="/dev/shm/x") for n in (1000, 2000)]
    rows.append({"agents": 3000, "procs": 2, "rounds": 0, "failed": "keep-alive"})  # left out, not drawn
    out = tmp_path / "scale.png"
    scale_bench.plot(rows, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000
