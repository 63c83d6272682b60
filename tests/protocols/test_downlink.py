"""The global model sent as an int8 step (``[transfer] downlink = "int8"``): the pure step,
its wire form, the round machine that keeps what the agents rebuild, and the agent's side
that rebuilds or fetches."""

from __future__ import annotations

import numpy as np
import pytest
from configs import coordinator_config

from fedagent.errors import CodecError, ConfigError
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.compression import quantize_int8
from fedagent.protocols.downlink import apply_step, default_mode, quantize_step, rebuild
from fedagent.protocols.messages import RoundStart, TrainConfig, body_of
from fedagent.protocols.participant import DeltaReceiver
from fedagent.protocols.rounds import (
    AgentOffline,
    AgentOnline,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)

RNG = np.random.default_rng(7)
W0 = {
    "conv.weight": RNG.standard_normal((4, 3, 3)).astype(np.float32),
    "fc.bias": RNG.standard_normal(5).astype(np.float32),
    "bn.num_batches_tracked": np.array(3, np.int64),
}


def _moved(w: dict, by: float) -> dict:
    return {
        k: (a + by * RNG.standard_normal(a.shape).astype(np.float32)) if a.dtype == np.float32 else np.asarray(a + 1)
        for k, a in w.items()
    }


def test_the_step_rebuilds_the_coordinators_model_to_the_bit():
    new = _moved(W0, 0.01)
    kept, delta = quantize_step(W0, {k: v.copy() for k, v in new.items()}, base_version=4)  # (taken over)
    assert delta.base_version == 4 and sorted(delta.steps) == ["conv.weight", "fc.bias"]
    assert list(delta.whole) == ["bn.num_batches_tracked"]
    assert delta.nbytes == 36 + 5 + 8  # a quarter of the float32 bytes, the counter whole
    again = rebuild(W0, delta)
    for k in W0:
        assert again[k].dtype == W0[k].dtype
        np.testing.assert_array_equal(again[k], kept[k])
    # what is kept is close to the model aggregated, not equal to it
    err = np.abs(kept["conv.weight"] - new["conv.weight"]).max()
    step = np.abs(new["conv.weight"] - W0["conv.weight"]).max()
    assert 0 < err <= step / 127 / 2 * 1.001


def test_the_delta_travels_and_is_checked():
    _, delta = quantize_step(W0, _moved(W0, 0.1), base_version=2)
    start = RoundStart(3, 3, ("a",), 60.0, TrainConfig(), None, delta=delta)
    env = Envelope(
        kind="round_start", federation="fed", sender="coordinator", round=3, seq=1, ts=1.0, body=start.to_body()
    )
    back = body_of("round_start", decode(encode(env)).body, Limits())
    assert isinstance(back, RoundStart)
    assert back.weights is None and back.delta is not None and back.delta.base_version == 2
    for k, (q, s) in delta.steps.items():
        np.testing.assert_array_equal(back.delta.steps[k][0], q)
        assert back.delta.steps[k][1] == s
    body = start.to_body()
    for broken, match in [
        ({**body["delta"], "scales": {**body["delta"]["scales"], "fc.bias": -1.0}}, "scale"),
        ({**body["delta"], "scales": {**body["delta"]["scales"], "fc.bias": float("nan")}}, "scale"),
        ({**body["delta"], "scales": {"conv.weight": 1.0}}, "different tensors"),
        ({**body["delta"], "from": -1}, "from"),
        ({**body["delta"], "whole": {**body["delta"]["whole"], "fc.bias": body["delta"]["q"]["fc.bias"]}}, "both"),
    ]:
        with pytest.raises(CodecError, match=match):
            RoundStart.from_body({**body, "delta": broken}, Limits())
    wrong_dtype = {
        **body["delta"],
        "q": {**body["delta"]["q"], "fc.bias": body["delta"]["whole"]["bn.num_batches_tracked"]},
    }
    with pytest.raises(CodecError, match="int8"):
        RoundStart.from_body({**body, "delta": wrong_dtype}, Limits())
    with pytest.raises(CodecError, match="not both"):
        RoundStart.from_body({**body, "weights": {}}, Limits())
    with pytest.raises(CodecError, match="older version"):
        RoundStart(3, 2, ("a",), 60.0, TrainConfig(), None, delta=delta)


