"""A stop signal that arrives while a child process is being started waits until the
block that starts and records the child has ended, then takes effect once."""

from __future__ import annotations

import os
import signal

import pytest

from fedagent.stopsignals import child_starting, deferring


class Stop(BaseException):
    pass


@pytest.fixture
def usr1_raises_stop():
    seen: list[int] = []

    def handler(signum, frame):
        seen.append(signum)
        raise Stop

    previous = signal.signal(signal.SIGUSR1, deferring(handler))
    yield seen
    signal.signal(signal.SIGUSR1, previous)


def test_outside_a_start_the_handler_runs_at_once(usr1_raises_stop):
    with pytest.raises(Stop):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1_raises_stop == [signal.SIGUSR1]


def test_inside_a_start_the_signal_waits_for_the_block_to_end(usr1_raises_stop):
    recorded = []
    with pytest.raises(Stop):
        with child_starting():
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            recorded.append("child")  # the caller records its child before the signal acts
            assert usr1_raises_stop == []
    assert recorded == ["child"]
    assert usr1_raises_stop == [signal.SIGUSR1], "raised once, after the block"


def test_nested_starts_wait_for_the_outermost(usr1_raises_stop):
    with pytest.raises(Stop):
        with child_starting():
            with child_starting():
                os.kill(os.getpid(), signal.SIGUSR1)
            assert usr1_raises_stop == []
    assert usr1_raises_stop == [signal.SIGUSR1]
    with child_starting():
        pass
    assert usr1_raises_stop == [signal.SIGUSR1], "nothing left pending"
