"""A fork server for the daemons the tests start: one process imports torch and fedagent
once, and every daemon is a fork of it instead of a fresh interpreter.

Each ``python -m fedagent agent|coordinator|aggregator`` spent about 3 s of CPU importing
before its first log line, and an agent 1.3 s more when its first optimiser step imported
torch's compiler stack; the process tests start a few hundred daemons.
``fedfixtures`` installs :meth:`ForkServer.launch` as the federations' launcher
(``fedagent.local.launch.use``) for a test session; ``FEDAGENT_TEST_FORK_SERVER=0``
keeps real processes. Only tests use it: the product starts its daemons with Popen.

A forked daemon is what ``python -m fedagent ARGS`` would be, as far as the daemon can
tell: a session of its own (its PID names its process group), standard input from
/dev/null, standard output and error to the file given, no other descriptor, the
environment, working directory, ``sys.argv`` and ``sys.path`` (``PYTHONPATH`` included) of
the request, signal dispositions of a fresh interpreter, numpy's global generator seeded
anew; it ends with ``os._exit`` and the exit status Python would have given. What it
shares with its siblings: the modules already imported (so an environment variable
read at import time, none in fedagent, is read once) and the string hash seed. A request
whose environment differs from the server's in a variable that takes effect when an
interpreter or a native library starts (``PYTHON*``, ``LD_*``, ``MALLOC_*``, thread
counts, ...) gets a real process instead.

The server forks only while it has one thread (checked before every fork: a thread
holding a lock at fork time leaves that lock held for ever in the child). Signals go to
the daemon's own PID, which stays reserved until the test has seen the exit status: the
server keeps an exited daemon as a zombie (``waitid(WNOWAIT)``) until its
:class:`ForkedDaemon` has collected the status and closed its channel, as ``Popen``
does by reaping only in ``poll()`` and ``wait()``.

Protocol (Unix seqpacket sockets, JSON, no pickle): the client sends on the control
socket ``{"args", "env", "cwd"}`` with two descriptors (SCM_RIGHTS): its end of a fresh
per-daemon channel and the output file. The server answers on that channel ``P`` + PID
(or ``E`` + a reason), later ``X`` + the exit code (``Popen.returncode``'s convention:
-N for a signal), and reaps the daemon when the client closes the channel.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

#: Environment variables that take effect when an interpreter or a native library
#: starts: a request that sets them otherwise than the server gets a real process.
#: (``TORCH_``, not ``TORCH``: torch writes its derived ``TORCHINDUCTOR_CACHE_DIR`` into
#: the test session's environment once it has used its compiler, and reads it only then.)
STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "TORCH_", "CUDA")
#: Handled per request (``sys.path``; the server's streams are unbuffered already).
PER_REQUEST = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED"})
#: What the server imports before it forks anything: what a daemon imports on its way
#: to its first log line.
PRELOAD = (
    "torch",
    "fedagent.cli",
    "fedagent.agent.daemon",
    "fedagent.coordinator.daemon",
    "fedagent.tasks.digits",
    # A daemon's first optimiser step imports the compiler stack (another 1.3 s of CPU).
    "torch.optim",
    "torch._dynamo",
)
ENV_SWITCH = "FEDAGENT_TEST_FORK_SERVER"
MAX_REQUEST = 1 << 20


# -- client (the test session) --------------------------------------------------------


class ForkServerGone(ChildProcessError):
    pass


class ForkedDaemon:
    """A daemon forked by the server: the part of ``Popen`` the federations use."""

    def __init__(self, args: Sequence[str], channel: socket.socket) -> None:
        self.args = list(args)
        self._channel: socket.socket | None = channel
        self._lock = threading.Lock()
        self.returncode: int | None = None
        reply = channel.recv(4096)
        if reply[:1] != b"P":
            channel.close()
            raise ForkServerGone(f"the fork server did not start {self.args}: {reply[1:].decode(errors='replace')}")
        (self.pid,) = struct.unpack("!i", reply[1:5])

    def __repr__(self) -> str:
        return f"<ForkedDaemon pid={self.pid} returncode={self.returncode} args={self.args}>"

    def _collect(self, timeout: float | None) -> int | None:
        # The lock keeps two threads from both reading the one status message; a poll()
        # meanwhile answers from what is known (as Popen's does while another waits).
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            return self.returncode
        try:
            if self.returncode is not None or self._channel is None:
                return self.returncode
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready, _, _ = select.select([self._channel], [], [], left)
            if not ready:
                return None
            message = self._channel.recv(64)
            if message[:1] != b"X":
                raise ForkServerGone(f"the fork server went away while {self.args} (pid {self.pid}) ran")
            (self.returncode,) = struct.unpack("!i", message[1:5])
            # Closing the channel lets the server reap the daemon: only now may its PID
            # go to another process.
            self._channel.close()
            self._channel = None
            return self.returncode
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # exited and not yet collected: as Popen.send_signal

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def startup_differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The variables, among those that act at process start, set otherwise in a and b."""
    keys = {k for k in (*a, *b) if k.startswith(STARTUP_PREFIXES) and k not in PER_REQUEST}
    return sorted(k for k in keys if a.get(k) != b.get(k))


