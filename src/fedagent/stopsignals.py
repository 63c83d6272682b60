"""Stop signals as an exception that unwinds the process, and held back while a child
process is being started.

SIGTERM (systemd, ``timeout``, ``kill``) and SIGHUP (the terminal went away) otherwise
end a Python process without running a single ``finally``: the daemons a demo or an
experiment started (each in a session of its own) would be left running and its work
directory left behind. Inside :func:`stop_signals` they, and Ctrl-C, raise
:class:`StopSignal`, a :class:`SystemExit` with status 128 + the signal's number (the
shell's convention: 130, 143, 129).

A stop signal whose handler raises can also arrive while ``subprocess.Popen`` waits for
its child's ``exec``. ``Popen`` then raises with the child already running, and nobody
holds its PID to stop it: a daemon outlives the demo or experiment that started it.
Handlers wrapped by :func:`deferring` (as :func:`stop_signals` wraps them) note a signal
that arrives inside :func:`child_starting` and raise it again as the block ends, once the
caller has recorded its child."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

Handler = Callable[[int, FrameType | None], Any]

#: Ctrl-C, a request to terminate, the terminal going away.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0
_pending: int | None = None


class StopSignal(SystemExit):
    """A stop signal asked the process to end. A :class:`SystemExit` (so no ``except
    Exception`` on the way swallows it) whose status is 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def raise_stop_signal(signum: int, frame: FrameType | None) -> NoReturn:
    raise StopSignal(signum)


@contextmanager
def stop_signals(handler: Handler | int = raise_stop_signal) -> Iterator[None]:
    """``handler`` for every stop signal inside the block (a function handler
    :func:`deferring`), the previous handlers after it. ``signal.SIG_IGN`` keeps a
    clean-up from being cut short by a second signal.

    A signal ignored by whoever started us (``nohup``, a job started in the background)
    stays ignored. Only the main thread may set handlers; elsewhere (a test calling a demo
    from a thread) the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wrapped = deferring(handler) if callable(handler) else handler
    previous: dict[signal.Signals, Any] = {}
    try:
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, wrapped)
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def deferring(handler: Handler) -> Handler:
    """``handler``, except that inside :func:`child_starting` the signal waits for the
    block's end."""

    def wrapped(signum: int, frame: FrameType | None) -> Any:
        global _pending
        if _depth:
            if _pending is None:
                _pending = signum
            return None
        return handler(signum, frame)

    return wrapped


@contextmanager
def child_starting() -> Iterator[None]:
    """Start a child process and record it inside this block: a stop signal handled by a
    :func:`deferring` handler is raised again when the block ends (the first one, once)."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            signal.raise_signal(signum)
