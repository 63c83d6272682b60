"""FedAvg's server step (``[rounds] server_lr``) and local steps (``[rounds] local_steps``):
the pure step, the round machine applying it, the train config on the wire, and the
coordinator's configuration reaching both."""

from __future__ import annotations

import numpy as np
import pytest
from configs import coordinator_config

from fedagent.errors import CodecError, ConfigError
from fedagent.protocols.aggregation import server_step, weighted_mean
from fedagent.protocols.messages import MAX_LOCAL_STEPS, RoundStart, TrainConfig
from fedagent.protocols.rounds import (
    AgentOnline,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)

W0 = {"w": np.zeros((2, 3), np.float32), "n": np.array(4, np.int64)}


def test_server_step_scales_the_move_of_floating_tensors_only():
    ref = {"w": np.full((2, 3), 1.0, np.float32), "n": np.array(4, np.int64)}
    agg = {"w": np.full((2, 3), 1.5, np.float32), "n": np.array(7, np.int64)}
    out = server_step(ref, agg, 3.0)
    np.testing.assert_allclose(out["w"], 1.0 + 3.0 * 0.5)
    assert out["w"].dtype == np.float32
    assert int(out["n"]) == 7 and out["n"].dtype == np.int64  # a counter is the aggregate's
    assert server_step(ref, agg, 1.0) is agg  # plain FedAvg: untouched
    np.testing.assert_allclose(server_step(ref, agg, 0.5)["w"], 1.25)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 101.0])
def test_server_step_refuses_a_meaningless_step(bad):
    with pytest.raises(ValueError, match="server_lr"):
        server_step(W0, W0, bad)
    with pytest.raises(ValueError, match="server_lr"):
        RoundConfig(server_lr=bad)


def test_step_n_after_one_local_step_is_centralized_sgd_on_the_union():
    """n sites, each with the quadratic loss ½‖w − cᵢ‖², one local SGD step of size η from
    the same model: the mean of their models moves 1/n as far as one gradient step on the
    sum of the losses; a server step of n makes it exactly that step."""
    rng = np.random.default_rng(0)
    n, eta = 3, 0.1
    w = rng.normal(size=5)
    centres = rng.normal(size=(n, 5))
    locals_ = [{"w": w - eta * (w - c)} for c in centres]
    mean = weighted_mean([(m, 1.0) for m in locals_])
    central = w - eta * sum(w - c for c in centres)
    fedavg_move = np.linalg.norm(mean["w"] - w)
    assert fedavg_move == pytest.approx(np.linalg.norm(central - w) / n)
    np.testing.assert_allclose(server_step({"w": w}, mean, float(n))["w"], central, rtol=1e-12)


def _started(m: RoundMachine, agents: list[str]) -> StartRound:
    cmds = []
    for a in agents:
        cmds += m.handle(AgentOnline(a, 10), 0.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    return start


def test_round_machine_moves_the_global_model_by_the_server_step():
    # server_lr alone (no server momentum): round 2's step is its own mean's only.
    m = RoundMachine(RoundConfig(rounds=2, min_agents=2, expected_agents=2, server_lr=2.0, server_momentum=0), W0)
    _started(m, ["a", "b"])
    m.handle(UpdateReceived("a", 1, 0, 10, {"w": np.full((2, 3), 1.0, np.float32), "n": W0["n"]}, {}), 1.0)
    cmds = m.handle(UpdateReceived("b", 1, 0, 30, {"w": np.full((2, 3), 3.0, np.float32), "n": W0["n"]}, {}), 2.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    # the weighted mean is 2.5, the model moved twice as far from 0
    np.testing.assert_allclose(agg.weights["w"], 5.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    np.testing.assert_allclose(start.weights["w"], 5.0)  # the next round starts from it
    m.handle(UpdateReceived("a", 2, 1, 10, {"w": np.full((2, 3), 6.0, np.float32), "n": W0["n"]}, {}), 3.0)
    cmds = m.handle(UpdateReceived("b", 2, 1, 10, {"w": np.full((2, 3), 6.0, np.float32), "n": W0["n"]}, {}), 4.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 7.0)  # 5 + 2 x (6 - 5)


def test_train_config_carries_local_steps_and_refuses_bad_ones():
    W = {"w": np.zeros(2, np.float32)}
    start = RoundStart(1, 0, ("a",), 60.0, TrainConfig(steps=45, lr=0.1, batch_size=16), W)
    back = TrainConfig.from_body(start.to_body()["train"])
    assert back.steps == 45 and back.epochs == 1 and back.batch_size == 16
    assert "steps" not in TrainConfig().to_body()  # epochs, as before
    assert TrainConfig.from_body(TrainConfig().to_body()).steps == 0
    for bad in [-1, True, 1.5, "3", MAX_LOCAL_STEPS + 1]:
        with pytest.raises(CodecError, match="steps"):
            TrainConfig.from_body({**TrainConfig().to_body(), "steps": bad})


def test_coordinator_config_reaches_the_round_machine(tmp_path):
    from fedagent.coordinator.fedavg import round_config

    rc = round_config(coordinator_config(tmp_path, {"rounds": 40, "local_steps": 45, "server_lr": 3}))
    assert rc.server_lr == 3 and rc.train.steps == 45
    default = round_config(coordinator_config(tmp_path, {"rounds": 4}))
    assert default.server_lr == 1.0 and default.train.steps == 0
    with pytest.raises(ConfigError, match="server_lr"):
        round_config(coordinator_config(tmp_path, {"rounds": 4, "server_lr": 0}))
    with pytest.raises(ConfigError, match="steps"):
        round_config(coordinator_config(tmp_path, {"rounds": 4, "local_steps": -2}))
