"""bench/procs.py: an interrupted benchmark ends every process it started, by PID, also
ones that left its process group (``setsid``, as Flower's ``flwr-serverapp`` did) or were
orphaned, and nothing else. Real processes (``sleep``), no Flower needed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from bench.procs import ProcessTree

pytestmark = pytest.mark.procs


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
    script = (
        f"setsid sleep 300 & echo $! > {escaped}.tmp; mv {escaped}.tmp {escaped}; "
        f"(sleep 300 & echo $! > {orphan}.tmp; mv {orphan}.tmp {orphan}); exec sleep 300"
    )
    bystander = subprocess.Popen(["sleep", "300"])  # not the tree's: must survive
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


_DEPLOY_CHILD = """
import signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from bench import flower
signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
try:
    flower.run_deployment(flower.VENV / "bin" / "python", Path({work!r}), 4096, 500, 600, print, clients=2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _marked(prefix: bytes) -> dict[int, str]:
    """Live processes whose environment carries this ProcessTree marker prefix."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(e.startswith(prefix) for e in env) and _alive(int(entry.name)):
            out[int(entry.name)] = cmd
    return out


@pytest.mark.slow
@pytest.mark.flower
def test_an_interrupted_flower_deployment_leaves_no_process(tmp_path, flower_python):
    """The real thing (needs bench/.venv-flower): SuperLink, 2 SuperNodes and ``flwr run``
    of a 500-round run; once ``flwr-serverapp`` runs, the benchmark gets SIGTERM (what
    bench/run.py turns into KeyboardInterrupt) and must leave no process of the run."""
    import sys

    root = str(Path(__file__).resolve().parents[2])
    child = subprocess.Popen(
        [sys.executable, "-c", _DEPLOY_CHILD.format(root=root, work=str(tmp_path))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    prefix = f"FEDAGENT_BENCH_TREE={child.pid}-".encode()
    try:
        _wait_for(lambda: any("flwr-serverapp" in c for c in _marked(prefix).values()), timeout=240)
        seen = _marked(prefix)
        assert len(seen) >= 4, seen  # SuperLink, 2 SuperNodes, flwr-serverapp at least
        child.send_signal(15)
        out, _ = child.communicate(timeout=60)
        assert "interrupted" in out, out
        _wait_for(lambda: not _marked(prefix), timeout=20)
        assert not any(_alive(p) for p in seen), {p: c for p, c in seen.items() if _alive(p)}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in _marked(prefix):  # a failed run must not leave them either
            os.kill(pid, 9)
