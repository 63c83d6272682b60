"""The chaos soak's clock jumps (bench/chaos.py), for a daemon started with
``FEDAGENT_CHAOS_CLOCK`` naming a file: ``time.time()`` and ``time.time_ns()`` return
the real wall clock plus the offset in seconds that file holds, read again at most once
a second. The monotonic clocks are left alone, as a wall-clock step leaves them.

Python-level on purpose: libfaketime (tests/faults/test_faults_clock.py) intercepts
``pthread_cond_timedwait`` too, which holds up the hand-over of Python's GIL: a daemon
with worker threads ran 3-6 times slower under it, and the faked daemon became the
soak's bottleneck. What this leaves out: clocks read in C (OpenSSL's certificate
checks, ``datetime.now()``)."""

import os
import time

_path = os.environ.pop("FEDAGENT_CHAOS_CLOCK", "")
if _path:
    _real_time, _real_time_ns, _monotonic = time.time, time.time_ns, time.monotonic
    _state = {"offset": 0.0, "read_at": -1.0}

    def _offset() -> float:
        now = _monotonic()
        if now - _state["read_at"] >= 1.0:
            _state["read_at"] = now
            try:
                with open(_path) as f:
                    _state["offset"] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return _state["offset"]

    def _time() -> float:
        return _real_time() + _offset()

    def _time_ns() -> int:
        return _real_time_ns() + int(_offset() * 1e9)

    time.time = _time
    time.time_ns = _time_ns
