"""``fedagent demo`` ended by SIGTERM (``timeout``, systemd, CI) or SIGHUP (the terminal
went away) stops every process it started and removes its work directory, as Ctrl-C
(SIGINT, the third case) does.

The demo runs as a real subprocess in a session of its own. Once it reports the
federation running, the test collects every process below it from /proc (Mosquitto, the
coordinator, the agents and anything they started), sends the signal, and then finds
none of them left and the work directory gone."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from netfed import wait_for


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent PID, state, start time in clock ticks) of a process, None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return int(fields[1]), fields[0], int(fields[19])


def _default_stop_signals() -> None:
    """As from a terminal: a job that a shell without job control starts in the background
    (`cmd &` in a script) inherits SIGINT ignored, one under nohup SIGHUP, and the demo
    keeps an ignored signal ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def descendants(root: int) -> dict[int, int]:
    """Every process below ``root``: PID -> start time (a PID reused later is another process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if (st := _stat(pid)) is not None:
                found[pid] = st[2]
                todo.append(pid)
    return found


def alive(procs: dict[int, int]) -> list[int]:
    return [
        pid for pid, started in procs.items() if (st := _stat(pid)) is not None and st[2] == started and st[1] != "Z"
    ]


class Output:
    """The demo's output lines, read in a thread of their own."""

    def __init__(self, pipe) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for raw in pipe:
            self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)  # the demo closed its output: it has ended

    def until(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {text!r} within {timeout}s; output:\n{''.join(self.seen)}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the demo ended before printing {text!r}; output:\n{''.join(self.seen)}")
            self.seen.append(line)

    def drain(self) -> str:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return "".join(self.seen)
            if line is not None:
                self.seen.append(line)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        # The three signals share one handler (fedagent.stopsignals, each checked by
        # tests/project/test_stopsignals.py): CI runs the demo with two of them.
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
        signal.SIGINT,
    ],
    ids=["SIGTERM", "SIGHUP", "SIGINT (Ctrl-C)"],
)
def test_a_signal_stops_everything_the_demo_started(tmp_path, request, sig):
    # The demo's work directory is made here (tempfile honours TMPDIR); a short path, as
    # the daemons' control sockets below it must fit a Unix socket address.
    tmp = Path(tempfile.mkdtemp(prefix="fdsig-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("NOTIFY_SOCKET", None)
    demo = subprocess.Popen(
        # More rounds than the test lasts: the federation is mid-run when the signal comes.
        [sys.executable, "-m", "fedagent", "demo", "--agents", "2", "--rounds", "10000"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_stop_signals,
    )
    out = Output(demo.stdout)
    started: dict[int, int] = {}
    try:
        out.until("federation running", 180)
        started = descendants(demo.pid)
        # Mosquitto, the coordinator and two agents at least.
        assert len(alive(started)) >= 4, (started, out.drain())
        # The demo's work directory; other temporaries its processes make meanwhile
        # (a library's scratch directory) are allowed, as long as they are gone at the end.
        entries = list(tmp.iterdir())
        demos = [p for p in entries if p.name.startswith("fedagent-demo-")]
        assert len(demos) == 1 and (demos[0] / "pki").is_dir(), entries
        work = demos[0]

        os.kill(demo.pid, sig)
        code = demo.wait(60)
        text = out.drain()
        assert code == 128 + sig, text
        said = "interrupted" if sig == signal.SIGINT else f"received {signal.Signals(sig).name}"
        assert f"demo stopped ({said}): every process it started has exited" in text, text
        wait_for(lambda: not alive(started), 10, "every process the demo started to be gone")
        assert not work.exists()
        assert list(tmp.iterdir()) == []
    finally:
        # Only if the test failed: nothing may outlive it.
        if demo.poll() is None:
            started |= descendants(demo.pid)
            demo.kill()
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)
        demo.wait(10)