def test_a_delta_that_does_not_fit_the_model_held_is_refused():
    _, delta = quantize_step(W0, _moved(W0, 0.1), base_version=0)
    with pytest.raises(CodecError, match="missing"):
        rebuild({**W0, "extra": np.zeros(2, np.float32)}, delta)
    with pytest.raises(CodecError, match="does not fit"):
        rebuild({**W0, "fc.bias": np.zeros(6, np.float32)}, delta)
    with pytest.raises(CodecError, match="does not fit"):
        rebuild({**W0, "bn.num_batches_tracked": np.array(1, np.int32)}, delta)


def _federation(downlink: str) -> tuple[RoundMachine, list]:
    m = RoundMachine(RoundConfig(rounds=4, min_agents=2, expected_agents=2, downlink=downlink), W0)
    cmds: list = []
    for a in ("a", "b"):
        cmds += m.handle(AgentOnline(a, 10), 0.0)
    return m, cmds


def _train_round(m: RoundMachine, start: StartRound, now: float) -> list:
    cmds: list = []
    for i, a in enumerate(("a", "b")):
        w = {k: (v + np.float32(0.05 * (i + 1))) if v.dtype == np.float32 else v for k, v in start.weights.items()}
        cmds += m.handle(UpdateReceived(a, start.round, start.model_version, 10 * (i + 1), w, {}), now)
    return cmds


