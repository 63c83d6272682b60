"""What a model's fingerprint says of its tensors, and what rounds do with it: buffers are
the agents' mean (never moved by the server step, exact on the way in and out, never
negative when the agents' are not), normalisation layers stay on the agents under
local_norm, and a refused update counts its sender out of the round at once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols.aggregation import WeightedMean
from fedagent.protocols.codec import Limits
from fedagent.protocols.compression import CompressionConfig, Compressor, decode_tensor
from fedagent.protocols.downlink import quantize_step, rebuild
from fedagent.protocols.fingerprint import Fingerprint, TensorInfo, first_difference
from fedagent.protocols.messages import ModelCheck, TrainConfig, body_of
from fedagent.protocols.rounds import (
    AgentOnline,
    Rejected,
    RoundAbandoned,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)
from fedagent.protocols.serveropt import MemoryVelocity, momentum_step, momentum_step_into, velocity_layout
from fedagent.protocols.streaming import UpdateEnd, UpdateHead

BN = Fingerprint(
    (
        TensorInfo("conv.weight", "float32", (4, 3), "parameter"),
        TensorInfo("bn.weight", "float32", (4,), "parameter", norm=True),
        TensorInfo("bn.running_var", "float32", (4,), "buffer", norm=True),
        TensorInfo("bn.num_batches_tracked", "int64", (), "buffer", norm=True),
        TensorInfo("fc.weight", "bfloat16", (2, 4), "parameter"),
        TensorInfo("proj.weight", "float32", (3,), "frozen"),
    )
)


def weights(conv=0.0, bnw=1.0, var=1.0, count=0, fc=0.0, proj=0.5) -> dict[str, np.ndarray]:
    return {
        "conv.weight": np.full((4, 3), conv, np.float32),
        "bn.weight": np.full(4, bnw, np.float32),
        "bn.running_var": np.full(4, var, np.float32),
        "bn.num_batches_tracked": np.array(count, np.int64),
        "fc.weight": np.full((2, 4), fc, np.float32),
        "proj.weight": np.full(3, proj, np.float32),
    }


# ---- the fingerprint ------------------------------------------------------------------
def test_the_digest_covers_every_field_and_the_order():
    base = BN.digest
    assert len(base) == 32 and Fingerprint(BN.tensors).digest == base
    for i, change in enumerate(
        [
            {"dtype": "float16"},
            {"shape": (4, 4)},
            {"kind": "frozen"},
            {"tied_to": "fc.weight"},
            {"norm": True},
        ]
    ):
        other = dataclasses.replace(BN.tensors[0], **change)
        assert Fingerprint((other, *BN.tensors[1:])).digest != base, i
    assert Fingerprint(BN.tensors[::-1]).digest != base


def test_first_difference_names_the_tensor_on_both_sides():
    wide = Fingerprint((TensorInfo("conv.weight", "float32", (8, 3), "parameter"), *BN.tensors[1:]))
    assert first_difference(BN, wide, here="on the coordinator", there="on agent-2") == (
        "tensor 'conv.weight': float32[4, 3] parameter on the coordinator, float32[8, 3] parameter on agent-2"
    )
    fewer = Fingerprint(BN.tensors[:-1])
    assert first_difference(BN, fewer) == "tensor 'proj.weight': float32[3] frozen here, absent there"
    assert first_difference(fewer, BN) == "tensor 'proj.weight': absent here, float32[3] frozen there"
    assert first_difference(BN, BN) == ""
    assert "another order" in first_difference(BN, Fingerprint(BN.tensors[::-1]))


def test_roles_follow_the_kinds_and_local_norm():
    plain = BN.roles()
    assert plain.buffers == {"bn.running_var", "bn.num_batches_tracked"}
    assert plain.fixed == {"bn.running_var", "bn.num_batches_tracked", "proj.weight"}
    assert plain.kept == frozenset()
    fedbn = BN.roles(local_norm=True)
    assert fedbn.kept == {"bn.weight", "bn.running_var", "bn.num_batches_tracked"}
    assert fedbn.buffers == frozenset() and "bn.weight" in fedbn.fixed
    assert BN.model_dtypes() == {"fc.weight": "bfloat16"}
    meta = BN.meta(kept=fedbn.kept)
    assert meta["buffers"] == ["bn.num_batches_tracked", "bn.running_var"] and meta["frozen"] == ["proj.weight"]


def test_a_model_check_travels_and_its_digest_must_match():
    check = ModelCheck.of(BN, refused="differs")
    back = body_of(check.kind, check.to_body(), Limits())
    assert back == check and back.fingerprint == BN
    forged = {**check.to_body(), "digest": "0" * 32}
    with pytest.raises(CodecError, match="digest"):
        body_of(check.kind, forged, Limits())
    bad = check.to_body()
    bad["tensors"][0]["kind"] = "weights"
    with pytest.raises(CodecError, match="kind"):
        body_of(check.kind, bad, Limits())


def test_local_norm_reaches_the_agents_in_the_train_config():
    t = TrainConfig(local_norm=True)
    assert t.to_body()["local_norm"] is True
    assert "local_norm" not in TrainConfig().to_body()  # earlier releases read what is sent
    assert TrainConfig.from_body(t.to_body()).local_norm


# ---- buffers in the aggregate and the server step -------------------------------------
def test_a_buffer_is_the_mean_of_the_values_and_never_negative():
    """Summed from the values in float64, not as differences to a far-away global model:
    tiny non-negative variances average to a non-negative one, to the last bit."""
    ref = {"var": np.full(3, 1e6, np.float32), "w": np.full(3, 1e6, np.float32)}
    acc = WeightedMean(ref, compact=True, values=frozenset({"var"}))
    acc.add({"var": np.array([1e-30, 0.0, 3e-38], np.float32), "w": np.array([1.0, 2, 3], np.float32)}, 3.0)
    acc.add({"var": np.array([0.0, 1e-30, 1e-45], np.float32), "w": np.array([1.0, 2, 3], np.float32)}, 7.0)
    out = acc.result()
    assert (out["var"] >= 0).all()
    np.testing.assert_allclose(out["var"], [3e-31, 7e-31, (3 * 3e-38 + 7 * 1e-45) / 10], rtol=1e-6)
    # A part that arrives as a step from the global model is turned back into a value.
    acc = WeightedMean(ref, values=frozenset({"var"}))
    acc.fold("var", 0, np.full(3, -1e6 + 2.0, np.float32), None, 1.0, delta=True)
    acc.fold("w", 0, np.zeros(3, np.float32), None, 1.0, delta=True)
    acc.count_in(1.0)
    np.testing.assert_allclose(acc.result()["var"], 2.0)


def test_the_server_step_moves_trainable_parameters_only():
    ref = weights(conv=1.0, var=1.0, count=10, proj=0.5)
    agg = weights(conv=2.0, var=0.25, count=30, proj=0.5)
    roles = BN.roles()
    velocity = {"conv.weight": np.full((4, 3), 1.0, np.float32), "bn.running_var": np.full(4, 9.0, np.float32)}
    new, vel = momentum_step(ref, agg, velocity, lr=2.0, beta=0.5, fixed=roles.fixed)
    np.testing.assert_allclose(new["conv.weight"], 1.0 + 2.0 * (1.0 + 0.5))  # x + η(Δ + βv)
    np.testing.assert_array_equal(new["bn.running_var"], 0.25)  # the mean: no η, no velocity
    assert int(new["bn.num_batches_tracked"]) == 30 and "bn.running_var" not in vel
    # The streamed step (velocity on disk) agrees to the bit, and writes zeros for buffers.
    store = MemoryVelocity(velocity)
    writer = store.begin(velocity_layout(ref), 1)
    streamed = momentum_step_into(ref, dict(agg), store, writer, lr=2.0, beta=0.5, fixed=roles.fixed)
    store.adopt(writer)
    for k in new:
        np.testing.assert_array_equal(streamed[k], new[k])
    np.testing.assert_array_equal(store.current["bn.running_var"], 0.0)


def test_the_int8_downlink_sends_buffers_whole():
    old = weights(var=1.0)
    new = weights(conv=0.3, var=0.001, count=4)
    new["bn.running_var"][0] = 0.999  # a step of ±1 would be quantised in steps of 1/127
    rebuilt, delta = quantize_step(old, dict(new), 1, whole=BN.roles().fixed)
    assert "bn.running_var" in delta.whole and "conv.weight" in delta.steps
    np.testing.assert_array_equal(rebuilt["bn.running_var"], new["bn.running_var"])
    np.testing.assert_array_equal(rebuild(old, delta)["bn.running_var"], new["bn.running_var"])


def test_an_agent_sends_its_buffers_exact_and_float16_tensors_compressed():
    base = {"w": np.zeros(4, np.float16), "var": np.ones(4, np.float32)}
    trained = {"w": np.array([0.5, -0.25, 1.0, 0.0], np.float16), "var": np.array([1e-7, 2, 3, 4], np.float32)}
    specs = {
        s.name: (s, d) for s, d in Compressor(CompressionConfig("int8"), exact=frozenset({"var"})).encode(trained, base)
    }
    assert specs["var"][0].enc == "raw" and specs["w"][0].enc == "int8" and specs["w"][0].dtype == "float16"
    np.testing.assert_array_equal(decode_tensor(*specs["var"]), trained["var"])
    np.testing.assert_allclose(decode_tensor(*specs["w"]), trained["w"].astype(np.float32), atol=1.0 / 254 + 1e-5)


# ---- the round machine ----------------------------------------------------------------
def machine(momentum: float = 0.7, local_norm: bool = False, **kw) -> RoundMachine:
    cfg = RoundConfig(
        rounds=6,
        min_agents=2,
        expected_agents=2,
        server_momentum=momentum,
        train=TrainConfig(local_norm=local_norm),
        **kw,
    )
    return RoundMachine(cfg, weights(), roles=BN.roles(local_norm=local_norm))


def start(m: RoundMachine, now: float = 0.0) -> StartRound:
    cmds = [c for a in ("a", "b") for c in m.handle(AgentOnline(a, 10), now)]
    return next(c for c in cmds if isinstance(c, StartRound))


def test_a_shrinking_running_variance_stays_the_agents_mean_under_server_momentum():
    """The failure this guards against: momentum 0.7 moved running_var like a weight,
    1.0 -> 0.349 -> -0.334 within three rounds, and the model's outputs went to NaN."""
    m = machine(momentum=0.7)
    start(m)
    var = 1.0
    for r in range(1, 7):
        var *= 0.35
        cmds = m.handle(UpdateReceived("a", r, r - 1, 10, weights(conv=r, var=var * 0.8, count=r), {}), r)
        cmds += m.handle(UpdateReceived("b", r, r - 1, 30, weights(conv=r, var=var * 1.2, count=r), {}), r)
        (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
        expected = np.float32((10 * np.float32(var * 0.8) + 30 * np.float64(np.float32(var * 1.2))) / 40)
        np.testing.assert_allclose(agg.weights["bn.running_var"], expected, rtol=1e-6)
        assert (agg.weights["bn.running_var"] > 0).all()
    # The trainable weights did take the momentum: they overshoot the agents' mean.
    assert float(agg.weights["conv.weight"][0, 0]) > 6.0


def test_local_norm_keeps_the_global_normalisation_layers_out_of_the_aggregate():
    m = machine(local_norm=True)
    s = start(m)
    assert s.train.local_norm
    m.handle(UpdateReceived("a", 1, 0, 10, weights(conv=1, bnw=5, var=0.1, count=9), {}), 1.0)
    cmds = m.handle(UpdateReceived("b", 1, 0, 10, weights(conv=1, bnw=7, var=0.2, count=9), {}), 1.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    for k, v in weights().items():
        if k.startswith("bn."):
            np.testing.assert_array_equal(agg.weights[k], v)
    assert float(agg.weights["conv.weight"][0, 0]) == pytest.approx(1.0)


def test_a_refused_update_counts_its_sender_out_at_once():
    """A refused update is not waited for until the deadline: the round aggregates what
    came as soon as nobody else is owed."""
    m = machine(round_timeout=120.0)
    start(m)
    good = m.handle(UpdateReceived("a", 1, 0, 10, weights(conv=1), {}), 1.0)
    assert good == []
    bad = weights(conv=1)
    bad["conv.weight"] = np.zeros((8, 3), np.float32)
    cmds = m.handle(UpdateReceived("b", 1, 0, 10, bad, {}), 2.0)
    assert isinstance(cmds[0], Rejected) and cmds[0].reason == "shape"
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    assert agg.participants == ("a",)


def test_a_stream_refused_before_or_at_its_header_counts_its_sender_out():
    m = machine(round_timeout=120.0)
    s = start(m)
    assert m.waiting() == {"for": "updates", "agents": ["a", "b"], "offline": []}
    # b's stream broke off before its header could be read (e.g. num_samples 0): the
    # intake refused it, and the machine hears the transfer end.
    assert m.handle(UpdateEnd("b", "t-b", False, "stream header: num_samples must be positive"), 1.0) == []
    assert m.waiting() == {"for": "updates", "agents": ["a"], "offline": []}
    head = UpdateHead("a", "t-a", s.round, 0, 10, {}, False, ())
    cmds = m.handle(head, 2.0)
    (rej,) = [c for c in cmds if isinstance(c, Rejected)]
    assert rej.reason == "names"
    # Refused at its header, a is out too: nobody is owed and nothing came, so the round
    # is abandoned at once (not at its deadline) and the next one starts.
    (abandoned,) = [c for c in cmds if isinstance(c, RoundAbandoned)]
    assert "0 of 2 updates" in abandoned.reason
    assert [c.round for c in cmds if isinstance(c, StartRound)] == [s.round + 1]


def test_status_says_the_round_waits_for_a_quorum_and_who_is_there():
    m = machine()
    m.handle(AgentOnline("a", 10), 0.0)
    assert m.status()["waiting"] == {"for": "quorum", "need": 2, "online": ["a"]}
