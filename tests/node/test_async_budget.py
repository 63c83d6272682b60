"""What one sender may cost an asynchronous federation's daemons before its frames are
checked: every kind an agent sends the coordinator has a budget of its own, a kind the
coordinator has no use for next to nothing, and an agent budgets its tasks."""

from __future__ import annotations

from fedagent.coordinator.fedbuff import OTHER, RATES
from fedagent.protocols.ratelimit import SenderBudget


def test_an_async_coordinator_budgets_each_kind_an_agent_sends_it():
    assert {"update", "heartbeat", "presence", "model_request", "evaluation"} <= set(RATES)
    b = SenderBudget(RATES, other=OTHER)
    # an update's frames: a stream of a few hundred chunks at once
    assert all(b.allow("a", "update", 0.0) == "" for _ in range(1000))
    # a kind it has no use for (here a task, which only the coordinator sends)
    drops = [b.allow("mallory", "async_task", 0.0) for _ in range(OTHER.burst + 1)]
    assert drops[-1] == "rate:other" and drops.count("") == OTHER.burst
    assert b.dropped == {"mallory": {"rate:other": 1}}


def test_an_agent_budgets_the_tasks_of_an_asynchronous_coordinator():
    b = SenderBudget()
    drops = [b.allow("coordinator", "async_task", 0.0) for _ in range(101)]
    assert drops[-1] == "rate:async_task" and drops.count("") == 100
    assert b.allow("coordinator", "async_task", 1.0) == ""  # 20 a second again
