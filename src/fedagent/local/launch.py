"""How the in-machine federations start a daemon: ``python -m fedagent <command> --config
<file>`` in a session of its own, its output and errors in one log file.

:func:`start` is the one place :class:`~fedagent.local.federation.Federation` and
:class:`~fedagent.local.tiers.TieredFederation` start a daemon. The test suite swaps in,
with :func:`use`, a fork server that has imported torch and fedagent once and forks each
daemon from there (tests/forkserver.py), because a few hundred interpreter starts that
each import torch again were a large part of the suite's CPU. Nothing else swaps it:
``fedagent demo``, the experiments, the benchmarks and systemd start real processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol


class DaemonProcess(Protocol):
    """What the federations and their tests use of a started daemon: the part of
    ``subprocess.Popen`` that a process forked by someone else can offer too."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


#: ``launcher(args, out, env)``: start ``fedagent *args`` with ``env``, its standard output
#: and error to ``out``, in a new session (its PID is its process group's ID).
Launcher = Callable[[Sequence[str], IO[bytes], Mapping[str, str]], DaemonProcess]


def popen(args: Sequence[str], out: IO[bytes], env: Mapping[str, str]) -> DaemonProcess:
    # A session of its own: Ctrl-C in a demo's terminal reaches only the demo, which then
    # stops the daemons in order; and the daemon's process group holds it and whatever it
    # starts, nothing else (the federations signal the group).
    return subprocess.Popen(
        [sys.executable, "-m", "fedagent", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,
    )


_launcher: Launcher = popen


def start(args: Sequence[str], out: IO[bytes], env: Mapping[str, str]) -> DaemonProcess:
    """Start the daemon ``fedagent *args`` (see :data:`Launcher`)."""
    return _launcher(args, out, env)


def use(launcher: Launcher) -> Launcher:
    """Start daemons with ``launcher`` from now on; returns the one it replaces."""
    global _launcher
    previous, _launcher = _launcher, launcher
    return previous
