"""The reassembler's buffer is uninitialised memory: every byte must come from a chunk."""

from __future__ import annotations

import os

from fedagent.protocols.chunking import Reassembler, split


def test_reverse_order_fills_every_byte_and_hands_over_the_buffer():
    payload = os.urandom(1_000_003)
    chunks = split(payload, max_chunk=65_536, transfer_id="t")
    r = Reassembler(max_transfer_bytes=2**21, max_pending_bytes=2**22, timeout=60)
    out = [r.feed("a", c, 0.0) for c in reversed(chunks)]
    assert out[:-1] == [None] * (len(chunks) - 1)
    whole = out[-1]
    assert isinstance(whole, memoryview) and not whole.readonly  # its own buffer, not a copy
    assert bytes(whole) == payload
    assert r.pending_bytes == 0


def test_a_single_chunk_given_as_a_view_comes_back_as_its_own_bytes():
    payload = bytearray(os.urandom(1000))
    (chunk,) = split(payload, max_chunk=4096, transfer_id="t", copy=False)
    assert isinstance(chunk["data"], memoryview)
    r = Reassembler(max_transfer_bytes=2**20, max_pending_bytes=2**20, timeout=60)
    whole = r.feed("a", chunk, 0.0)
    payload[:] = bytes(1000)  # the frame's buffer changes afterwards
    assert type(whole) is bytes and whole != bytes(payload)
