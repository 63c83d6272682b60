"""bench/procs.py: an interrupted benchmark ends every process it started, by PID, also
ones that left its process group (``setsid``, as Flower's ``flwr-serverapp`` did) or were
orphaned, and nothing else. Real processes (``sleep``), no Flower needed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.procs import ProcessTree


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_interrupted_tree_ends_escaped_and_orphaned_descendants(tmp_path):
    escaped, orphan = tmp_path / "escaped.pid", tmp_path / "orphan.pid"
    # One child leaves the group and session (setsid), one is orphaned by its subshell
    # (re-parented away from the tree), the command itself keeps running.
    script = (f"setsid sleep 300 & echo $! > {escaped}.tmp; mv {escaped}.tmp {escaped}; "
              f"(sleep 300 & echo $! > {orphan}.tmp; mv {orphan}.tmp {orphan}); exec sleep 300")
    bystander = subprocess.Popen(["sleep", "300"])       # not the tree's: must survive
    try:
        pids: list[int] = []
        with pytest.raises(KeyboardInterrupt):
            with ProcessTree() as tree:
                root = tree.spawn(["sh", "-c", script])
                _wait_for(lambda: escaped.exists() and orphan.exists())
                pids = [root.pid, int(escaped.read_text()), int(orphan.read_text())]
                assert all(_alive(p) for p in pids)
                assert set(pids) <= set(tree.alive())
                raise KeyboardInterrupt
        _wait_for(lambda: not any(_alive(p) for p in pids))
        assert root.returncode is not None
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_an_error_inside_the_block_ends_the_tree_too():
    with pytest.raises(RuntimeError, match="boom"):
        with ProcessTree() as tree:
            p = tree.spawn(["sleep", "300"])
            raise RuntimeError("boom")
    assert p.returncode is not None and not _alive(p.pid)
