"""The fork server the tests start daemons with (tests/forkserver.py) gives each daemon
what a fresh ``python -m fedagent`` would have had, as far as the tests can tell: a
session of its own under its own PID (so SIGSTOP and ``kill -9`` reach it and nobody
else), /dev/null as input and the log file as output, nothing else of the server's
descriptors, the request's environment; and its exit status as ``Popen`` reports it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from pathlib import Path

import forkserver
import pytest
from netfed import running, wait_for
from netns import requires_netns

from fedagent.errors import EXIT_CONFIG
from fedagent.local import launch


@pytest.fixture
def server(tmp_path: Path):
    s = forkserver.ForkServer(tmp_path / "forkserver.log")
    previous = launch.use(s.launch)
    try:
        yield s
    finally:
        launch.use(previous)
        s.close()


def _open_files(pid: int) -> set[str]:
    """What the descriptors of ``pid`` point to (one it closes while they are read is left
    out: it is no longer open)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    return out


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_forked_daemon_is_a_process_of_its_own(tmp_path: Path, server, monkeypatch) -> None:
    # Read by the daemon as it starts: the request's environment, not the server's.
    monkeypatch.setenv("FEDAGENT_LOG_LEVEL", "DEBUG")
    with running(tmp_path / "fed", agents=1, rounds=1, alpha=1.0, start=False) as fed:
        proc = fed.spawn("agent-1")
        daemon = proc.popen
        assert isinstance(daemon, forkserver.ForkedDaemon), daemon
        assert daemon.pid not in (os.getpid(), server._proc.pid if server._proc else None)
        assert os.getsid(daemon.pid) == daemon.pid and os.getpgid(daemon.pid) == daemon.pid
        assert Path(f"/proc/{daemon.pid}/fd/0").resolve() == Path(os.devnull)
        assert Path(f"/proc/{daemon.pid}/fd/1").resolve() == proc.log.resolve()
        assert Path(f"/proc/{daemon.pid}/fd/2").resolve() == proc.log.resolve()
        # The agent is up (its control socket answers) and is no thread of the server's.
        wait_for(lambda: fed.status("agent-1"), 60, "the agent's status", fed)
        assert len(os.listdir(f"/proc/{server._proc.pid}/task")) == 1
        # Nothing of the server's descriptors: its control socket and the other channels.
        server_inodes = _open_files(server._proc.pid)
        daemon_inodes = _open_files(daemon.pid)
        shared = {i for i in server_inodes & daemon_inodes if i.startswith("socket:")}
        assert not shared, shared
        assert "DEBUG fedagent.agent: torch warmed up" in proc.log.read_text()

        os.killpg(daemon.pid, signal.SIGSTOP)
        wait_for(lambda: _state(daemon.pid) == "T", 10, "the agent stopped")
        assert daemon.poll() is None
        os.killpg(daemon.pid, signal.SIGCONT)
        wait_for(lambda: _state(daemon.pid) != "T", 10, "the agent running again")
        fed.stop(proc, signal.SIGKILL)
        assert daemon.returncode == -signal.SIGKILL
        fed.procs.remove(proc)

        # A config mistake: the daemon's own exit status, as Popen reports it.
        fed.config_path("agent-1").write_text("[agent\n")
        broken = fed.spawn("agent-1")
        assert broken.popen.wait(60) == EXIT_CONFIG
        fed.procs.remove(broken)

        # A variable that acts when an interpreter starts: a real process.
        monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
        real = fed.spawn("agent-1")
        assert isinstance(real.popen, subprocess.Popen), real.popen
        assert real.popen.wait(120) == EXIT_CONFIG
        fed.procs.remove(real)
    assert server.forked == 2
    assert server.fallbacks == [(["agent", "--config", str(fed.config_path("agent-1"))], ["MALLOC_ARENA_MAX"])]


@requires_netns
@pytest.mark.root
def test_a_daemon_started_from_another_network_namespace_is_a_real_process_there(tmp_path: Path, server) -> None:
    """The chaos soak enters a daemon's namespace on its own thread (setns) and starts
    it there: a child of the fork server would be in the server's namespace instead."""
    clone_newnet = 0x40000000
    started: dict[str, object] = {}
    with running(tmp_path / "fed", agents=1, rounds=1, alpha=1.0, start=False) as fed:
        fed.spawn("agent-1")  # from here: forked, and the server started
        assert server.forked == 1

        def elsewhere() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(clone_newnet) != 0:  # this thread only
                started["error"] = os.strerror(ctypes.get_errno())
                return
            started["proc"] = fed.spawn("agent-1")

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        assert "error" not in started, started
        isolated = started["proc"]
        assert isinstance(isolated.popen, subprocess.Popen), isolated.popen  # type: ignore[attr-defined]
    assert server.forked == 1
    assert server.fallbacks == [(["agent", "--config", str(fed.config_path("agent-1"))], ["network namespace"])]
