"""Update compression and streamed aggregation: pure code, in memory."""

from __future__ import annotations

import hashlib
import random
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagent.errors import CodecError
from fedagent.protocols.codec import Envelope
from fedagent.protocols.compression import CompressionConfig, Compressor, TensorSpec, decode_tensor, spec_from_wire
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
from fedagent.protocols.streaming import (
    HEAD_KIND,
    PART_VALUES,
    StreamIntake,
    UpdateEnd,
    UpdateHead,
    UpdatePart,
    encode_stream,
    head_body,
    iter_stream_chunks,
)

FED = "lab"


def payload(
    sender, weights, *, base=None, mode="none", ratio=0.1, round_=1, base_version=0, n=10, metrics=None, compressor=None
):
    comp = compressor or Compressor(CompressionConfig(mode, ratio))
    tensors = comp.encode(weights, base)
    head = Envelope(
        kind=HEAD_KIND,
        federation=FED,
        sender=sender,
        round=round_,
        seq=1,
        ts=time.time(),
        body=head_body(round_, base_version, n, metrics or {"loss": 1.0}, False, tensors),
    )
    return encode_stream(head, tensors)


def chunks(data, size, tid="t1"):
    return list(iter_stream_chunks(data, max_chunk=size, transfer_id=tid))


def intake(**kw):
    return StreamIntake(
        FED,
        max_transfer_bytes=kw.pop("max_transfer_bytes", 2**24),
        max_pending_bytes=kw.pop("max_pending_bytes", 2**20),
        timeout=kw.pop("timeout", 30.0),
        **kw,
    )


def rebuild(events, shapes):
    """Dense arrays from parts, as a consumer would fold them (delta or full)."""
    out = {k: np.zeros(int(np.prod(s)), np.float64) for k, s in shapes.items()}
    for ev in events:
        if isinstance(ev, UpdatePart):
            if ev.indices is None:
                out[ev.name][ev.start : ev.start + ev.values.size] += ev.values
            else:
                out[ev.name][ev.indices] += ev.values
    return {k: v.reshape(shapes[k]) for k, v in out.items()}


MODEL = {
    "w": np.linspace(-1, 1, 300, dtype=np.float32).reshape(20, 15),
    "b": np.arange(7, dtype=np.float32),
    "n": np.array(3, dtype=np.int64),
}
SHAPES = {k: v.shape for k, v in MODEL.items()}


# ---- compression ---------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 500), st.floats(1e-6, 1e3), st.integers(0, 2**31 - 1))
def test_int8_round_trip_error_is_within_half_a_step(size, spread, seed):
    rng = np.random.default_rng(seed)
    base = {"x": rng.normal(size=size).astype(np.float32)}
    new = {"x": (base["x"] + rng.normal(scale=spread, size=size)).astype(np.float32)}
    ((spec, data),) = Compressor(CompressionConfig("int8")).encode(new, base)
    got = decode_tensor(spec, data)
    delta = new["x"].astype(np.float32) - base["x"]
    step = float(np.abs(delta).max()) / 127
    assert spec.nbytes == size
    assert np.abs(got - delta).max() <= step / 2 * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("wdtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_deltas_are_those_of_float32_copies(wdtype, mode):
    """The deltas are computed in float32 from both tensors cast as they are read: the
    same bytes as float32 copies of them subtracted, whatever the tensors' dtype."""
    rng = np.random.default_rng(7)
    base = {"x": rng.normal(size=(30, 11)).astype(np.float32)}
    new = {"x": (base["x"] + rng.normal(scale=0.05, size=(30, 11))).astype(wdtype)}
    ((spec, data),) = Compressor(CompressionConfig(mode)).encode(new, base)
    d = new["x"].astype(np.float32) - base["x"].astype(np.float32)
    if mode == "fp16":
        expected = d.astype("<f2")
    else:
        scale = float(np.abs(d).max()) / 127.0
        expected = np.clip(np.rint(d / scale), -127, 127).astype("<i1")
        assert spec.param == scale
    assert bytes(data) == expected.tobytes()


@pytest.mark.parametrize("mode", ["fp16", "int8", "topk"])
def test_a_zero_dimensional_float_tensor_is_compressed_too(mode):
    base = {"s": np.array(0.25, np.float32)}
    ((spec, data),) = Compressor(CompressionConfig(mode, 0.5)).encode({"s": np.array(1.5, np.float32)}, base)
    assert spec.shape == () and float(decode_tensor(spec, data)) == pytest.approx(1.25, rel=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 400), st.integers(0, 2**31 - 1))
