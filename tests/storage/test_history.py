"""A daemon's history.jsonl: rotated by size, read whole (rotated files first) by every reader."""

from __future__ import annotations

import json

import pytest

from fedagent import config
from fedagent.config import TlsConfig
from fedagent.local.report import find_histories, read_history, write_report
from fedagent.storage import history as H

SMALL = H.MIN_MAX_BYTES


def _round(r: int) -> dict:
    # about 700 bytes, as a round record of a digits coordinator
    return {"event": "round", "round": r, "model_version": r, "participants": ["a", "b"], "pad": "x" * 600}


def test_history_rotates_at_its_size_and_keeps_its_files(tmp_path):
    h = H.History(tmp_path / "fed" / H.NAME, max_bytes=SMALL, keep=2)
    for r in range(1, 301):
        h.append(_round(r))
    files = H.history_files(h.path)
    # the current file and two rotated ones; every file below the limit
    assert [f.name for f in files] == ["history.jsonl.2", "history.jsonl.1", "history.jsonl"]
    assert all(f.stat().st_size <= SMALL for f in files)
    assert not H.rotated(h.path, 3).exists() and h.rotations >= 3
    # what is left is the newest records, in order, without a gap or a duplicate
    kept = [rec["round"] for rec in H.read_records(h.path)]
    assert kept == list(range(kept[0], 301)) and kept[0] > 1
    assert sum(f.stat().st_size for f in files) <= (h.keep + 1) * SMALL


@pytest.mark.parametrize("fragment", [b'{"event": "round", "rou', b"x" * 5000])
def test_a_record_cut_short_by_a_crash_is_removed_when_the_history_opens(tmp_path, fragment):
    """An append a power cut interrupted leaves the start of a line without its newline;
    opened again, the history drops that fragment, so the next record stays readable."""
    h = H.History(tmp_path / H.NAME, max_bytes=SMALL, keep=1)
    h.append(_round(1))
    with open(h.path, "ab") as f:
        f.write(fragment)
    h = H.History(tmp_path / H.NAME, max_bytes=SMALL, keep=1)
    h.append(_round(2))
    assert [rec["round"] for rec in H.read_records(h.path)] == [1, 2]
    # A file holding nothing but a fragment is emptied the same way.
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / H.NAME).write_bytes(fragment)
    h = H.History(tmp_path / "only" / H.NAME, max_bytes=SMALL, keep=1)
    assert h.path.read_bytes() == b""


def test_tail_reaches_into_the_rotated_file(tmp_path):
    h = H.History(tmp_path / H.NAME, max_bytes=SMALL, keep=1)
    r = 0
    while h.rotations == 0:
        r += 1
        h.append(_round(r))
    # the current file holds one record: the tail also shows those before the rotation
    lines = h.tail(4000)
    rounds = [json.loads(line)["round"] for line in lines]
    assert rounds[-1] == r and rounds == list(range(r - len(rounds) + 1, r + 1)) and len(rounds) > 1
    assert len(H.History(tmp_path / "none" / H.NAME).tail(4000)) == 0


def test_readers_find_a_history_whose_current_file_is_missing(tmp_path):
    # A crash after a rotation and before the next record: only history.jsonl.1 exists.
    d = tmp_path / "state" / "coordinator" / "coordinator" / "fed"
    d.mkdir(parents=True)
    H.rotated(d / H.NAME, 1).write_text(json.dumps(_round(1)) + "\n")
    (d / "history.jsonl.bak").write_text("not a rotated file\n")
    assert find_histories(tmp_path / "state") == [d / H.NAME]
    assert [r["round"] for r in H.read_records(d / H.NAME)] == [1]


def test_the_report_reads_the_rotated_files_oldest_first(tmp_path):
    path = tmp_path / "state" / "coordinator" / "coordinator" / "fed" / H.NAME
    h = H.History(path, max_bytes=SMALL, keep=10)
    for r in range(1, 201):
        h.append({**_round(r), "metrics": {"loss": 1.0 / r}, "seconds": 0.1})
    assert len(H.history_files(path)) > 2
    loaded = read_history(path)
    assert [r["round"] for r in loaded.rounds] == list(range(1, 201)) and loaded.malformed == 0
    text = write_report(find_histories(tmp_path / "state"), tmp_path / "out").read_text()
    assert "| rounds aggregated | 200 |" in text


def test_rotation_settings_come_from_the_config(tmp_path):
    tls = TlsConfig(ca=tmp_path / "ca.crt", cert=tmp_path / "a.crt", key=tmp_path / "a.key")
    text = config.render(node_id="agent-a", federation="fed", tls=tls, state_dir=tmp_path / "state")
    p = tmp_path / "agent.toml"
    p.write_text(f"history_max_bytes = {SMALL}\nhistory_keep = 2\n" + text)
    cfg = config.load(p, "agent")
    assert (cfg.history_max_bytes, cfg.history_keep) == (SMALL, 2)
    p.write_text(text)
    cfg = config.load(p, "agent")
    assert (cfg.history_max_bytes, cfg.history_keep) == (H.DEFAULT_MAX_BYTES, H.DEFAULT_KEEP)
    with pytest.raises(ValueError):
        H.History(tmp_path / H.NAME, max_bytes=SMALL - 1)
