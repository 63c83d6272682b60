"""`fedagent report`: markdown and PNG plots from daemon histories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedagent.errors import FedagentError
from fedagent.local.report import find_histories, read_history, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def write_lines(path: Path, records, garbage=()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(garbage)
    path.write_text("\n".join(lines) + "\n")
    return path


def coordinator_history(tmp_path: Path) -> Path:
    recs = []
    for r in range(1, 6):
        recs.append(
            {
                "event": "round",
                "round": r,
                "model_version": r,
                "participants": ["a", "b"],
                "metrics": {"loss": 1.0 / r},
                "seconds": 0.1 * r,
                "bytes_in": 1000 * r,
                "bytes_out": 2000 * r,
            }
        )
    recs.insert(2, {"event": "abandoned", "round": 3, "reason": "deadline passed with 0 of 2 updates"})
    return write_lines(
        tmp_path / "state" / "coordinator" / "coordinator" / "fed" / "history.jsonl",
        recs,
        garbage=["{not json", '{"event": "round"}', "[1, 2]", '{"event": "weird"}'],
    )


def test_report_from_histories_with_garbage_lines(tmp_path):
    coord = coordinator_history(tmp_path)
    agent = write_lines(
        tmp_path / "state" / "site-a" / "agent" / "fed" / "history.jsonl",
        [{"event": "global_eval", "model_version": v, "metrics": {"accuracy": 0.1 * v}} for v in range(5)]
        + [{"event": "update", "round": 1, "metrics": {"loss": 0.7}}],
    )
    assert read_history(coord).malformed == 4
    assert sorted(find_histories(tmp_path / "state")) == sorted([coord, agent])
    md = write_report(find_histories(tmp_path / "state"), tmp_path / "out", title="t")
    text = md.read_text()
    for png in ("metrics.png", "bytes.png", "round_time.png", "participation.png", "agents_accuracy.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, png
        assert f"]({png})" in text
    assert "| rounds aggregated | 5 |" in text
    assert "loss = 0.2000" in text  # final round's loss
    assert "deadline passed with 0 of 2 updates" in text
    assert "| site-a | 1 |" in text and "accuracy = 0.4000" in text
    assert "4 malformed history lines were skipped" in text


def test_empty_history_is_a_clear_error(tmp_path):
    empty = write_lines(tmp_path / "h" / "coordinator" / "f" / "history.jsonl", [], garbage=["garbage"])
    with pytest.raises(FedagentError, match="no rounds recorded"):
        write_report([empty], tmp_path / "out")


@pytest.mark.procs
def test_report_cli(tmp_path):
    coordinator_history(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent",
            "report",
            "--state-dir",
            str(tmp_path / "state"),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "wrote" in out.stdout and (tmp_path / "r" / "report.md").exists()
    none = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent",
            "report",
            "--state-dir",
            str(tmp_path / "nothing"),
            "--out",
            str(tmp_path / "r2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert none.returncode == 78 and "no history.jsonl" in none.stderr
