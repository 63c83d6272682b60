"""Server momentum (``[rounds] server_momentum``, FedAvgM): the pure step against its
formula, the round machine applying it and resuming it, and the configuration."""

from __future__ import annotations

import numpy as np
import pytest
from configs import coordinator_config

from fedagent.errors import ConfigError
from fedagent.protocols.aggregation import server_step
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.rounds import (
    AgentOnline,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)
from fedagent.protocols.serveropt import DEFAULT_MOMENTUM, check_momentum, check_velocity, momentum_step

W0 = {"w": np.zeros((2, 3), np.float32), "n": np.array(4, np.int64)}


def test_momentum_step_follows_the_formula_over_rounds():
    """v₁ = Δ₁, v_t = β·v_{t−1} + Δ_t, x_{t+1} = x_t + η·v_t, with Δ_t = a_t − x_t:
    the step's chain over six rounds against the sums written out."""
    rng = np.random.default_rng(1)
    beta, lr = 0.7, 1.5
    x = {"w": rng.normal(size=(3, 4))}  # float64: the formula's own precision
    vel: dict[str, np.ndarray] = {}
    xs, deltas = [x["w"].copy()], []
    for _ in range(6):
        agg = {"w": x["w"] + rng.normal(scale=0.1, size=(3, 4))}
        deltas.append(agg["w"] - x["w"])
        x, vel = momentum_step(x, agg, vel, lr=lr, beta=beta)
        xs.append(x["w"])
    for t in range(1, 7):
        v_t = sum(beta ** (t - k) * deltas[k - 1] for k in range(1, t + 1))
        np.testing.assert_allclose(xs[t], xs[t - 1] + lr * v_t, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(vel["w"], sum(beta ** (6 - k) * deltas[k - 1] for k in range(1, 7)), rtol=1e-12)


def test_momentum_step_keeps_dtypes_counters_and_its_inputs():
    ref = {"w": np.full((2, 3), 1.0, np.float32), "n": np.array(4, np.int64)}
    agg = {"w": np.full((2, 3), 1.5, np.float32), "n": np.array(7, np.int64)}
    old = {"w": np.full((2, 3), 0.25, np.float32)}
    out, vel = momentum_step(ref, agg, old, lr=1.0, beta=0.5)
    np.testing.assert_allclose(vel["w"], 0.5 * 0.25 + 0.5)
    np.testing.assert_allclose(out["w"], 1.0 + 0.625)
    assert out["w"].dtype == np.float32 and vel["w"].dtype == np.float32
    assert int(out["n"]) == 7 and "n" not in vel  # a counter is the aggregate's, without velocity
    # nothing the caller holds is changed: a refused round keeps the old model and velocity
    np.testing.assert_array_equal(ref["w"], 1.0)
    np.testing.assert_array_equal(old["w"], 0.25)
    # β = 0 is the plain server step, with no velocity to keep
    plain, none = momentum_step(ref, agg, {}, lr=2.0, beta=0.0)
    np.testing.assert_array_equal(plain["w"], server_step(ref, agg, 2.0)["w"])
    assert none == {}


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True])
def test_a_meaningless_momentum_is_refused(bad):
    with pytest.raises(ValueError, match="server_momentum"):
        check_momentum(bad)
    with pytest.raises(ValueError, match="server_momentum"):
        RoundConfig(server_momentum=bad)


def test_a_velocity_that_does_not_fit_the_model_is_refused():
    check_velocity(W0, {"w": np.zeros((2, 3), np.float32)})
    for bad, what in [
        ({"x": np.zeros((2, 3), np.float32)}, "no floating tensor"),
        ({"n": np.zeros((), np.int64)}, "no floating tensor"),
        ({"w": np.zeros((3, 2), np.float32)}, "float32"),
        ({"w": np.zeros((2, 3), np.float64)}, "float64"),
        ({"w": np.full((2, 3), np.nan, np.float32)}, "not finite"),
    ]:
        with pytest.raises(ValueError, match=what):
            check_velocity(W0, bad)
        with pytest.raises(ValueError, match=what):
            RoundMachine(RoundConfig(server_momentum=0.9), W0, velocity=bad)


