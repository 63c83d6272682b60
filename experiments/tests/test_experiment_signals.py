"""`fedagent experiment ...` ended by SIGTERM (systemd, `timeout`, `kill`) or Ctrl-C stops
the daemons it started, removes its work directory and exits with 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netfed import wait_for

pytestmark = pytest.mark.procs


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (this user's processes only)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _default_sigint() -> None:
    """The experiment starts with SIGINT at its default, as from a terminal (a suite run
    as a background job inherits SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT (Ctrl-C)"])
def test_a_stop_signal_stops_the_experiments_daemons_and_removes_its_work_dir(tmp_path, sig):
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedagent",
            "experiment",
            "flsimco",
            "--rounds",
            "50",
            "--coverage",
            "2",
            "--strategy",
            "fedavg",
            "--local-epochs",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout is not None
        work = None
        for line in proc.stdout:
            if "work dir " in line:
                work = line.rsplit("work dir ", 1)[1].strip()
                break
        assert work is not None and Path(work).is_dir(), "the experiment names its work directory"
        # The RSU (coordinator) and the vehicles are daemons whose command lines name files
        # in the work directory; wait until the coordinator and at least one agent run.
        wait_for(lambda: len(_processes_mentioning(work)) >= 2, 120, "the experiment's daemons")
        proc.send_signal(sig)
        proc.stdout.read()  # drain, so the experiment never blocks on a full pipe
        assert proc.wait(timeout=120) == 128 + sig
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in _processes_mentioning(work)}
        assert left == {}, "no daemon of the experiment outlives it"
        assert not Path(work).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
