"""An asynchronous coordinator's round journal rewritten at a model (fedagent.coordinator.compaction,
RoundJournal.rewrite_*, DurableJournal.rewrite): bounded while some update is always in
transfer, and never without a frame a restart still needs."""

from __future__ import annotations

import os
import random

import powercut
import pytest

from fedagent.storage import statefile
from fedagent.storage.roundjournal import InFlight, RoundJournal


class Cut(Exception):
    """The power goes."""


@pytest.mark.parametrize("seed", [1, 2])
def test_a_power_cut_at_any_point_of_a_rewrite_leaves_a_journal_with_every_needed_frame(tmp_path, seed):
    """A rewrite cut by a power loss before each of its syncs and renames in turn (and
    once after all of them), with the unsynced bytes partly kept at random: the journal
    found after each cut is the old one or the new one, whole, with every frame the
    checkpoint does not hold (including one acknowledged while the rewrite ran); a
    leftover new file is a temporary file the coordinator removes when it starts."""
    rng = random.Random(seed)
    frames = [("fedagent/v1/f/node/a/to/coordinator/update", bytes([i]) * (300 + i)) for i in range(8)]
    needed = frames[5:]  # the first five are in the checkpoint
    late = ("fedagent/v1/f/node/a/to/coordinator/update", b"late" * 100)  # written during the rewrite
    k = 0
    while True:
        root, trace = tmp_path / f"cut{k}" / "disk", tmp_path / f"cut{k}" / "trace"
        root.mkdir(parents=True)
        path = root / "round-journal"
        j = RoundJournal(path, max_frame=1 << 20)
        j.begin(2, 1, ())
        for t, d in frames:
            j.append(t, d)
        powercut.install(root, trace)
        calls = 0
        wrapped = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace")}

        def counting(name):
            def call(*args):
                nonlocal calls
                if calls == k:
                    raise Cut(name)
                calls += 1
                return wrapped[name](*args)

            return call

        finished = False
        try:
            for name in wrapped:
                os.__dict__[name] = counting(name)
            mark = j.rewrite_mark()
            keep = [(a, b, "a") for a, b, t, d in j.frame_records(mark.upto) if (t, d) in needed]
            j.rewrite_write(mark, InFlight(3, 2, ()), keep)
            j.append(*late)
            j.rewrite_commit(mark)
            finished = True
        except Cut:
            pass
        finally:
            powercut.uninstall()
            j.close()
        powercut.restore(root, trace, rng)
        statefile.cleanup_temp_files(root)
        assert sorted(p.name for p in root.iterdir()) == ["round-journal"]
        again = RoundJournal(path, max_frame=1 << 20)
        inflight = again.recover()
        got = list(again.frames_of())
        again.close()
        if inflight == InFlight(2, 1, ()):
            assert got[: len(frames)] == frames and got[len(frames) :] in ([], [late])
        else:
            assert inflight == InFlight(3, 2, ()), inflight
            assert got in (needed, [*needed, late])
        if finished:
            assert inflight == InFlight(3, 2, ()) and got == [*needed, late]
            break
        k += 1
    assert k >= 4  # cut before: the new file's sync, the late frame's, the tail's sync, the rename
