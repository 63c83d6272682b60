"""The wire codec: round trips, and every known bad input for the msgpack codec
refused with CodecError — the only exception the decoder may raise."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedagent.errors import CodecError
from fedagent.protocols import codec
from fedagent.protocols.codec import (
    DTYPES,
    PROTOCOL_VERSION,
    Envelope,
    Limits,
    check_finite,
    decode,
    decode_tensor,
    decode_weights,
    encode,
    encode_tensor,
    encode_weights,
    weights_nbytes,
)

# --- helpers ----------------------------------------------------------------------------

FIELDS = {"v": 1, "k": "update", "f": "fed", "s": "agent-1", "r": 3, "q": 7, "t": 1.5}


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def wire(body: bytes | None = None, **fields: object) -> bytes:
    """An envelope map written by hand, with ``body`` as raw msgpack bytes."""
    top = {**FIELDS, **fields}
    head = b"".join(pack(k) + pack(v) for k, v in top.items())
    return bytes([0x80 | (len(top) + 1)]) + head + pack("b") + (pack({}) if body is None else body)


def wire_extra(pair: bytes) -> bytes:
    """A valid envelope map with one more raw key/value pair."""
    data = wire()
    return bytes([data[0] + 1]) + data[1:] + pair


def env(**kw: object) -> Envelope:
    args = {"kind": "update", "federation": "fed", "sender": "agent-1", "round": 3, "seq": 7, "ts": 1.5, "body": {}}
    args.update(kw)
    return Envelope(**args)  # type: ignore[arg-type]


def refused(data: object, limits: Limits = Limits(), match: str | None = None) -> CodecError:
    with pytest.raises(CodecError, match=match) as info:
        decode(data, limits)  # type: ignore[arg-type]
    return info.value


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak memory traced while ``fn`` runs (a CodecError from it is expected)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(CodecError):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def raw_bytes(a: np.ndarray) -> bytes:
    return a.astype(a.dtype.newbyteorder("<")).tobytes()


WEIGHTS = {
    "layer.0/w": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.ones(4, np.int64),
    "mask": np.array([True, False]),
    "h": np.array([], np.float16).reshape(0, 5),
}
VALID = encode(env(body={"weights": encode_weights(WEIGHTS), "metrics": {"loss": 0.25}, "ids": ["a", "b"]}))

# --- strategies ---------------------------------------------------------------------

names = st.from_regex(r"[a-z0-9][a-z0-9-]{0,62}", fullmatch=True)
kinds = st.from_regex(r"[a-z0-9_]{1,32}", fullmatch=True)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
bodies = st.dictionaries(st.text(max_size=8), values, max_size=5)
envelopes = st.builds(
    Envelope,
    kind=kinds,
    federation=names,
    sender=names,
    round=st.integers(0, 2**63 - 1),
    seq=st.integers(0, 2**63 - 1),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    body=bodies,
)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(sorted(DTYPES))))
    if dt.itemsize > 1:
        dt = dt.newbyteorder(draw(st.sampled_from("<>=")))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    a = draw(hnp.arrays(dt, shape))
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T  # not C-contiguous
    return a


tensor_names = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "P", "S"], include_characters=" "), min_size=1, max_size=200
)

# --- round trips -----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(envelopes)
def test_envelope_round_trip(e: Envelope) -> None:
    assert decode(encode(e)) == e


@given(envelopes)
@settings(max_examples=30, deadline=None)
def test_decode_accepts_bytearray_and_memoryview(e: Envelope) -> None:
    data = encode(e)
    assert decode(bytearray(data)) == e
    assert decode(memoryview(data)) == e
    assert decode(memoryview(data).cast("b")) == e  # signed format: still read as bytes
    assert decode(memoryview(bytes(b for x in data for b in (x, 0)))[::2]) == e  # not contiguous


def test_nan_body_values_are_carried_structure_only() -> None:
    got = decode(encode(env(body={"x": math.nan, "y": [math.inf, -math.inf]})))
    assert math.isnan(got.body["x"]) and got.body["y"] == [math.inf, -math.inf]


def test_tuples_are_sent_as_lists_and_int_ts_becomes_float() -> None:
    e = env(body={"shape": (1, 2)}, ts=5)
    assert e.ts == 5.0 and type(e.ts) is float
    assert decode(encode(e)).body == {"shape": [1, 2]}


@settings(max_examples=300, deadline=None)
@given(arrays())
def test_tensor_round_trip(a: np.ndarray) -> None:
    wire_form = encode_tensor(a)
    assert wire_form["dtype"] == a.dtype.name and wire_form["shape"] == list(a.shape)
    assert wire_form["data"] == raw_bytes(a)
    got = decode_tensor(pack_unpack(wire_form), expect_dtype=a.dtype.name, expect_shape=a.shape)
    assert got.dtype.name == a.dtype.name and got.shape == a.shape
    assert raw_bytes(got) == raw_bytes(a)  # bit-exact, NaN payloads included
    assert not got.flags.writeable  # a zero-copy view of the message bytes


def pack_unpack(obj: object) -> object:
    return msgpack.unpackb(pack(obj), raw=False)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (0, 0), (2, 3)])
def test_every_dtype_and_zero_size(dtype: str, shape: tuple[int, ...]) -> None:
    a = (np.arange(math.prod(shape)) % 2).astype(dtype).reshape(shape)
    got = decode_tensor(encode_tensor(a))
    assert got.dtype == np.dtype(dtype) and got.shape == shape and np.array_equal(got, a)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(tensor_names, arrays(), max_size=5))
def test_weights_round_trip_through_an_envelope(w: dict[str, np.ndarray]) -> None:
    e = env(body={"weights": encode_weights(w)})
    body = decode(encode(e)).body
    expect = {k: (a.dtype.name, a.shape) for k, a in w.items()}
    got = decode_weights(body["weights"], Limits(), expect=expect)
    assert got.keys() == w.keys()
    for k, a in w.items():
        assert raw_bytes(got[k]) == raw_bytes(a) and got[k].shape == a.shape
    assert weights_nbytes(got) == weights_nbytes(body["weights"]) == sum(a.nbytes for a in w.values())


def test_valid_fixture_decodes() -> None:
    got = decode_weights(decode(VALID).body["weights"])
    assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in WEIGHTS.items()}


# --- envelope validation -----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", ""),
        ("kind", "Update"),
        ("kind", "a" * 33),
        ("kind", "round-start"),
        ("kind", "x\n"),
        ("kind", 5),
        ("federation", "Fed"),
        ("federation", "a/b"),
        ("federation", "#"),
        ("federation", "fed\n"),
        ("federation", ""),
        ("sender", "a+b"),
        ("sender", None),
        ("sender", "-x"),
        ("sender", "x" * 64),
        ("round", -1),
        ("round", True),
        ("round", 1.0),
        ("round", 2**63),
        ("seq", -1),
        ("seq", 2**63),
        ("seq", "1"),
        ("ts", math.nan),
        ("ts", math.inf),
        ("ts", "1"),
        ("ts", None),
        ("ts", False),
        ("body", []),
        ("body", None),
        ("body", {1: 2}),
        ("body", {"x": {b"k": 1}}),
        ("body", {"x": {1, 2}}),
        ("body", {"x": np.float32(1)}),
        ("body", {"x": 2**64}),
        ("body", {"x": -(2**63) - 1}),
        ("body", {"x": [object()]}),
        ("body", {"x": msgpack.ExtType(1, b"")}),
        ("version", 2),
        ("version", True),
        ("version", "1"),
    ],
)
def test_envelope_refuses_bad_fields(field: str, value: object) -> None:
    with pytest.raises(CodecError):
        env(**{field: value})


def test_envelope_accepts_the_int_range_of_msgpack() -> None:
    e = env(body={"lo": -(2**63), "hi": 2**64 - 1})
    assert decode(encode(e)) == e


def test_encode_wraps_a_body_mutated_after_construction() -> None:
    e = env(body={"x": 1})
    e.body["x"] = {1, 2}
    with pytest.raises(CodecError, match="cannot encode"):
        encode(e)


def test_unknown_version_is_named() -> None:
    err = refused(wire(v=7))
    assert str(err) == "unsupported protocol version 7; this agent speaks 1"
    # checked first: a newer layout gives the version error, not a missing-field one
    assert "version 2;" in str(refused(pack({"v": 2, "whatever": [1, 2]})))
    refused(pack({"k": "update"}), match="without a protocol version")
    refused(wire(v=True), match="unsupported protocol version True")
    refused(wire(v="1"), match="unsupported protocol version")
    with pytest.raises(CodecError, match="unsupported protocol version 2; this agent speaks 1"):
        env(version=2)
    assert PROTOCOL_VERSION == 1


@pytest.mark.parametrize(
    "data",
    [
        pack({k: v for k, v in FIELDS.items() if k != "q"} | {"b": {}}),  # missing field
        wire(x=1),  # unknown field
        wire(k=b"update"),
        wire(f="FED"),
        wire(s="a/b"),
        wire(r=-1),
        wire(q=2**63),
        wire(t=math.nan),
        wire(t="now"),
        wire(r=True),
        wire(body=pack([])),
        wire(body=pack(None)),
    ],
)
def test_wrong_envelope_fields(data: bytes) -> None:
    refused(data)


# --- bad inputs for the msgpack codec ------------------------------------------

LYING_HEADERS = {
    "array32 dd7fffffff": b"\xdd\x7f\xff\xff\xff",
    "array32 dd7fffffff+items": b"\xdd\x7f\xff\xff\xff" + b"\x00" * 64,
    "map32 huge": b"\xdf\xff\xff\xff\xff" + b"\xa1a\x00" * 8,
    "bin32 ffffffff": b"\xc6\xff\xff\xff\xff" + b"short",
    "str32 ffffffff": b"\xdb\xff\xff\xff\xff" + b"short",
    "bin8 past end": b"\xc4\xff" + b"abc",
    "str16 past end": b"\xda\x01\x00" + b"abc",
    "array16 past end": b"\xdc\x01\x00\x00",
}


@pytest.mark.parametrize("raw", LYING_HEADERS.values(), ids=LYING_HEADERS.keys())
def test_length_headers_that_lie(raw: bytes) -> None:
    refused(raw)  # alone: not even an envelope
    refused(wire(body=b"\x81\xa1x" + raw))  # inside a body
    refused(
        wire(body=b"\x81\xa1x" + raw),
        Limits(max_array_len=2**32, max_map_len=2**32, max_str_len=2**32, max_bin_len=2**32),
    )


@pytest.mark.parametrize(
    "opener",
    [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"],
    ids=["fixarray", "fixmap", "array16", "map16"],
)
def test_ten_thousand_deep_nesting(opener: bytes) -> None:
    deep = opener * 10_000 + b"\x00"
    refused(wire(body=b"\x81\xa1x" + deep), match="nested deeper")
    refused(wire(body=b"\x81\xa1x" + opener * 10_000), match="nested deeper")  # and unterminated
    refused(b"\x81\xa1k" * 10_000 + b"\x00", match="nested deeper")  # the envelope map itself


def test_depth_limit_is_exact() -> None:
    def nested(depth: int) -> dict:
        body: dict = {}
        for _ in range(depth - 1):
            body = {"d": body}
        return body

    limit = Limits().max_depth
    assert decode(encode(env(body=nested(limit)))).body == nested(limit)
    refused(encode(env(body=nested(limit + 1))), match="nested deeper")
    assert decode(encode(env(body=nested(limit + 1))), Limits(max_depth=limit + 1))
    refused(encode(env(body={"l": [[[[]]]]})), Limits(max_depth=4), match="nested deeper")


NON_STRING_KEYS = {
    "int": b"\x01",
    "negative int": b"\xff",
    "NaN float64": b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",
    "NaN float32": b"\xca\x7f\xc0\x00\x00",
    "inf": b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",
    "bytes": b"\xc4\x01k",
    "nil": b"\xc0",
    "true": b"\xc3",
    "array": b"\x91\x00",
    "map": b"\x81\xa1a\x00",
}


@pytest.mark.parametrize("key", NON_STRING_KEYS.values(), ids=NON_STRING_KEYS.keys())
def test_non_string_map_keys(key: bytes) -> None:
    refused(wire(body=b"\x81" + key + b"\x00"), match="key")
    refused(wire(body=b"\x81\xa1x\x82\xa1a\x00" + key + b"\x00"), match="key")  # nested
    refused(wire_extra(key + b"\x00"), match="key")  # in the envelope map itself


def test_duplicate_keys_are_refused() -> None:
    # msgpack on its own keeps the last value of a duplicate key; the decoder refuses it.
    assert msgpack.unpackb(b"\x82\xa1a\x01\xa1a\x02") == {"a": 2}
    refused(wire(body=b"\x82\xa1a\x01\xa1a\x02"), match="duplicate")
    refused(wire(body=b"\x81\xa1x\x82\xa1a\x01\xa1a\x01"), match="duplicate")  # same value too
    refused(wire_extra(pack("v") + pack(1)), match="duplicate")
    refused(wire_extra(pack("b") + pack({})), match="duplicate")
    t = encode_tensor(np.zeros(2, np.float32))
    dup_tensor = b"\x84" + b"".join(pack(k) + pack(v) for k, v in t.items()) + pack("dtype") + pack("int8")
    refused(wire(body=b"\x81\xa1w" + dup_tensor), match="duplicate")


@pytest.mark.parametrize(
    "raw",
    [b"\xa2\xff\xfe", b"\xa3\xed\xa0\x80", b"\xa2\xc0\x80", b"\xa1\x80", b"\xd9\x02\xe2\x82", b"\xa4\xf4\x90\x80\x80"],
    ids=["ff-fe", "surrogate", "overlong-nul", "continuation", "truncated-seq", "above-10ffff"],
)
def test_invalid_utf8(raw: bytes) -> None:
    refused(wire(body=b"\x81\xa1x" + raw), match="UTF-8")  # as a value
    refused(wire(body=b"\x81" + raw + b"\x00"), match="UTF-8")  # as a key
    refused(wire(s=None).replace(pack("s") + pack(None), pack("s") + raw), match="UTF-8")


EXTS = {
    "fixext1 code 5": b"\xd4\x05\x00",
    "fixext2": b"\xd5\x01\x00\x00",
    "fixext4 timestamp": b"\xd6\xff\x00\x00\x00\x00",
    "fixext8 timestamp": b"\xd7\xff" + b"\x00" * 8,
    "fixext16": b"\xd8\x7f" + b"\x00" * 16,
    "ext8 empty code 5": b"\xc7\x00\x05",
    "ext8 empty timestamp": b"\xc7\x00\xff",
    "ext8 timestamp96": b"\xc7\x0c\xff" + b"\x00" * 12,
    "ext16": b"\xc8\x00\x01\x80\x00",
    "ext32": b"\xc9\x00\x00\x00\x01\x01\x00",
    "ext8 truncated": b"\xc7",
}


@pytest.mark.parametrize("raw", EXTS.values(), ids=EXTS.keys())
def test_ext_types_are_never_decoded(raw: bytes) -> None:
    refused(wire(body=b"\x81\xa1x" + raw), match="ext")
    refused(wire(body=b"\x81\xa1x\x92\x00" + raw), match="ext")


def test_zero_length_ext_slips_past_max_ext_len_in_msgpack_itself() -> None:
    # Why the decoder has its own ext check and a refusing ext_hook: max_ext_len=0 does
    # not stop an ext8 of length 0, which msgpack turns into an ExtType object.
    got = msgpack.unpackb(b"\xc7\x00\x05", max_ext_len=0)
    assert got == msgpack.ExtType(5, b"")


def test_trailing_bytes() -> None:
    refused(VALID + b"\x00", match="trailing")
    refused(VALID + VALID, match="trailing")
    refused(VALID + b"\xc1", match="trailing")


def test_truncation_at_every_offset() -> None:
    for cut in range(len(VALID)):
        refused(VALID[:cut])
    assert decode(VALID)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xc0",
        b"\x91\x80",
        b"\xa1x",
        b"\xc1",
        b"\xc4\x00",
        b"\x80",
        b"\x81\xa1v\x01",
        wire(body=b"\x81\xa1x\xc1"),
    ],
)
def test_not_an_envelope(data: bytes) -> None:
    refused(data)


@pytest.mark.parametrize("data", ["text", None, 5, [1], {"v": 1}])
def test_decode_refuses_non_bytes(data: object) -> None:
    refused(data)


def test_oversized_message_refused_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(codec, "_scan", lambda *a: calls.append("scan"))
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: calls.append("unpackb"))
    limits = Limits(max_message_bytes=len(VALID) - 1)
    refused(VALID, limits, match=f"{len(VALID)} bytes exceeds the limit of {len(VALID) - 1}")
    refused(memoryview(VALID), limits, match="exceeds the limit")
    assert calls == []


def test_hundred_megabyte_array_header_refused_without_allocating() -> None:
    count = 100_000_000
    body = b"\x81\xa1x\xdd" + count.to_bytes(4, "big") + b"\x00" * count  # 100 MB of fixint 0
    data = wire(body=body)
    big = Limits(max_message_bytes=len(data))
    assert peak_bytes(lambda: decode(data, big)) < 1_000_000
    refused(data, big, match="exceeds max_array_len")
    refused(data, match="exceeds the limit")  # default limits: too big before any parsing
    # a bin header claiming 100 MB that is not there
    no_data = wire(body=b"\x81\xa1x\xc6" + count.to_bytes(4, "big"))
    assert peak_bytes(lambda: decode(no_data, big)) < 1_000_000


def test_object_count_bounds_amplification() -> None:
    # 100k empty arrays: 100 kB on the wire, ~6 MB of Python lists if unpacked.
    data = wire(body=b"\x81\xa1x\xdd" + (100_000).to_bytes(4, "big") + b"\x90" * 100_000)
    assert decode(data).body["x"][-1] == []
    small = Limits(max_objects=50_000)
    assert peak_bytes(lambda: decode(data, small)) < 200_000
    refused(data, small, match="more than 50000 objects")


def test_huge_tensor_header_refused_without_allocating() -> None:
    t = {"dtype": "float64", "shape": [2**31, 2**31, 2**31], "data": b"\x00" * 8}
    data = encode(env(body={"weights": {"w": t}}))
    body = decode(data).body
    assert peak_bytes(lambda: decode_weights(body["weights"], Limits(max_tensor_bytes=2**62))) < 50_000
    with pytest.raises(CodecError, match="tensor 'w'.*exceeds max_tensor_bytes"):
        decode_weights(body["weights"])


# --- the second line of defence holds on its own --------------------------------

SECOND_LINE = [
    *LYING_HEADERS.values(),
    *(b"\x81" + k + b"\x00" for k in NON_STRING_KEYS.values()),
    *EXTS.values(),
    b"\x91" * 10_000 + b"\x00",
    b"\x82\xa1a\x01\xa1a\x02",
    b"\xa2\xff\xfe",
    b"\xc1",
]


@pytest.mark.parametrize("raw", SECOND_LINE)
def test_msgpack_layer_alone_still_refuses(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the header scan switched off, msgpack's limits and the hooks still refuse."""
    monkeypatch.setattr(codec, "_scan", lambda *a: None)
    refused(wire(body=b"\x81\xa1x" + raw))
    refused(VALID + raw)


