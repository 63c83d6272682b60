"""Inside ``stop_signals`` a stop signal raises StopSignal (exit status 128 + its number)
and an ignored one stays ignored; a stop signal that arrives while a child process is
being started waits until the block that starts and records the child has ended, then
takes effect once."""

from __future__ import annotations

import os
import signal

import pytest

from fedagent.stopsignals import StopSignal, child_starting, deferring, stop_signals


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


@pytest.fixture
def stop_signals_restored():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_unwinds_with_its_exit_status_and_the_handlers_come_back(stop_signals_restored, sig):
    signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    before = signal.getsignal(sig)
    unwound = []
    with pytest.raises(StopSignal) as raised:
        with stop_signals():
            try:
                os.kill(os.getpid(), sig)
            finally:
                unwound.append(sig)
    assert unwound == [sig] and raised.value.signum == sig and raised.value.code == 128 + sig
    assert isinstance(raised.value, SystemExit) and not isinstance(raised.value, Exception)
    assert signal.getsignal(sig) is before


def test_a_signal_ignored_by_whoever_started_us_stays_ignored(stop_signals_restored):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with stop_signals():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_a_stop_signal_waits_for_a_child_being_started(stop_signals_restored):
    recorded = []
    with pytest.raises(StopSignal):
        with stop_signals(), child_starting():
            os.kill(os.getpid(), signal.SIGTERM)
            recorded.append("child")
    assert recorded == ["child"]
