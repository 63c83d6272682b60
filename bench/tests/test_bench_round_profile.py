"""The round profile's per-phase split of the agents' CPU (bench/round_profile.py)."""

from __future__ import annotations

import json

import pytest

from bench.round_profile import _agents


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_agents_cpu_is_split_per_round_and_summed_over_agents(tmp_path):
    # Round 1 only sets where round 2's idle time starts; rounds before the first
    # measured one (the warm-up) are left out.
    _write(
        tmp_path / "agent-1.jsonl",
        [
            {"round": 1, "first_frame": 0.0, "decoded": 0.5, "sent": 1.0},
            {"round": 2, "first_frame": 1.25, "decoded": 1.5, "sent": 2.0},
            {"round": 3, "first_frame": 2.5, "decoded": 3.0, "sent": 4.0},
        ],
    )
    _write(
        tmp_path / "agent-2.jsonl",
        [
            {"round": 2, "first_frame": 10.0, "decoded": 10.5, "sent": 11.0},
            {"round": 3, "first_frame": 11.0, "decoded": 11.25, "sent": 11.5},
        ],
    )
    got = _agents(tmp_path, first_round=3)
    assert got == {
        "idle": [pytest.approx(0.5)],  # 0.5 + 0.0
        "receive": [pytest.approx(0.75)],  # 0.5 + 0.25
        "answer": [pytest.approx(1.25)],  # 1.0 + 0.25
    }


def test_no_profile_lines_give_no_phases(tmp_path):
    assert _agents(tmp_path, first_round=3) == {"idle": [], "receive": [], "answer": []}
