"""The replay guard's journal (fedagent.security.replaylog): every number whose commit returned is
a replay after a restart, whatever a crash did to the file's tail; damage elsewhere
fences off frames stamped before the restart; the file stays bounded by compaction."""

from __future__ import annotations

import msgpack
import pytest

from fedagent.errors import FedagentError
from fedagent.security import replaylog
from fedagent.security.replaylog import MAGIC, ReplayJournal
from fedagent.security.signing import AuthError, ReplayGuard
from fedagent.storage import statefile

NOW = 1_000_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def journal(path, keep: int = 8, clock=None) -> tuple[ReplayGuard, ReplayJournal]:
    g = ReplayGuard(window=4096, max_skew=300, keep=keep)
    j = ReplayJournal(path, g, clock or Clock())
    j.load()
    return g, j


def accept(g: ReplayGuard, j: ReplayJournal, sender: str, seq: int, t: float = NOW) -> None:
    g.check(sender, seq, t, t)
    j.commit()


def refused(g: ReplayGuard, sender: str, seq: int, ts: float = NOW) -> bool:
    try:
        g.check(sender, seq, ts, NOW)
    except AuthError as exc:
        assert exc.reason == "replay"
        return True
    return False


def test_every_committed_number_is_a_replay_after_restart(tmp_path):
    path = tmp_path / "replay-guard.msgpack"
    g, j = journal(path)
    accepted = [("a", s) for s in (1000, 1003, 1001, 1010, 1007, 1020, 1015, 1011, 1030, 1025)] + [("b", 5)]
    for sender, seq in accepted:
        accept(g, j, sender, seq)
    assert j.appends == len(accepted) and j.compactions == 1  # the empty file made at start
    j.close()
    g2, _ = journal(path)
    assert all(refused(g2, s, q) for s, q in accepted)
    # Above the kept floor, numbers never seen still pass (out-of-order delivery).
    assert not refused(g2, "a", 1012) and not refused(g2, "a", 1031) and not refused(g2, "c", 1)


def test_a_tail_cut_anywhere_loses_only_the_uncommitted_record(tmp_path):
    """A crash can stop an append at any byte: every cut of the file loads, keeps every
    record before the cut, and appends after the restart are found again."""
    path = tmp_path / "j"
    g, j = journal(path)
    sizes = [path.stat().st_size]
    for seq in range(100, 106):
        accept(g, j, "a", seq)
        sizes.append(path.stat().st_size)
    j.close()
    full = path.read_bytes()
    for cut in range(len(MAGIC), len(full) + 1):
        path.write_bytes(full[:cut])
        g2, j2 = journal(path)
        done = [100 + i for i, end in enumerate(sizes[1:]) if end <= cut]
        assert all(refused(g2, "a", s) for s in done), cut
        assert g2.fence == float("-inf")
        accept(g2, j2, "a", 500)
        j2.close()
        g3, j3 = journal(path)
        assert refused(g3, "a", 500) and all(refused(g3, "a", s) for s in done), cut
        j3.close()


def test_a_damaged_record_before_others_fences_off_older_frames(tmp_path):
    path = tmp_path / "j"
    g, j = journal(path)
    for seq in (10, 11, 12):
        accept(g, j, "a", seq)
    j.close()
    data = bytearray(path.read_bytes())
    # Flip a byte inside the payload of the second append (not the last record).
    first = len(MAGIC) + replaylog.HEADER.size + replaylog.HEADER.unpack_from(data, len(MAGIC))[0]
    second = first + replaylog.HEADER.size + replaylog.HEADER.unpack_from(data, first)[0]
    data[second + replaylog.HEADER.size + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    clock = Clock(NOW + 5)
    g2, j2 = journal(path, clock=clock)
    assert g2.fence == NOW + 5
    assert refused(g2, "a", 10) and refused(g2, "a", 12)  # records that check out still count
    # Number 11 sat in the damaged record: it (or any frame signed before the restart) is refused by stamp.
    assert refused(g2, "a", 11, ts=NOW)
    assert refused(g2, "z", 1, ts=NOW + 5)
    assert not refused(g2, "z", 2, ts=NOW + 6)  # signed after the restart: fine
    j2.close()
    # The file was compacted clean, fence included, so another crash keeps it.
    g3, j3 = journal(path, clock=Clock(NOW + 10))
    assert g3.fence == NOW + 5 and refused(g3, "a", 11, ts=NOW) and refused(g3, "y", 1, ts=NOW + 5)
    assert not refused(g3, "y", 2, ts=NOW + 6)
    j3.close()
    # Once the skew window has passed, compaction drops the fence (older frames are stale anyway).
    g4, j4 = journal(path, clock=Clock(NOW + 5 + 301))
    accept(g4, j4, "z", 3, t=NOW + 400)
    j4._compact()
    j4.close()
    g5, _ = journal(path, clock=Clock(NOW + 400))
    assert g5.fence == float("-inf") and refused(g5, "z", 3)


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"n": {"a": ["x"]}}),  # not integers
        msgpack.packb({"n": {"a": list(range(9))}}),  # more than keep numbers
        msgpack.packb({"n": {}, "evil": 1}),  # unknown key
        msgpack.packb({"n": {"a": [1]}, "f": float("nan")}),  # fence not finite
        b"\xc1",  # not msgpack
        msgpack.packb({"n": {"a": [b"x" * 10]}}, use_bin_type=True),
    ],
)
def test_a_well_checksummed_record_with_bad_content_is_damage_not_trusted(tmp_path, payload):
    path = tmp_path / "j"
    g, j = journal(path)
    accept(g, j, "a", 7)
    j.close()
    bad = replaylog.HEADER.pack(len(payload), replaylog.zlib.crc32(payload)) + payload
    with open(path, "ab") as f:
        f.write(bad)
    g2, j2 = journal(path, clock=Clock(NOW + 1))
    assert refused(g2, "a", 7) and g2.fence == NOW + 1
    j2.close()