def test_round_starts_after_the_first_carry_the_step_and_agents_hold_the_machines_model():
    m, cmds = _federation("int8")
    held = {k: v.copy() for k, v in W0.items()}  # what an agent holds: the first model whole
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert start.delta is None  # nothing aggregated yet: the model goes whole
    for r in range(1, 4):
        cmds = _train_round(m, start, float(r))
        (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
        (start,) = [c for c in cmds if isinstance(c, StartRound)]
        assert start.delta is not None and start.delta.base_version == agg.model_version - 1
        held = rebuild(held, start.delta)
        for k in held:
            np.testing.assert_array_equal(held[k], m.weights[k])  # the agents' model is the coordinator's
            np.testing.assert_array_equal(held[k], agg.weights[k])  # and what is checkpointed
    # plain: the model goes whole every round and is the exact aggregate
    p, cmds = _federation("none")
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    cmds = _train_round(p, start, 1.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert start.delta is None
    np.testing.assert_allclose(p.weights["fc.bias"], W0["fc.bias"] + np.float32(0.05 * 5 / 3), rtol=1e-6)
    # with the step, the kept model differs from the exact aggregate (by the int8 rounding):
    # the comparison above can fail
    m2, cmds = _federation("int8")
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    _train_round(m2, start, 1.0)
    assert not np.array_equal(m2.weights["conv.weight"], p.weights["conv.weight"])


def test_round_starts_go_whole_while_an_agent_of_an_earlier_release_is_online():
    m = RoundMachine(RoundConfig(rounds=4, min_agents=2, expected_agents=2, downlink="int8"), W0)
    cmds = m.handle(AgentOnline("a", 10), 0.0) + m.handle(AgentOnline("b", 10, reads_steps=False), 0.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert m.status()["whole_model_only"] == ["b"]
    cmds = _train_round(m, start, 1.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    # b cannot rebuild a step: the model goes whole, and it is the model the machine keeps
    assert start.delta is None and start.model_version == 1
    for k in W0:
        np.testing.assert_array_equal(start.weights[k], m.weights[k])
    held = {k: v.copy() for k, v in start.weights.items()}
    # b comes back upgraded: the next round start is a step again, from the model a holds
    m.handle(AgentOnline("b", 10), 1.5)
    assert m.status()["whole_model_only"] == []
    cmds = _train_round(m, start, 2.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert start.delta is not None and start.delta.base_version == 1
    held = rebuild(held, start.delta)
    for k in W0:
        np.testing.assert_array_equal(held[k], m.weights[k])
    # an agent of an earlier release that has gone offline holds nothing back
    m.handle(AgentOnline("c", 10, reads_steps=False), 2.5)
    assert m.status()["whole_model_only"] == ["c"]
    m.handle(AgentOffline("c"), 2.6)
    assert m.status()["whole_model_only"] == []


def test_a_restarted_coordinator_sends_the_model_whole():
    m, cmds = _federation("int8")
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    _train_round(m, start, 1.0)
    again = RoundMachine(
        RoundConfig(rounds=4, min_agents=2, expected_agents=2, downlink="int8"),
        m.weights,
        model_version=m.model_version,
        completed_rounds=1,
        last_round=1,
    )
    cmds = []
    for a in ("a", "b"):
        cmds += again.handle(AgentOnline(a, 10), 5.0)
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert start.delta is None and start.model_version == 1


def _start(rnd: int, version: int, base: dict, new: dict) -> RoundStart:
    _, delta = quantize_step(base, new, base_version=version - 1)
    return RoundStart(rnd, version, ("a",), 60.0, TrainConfig(), None, delta=delta)


def test_the_agent_rebuilds_from_the_version_it_holds_or_waits_for_the_model():
    v1 = _moved(W0, 0.1)
    start = _start(2, 1, W0, v1)
    rx = DeltaReceiver()
    got, why = rx.resolve(start, (0, W0))
    assert why == "" and got is not None and got.delta is None and rx.rebuilt == 1
    assert got.weights is not None
    np.testing.assert_array_equal(got.weights["fc.bias"], rebuild(W0, start.delta)["fc.bias"])  # type: ignore[arg-type]
    # holding the round's own version already (a round abandoned, then started again)
    same, _ = rx.resolve(start, (1, got.weights))
    assert same is not None and same.weights is got.weights
    # holding another version: the start waits for the model
    late = DeltaReceiver()
    none, why = late.resolve(start, None)
    assert none is None and "holds none" in why and late.pending is start
    assert late.on_model(0, W0) is None and late.pending is start  # an older model: keep waiting
    fetched = late.on_model(1, v1)
    assert fetched is not None and fetched.weights is v1 and late.pending is None and late.fetched == 1
    # a model newer than the waiting round's: that round is over
    stale = DeltaReceiver()
    stale.resolve(start, (5, W0))
    assert stale.on_model(2, v1) is None and stale.pending is None
    # a newer round start supersedes the waiting one
    newer = DeltaReceiver()
    newer.resolve(start, None)
    newer.resolve(RoundStart(3, 1, ("a",), 60.0, TrainConfig(), v1), None)
    assert newer.pending is None
    # a step that does not fit the model held is not used
    bad = DeltaReceiver()
    miss, why = bad.resolve(start, (0, {**W0, "fc.bias": np.zeros(6, np.float32)}))
    assert miss is None and "does not fit" in why and bad.pending is start


def test_the_broadcast_follows_the_update_compression_by_default(tmp_path):
    from fedagent.coordinator.fedavg import round_config

    assert default_mode("int8") == "int8" and default_mode("none") == "none" and default_mode("topk") == "none"
    assert round_config(coordinator_config(tmp_path, {"rounds": 2})).downlink == "int8"
    plain = coordinator_config(tmp_path, {"rounds": 2}, compression='"none"')
    assert round_config(plain).downlink == "none"
    pinned = coordinator_config(tmp_path, {"rounds": 2}, compression='"none"', downlink='"int8"')
    assert round_config(pinned).downlink == "int8"
    with pytest.raises(ConfigError, match="downlink"):
        coordinator_config(tmp_path, {"rounds": 2}, downlink='"fp16"')
    with pytest.raises(ValueError, match="downlink"):
        RoundConfig(downlink="fp16")


def test_the_step_takes_over_the_new_model_and_leaves_the_old_one_alone():
    old = {k: v.copy() for k, v in W0.items()}
    new = _moved(W0, 0.01)
    want_q, want_s = quantize_int8(new["conv.weight"] - W0["conv.weight"])
    kept, delta = quantize_step(old, new, base_version=0)
    assert new == {}  # taken over: its tensors held the steps
    for k in W0:
        np.testing.assert_array_equal(old[k], W0[k])
    np.testing.assert_array_equal(delta.steps["conv.weight"][0], want_q)  # the same as from a copy
    assert delta.steps["conv.weight"][1] == want_s
    # the same arrays as old and new (an unchanged model): old is not written
    same = {k: v.copy() for k, v in W0.items()}
    _, zero = quantize_step(same, dict(same), base_version=0)
    np.testing.assert_array_equal(same["fc.bias"], W0["fc.bias"])
    assert zero.steps["fc.bias"][1] == 0.0


def test_apply_step_is_float32_arithmetic():
    base = np.array([1.0, -2.0, 3.5], np.float32)
    q = np.array([127, -127, 0], np.int8)
    out = apply_step(base, q, 0.001)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, base + q.astype(np.float32) * np.float32(0.001))
