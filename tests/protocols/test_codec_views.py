"""decode(views=True): large binaries as read-only views of the payload, everything
else exactly as a plain decode, and a peer's ext types still refused."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols.codec import Envelope, Segments, decode, decode_weights, encode, encode_weights


def envelope() -> Envelope:
    w = {"a": np.arange(50_000, dtype=np.float32), "b": np.ones(7, np.float32)}
    return Envelope(
        kind="update",
        federation="f",
        sender="s",
        round=1,
        seq=2,
        ts=3.0,
        body={
            "weights": encode_weights(w),
            "small": b"x" * (Segments.VIEW_FROM - 1),
            "big": bytes(range(256)) * 300,
            "list": [b"y" * Segments.VIEW_FROM, 5, "z"],
        },
    )


@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_views_decode_to_the_same_values(container):
    data = encode(envelope())
    plain, viewed = decode(data), decode(container(data), views=True)
    assert plain.body.keys() == viewed.body.keys()
    assert type(viewed.body["big"]) is memoryview and viewed.body["big"].readonly
    assert type(viewed.body["small"]) is bytes  # below VIEW_FROM: copied as usual
    assert viewed.body["big"] == plain.body["big"] and viewed.body["small"] == plain.body["small"]
    assert viewed.body["list"][0] == plain.body["list"][0] and viewed.body["list"][1:] == [5, "z"]
    a, b = decode_weights(plain.body["weights"]), decode_weights(viewed.body["weights"])
    assert np.array_equal(a["a"], b["a"]) and np.array_equal(a["b"], b["b"])
    assert not b["a"].flags.writeable
    assert (viewed.kind, viewed.sender, viewed.seq, viewed.ts) == (plain.kind, plain.sender, plain.seq, plain.ts)
    assert encode(viewed) == data  # views pack as the same bytes (signatures agree)


def test_a_peers_ext_is_refused_with_views_too():
    wire = {"v": 1, "k": "x", "f": "f", "s": "s", "r": 0, "q": 1, "t": 0.0, "b": {"big": b"z" * 70_000}}
    for code in (0x42, 1):  # 0x42: the code the placeholders use
        wire["b"]["e"] = msgpack.ExtType(code, b"\0\0\0\0")
        data = msgpack.packb(wire, use_bin_type=True)
        with pytest.raises(CodecError, match="ext type"):
            decode(data, views=True)
