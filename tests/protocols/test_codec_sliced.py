"""Sliced tensors: a gradient sent without its all-zero slices (protocols/codec.py).

Lossless by construction (the receiver rebuilds the tensor bit for bit, -0.0 included),
and everything a peer could lie about is refused before the dense array is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols.codec import (
    SLICE_FROM,
    Envelope,
    Limits,
    decode,
    decode_tensor_sliced,
    decode_weights,
    encode,
    encode_tensor_sliced,
    encode_weights,
)
from fedagent.protocols.messages import SyncGradient, SyncStep, body_of


def bow_gradient(rows: int = 100, cols: int = 5000, zero_every: int = 2, seed: int = 0) -> np.ndarray:
    """Like the gradient of a bag-of-words encoder's first layer: whole columns zero."""
    g = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    g[:, ::zero_every] = 0.0
    return g


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_zero_columns_are_left_out_and_the_tensor_comes_back_bit_for_bit():
    g = bow_gradient()
    g[3, 1] = -0.0  # a column holding only a negative zero is not all-zero bytes
    g[:, 1] = -0.0
    wire = encode_tensor_sliced(g)
    assert wire["axis"] == 1
    kept = np.frombuffer(wire["index"], dtype="<u4")
    assert 1 in kept and 3 in kept and 0 not in kept and 2 not in kept
    assert len(kept) == 5000 - len(range(0, 5000, 2))
    assert wire["data"].nbytes == 100 * len(kept) * 4
    out = decode_tensor_sliced(wire)
    assert same_bits(out, g)
    assert np.signbit(out[:, 1]).all()
    out[0, 0] = 1.0  # a new, writable array


def test_zero_rows_choose_axis_0_and_other_dtypes_round_trip():
    for dtype in (np.float64, np.int32, np.float16):
        a = np.arange(200 * 300).reshape(200, 300).astype(dtype)
        a[::2] = 0
        wire = encode_tensor_sliced(a)
        assert wire["axis"] == 0 and len(wire["index"]) == 4 * 100
        assert same_bits(decode_tensor_sliced(wire), a)
    cube = np.ones((40, 50, 30), dtype=np.float32)
    cube[:, 7:40, :] = 0.0
    wire = encode_tensor_sliced(cube)
    assert wire["axis"] == 1
    assert same_bits(decode_tensor_sliced(wire), cube)


def test_dense_small_and_all_zero_tensors():
    dense = np.random.default_rng(1).standard_normal((100, 500)).astype(np.float32)
    assert "axis" not in encode_tensor_sliced(dense)  # nothing to leave out
    # Too few zero slices to pay for gathering and scattering them: sent whole.
    assert "axis" not in encode_tensor_sliced(bow_gradient(zero_every=4))
    assert "axis" in encode_tensor_sliced(bow_gradient(zero_every=2))
    small = np.zeros((10, 10), dtype=np.float32)
    assert small.nbytes < SLICE_FROM and "axis" not in encode_tensor_sliced(small)
    zeros = np.zeros((100, 5000), dtype=np.float32)
    wire = encode_tensor_sliced(zeros)
    assert wire["index"] == b"" and wire["data"].nbytes == 0
    assert same_bits(decode_tensor_sliced(wire), zeros)


def good_wire() -> dict:
    g = bow_gradient(rows=20, cols=4000, zero_every=2)
    wire = encode_tensor_sliced(g)
    return {**wire, "data": bytes(wire["data"])}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.pop("axis"), "exactly the fields"),
        (lambda w: w.update(extra=1), "exactly the fields"),
        (lambda w: w.update(axis=2), "not an axis"),
        (lambda w: w.update(axis=True), "not an axis"),
        (lambda w: w.update(axis=-1), "not an axis"),
        (lambda w: w.update(dtype="object"), "not allowed"),
        (lambda w: w.update(index=w["index"] + b"\x00"), "whole number of uint32"),
        (lambda w: w.update(index="abcd"), "must be binary"),
        (lambda w: w.update(index=np.arange(4001, dtype="<u4").tobytes()), "4001 positions"),
        (lambda w: w.update(data=w["data"][:-4]), "need"),
        (lambda w: w.update(data=w["data"] + b"\x00" * 80), "need"),
        (lambda w: w.update(shape=[40, 4000]), "need"),
    ],
)
def test_malformed_sliced_tensors_are_refused(change, message):
    wire = good_wire()
    change(wire)
    with pytest.raises(CodecError, match=message):
        decode_tensor_sliced(wire)