def _machine(**kw) -> RoundMachine:
    return RoundMachine(RoundConfig(rounds=4, min_agents=2, expected_agents=2, server_momentum=0.5, **kw), W0)


def _round(m: RoundMachine, values: tuple[float, float], now: float) -> RoundAggregated:
    if m.round == 0 or not m.selected:
        for a in ("a", "b"):
            m.handle(AgentOnline(a, 10), now)
    r, v = m.round, m.model_version
    m.handle(UpdateReceived("a", r, v, 10, {"w": np.full((2, 3), values[0], np.float32), "n": W0["n"]}, {}), now)
    cmds = m.handle(UpdateReceived("b", r, v, 30, {"w": np.full((2, 3), values[1], np.float32), "n": W0["n"]}, {}), now)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    return agg


def test_round_machine_applies_momentum_and_reports_the_velocity():
    m = _machine()
    a1 = _round(m, (1.0, 3.0), 1.0)  # mean 2.5 from 0: Δ = 2.5, v = 2.5
    np.testing.assert_allclose(a1.weights["w"], 2.5)
    np.testing.assert_allclose(a1.velocity["w"], 2.5)
    a2 = _round(m, (3.0, 3.0), 2.0)  # mean 3 from 2.5: Δ = 0.5, v = 1.25 + 0.5
    np.testing.assert_allclose(a2.velocity["w"], 1.75)
    np.testing.assert_allclose(a2.weights["w"], 4.25)
    assert "n" not in a2.velocity and int(a2.weights["n"]) == 4


def test_a_resumed_machine_continues_with_the_saved_velocity():
    """A machine rebuilt from round 2's model and velocity (what the coordinator's
    checkpoint holds) makes round 3's model exactly as the one that ran on."""
    ran = _machine()
    _round(ran, (1.0, 3.0), 1.0)
    saved = _round(ran, (3.0, 2.0), 2.0)
    third = _round(ran, (5.0, 4.0), 3.0)

    def resume(**velocity) -> RoundMachine:
        return RoundMachine(
            RoundConfig(rounds=4, min_agents=2, expected_agents=2, server_momentum=0.5),
            saved.weights,
            model_version=saved.model_version,
            completed_rounds=2,
            last_round=saved.round,
            **velocity,
        )

    again = _round(resume(velocity=saved.velocity), (5.0, 4.0), 10.0)
    np.testing.assert_array_equal(again.weights["w"], third.weights["w"])
    np.testing.assert_array_equal(again.velocity["w"], third.velocity["w"])
    # without the velocity the step differs: the test above can fail
    assert not np.array_equal(_round(resume(), (5.0, 4.0), 10.0).weights["w"], third.weights["w"])


def test_a_velocity_is_ignored_without_momentum():
    m = RoundMachine(
        RoundConfig(rounds=2, min_agents=2, expected_agents=2, server_momentum=0),
        W0,
        velocity={"w": np.ones((2, 3), np.float32)},
    )
    agg = _round(m, (1.0, 3.0), 1.0)
    np.testing.assert_allclose(agg.weights["w"], 2.5)  # plain FedAvg
    assert agg.velocity == {}


def test_a_refused_aggregate_keeps_model_and_velocity():
    """An aggregate that overflows is not adopted: neither is the velocity made from it."""
    m = _machine()
    _round(m, (1.0, 3.0), 1.0)
    before = dict(m.velocity)
    r, v = m.round, m.model_version
    big = np.full((2, 3), 3e38, np.float32)
    m.handle(UpdateReceived("a", r, v, 10, {"w": big, "n": W0["n"]}, {}), 2.0)
    cmds = m.handle(UpdateReceived("b", r, v, 30, {"w": big, "n": W0["n"]}, {}), 2.0)
    assert not [c for c in cmds if isinstance(c, RoundAggregated)]
    assert m.model_version == 1
    np.testing.assert_array_equal(m.velocity["w"], before["w"])
    np.testing.assert_allclose(m.weights["w"], 2.5)


