"""Process trees a benchmark starts, and ends again whatever happens.

Flower's deployment (SuperLink, SuperNodes, ``flwr run``) starts processes of its own —
a SuperExec, a ``flwr-serverapp`` per run, a ClientApp per message. The SuperExec calls
``setsid`` (seen with flwr 1.41: its session and group are its own, the serverapp in
it), so signalling the SuperLink's process group never reached them: they ended only if
Flower's own parent-PID polling noticed in time, and an interrupted benchmark once left a
``flwr-serverapp`` running. A :class:`ProcessTree` therefore finds its processes three
ways, each by PID:

* every command it starts leads a new session (its own process group);
* every command gets a marker in its environment (``FEDAGENT_BENCH_TREE=<token>``),
  which every descendant inherits unless it empties its environment — a process that
  calls ``setsid`` or is orphaned (re-parented to init) keeps it;
* the parent links under /proc, followed from the commands it started.

``close()`` (also on leaving a ``with`` block by an exception or KeyboardInterrupt)
finds them all, sends SIGTERM, waits, then SIGKILL to what is left. A PID is signalled
only while its /proc start time is the one recorded when it was found, so a PID reused by
an unrelated process in the meantime is never touched. Only the processes of this user
can be read, and only they are candidates.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

MARK = "FEDAGENT_BENCH_TREE"


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent PID, start time in clock ticks since boot) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie holds no resources; its parent reaps it
        return None
    return int(fields[1]), int(fields[19])


def _has_mark(pid: int, token: bytes) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return token in env.split(b"\0")


class ProcessTree:
    """Commands started with :meth:`spawn` and every process they start."""

    def __init__(self) -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._mark = f"{MARK}={self.token}".encode()
        self.roots: list[subprocess.Popen] = []
        self.known: dict[int, int] = {}  # PID -> start time, as found

    def spawn(self, cmd: list[str], **kw) -> subprocess.Popen:
        env = dict(kw.pop("env", None) or os.environ)
        env[MARK] = self.token
        p = subprocess.Popen(cmd, env=env, start_new_session=True, **kw)
        self.roots.append(p)
        st = _stat(p.pid)
        if st is not None:
            self.known[p.pid] = st[1]
        return p

    def sweep(self) -> dict[int, int]:
        """Record every live process of this tree (call it now and then while the tree
        runs: a process orphaned before it is seen is still found by its marker)."""
        me = os.getpid()
        table: dict[int, tuple[int, int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                pid = int(entry.name)
                st = _stat(pid)
                if st is not None and pid != me:
                    table[pid] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        found = {pid for pid in table if pid in self.known and table[pid][1] == self.known[pid]}
        found |= {pid for pid in table if _has_mark(pid, self._mark)}
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        for pid in found:
            self.known.setdefault(pid, table[pid][1])
        return {pid: self.known[pid] for pid in found if table[pid][1] == self.known[pid]}

    def alive(self) -> list[int]:
        """The tree's live processes, newly started ones included."""
        self._reap()
        return sorted(self.sweep())

    def _signal(self, sig: int) -> None:
        for pid, start in self.sweep().items():
            if (_stat(pid) or (0, -1))[1] == start:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        for p in self.roots:
            p.poll()

    def close(self, grace: float = 10.0) -> list[int]:
        """End the whole tree; returns the PIDs that needed SIGKILL."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        stubborn = self.alive()
        if stubborn:
            self._signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.alive() and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.05)
        for p in self.roots:
            try:
                p.wait(1)
            except subprocess.TimeoutExpired:
                pass
        return stubborn

    def __enter__(self) -> ProcessTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
