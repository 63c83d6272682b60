"""The signing digest hashes large binary values where they lie (no packed copy of a
model per message); what it hashes must stay exactly msgpack's packing of the envelope,
or nodes of different versions stop verifying each other's frames."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagent.protocols.codec import Envelope, decode, encode
from fedagent.protocols.messages import SyncGradient
from fedagent.security.signing import _DOMAIN, DATA_BOUND_KINDS, signing_digest


def packed_digest(env: Envelope) -> bytes:
    """The definition: SHA-256 of msgpack's packing of every field and the body."""
    body = env.body
    if env.kind in DATA_BOUND_KINDS and "data" in body:
        body = {k: v for k, v in body.items() if k != "data"}
    packed = msgpack.packb(
        [_DOMAIN, env.version, env.kind, env.federation, env.sender, env.round, env.seq, env.ts, env.cert, body],
        use_bin_type=True,
        datetime=False,
    )
    return hashlib.sha256(packed).digest()


def envelope(body: dict, kind: str = "sync_gradient") -> Envelope:
    return Envelope(kind=kind, federation="fed", sender="agent-1", round=3, seq=7, ts=1.5, body=body, cert=b"c" * 300)


# Binary values around every msgpack length form and the in-place threshold, as bytes,
# bytearray and memoryviews of several formats (contiguous or not).
sizes = st.sampled_from([0, 1, 255, 256, 16383, 16384, 65535, 65536, 70001])


@st.composite
def binaries(draw):
    n = draw(sizes)
    raw = bytes(draw(st.integers(0, 255)) for _ in range(3)) * (n // 3) + b"x" * (n % 3)
    kind = draw(st.sampled_from(["bytes", "bytearray", "mv", "mv_f32", "mv_strided"]))
    if kind == "bytes":
        return raw
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "mv":
        return memoryview(raw)
    if kind == "mv_f32":
        return memoryview(np.frombuffer(raw[: n - n % 4], dtype=np.float32))
    return memoryview(np.frombuffer(raw, dtype=np.uint8)[::2].copy())  # contiguous copy of a strided view


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    binaries(),
)
bodies = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(st.text(max_size=8), bodies, max_size=5), st.sampled_from(["sync_gradient", "chunk"]))
def test_the_digest_is_sha256_of_msgpacks_packing_whatever_the_body(body, kind):
    env = envelope(body, kind)
    assert signing_digest(env) == packed_digest(env)


def test_a_gradient_message_hashes_the_same_on_both_sides_and_as_defined():
    rng = np.random.default_rng(0)
    grad = {"beta": rng.normal(size=(50, 500)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    env = envelope(SyncGradient(3, 2, 64, 0.5, grad).to_body())
    sent = signing_digest(env)  # memoryviews of the arrays
    received = decode(encode(env))  # what the receiver rebuilds from the wire
    assert sent == packed_digest(env) == signing_digest(received) == packed_digest(received)
    flipped = dict(grad, b=grad["b"].copy())
    flipped["b"][3] = np.nextafter(flipped["b"][3], np.float32(np.inf))
    assert signing_digest(envelope(SyncGradient(3, 2, 64, 0.5, flipped).to_body())) != sent
