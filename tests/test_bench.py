"""The benchmark entry command runs and prints a ratio table (no timing is asserted:
CI machines are too noisy for that; bench/run.py is for measuring)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_codec_bench_prints_a_ratio_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "run.py"),
            "--quick",
            "--only",
            "codec",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ratio" in out.stdout
    # One row per measurement, each with a ratio printed as "N.NNx".
    ratios = re.findall(r"(\d+\.\d\d)x", out.stdout)
    assert len(ratios) == 2, out.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert [r["section"] for r in rows] == ["codec", "codec"]
    assert all(r["baseline"] == "memcpy" and r["baseline_value"] > 0 and r["value"] > 0 for r in rows)
    assert all(abs(r["ratio"] - r["value"] / r["baseline_value"]) < 1e-9 for r in rows)
    assert results["machine"]["cpus"]
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n") == 2 + len(rows)


def test_unknown_section_is_refused():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--only", "nosuch"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "unknown section" in out.stderr and "codec" in out.stderr


# ---- a row that stops appearing fails the run ---------------------------------------------
def _run_fake(monkeypatch, tmp_path, rows, *, expected: int, not_measured: tuple[str, ...] = ()):
    """bench/run.py's main() with one registered section ``fake`` that returns ``rows``
    and declares ``expected``; returns (exit code, results.json)."""
    import signal

    from bench import registry
    from bench import run as bench_run

    def fake(ctx):
        for what in not_measured:
            ctx.shared.setdefault("failures", []).append(what)
        return list(rows)

    monkeypatch.setitem(registry.SECTIONS, "fake", fake)
    monkeypatch.setitem(registry.EXPECTED_ROWS, "fake", lambda ctx: expected)
    old = signal.getsignal(signal.SIGTERM)
    try:
        code = bench_run.main(["--only", "fake", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, old)
    return code, json.loads((tmp_path / "results.json").read_text())


def _row(value=1.0, baseline=2.0, subject="a thing"):
    from bench.registry import Row

    return Row("fake", subject, value, "the baseline", baseline)


def test_run_exits_zero_when_every_declared_row_is_measured(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row(), _row(subject="another")], expected=2)
    assert code == 0, capsys.readouterr().out
    assert results["missing"] == [] and results["not_measured"] == [] and len(results["rows"]) == 2


def test_run_exits_non_zero_when_a_declared_row_is_missing(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row()], expected=2)
    out = capsys.readouterr().out
    assert code == 1
    assert "MISSING: section fake: 1 of the 2 rows it should measure" in out
    assert results["missing"] == ["section fake: 1 of the 2 rows it should measure"]
    assert "Missing: section fake" in (tmp_path / "table.md").read_text()


def test_run_exits_non_zero_for_a_row_that_is_not_a_measurement(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row(), _row(value=float("nan"), subject="broken")], expected=2)
    assert code == 1
    assert any("broken: value nan is not a measurement" in m for m in results["missing"]), results["missing"]
    code, results = _run_fake(monkeypatch, tmp_path, [_row(baseline=0.0), _row()], expected=2)
    assert code == 1 and any("baseline 0.0" in m for m in results["missing"]), results["missing"]


def test_run_exits_non_zero_when_a_section_reports_a_case_not_measured(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(
        monkeypatch, tmp_path, [_row(), _row()], expected=2, not_measured=("Flower deployment, 44.8 MB: timed out",)
    )
    assert code == 1
    assert "NOT MEASURED: Flower deployment, 44.8 MB: timed out" in capsys.readouterr().out
    assert results["not_measured"] == ["Flower deployment, 44.8 MB: timed out"]


def test_every_section_declares_the_rows_it_measures():
    import importlib

    from bench.registry import EXPECTED_ROWS, MODULES, SECTIONS, Context

    for mod in MODULES:
        importlib.import_module(mod)
    assert set(SECTIONS) == set(EXPECTED_ROWS) and len(SECTIONS) >= 9, sorted(SECTIONS)
    for quick in (False, True):
        ctx = Context(quick=quick, work=Path("."), repeats=1)
        for name, rows in EXPECTED_ROWS.items():
            assert rows(ctx) >= 1, (name, quick)