def test_msgpack_layer_alone_refuses_deep_input_and_big_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_scan", lambda *a: None)
    refused(wire(body=b"\x81\xa1x" + b"\x91" * 40 + b"\x00"), match="nested deeper")  # iterative post-check
    count = 100_000_000
    data = wire(body=b"\x81\xa1x\xdd" + count.to_bytes(4, "big") + b"\x00" * count)
    assert peak_bytes(lambda: decode(data, Limits(max_message_bytes=len(data)))) < 1_000_000


@pytest.mark.parametrize(
    "exc",
    [
        RecursionError("deep"),
        MemoryError(),
        TypeError("t"),
        ValueError("v"),
        msgpack.ExtraData(1, b"x"),
        msgpack.StackError(),
        msgpack.FormatError(),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
        OverflowError(),
        KeyError("k"),
    ],
)
def test_every_unpacker_error_becomes_codec_error(exc: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise exc

    monkeypatch.setattr(msgpack, "unpackb", boom)
    err = refused(VALID)
    assert err.__cause__ is exc


def test_pure_python_msgpack_fallback_is_refused_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    from msgpack import fallback

    monkeypatch.setattr(codec, "_scan", lambda *a: None)
    monkeypatch.setattr(msgpack, "unpackb", fallback.unpackb)
    assert decode(VALID)
    for raw in SECOND_LINE:
        refused(wire(body=b"\x81\xa1x" + raw))


# --- tensors ------------------------------------------------------------------------


def tensor(**kw: object) -> dict:
    return {"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 24} | kw


@pytest.mark.parametrize(
    "obj, match",
    [
        (tensor(dtype="object"), "dtype"),
        (tensor(dtype="O"), "dtype"),
        (tensor(dtype="V8"), "dtype"),
        (tensor(dtype="<U4"), "dtype"),
        (tensor(dtype="<f4"), "dtype"),
        (tensor(dtype="float128"), "dtype"),
        (tensor(dtype="complex64"), "dtype"),
        (tensor(dtype="float32 "), "dtype"),
        (tensor(dtype=None), "dtype"),
        (tensor(dtype=b"float32"), "dtype"),
        (tensor(dtype="S8"), "dtype"),
        (tensor(dtype="M8"), "dtype"),
        (tensor(shape=[-2, -3]), "negative"),
        (tensor(shape=[2, -3]), "negative"),
        (tensor(shape=[True, 3]), "not an int"),
        (tensor(shape=[2.0, 3]), "not an int"),
        (tensor(shape="2,3"), "shape"),
        (tensor(shape=None), "shape"),
        (tensor(shape=[7]), "needs 28"),
        (tensor(shape=[1] * 9, data=b"\x00" * 4), "max_tensor_dims"),
        (tensor(shape=[2**63, 0]), "exceeds"),
        (tensor(shape=[2**40] * 8), "exceeds"),
        (tensor(data=b"\x00" * 23), "needs 24"),
        (tensor(data=b"\x00" * 25), "needs 24"),
        (tensor(data=b""), "needs 24"),
        (tensor(data="x" * 24), "binary"),
        (tensor(data=[0] * 24), "binary"),
        (tensor(data=None), "binary"),
        (tensor(dtype="bool", shape=[2], data=b"\x01\x02"), "bool"),
        (tensor(extra=1), "exactly"),
        ({"dtype": "float32", "shape": [0]}, "exactly"),
        ([1, 2], "map"),
        (None, "map"),
    ],
)
def test_bad_tensors(obj: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_tensor(obj)


def test_tensor_expectations() -> None:
    t = encode_tensor(np.zeros((2, 3), np.float32))
    assert decode_tensor(t, expect_dtype="float32", expect_shape=(2, 3)).shape == (2, 3)
    with pytest.raises(CodecError, match="float64 was expected"):
        decode_tensor(t, expect_dtype="float64")
    with pytest.raises(CodecError, match=r"\[3, 2\] was expected"):
        decode_tensor(t, expect_shape=(3, 2))
    with pytest.raises(CodecError, match="exceeds max_tensor_bytes"):
        decode_tensor(t, Limits(max_tensor_bytes=23))
    assert decode_tensor(t, Limits(max_tensor_bytes=24)).nbytes == 24


@pytest.mark.parametrize(
    "a",
    [
        np.array([object()]),
        np.array(["abcd"]),
        np.zeros(2, "V8"),
        np.zeros(2, np.complex64),
        np.zeros(2, [("a", "f4")]),
        np.zeros(2, "M8[s]"),
        np.zeros(2, np.uint64),
        np.zeros(2, np.uint32),
        np.zeros(2, "S4"),
    ],
    ids=["object", "unicode", "void", "complex", "structured", "datetime", "uint64", "uint32", "bytes"],
)
def test_encode_refuses_dtypes_outside_the_allow_list(a: np.ndarray) -> None:
    with pytest.raises(CodecError, match="cannot be sent"):
        encode_tensor(a)
    with pytest.raises(CodecError, match="tensor 'x'"):
        encode_weights({"x": a})


def test_encode_tensor_refuses_non_arrays() -> None:
    with pytest.raises(CodecError):
        encode_tensor([1.0, 2.0])  # type: ignore[arg-type]


# --- weights -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "x" * 201, "a\nb", "tab\there", "\x00", 5, b"w"])
def test_bad_tensor_names(name: object) -> None:
    t = encode_tensor(np.zeros(1, np.float32))
    with pytest.raises(CodecError, match="tensor name"):
        decode_weights({name: t})
    with pytest.raises(CodecError, match="tensor name"):
        encode_weights({name: np.zeros(1)})  # type: ignore[dict-item]
    assert decode_weights({"x" * 200: t})


def test_weights_expect_names_the_tensor() -> None:
    w = encode_weights({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)})
    expect = {"w": ("float32", (2, 2)), "b": ("float32", (2,))}
    assert decode_weights(w, Limits(), expect=expect).keys() == {"w", "b"}
    with pytest.raises(CodecError, match="tensor 'b' missing"):
        decode_weights({"w": w["w"]}, expect=expect)
    with pytest.raises(CodecError, match="unexpected tensor 'c'"):
        decode_weights(w | {"c": w["b"]}, expect=expect)
    with pytest.raises(CodecError, match="tensor 'b'.*float64 was expected"):
        decode_weights(w, expect=expect | {"b": ("float64", (2,))})
    with pytest.raises(CodecError, match=r"tensor 'w'.*\[4\] was expected"):
        decode_weights(w, expect=expect | {"w": ("float32", (4,))})
    with pytest.raises(CodecError, match="tensor 'w'.*needs 16"):
        decode_weights(w | {"w": w["w"] | {"data": b"\x00" * 15}})
    with pytest.raises(CodecError, match="weights must be a map"):
        decode_weights([w])
    with pytest.raises(CodecError, match="max_map_len"):
        decode_weights(w, Limits(max_map_len=1))


def test_check_finite_names_the_tensor() -> None:
    check_finite({"i": np.array([2**62]), "b": np.array([True]), "f": np.ones(3, np.float16), "e": np.zeros(0)})
    for dtype in ("float16", "float32", "float64"):
        for bad in (math.nan, math.inf, -math.inf):
            a = np.zeros(5, dtype)
            a[3] = bad
            with pytest.raises(CodecError, match="tensor 'layer.1' holds 1 non-finite"):
                check_finite({"ok": np.zeros(2), "layer.1": a})
    big = np.zeros((3, 2**20), np.float32)  # past one block
    big[2, -1] = math.nan
    with pytest.raises(CodecError, match="tensor 'big'"):
        check_finite({"big": big})
    with pytest.raises(CodecError, match="tensor 't'"):
        check_finite({"t": np.full((4, 4), math.inf).T})
    # the codec itself carries NaN: finiteness is aggregation's business
    nan = decode_tensor(encode_tensor(np.array([math.nan], np.float32)))
    assert math.isnan(nan[0])


def test_weights_nbytes() -> None:
    assert weights_nbytes(WEIGHTS) == 12 * 4 + 4 * 8 + 2 + 0
    assert weights_nbytes(encode_weights(WEIGHTS)) == weights_nbytes(WEIGHTS)
    with pytest.raises(CodecError):
        weights_nbytes({"x": [1, 2]})


def test_limits_validate_themselves() -> None:
    for bad in ({"max_depth": 0}, {"max_depth": 10_000}, {"max_str_len": -1}, {"max_objects": 1.5}):
        with pytest.raises(ValueError):
            Limits(**bad)  # type: ignore[arg-type]
    refused(VALID, "no limits")  # type: ignore[arg-type]


# --- fuzz ------------------------------------------------------------------------------


def decodes_or_codec_error(data: bytes, limits: Limits = Limits()) -> None:
    try:
        result = decode(data, limits)
    except CodecError:
        return
    assert isinstance(result, Envelope)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decodes_or_codec_error(data)
    decodes_or_codec_error(b"\x88" + data)  # looks like the start of an envelope


SEEDS = [
    VALID,
    encode(env(kind="chunk", body={"tid": "t", "i": 0, "n": 1, "size": 3, "sha256": b"\x00" * 32, "data": b"abc"})),
    encode(env(body={"deep": [[[{"a": [1, 2.5, None, True, "x", b"y"]}]]]})),
]

mutations = st.lists(
    st.tuples(
        st.sampled_from(["set", "insert", "delete", "flip"]),
        st.integers(0, 10**6),
        st.sampled_from(
            [
                0x00,
                0x7F,
                0x80,
                0x8F,
                0x90,
                0x9F,
                0xA0,
                0xBF,
                0xC0,
                0xC1,
                0xC4,
                0xC6,
                0xC7,
                0xCB,
                0xD4,
                0xD9,
                0xDB,
                0xDC,
                0xDD,
                0xDE,
                0xDF,
                0xFF,
            ]
        )
        | st.integers(0, 255),
    ),
    min_size=1,
    max_size=6,
)


def mutate(seed: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(seed)
    for op, pos, value in ops:
        at = pos % (len(b) + 1)
        if op == "insert":
            b[at:at] = bytes([value])
        elif b and op == "set":
            b[at % len(b)] = value
        elif b and op == "delete":
            del b[at % len(b)]
        elif b and op == "flip":
            b[at % len(b)] ^= 1 << (value % 8)
    return bytes(b)


@settings(max_examples=700, deadline=None)
@given(
    st.sampled_from(SEEDS),
    mutations,
    st.sampled_from([Limits(), Limits(max_depth=3, max_objects=40, max_array_len=4, max_str_len=8)]),
)
def test_fuzz_mutated_valid_messages(seed: bytes, ops: list[tuple[str, int, int]], limits: Limits) -> None:
    data = mutate(seed, ops)
    decodes_or_codec_error(data, limits)
    try:
        e = decode(data, limits)
    except CodecError:
        return
    if "weights" in e.body:  # and what got through goes on through the tensor decoder
        try:
            decode_weights(e.body["weights"], limits)
        except CodecError:
            pass