def test_fp16_round_trip_error_is_fp16_rounding(size, seed):
    rng = np.random.default_rng(seed)
    base = {"x": rng.normal(size=size).astype(np.float32)}
    new = {"x": (base["x"] + rng.normal(scale=0.01, size=size)).astype(np.float32)}
    ((spec, data),) = Compressor(CompressionConfig("fp16")).encode(new, base)
    delta = new["x"] - base["x"]
    np.testing.assert_allclose(decode_tensor(spec, data), delta, rtol=2**-10, atol=6e-8)


def test_topk_sends_the_largest_and_error_feedback_keeps_the_rest():
    comp = Compressor(CompressionConfig("topk", 0.25))
    base = {"x": np.zeros(8, np.float32)}
    d1 = np.array([5, -1, 0.5, 4, 0.1, -3, 0.2, 2], np.float32)
    ((spec, data),) = comp.encode({"x": d1}, base)
    assert spec.param == 2 and spec.nbytes == 2 * 8
    sent = decode_tensor(spec, data)
    np.testing.assert_array_equal(sent, [5, 0, 0, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(comp.residual["x"], d1 - sent)  # residual = what was not sent
    # Next round: a zero delta still sends the largest residual entries (error feedback).
    ((spec2, data2),) = comp.encode({"x": np.zeros(8, np.float32)}, base)
    np.testing.assert_array_equal(decode_tensor(spec2, data2), [0, 0, 0, 0, 0, -3, 0, 2])
    # Over rounds everything is eventually sent: sent total + residual = sum of deltas.
    total = sent + decode_tensor(spec2, data2) + comp.residual["x"]
    np.testing.assert_allclose(total, d1)


def test_integer_tensors_travel_raw_and_whole():
    tensors = Compressor(CompressionConfig("int8")).encode(MODEL, {k: np.zeros_like(v) for k, v in MODEL.items()})
    encs = {s.name: s.enc for s, _ in tensors}
    assert encs == {"w": "int8", "b": "int8", "n": "raw"}


@pytest.mark.parametrize(
    "bad, match",
    [
        (["w", "float32", [2, 2], "topk", 5, 40], "topk k"),
        (["w", "float32", [2, 2], "int8", float("nan"), 4], "scale"),
        (["w", "object", [2], "raw", 0, 16], "dtype"),
        (["w", "int64", [2], "int8", 1.0, 2], "travel raw"),
        (["w", "float32", [-1, 2], "raw", 0, 8], "shape"),
        (["w", "float32", [2, 2], "raw", 0, 15], "nbytes"),
        (["w", "float32", [2**20, 2**20], "raw", 0, 2**42], "exceed"),
        (["w", "float32", [2], "zip", 0, 8], "encoding"),
        ("w", "spec must be"),
    ],
)
def test_bad_tensor_specs_are_refused_before_allocation(bad, match):
    with pytest.raises(CodecError, match=match):
        spec_from_wire(bad)


def test_topk_indices_out_of_range_or_repeated_are_refused():
    spec = TensorSpec("w", "float32", (4,), "topk", 2, 16)
    for idx in ([1, 4], [2, 2], [3, 1]):
        blob = np.array(idx, "<u4").tobytes() + np.ones(2, "<f4").tobytes()
        with pytest.raises(CodecError):
            decode_tensor(spec, blob)


# ---- the stream intake -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "fp16", "int8", "topk"])
@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_stream_parts_rebuild_the_update_whatever_the_chunking(mode, chunk):
    rng = np.random.default_rng(1)
    base = {k: v.copy() for k, v in MODEL.items()}
    new = {
        k: (v + rng.normal(scale=0.1, size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v + 1
        for k, v in MODEL.items()
    }
    data = payload("a", new, base=base, mode=mode, ratio=1.0)
    it = intake()
    events = []
    for body in chunks(data, chunk):
        events += it.feed("a", body, 0.0)
    assert isinstance(events[0], UpdateHead) and events[-1] == UpdateEnd("a", "t1", True)
    got = rebuild(events, SHAPES)
    for name in MODEL:
        full = got[name] if mode == "none" or name == "n" else got[name] + base[name]
        tol = {"none": 0, "fp16": 1e-3, "int8": 0.01, "topk": 1e-6}[mode]
        np.testing.assert_allclose(full, new[name], atol=tol + 1e-7)
    assert it.pending_transfers == 0


def test_int8_parts_wait_as_their_steps_and_decode_to_the_same_floats():
    """An int8 run is handed on as its int8 steps (views of the chunk), in parts of at most
    PART_VALUES values; a part's floats are made when first read, the same bits as the
    steps decoded whole (int8 in float32 times the scale, a float32 product)."""
    rng = np.random.default_rng(2)
    base = {"w": rng.standard_normal(300_000, dtype=np.float32), "b": np.zeros(5, np.float32)}
    new = {k: v + rng.standard_normal(v.shape, dtype=np.float32) for k, v in base.items()}
    it = intake()
    bodies = chunks(payload("a", new, base=base, mode="int8"), 200_000)
    events = [ev for body in bodies for ev in it.feed("a", body, 0.0)]
    head, parts = events[0], [ev for ev in events if isinstance(ev, UpdatePart)]
    assert isinstance(head, UpdateHead) and events[-1] == UpdateEnd("a", "t1", True)
    assert len(parts) > 300_000 // PART_VALUES
    for p in parts:
        assert p.data.dtype == np.int8 and 0 < p.data.size <= PART_VALUES and p.delta
        assert p.nbytes == 4 * p.data.size  # counted as the floats it becomes, before they exist
    got = rebuild(events, {k: v.shape for k, v in base.items()})
    for spec in head.tensors:
        q = np.concatenate([p.data for p in parts if p.name == spec.name])
        decoded_whole = q.astype(np.float32) * np.float32(spec.param)
        assert np.array_equal(np.concatenate([p.values for p in parts if p.name == spec.name]), decoded_whole)
        assert np.array_equal(decode_tensor(spec, q.tobytes()).reshape(-1), decoded_whole)
        assert np.array_equal(got[spec.name].reshape(-1), decoded_whole.astype(np.float64))


def test_an_int8_chunk_costs_its_floats_only_while_a_part_is_read():
    """A 4 MiB chunk of int8 steps decoded whole was 16 MB of floats at once (32 MB while
    scaled); its parts hold views of it until read, and a part read costs its own floats."""
    rng = np.random.default_rng(3)
    n = 4 * 2**20
    new = {"w": rng.standard_normal(n, dtype=np.float32)}
    (body,) = chunks(payload("a", new, base={"w": np.zeros(n, np.float32)}, mode="int8"), 8 * 2**20)
    it = intake(max_transfer_bytes=2**26)
    tracemalloc.start()
    try:
        events = it.feed("a", body, 0.0)
        _, fed = tracemalloc.get_traced_memory()
        assert events[-1] == UpdateEnd("a", "t1", True)
        parts = [ev for ev in events if isinstance(ev, UpdatePart)]
        del events
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()
        values = 0
        while parts:
            part = parts.pop()
            values += part.values.size  # read (as the machine folds it), then dropped
            del part
        _, read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert values == n
    assert fed < n // 8, f"feeding the chunk took {fed / n:.2f} x its size"
    assert read - held < 4 * PART_VALUES + 2**16, f"reading the parts took {(read - held) / n:.2f} x the chunk"


def test_out_of_order_chunks_are_held_back_and_duplicates_ignored():
    data = payload("a", MODEL)
    bodies = chunks(data, 50)
    order = list(range(len(bodies)))
    random.Random(3).shuffle(order)
    it = intake()
    events = []
    for i in order + order[:3]:
        events += it.feed("a", bodies[i], 0.0)
    assert events[-1].ok and it.pending_bytes == 0
    np.testing.assert_allclose(rebuild(events, SHAPES)["w"], MODEL["w"])


def test_digest_mismatch_ends_the_stream_not_ok():
    data = payload("a", MODEL)
    bodies = chunks(data, 100)
    bad = hashlib.sha256(b"other").digest()
    it = intake()
    events = []
    for b in bodies:
        events += it.feed("a", {**b, "sha256": bad}, 0.0)
    assert events[-1] == UpdateEnd("a", "t1", False, "sha256 mismatch")


def test_header_that_lies_about_sizes_is_refused_before_values():
    data = bytearray(payload("a", MODEL))
    body = chunks(bytes(data) + b"\0" * 8, 1 << 20)[0]  # 8 bytes more than the header accounts for
    events = intake().feed("a", body, 0.0)
    assert events == [
        UpdateEnd("a", "t1", False, "stream header: tensor byte counts do not add up to the payload size")
    ]


def test_header_from_another_sender_is_refused():
    data = payload("mallory", MODEL)
    events = intake().feed("a", chunks(data, 1 << 20)[0], 0.0)
    assert len(events) == 1 and not events[0].ok and "sender" in events[0].reason


def test_hold_back_budget_bounds_out_of_order_memory():
    data = payload("a", MODEL)
    bodies = chunks(data, 64)
    it = intake(max_pending_bytes=200)
    events = []
    for b in reversed(bodies):
        events += it.feed("a", b, 0.0)
        if events:
            break
    assert events and not events[0].ok and "hold-back" in events[0].reason and it.pending_bytes == 0


def test_silent_transfer_times_out():
    data = payload("a", MODEL)
    it = intake(timeout=5.0)
    it.feed("a", chunks(data, 64)[0], 0.0)
    assert it.pending_transfers == 1 and it.expire(4.0) == []
    (end,) = it.expire(6.0)
    assert not end.ok and it.pending_transfers == 0


# ---- the round machine folds streams -------------------------------------------------
W = {"w": np.zeros((20, 15), np.float32), "b": np.zeros(7, np.float32), "n": np.array(0, np.int64)}
SH = {k: v.shape for k, v in W.items()}


def machine(agents, **cfg):
    cfg.setdefault("min_agents", len(agents))
    m = RoundMachine(RoundConfig(rounds=3, expected_agents=len(agents), **cfg), {k: v.copy() for k, v in W.items()})
    cmds = []
    for a in agents:
        cmds += m.handle(AgentOnline(a, 10), 0.0)
    assert [c for c in cmds if isinstance(c, StartRound)]
    return m


def stream_events(sender, weights, tid="t1", mode="none", chunk=97, **kw):
    it = intake()
    out = []
    for b in chunks(payload(sender, weights, base=W, mode=mode, ratio=1.0, **kw), chunk, tid):
        out += it.feed(sender, b, 0.0)
    return out


def const(v):
    return {"w": np.full((20, 15), v, np.float32), "b": np.full(7, v, np.float32), "n": np.array(int(v), np.int64)}


@pytest.mark.parametrize("mode", ["none", "fp16", "int8", "topk"])
def test_streamed_updates_aggregate_like_whole_ones(mode):
    m = machine(["a", "b"])
    cmds = []
    for ev in stream_events("a", const(1.0), mode=mode, n=10) + stream_events("b", const(3.0), mode=mode, n=30):
        cmds += m.handle(ev, 1.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 2.5, rtol=1e-3)
    assert agg.weights["w"].dtype == np.float32 and int(agg.weights["n"]) == 2


def test_interleaved_streams_fold_together():
    m = machine(["a", "b"])
    ea, eb = stream_events("a", const(2.0)), stream_events("b", const(4.0))
    cmds = []
    for x, y in zip(ea, eb):
        cmds += m.handle(x, 1.0) + m.handle(y, 1.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 3.0)


def test_header_rejections_cost_nothing():
    m = machine(["a", "b"])
    evs = stream_events("a", const(1.0), base_version=7)
    cmds = []
    for ev in evs:
        cmds += m.handle(ev, 1.0)
    assert [c.reason for c in cmds if isinstance(c, Rejected)] == ["stale"]
    assert not [c for c in cmds if isinstance(c, RoundAbandoned)]
    for ev in stream_events("a", const(1.0), tid="t2") + stream_events("b", const(3.0)):
        cmds += m.handle(ev, 2.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 2.0)


def test_a_stream_from_an_agent_online_after_an_everyone_round_started_is_discarded():
    m = machine(["a", "b"])
    assert m.everyone
    m.handle(AgentOnline("late", 10), 0.5)
    cmds = []
    for ev in stream_events("late", const(9.0)):
        cmds += m.handle(ev, 1.0)
    assert [type(c).__name__ for c in cmds] == ["LateUpdate"]
    for ev in stream_events("a", const(1.0), tid="t2") + stream_events("b", const(3.0), tid="t3"):
        cmds += m.handle(ev, 2.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    assert agg.participants == ("a", "b")
    np.testing.assert_allclose(agg.weights["w"], 2.0)


def test_nan_part_after_folded_parts_spoils_the_round_and_benches_the_sender():
    m = machine(["a", "b", "c"], min_updates=1, min_agents=2)
    bad = const(1.0)
    bad["b"][3] = np.nan  # tensor b comes after w: w is folded already
    cmds = []
    for ev in stream_events("a", bad):
        cmds += m.handle(ev, 1.0)
    (rej,) = [c for c in cmds if isinstance(c, Rejected)]
    assert rej.reason == "non-finite" and rej.sender == "a"
    (ab,) = [c for c in cmds if isinstance(c, RoundAbandoned)]
    assert "a" in ab.reason
    (start,) = [c for c in cmds if isinstance(c, StartRound)]
    assert start.round == 2 and "a" not in start.selected


def test_digest_failure_spoils_only_when_parts_were_folded():
    m = machine(["a", "b"])
    evs = stream_events("a", const(1.0))
    cmds = []
    for ev in evs[:-1]:
        cmds += m.handle(ev, 1.0)
    cmds += m.handle(UpdateEnd("a", "t1", False, "sha256 mismatch"), 1.0)
    assert [c for c in cmds if isinstance(c, RoundAbandoned)]


def test_deadline_waits_for_a_half_folded_update():
    m = machine(["a", "b"], round_timeout=10.0, min_updates=1)
    cmds = []
    for ev in stream_events("b", const(3.0)):
        cmds += m.handle(ev, 1.0)
    evs = stream_events("a", const(1.0))
    for ev in evs[:3]:
        cmds += m.handle(ev, 2.0)
    from fedagent.protocols.rounds import Wakeup

    assert not [c for c in m.handle(Wakeup(), 11.0) if isinstance(c, RoundAggregated)]
    for ev in evs[3:]:
        cmds += m.handle(ev, 12.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 2.0)


def test_norm_bound_applies_to_streamed_updates():
    m = machine(["a", "b"], max_norm=5.0, min_updates=1)
    cmds = []
    for ev in stream_events("a", const(10.0)):
        cmds += m.handle(ev, 1.0)
    assert [c.reason for c in cmds if isinstance(c, Rejected)] == ["norm"]


def test_aggregating_many_streamed_updates_stays_within_three_models_of_memory():
    """tracemalloc peak while 20 updates of a 4 MB model are folded, interleaved chunk by
    chunk as 20 concurrent senders would deliver them: the global model, one float32 sum
    and chunk-sized buffers, not 20 models."""
    rng = np.random.default_rng(0)
    ref = {"a": np.zeros((500, 1000), np.float32), "b": np.zeros(500_000, np.float32)}
    model_bytes = sum(v.nbytes for v in ref.values())
    agents = [f"s{i}" for i in range(20)]
    upd = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ref.items()}
    data = {a: payload(a, upd, n=i + 1) for i, a in enumerate(agents)}
    del upd
    # Everything the coordinator allocates from here on is traced: its running sums,
    # the intake's state, the parts, the result. The global model (ref) is counted as
    # the third model on top of the bound asserted below.
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    # The aggregation's own memory: without server momentum, whose velocity (one more
    # model, on by default) is the coordinator's to hold, not the intake's.
    m = RoundMachine(RoundConfig(rounds=1, min_agents=20, expected_agents=20, server_momentum=0), ref)
    for a in agents:
        m.handle(AgentOnline(a, 10), 0.0)
    it = intake(max_transfer_bytes=2**26)
    streams = {a: iter_stream_chunks(data[a], max_chunk=256 * 1024, transfer_id=f"t{a}") for a in agents}
    done = []
    while streams:
        for a in list(streams):
            body = next(streams[a], None)
            if body is None:
                del streams[a]
                continue
            for ev in it.feed(a, body, 0.0):
                done += [c for c in m.handle(ev, 1.0) if isinstance(c, RoundAggregated)]
            del body
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(done) == 1 and done[0].participants == tuple(sorted(agents))
    # One float32 sum (1 model) + chunk-sized buffers; with the global model that is < 3.
    assert peak - base < 2 * model_bytes, f"peak {(peak - base) / model_bytes:.2f} x the model"


def test_whole_updates_still_aggregate():
    m = machine(["a", "b"])
    m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {"loss": 1.0}), 1.0)
    cmds = m.handle(UpdateReceived("b", 1, 0, 30, const(3.0), {"loss": 3.0}), 1.0)
    (agg,) = [c for c in cmds if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], 2.5)


# ---- hashing in an executor --------------------------------------------------------------
@pytest.fixture
def worker(monkeypatch):
    """A one-thread executor, and every stream large enough to use it."""
    from concurrent.futures import ThreadPoolExecutor

    import fedagent.protocols.streaming as streaming

    monkeypatch.setattr(streaming, "OFFLOAD_BYTES", 1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


@pytest.mark.parametrize("tamper", [None, 0, 3, -1])
def test_streams_hashed_in_an_executor_end_as_inline(worker, tamper):
    """Same events, in order or not, as hashed in feed(); a chunk altered in transit (its
    data, not its signed fields) still ends the stream not ok, wherever it is."""
    data = payload("a", MODEL)
    bodies = chunks(data, 50)
    if tamper is not None:
        bodies[tamper] = {**bodies[tamper], "data": bytes(len(bodies[tamper]["data"]))}
    order = list(range(len(bodies)))
    random.Random(5).shuffle(order)
    for feed_order in (range(len(bodies)), order):
        got = {}
        for name, it in (("inline", intake()), ("worker", intake(executor=worker))):
            events = []
            for i in feed_order:
                events += it.feed("a", bodies[i], 0.0)
            got[name] = events
            assert it.pending_transfers == 0 and it.pending_bytes == 0
        assert [type(e) for e in got["worker"]] == [type(e) for e in got["inline"]]
        assert got["worker"][-1] == got["inline"][-1]
        assert got["worker"][-1].ok is (tamper is None)


def test_a_failed_hashing_job_ends_the_stream_not_ok(worker):
    from concurrent.futures import Future

    class Failing:
        def submit(self, fn, *args):
            f: Future[None] = Future()
            f.set_exception(MemoryError("no room"))
            return f

    it = intake(executor=Failing())
    events = []
    for body in chunks(payload("a", MODEL), 100):
        events += it.feed("a", body, 0.0)
    assert events[-1].ok is False and "not hashed" in events[-1].reason
    assert it.pending_transfers == 0
