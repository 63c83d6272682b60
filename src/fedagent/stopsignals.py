"""Stop signals that wait until a started child process has been recorded.

A stop signal whose handler raises (SIGTERM turned into an exception, Ctrl-C's
KeyboardInterrupt) can arrive while ``subprocess.Popen`` waits for its child's ``exec``.
``Popen`` then raises with the child already running, and nobody holds its PID to stop
it: a daemon outlives the demo or experiment that started it. Handlers wrapped by
:func:`deferring` note a signal that arrives inside :func:`child_starting` and raise it
again as the block ends, once the caller has recorded its child."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

_depth = 0
_pending: int | None = None


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