def test_index_must_be_strictly_increasing_and_in_range():
    base = good_wire()
    idx = np.frombuffer(base["index"], dtype="<u4").copy()
    swapped = idx.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    dup = idx.copy()
    dup[5] = dup[4]
    far = idx.copy()
    far[-1] = 4000
    for bad, message in ((swapped, "strictly increasing"), (dup, "strictly increasing"), (far, "out of range")):
        with pytest.raises(CodecError, match=message):
            decode_tensor_sliced({**base, "index": bad.tobytes()})


def test_a_huge_dense_shape_is_refused_before_anything_is_allocated():
    # 2**40 float32 if it were allocated; the index and data are tiny and consistent.
    wire = {"dtype": "float32", "shape": [2**20, 2**20], "axis": 0, "index": b"", "data": b""}
    with pytest.raises(CodecError, match="max_tensor_bytes"):
        decode_tensor_sliced(wire, Limits())
    with pytest.raises(CodecError, match="where"):
        decode_tensor_sliced(good_wire(), expect_shape=(20, 3999))


def test_decode_weights_accepts_sliced_tensors_only_when_asked():
    g = {"w": bow_gradient(rows=20, cols=4000), "b": np.ones(20, dtype=np.float32)}
    wire = encode_weights(g, sliced=True)
    assert "axis" in wire["w"] and "axis" not in wire["b"]
    back = decode_weights(wire, sliced=True)
    assert all(same_bits(back[k], g[k]) for k in g)
    # A receiver that does not decode them (an older coordinator) says what it expects.
    with pytest.raises(CodecError, match="exactly the fields dtype, shape, data"):
        decode_weights(wire)


def envelope(kind: str, body: dict) -> Envelope:
    return Envelope(kind=kind, federation="fed", sender="agent-1", round=3, seq=1, ts=1.0, body=body)


def test_sync_gradient_sliced_on_the_wire_is_smaller_and_decodes_to_the_same_arrays():
    grads = {
        "input_layer.weight": bow_gradient(),
        "beta": np.random.default_rng(2).standard_normal((50, 5000)).astype(np.float32),
    }
    whole = SyncGradient(3, 2, 64, 1.5, grads)
    sliced = SyncGradient(3, 2, 64, 1.5, grads, sliced=True)
    a, b = encode(envelope("sync_gradient", whole.to_body())), encode(envelope("sync_gradient", sliced.to_body()))
    assert len(b) < len(a) - 100 * 2400 * 4
    for payload in (a, b):
        env = decode(payload, Limits(), views=True)
        msg = body_of(env.kind, env.body, Limits())
        assert isinstance(msg, SyncGradient)
        assert all(same_bits(msg.gradient[k], grads[k]) for k in grads)


def test_sync_step_announces_sliced_gradients_and_older_steps_mean_whole_ones():
    step = SyncStep(4, 3, ("agent-1",), 60.0, "d" * 64, None, sliced_gradients=True)
    body = step.to_body()
    assert body["sliced_gradients"] is True
    assert body_of("sync_step", body, Limits()).sliced_gradients is True
    del body["sliced_gradients"]  # what an older coordinator sends
    assert body_of("sync_step", body, Limits()).sliced_gradients is False
    with pytest.raises(CodecError):
        body_of("sync_step", {**step.to_body(), "sliced_gradients": 1}, Limits())
