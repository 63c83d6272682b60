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