def _customizes_startup(pythonpath: str) -> bool:
    return any(
        (Path(d) / name).exists()
        for d in pythonpath.split(os.pathsep)
        if d
        for name in ("sitecustomize.py", "usercustomize.py")
    )


class ForkServer:
    """The client side, started on first use; :meth:`launch` is a ``launch.Launcher``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        # The session's environment as it began: not whatever the test that happens to
        # start the first daemon has set meanwhile.
        self._session_env = dict(os.environ)
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}
        self._netns = 0
        self.forked = 0
        self.fallbacks: list[tuple[list[str], list[str]]] = []

    def _start(self) -> socket.socket:
        if self._control is not None:
            return self._control
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in self._session_env.items() if k != "PYTHONPATH"}
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NOTIFY_SOCKET", None)
        with self.log.open("ab") as out:
            # -P: no script directory on sys.path (each daemon gets the path its request
            # implies); a session of its own, so a Ctrl-C meant for pytest stops pytest,
            # which then stops the daemons and closes the control socket.
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-u", __file__, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        theirs.close()
        ready, _, _ = select.select([ours], [], [], 300)
        hello = ours.recv(4096) if ready else b""
        if hello != b"ready":
            ours.close()
            self._stop_process()
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise ForkServerGone(f"the fork server did not start ({hello!r}); its log:\n{tail}")
        self._env = env
        self._netns = _netns()  # the server's: it was started from this thread
        self._control = ours
        return ours

    def launch(self, args: Sequence[str], out: IO[bytes], env: Mapping[str, str]):
        from fedagent.local import launch

        with self._lock:
            control = self._start()
            differs = startup_differences(env, self._env)
            if _netns() != self._netns:
                # The caller entered a network namespace for this daemon (the chaos soak
                # does, with setns on its thread): a child of the server would not be in it.
                differs.append("network namespace")
            if differs or _customizes_startup(env.get("PYTHONPATH", "")):
                self.fallbacks.append((list(args), differs))
                return launch.popen(args, out, env)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                request = json.dumps({"args": list(args), "env": dict(env), "cwd": os.getcwd()}).encode()
                socket.send_fds(control, [request], [theirs.fileno(), out.fileno()])
            finally:
                theirs.close()
            self.forked += 1
        return ForkedDaemon(args, ours)

    def _stop_process(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """End the server (it exits when its control socket closes). Daemons still
        running are left to whoever started them (the federations stop theirs)."""
        with self._lock:
            if self._control is not None:
                self._control.close()
                self._control = None
            self._stop_process()

    def summary(self) -> str:
        fell_back = "; ".join(f"{' '.join(args)} ({', '.join(why) or 'sitecustomize'})" for args, why in self.fallbacks)
        return f"{self.forked} daemons forked by the fork server, {len(self.fallbacks)} started as processes" + (
            f": {fell_back}" if fell_back else ""
        )


# -- server -----------------------------------------------------------------------------


def _netns() -> int:
    """The network namespace of the calling thread (the inode of its ns/net link)."""
    return os.stat("/proc/thread-self/ns/net").st_ino


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _stop_blas_threads() -> None:
    """Join OpenBLAS's worker threads (numpy's import starts them), as OpenBLAS's own
    fork handler does: a daemon's first BLAS call starts its pool again."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for path in libraries:
        shutdown = getattr(ctypes.CDLL(path), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


def _exit_code(status: os.waitid_result) -> int:
    if status.si_code == os.CLD_EXITED:
        return status.si_status
    return -status.si_status  # killed or dumped: Popen's -N


class _Server:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        # pid -> its channel (None once the client closed it); pid -> exit code, for a
        # daemon that exited and waits as a zombie for its client to close the channel.
        self.channels: dict[int, socket.socket | None] = {}
        self.exited: dict[int, int] = {}

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.control.send(b"ready")
        while True:
            watched: list[object] = [self.control, self.wake_r]
            watched += [ch for ch in self.channels.values() if ch is not None]
            ready, _, _ = select.select(watched, [], [])
            if self.wake_r in ready:
                while True:
                    try:
                        if not os.read(self.wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            self._check_children()
            for ch in ready:
                if ch is self.control:
                    if not self._request():
                        return
                elif isinstance(ch, socket.socket):
                    self._channel_closed(ch)

    def _check_children(self) -> None:
        for pid in list(self.channels):
            if pid in self.exited:
                continue
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if status is None or status.si_pid == 0:
                continue
            code = self.exited[pid] = _exit_code(status)
            channel = self.channels[pid]
            if channel is None:
                self._reap(pid)
                continue
            try:
                channel.send(b"X" + struct.pack("!i", code))
            except OSError:
                self._channel_closed(channel)

    def _channel_closed(self, channel: socket.socket) -> None:
        pid = next((p for p, ch in self.channels.items() if ch is channel), None)
        if pid is None:
            return  # already closed in this turn of the loop (a failed send)
        channel.close()
        self.channels[pid] = None
        if pid in self.exited:
            self._reap(pid)

    def _reap(self, pid: int) -> None:
        os.waitpid(pid, 0)
        del self.channels[pid]
        del self.exited[pid]

    def _request(self) -> bool:
        try:
            message, fds, _flags, _addr = socket.recv_fds(self.control, MAX_REQUEST, 2)
        except OSError:
            return False
        if not message:
            return False  # the test session ended
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return True
        channel = socket.socket(fileno=fds[0])
        out = fds[1]
        try:
            request = json.loads(message)
            args = [str(a) for a in request["args"]]
            env = {str(k): str(v) for k, v in request["env"].items()}
            cwd = str(request["cwd"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            channel.send(b"E" + f"a malformed request: {exc}".encode())
            channel.close()
            os.close(out)
            return True
        _stop_blas_threads()
        threads = _threads()
        if threads != 1:
            channel.send(b"E" + f"the fork server has {threads} threads: it forks only with one".encode())
            channel.close()
            os.close(out)
            return True
        sys.stdout.flush()
        sys.stderr.flush()
        # The daemon closes its end of this pipe once it has its session and its
        # descriptors: only then does the client get its PID (Popen too returns only
        # after the exec), so a signal to the PID's group at once reaches the daemon.
        settled, settling = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(settled)
            os.close(settling)
            channel.send(b"E" + f"fork failed: {exc}".encode())
            channel.close()
            os.close(out)
            return True
        if pid == 0:
            self._become_daemon(args, env, cwd, out, channel)  # never returns
        os.close(settling)
        os.read(settled, 1)
        os.close(settled)
        os.close(out)
        self.channels[pid] = channel
        channel.send(b"P" + struct.pack("!i", pid))
        return True

    def _become_daemon(self, args: list[str], env: dict[str, str], cwd: str, out: int, channel: socket.socket) -> None:
        code = 1
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # The descriptors of the server: detached from their Python objects first, so
            # that no object closes a number the daemon has since reused.
            self.control.detach()
            channel.detach()
            for ch in self.channels.values():
                if ch is not None:
                    ch.detach()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            _fresh_interpreter_state(args, env, cwd)
            from fedagent.cli import main

            main(args=args, prog_name="python -m fedagent")
            code = 0
        except SystemExit as exc:
            code = _system_exit_code(exc)
        except KeyboardInterrupt:
            # As an interpreter ends on an unhandled Ctrl-C: killed by SIGINT.
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def _system_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _fresh_interpreter_state(args: list[str], env: dict[str, str], cwd: str) -> None:
    """What ``python -m fedagent ARGS`` would have set up differently from the server."""
    import importlib
    import importlib.util

    entry = importlib.util.find_spec("fedagent.__main__")
    sys.argv = [str(entry.origin if entry else "-m"), *args]  # -m's sys.argv[0]: the module's file
    # -m puts the working directory first, then PYTHONPATH, then the installation's path.
    extra = [cwd, *(d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d)]
    sys.path[:0] = extra
    importlib.invalidate_caches()
    # A fresh interpreter's numpy seeds its global generator from the OS; the server's
    # would give every daemon the same draws. (random reseeds itself after a fork.)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # The dispositions and the mask the server's interpreter started with: those of a
    # fresh interpreter started by the same parent (Ctrl-C raises, SIGPIPE and SIGXFSZ
    # ignored, a signal ignored by the parent stays ignored).
    for signum, handler in STARTUP_SIGNALS.items():
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, STARTUP_MASK)


STARTUP_SIGNALS: dict[int, object] = {}
STARTUP_MASK: set[int] = set()


def main(control_fd: int) -> None:
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if handler is not None and signum not in (signal.SIGKILL, signal.SIGSTOP):
            STARTUP_SIGNALS[signum] = handler
    STARTUP_MASK.update(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    control = socket.socket(fileno=control_fd)
    for name in PRELOAD:
        __import__(name)
    _stop_blas_threads()
    threads = _threads()
    if threads != 1:
        control.send(b"E" + f"{threads} threads after the imports".encode())
        print(f"fork server: {threads} threads after importing {PRELOAD}; it forks only with one", file=sys.stderr)
        raise SystemExit(1)
    _Server(control).serve()


if __name__ == "__main__":
    main(int(sys.argv[1]))