def test_coordinator_config_reaches_the_round_machine(tmp_path):
    from fedagent.coordinator.fedavg import round_config

    rc = round_config(coordinator_config(tmp_path, {"rounds": 4, "server_momentum": 0.9, "server_lr": 0.5}))
    assert rc.momentum == 0.9 and rc.server_lr == 0.5
    with pytest.raises(ConfigError, match="server_momentum"):
        round_config(coordinator_config(tmp_path, {"rounds": 4, "server_momentum": 1.0}))


def test_momentum_is_on_by_default_and_zero_turns_it_off(tmp_path):
    """One default for the config file and the round machine; 0 is plain FedAvg."""
    from fedagent.coordinator.fedavg import round_config

    assert DEFAULT_MOMENTUM == 0.7
    assert RoundConfig().momentum == DEFAULT_MOMENTUM
    # The same default for a library caller that builds the round configuration itself.
    private = DPConfig(noise_multiplier=1.0, clip_norm=0.5)
    assert RoundConfig(dp=private).momentum == 0
    assert RoundConfig(dp=private, server_momentum=0.5).momentum == 0.5
    assert RoundConfig(server_momentum=0).momentum == 0
    assert round_config(coordinator_config(tmp_path, {"rounds": 4})).momentum == DEFAULT_MOMENTUM
    assert round_config(coordinator_config(tmp_path, {"rounds": 4, "server_momentum": 0})).momentum == 0
    # Differentially private rounds default to none (the velocity would sum the noise),
    # central or distributed; set explicitly, momentum applies to them too.
    for mode in ("central", "distributed"):
        privacy = {"mode": mode, "noise_multiplier": 1.0}
        assert round_config(coordinator_config(tmp_path, {"rounds": 4}, privacy=privacy)).momentum == 0
        explicit = coordinator_config(tmp_path, {"rounds": 4, "server_momentum": 0.5}, privacy=privacy)
        assert round_config(explicit).momentum == 0.5
    # Round 2 of the default moves the model further than plain FedAvg's (the velocity
    # carries round 1's step), and ``server_momentum = 0`` is plain FedAvg.
    default = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=2), W0)
    plain = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=2, server_momentum=0), W0)
    for m in (default, plain):
        _round(m, (1.0, 3.0), 1.0)
    np.testing.assert_allclose(_round(plain, (3.0, 5.0), 2.0).weights["w"], 4.5)
    np.testing.assert_allclose(_round(default, (3.0, 5.0), 2.0).weights["w"], 4.5 + 0.7 * 2.5)


def test_start_round_carries_the_moved_model():
    m = _machine()
    cmds = []
    for a in ("a", "b"):
        cmds += m.handle(AgentOnline(a, 10), 0.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    r, v = start.round, start.model_version
    m.handle(UpdateReceived("a", r, v, 10, {"w": np.full((2, 3), 1.0, np.float32), "n": W0["n"]}, {}), 1.0)
    cmds = m.handle(UpdateReceived("b", r, v, 30, {"w": np.full((2, 3), 3.0, np.float32), "n": W0["n"]}, {}), 1.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    np.testing.assert_allclose(start.weights["w"], 2.5)


@pytest.mark.parametrize(
    ("step", "text"),
    [
        ({"lr": 1.0, "momentum": 0.7, "default": True}, "momentum 0.7 (default)"),
        (
            {"lr": 1.0, "momentum": 0.0, "default": True},
            "plain FedAvg, no momentum (default with differential privacy)",
        ),
        (
            {"lr": 2.0, "momentum": 0.0, "default": False},
            "plain FedAvg, no momentum ([rounds] server_momentum), server_lr 2",
        ),
        ({"lr": 1.0, "momentum": 0.9, "default": False}, "momentum 0.9 ([rounds] server_momentum)"),
    ],
)
def test_status_names_the_server_step(step, text):
    from fedagent.cli.render import status_rows

    rows = dict(status_rows({"role": "coordinator", "server_step": step}))
    assert rows["server step"] == text