def test_a_lying_length_is_a_torn_tail_and_allocates_nothing(tmp_path):
    path = tmp_path / "j"
    g, j = journal(path)
    accept(g, j, "a", 7)
    j.close()
    with open(path, "ab") as f:
        f.write(replaylog.HEADER.pack(0xFFFFFFFF, 0) + b"short")
    g2, j2 = journal(path)
    assert refused(g2, "a", 7) and g2.fence == float("-inf")
    j2.close()


def test_an_oversized_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(replaylog, "MAX_FILE", 1024)
    path = tmp_path / "j"
    path.write_bytes(MAGIC + b"\0" * 2000)
    with pytest.raises(FedagentError, match="more than"):
        journal(path)


def test_the_snapshot_format_before_the_journal_is_taken_over(tmp_path):
    old = ReplayGuard(window=4096, max_skew=300, keep=8)
    for s in (3, 4, 9):
        old.check("a", s, NOW, NOW)
    path = tmp_path / "replay-guard.msgpack"
    path.write_bytes(old.snapshot())
    g, j = journal(path)
    assert all(refused(g, "a", s) for s in (3, 4, 9)) and g.fence == float("-inf")
    assert path.read_bytes().startswith(MAGIC)
    j.close()


def test_compaction_bounds_the_file_and_keeps_the_state(tmp_path, monkeypatch):
    monkeypatch.setattr(replaylog, "MIN_COMPACT", 512)
    path = tmp_path / "j"
    g, j = journal(path)
    for seq in range(1, 400):
        accept(g, j, f"s{seq % 5}", seq)
    assert j.compactions > 2
    assert path.stat().st_size < 2 * 512 + 200
    j.close()
    g2, _ = journal(path)
    assert g2.tops() == g.tops()
    assert all(refused(g2, f"s{seq % 5}", seq) for seq in range(360, 400))


def test_restarts_do_not_ratchet_the_compaction_limit_up(tmp_path, monkeypatch):
    """The limit is twice the last compaction (the file's first record), not twice the
    file as found at a restart: else every restart could double the file."""
    monkeypatch.setattr(replaylog, "MIN_COMPACT", 1)
    path = tmp_path / "j"
    g, j = journal(path)
    accept(g, j, "a", 1)
    j.close()
    with open(path, "ab") as f:  # appends made before a crash
        for seq in range(2, 12):
            f.write(statefile.record({"n": {"a": [seq]}}))
    g2, j2 = journal(path)
    assert j2.compactions == 0
    accept(g2, j2, "a", 12)
    assert j2.compactions == 1
    j2.close()
    g3, _ = journal(path)
    assert all(refused(g3, "a", s) for s in range(1, 13))


def test_a_failed_append_loses_nothing_and_the_next_commit_rewrites(tmp_path, monkeypatch):
    from fedagent.errors import StateWriteError

    path = tmp_path / "j"
    g, j = journal(path)
    accept(g, j, "a", 1)
    size = path.stat().st_size
    real = replaylog.os.fdatasync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(replaylog.os, "fdatasync", full_disk)
    g.check("a", 2, NOW, NOW)
    with pytest.raises(StateWriteError, match="No space left"):
        j.commit()
    assert path.stat().st_size == size  # the half record was cut off
    monkeypatch.setattr(replaylog.os, "fdatasync", real)
    compactions = j.compactions
    accept(g, j, "a", 3)
    assert j.compactions == compactions + 1
    j.close()
    g2, _ = journal(path)
    assert refused(g2, "a", 1) and refused(g2, "a", 2) and refused(g2, "a", 3)
