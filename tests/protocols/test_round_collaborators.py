"""The round machine's collaborators on their own: the server step (the global model's
move, its velocity, the int8 downlink) and the privacy budget (charging, the stop, the
agents' noise shares). The machine's traces are in test_rounds.py, test_dp.py and
test_server_*.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedagent.protocols import dp
from fedagent.protocols.downlink import rebuild
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import PrivacyBudget, ServerStep
from fedagent.protocols.serveropt import MemoryVelocity

X = {"w": np.array([1.0, 2.0, 3.0], np.float32), "n": np.array([4], np.int64)}
A = {"w": np.array([2.0, 2.0, 1.0], np.float32), "n": np.array([5], np.int64)}


def step(**kw) -> ServerStep:
    return ServerStep(X, **{"server_lr": 1.0, "momentum": 0.0, "downlink": "none", **kw})


def test_without_momentum_the_model_moves_by_server_lr_times_the_step() -> None:
    s = step(server_lr=0.5)
    new, velocity = s.propose(X, A, 0)
    np.testing.assert_allclose(new["w"], [1.5, 2.0, 2.0])
    assert new["n"][0] == 5  # counters are the aggregate's
    assert s.adopt(X, new, velocity, 0) is new and s.velocity == {} and s.delta is None


def test_momentum_velocity_is_taken_only_when_the_step_is_adopted() -> None:
    s = step(momentum=0.5)
    new, velocity = s.propose(X, A, 0)
    assert s.velocity == {}  # proposed, not adopted
    s.adopt(X, new, velocity, 0)
    np.testing.assert_allclose(s.velocity["w"], [1.0, 0.0, -2.0])
    new2, v2 = s.propose(new, A, 1)
    np.testing.assert_allclose(v2["w"], 0.5 * s.velocity["w"] + (A["w"] - new["w"]))


def test_a_store_keeps_the_velocity_of_adopted_steps_only() -> None:
    store = MemoryVelocity()
    s = step(momentum=0.5, store=store)
    new, velocity = s.propose(X, A, 0)
    assert velocity == {} and store.model_version is None
    s.drop()  # the aggregate was refused
    assert store.current == {}
    new, velocity = s.propose(X, A, 0)
    s.adopt(X, new, velocity, 0)
    assert store.model_version == 1
    np.testing.assert_allclose(store.current["w"], [1.0, 0.0, -2.0])
    with pytest.raises(ValueError, match="both in memory and in a store"):
        step(momentum=0.5, store=store, velocity={"w": np.zeros(3, np.float32)})


def test_with_the_int8_downlink_the_model_is_what_agents_rebuild_from_its_step() -> None:
    s = step(downlink="int8")
    new, velocity = s.propose(X, A, 3)
    adopted = s.adopt(X, new, velocity, 3)
    assert s.delta is not None and s.delta.base_version == 3
    back = rebuild(X, s.delta)
    for k in X:
        np.testing.assert_array_equal(back[k], adopted[k])


def budget(**kw) -> PrivacyBudget:
    return PrivacyBudget(dp.DPConfig(**kw), None, np.random.default_rng(0))


def test_a_budget_charges_each_release_and_stops_before_passing_its_budget() -> None:
    b = budget(noise_multiplier=1.0, epsilon_budget=5.0)
    assert b.over_budget(10, 1.0) == ""
    b.charge(10, 10, 1.0)
    assert b.accountant.releases == [dp.Release(1.0, (1.0,))]
    while not b.over_budget(10, 1.0):
        b.charge(10, 10, 1.0)
    assert "privacy budget reached" in b.over_budget(10, 1.0)
    assert b.accountant.epsilon <= 5.0
    again = PrivacyBudget(b.config, b.state(), np.random.default_rng(0))
    assert again.accountant.epsilon == pytest.approx(b.accountant.epsilon)
    assert again.report()["releases"] == len(b.accountant.releases)


def test_under_distributed_dp_fewer_answers_carry_less_noise_and_each_agent_adds_its_share() -> None:
    b = budget(mode="distributed", noise_multiplier=2.0, clip_norm=0.5)
    assert b.release(4, 1, 1.0) == dp.Release(1.0, (2.0 * math.sqrt(1 / 4),))
    train = b.train(TrainConfig(stream=False), 4)
    assert train.dp_clip == 0.5 and train.dp_noise_std == pytest.approx(2.0 * 0.5 / 2)
    assert budget().train(TrainConfig(), 4) == TrainConfig()  # central: the coordinator noises the sum
