"""The slowed task (a slower device for demos and benchmarks): how long a training waits,
and what its options accept. The clock is replaced, so nothing sleeps."""

from __future__ import annotations

import types

import pytest

from fedagent.errors import ConfigError
from fedagent.tasks import slowed


class Clock:
    def __init__(self, took: float) -> None:
        self.now, self.took, self.slept = 0.0, took, 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept += s


@pytest.mark.parametrize(
    ("took", "slowdown", "at_least", "waits"),
    [
        (0.2, 5.0, 0.0, 0.8),  # four times as long as it took
        (0.2, 1.0, 1.0, 0.8),  # up to the device's second
        (0.2, 5.0, 1.0, 4.8),  # the device's second, five times
        (2.0, 1.0, 1.0, 0.0),  # longer than the floor already
    ],
)
def test_a_training_waits_slowdown_times_the_longer_of_its_time_and_the_floor(
    monkeypatch, took, slowdown, at_least, waits
):
    clock = Clock(took)
    monkeypatch.setattr(slowed, "time", clock)
    inner = types.SimpleNamespace(uses_torch_optimiser=True)
    task = slowed.SlowedTask(inner, slowdown=slowdown, at_least=at_least)  # type: ignore[arg-type]
    clock.now = took
    task._slowly(0.0)
    assert clock.slept == pytest.approx(waits)


@pytest.mark.parametrize("opts", [{"slowdown": 0.5}, {"at_least": -1}, {"at_least": True}, {"inner": ""}])
def test_options_out_of_range_are_refused(opts):
    with pytest.raises(ConfigError):
        slowed.make(opts)


def test_the_inner_task_is_built_with_its_own_options():
    t = slowed.make({"inner": "digits", "slowdown": 2, "at_least": 0.5, "shard": 0, "shards": 4, "seed": 0})
    assert (t.slowdown, t.at_least) == (2.0, 0.5) and t.num_samples() > 0
