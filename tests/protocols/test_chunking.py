"""Chunked transfers: split, and reassembly under limits, in any order, with duplicates."""

from __future__ import annotations

import hashlib
import math
import random
import threading
import tracemalloc
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagent.errors import CodecError
from fedagent.protocols.chunking import MAX_TID_LEN, Reassembler, split
from fedagent.protocols.codec import Envelope, Limits, decode, encode

MB = 2**20


def reassembler(**kw: object) -> Reassembler:
    args = {"max_transfer_bytes": 10 * MB, "max_pending_bytes": 20 * MB, "timeout": 30.0} | kw
    return Reassembler(**args)  # type: ignore[arg-type]


def feed_all(r: Reassembler, sender: str, bodies: list[dict], now: float = 0.0) -> list[bytes]:
    return [out for b in bodies if (out := r.feed(sender, b, now)) is not None]


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# --- split ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.integers(1, 700))
def test_split_layout(data: bytes, max_chunk: int) -> None:
    bodies = split(data, max_chunk=max_chunk, transfer_id="t-1")
    n = max(1, math.ceil(len(data) / max_chunk))
    assert len(bodies) == n
    assert [b["i"] for b in bodies] == list(range(n))
    assert all(b["n"] == n and b["size"] == len(data) and b["tid"] == "t-1" for b in bodies)
    assert all(b["sha256"] == hashlib.sha256(data).digest() for b in bodies)
    assert all(len(b["data"]) == max_chunk for b in bodies[:-1])
    assert 0 < len(bodies[-1]["data"]) <= max_chunk or not data
    assert b"".join(b["data"] for b in bodies) == data
    assert all(type(b["data"]) is bytes for b in bodies)


def test_split_accepts_buffers_and_validates_arguments() -> None:
    data = payload(100)
    assert split(memoryview(data), max_chunk=30, transfer_id="x") == split(data, max_chunk=30, transfer_id="x")
    assert split(bytearray(data), max_chunk=30, transfer_id="x") == split(data, max_chunk=30, transfer_id="x")
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError):
            split(data, max_chunk=bad, transfer_id="x")  # type: ignore[arg-type]
    for tid in ("", "x" * (MAX_TID_LEN + 1), "a\nb", None, 5):
        with pytest.raises(ValueError):
            split(data, max_chunk=30, transfer_id=tid)  # type: ignore[arg-type]
    assert split(data, max_chunk=30, transfer_id="x" * MAX_TID_LEN)


def test_empty_payload_is_one_empty_chunk() -> None:
    (body,) = split(b"", max_chunk=10, transfer_id="e")
    assert body["n"] == 1 and body["size"] == 0 and body["data"] == b""
    assert reassembler().feed("a", body, 0.0) == b""


# --- round trips ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4000), st.integers(1, 500), st.randoms(use_true_random=False), st.integers(0, 20))
def test_reassembly_in_any_order_with_duplicates(data: bytes, max_chunk: int, rnd: random.Random, extra: int) -> None:
    bodies = split(data, max_chunk=max_chunk, transfer_id="tx")
    stream = bodies + [rnd.choice(bodies) for _ in range(extra)]
    rnd.shuffle(stream)
    r = reassembler()
    out = []
    for t, b in enumerate(stream):
        got = r.feed("agent-1", b, float(t))
        if got is not None:
            out.append(got)
            assert r.pending_bytes == 0 and r.pending_transfers == 0
    assert out == [data]  # exactly once, whatever the order and the duplicates
    assert feed_all(r, "agent-1", bodies, 1.0) == []  # a late redelivery of the whole set
    assert r.pending_bytes == 0 and r.pending_transfers == 0


def test_chunks_travel_in_envelopes_under_wire_limits() -> None:
    data = payload(300_000)
    max_chunk = 64 * 1024
    wire_limits = Limits(max_message_bytes=max_chunk + 4096, max_bin_len=max_chunk + 4096)
    frames = [
        encode(Envelope(kind="chunk", federation="fed", sender="agent-1", round=2, seq=i, ts=1.0, body=b))
        for i, b in enumerate(split(data, max_chunk=max_chunk, transfer_id="abc-1"))
    ]
    assert all(len(f) <= max_chunk + 4096 for f in frames)
    r = reassembler()
    out = feed_all(r, "agent-1", [decode(f, wire_limits).body for f in reversed(frames)])
    assert out == [data]


def test_interleaved_transfers_and_senders_never_mix() -> None:
    a, b = payload(1000, 1), payload(1000, 2)
    ca = split(a, max_chunk=100, transfer_id="same")
    cb = split(b, max_chunk=100, transfer_id="same")
    r = reassembler()
    results: dict[str, bytes] = {}
    for x, y in zip(ca, cb, strict=True):
        for sender, body in (("alice", x), ("bob", y)):
            if (got := r.feed(sender, body, 0.0)) is not None:
                results[sender] = got
    assert results == {"alice": a, "bob": b}
    # and one sender's two transfers by tid
    r2 = reassembler()
    c1, c2 = split(a, max_chunk=300, transfer_id="1"), split(b, max_chunk=300, transfer_id="2")
    mixed = [c for pair in zip(c1, c2, strict=True) for c in pair]
    assert feed_all(r2, "alice", mixed) == [a, b]


# --- corruption and inconsistency ----------------------------------------------------


def test_digest_mismatch_drops_the_transfer() -> None:
    data = payload(1000)
    bodies = split(data, max_chunk=100, transfer_id="t")
    bad = dict(bodies[4], data=bytes(100))  # same length, other bytes
    r = reassembler()
    feed_all(r, "a", bodies[:4] + [bad] + bodies[5:-1])
    assert r.pending_transfers == 1
    with pytest.raises(CodecError, match="sha256 mismatch"):
        r.feed("a", bodies[-1], 0.0)
    assert r.pending_bytes == 0 and r.pending_transfers == 0
    # a single-chunk transfer too
    (one,) = split(b"hello", max_chunk=10, transfer_id="s")
    with pytest.raises(CodecError, match="sha256 mismatch"):
        r.feed("a", dict(one, data=b"jello"), 0.0)
    assert r.feed("a", one, 0.0) == b"hello"  # the genuine one is still accepted


class _CountingSha:
    """hashlib.sha256 that counts the bytes each call to feed() hashes."""

    fed = 0
    _sha256 = hashlib.sha256

    def __init__(self, data: bytes = b"") -> None:
        self._h = _CountingSha._sha256()
        self.update(data)

    def update(self, data) -> None:
        _CountingSha.fed += memoryview(data).nbytes
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


def test_in_order_chunks_are_hashed_as_they_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk that completes an in-order transfer costs a hash of itself only, not a
    pass over the whole payload; out of order, the digest still covers every byte."""
    import fedagent.protocols.chunking as chunking

    monkeypatch.setattr(chunking.hashlib, "sha256", _CountingSha)
    data = payload(1050)
    bodies = split(data, max_chunk=100, transfer_id="t")
    r = reassembler()
    feed_all(r, "a", bodies[:-1])
    _CountingSha.fed = 0
    assert r.feed("a", bodies[-1], 0.0) == data
    assert _CountingSha.fed == 50
    # out of order: the last and the first chunk last; tampered in the middle: refused
    for order, tamper in (([10, *range(1, 10), 0], None), ([*range(10), 10], 5), ([10, *range(10)], 0)):
        fed = [dict(bodies[i], tid=f"o{order[0]}{tamper}") for i in order]
        if tamper is not None:
            k = order.index(tamper)
            fed[k] = dict(fed[k], data=bytes(100))
        r = reassembler()
        if tamper is None:
            assert feed_all(r, "a", fed) == [data]
        else:
            with pytest.raises(CodecError, match="sha256 mismatch"):
                feed_all(r, "a", fed)
            assert r.pending_transfers == 0


@pytest.mark.parametrize(
    "change", [{"n": 11, "size": 1100}, {"n": 11, "size": 1050}, {"size": 999}, {"sha256": bytes(32)}]
)
def test_chunks_that_disagree_drop_the_transfer(change: dict) -> None:
    # each of these chunks is self-consistent; it only contradicts the earlier ones
    bodies = split(payload(1000), max_chunk=100, transfer_id="t")
    r = reassembler()
    feed_all(r, "a", bodies[:3])
    assert r.pending_transfers == 1
    with pytest.raises(CodecError, match="disagrees"):
        r.feed("a", bodies[3] | change, 0.0)
    assert r.pending_transfers == 0 and r.pending_bytes == 0


def test_chunk_lengths_must_fit_together() -> None:
    data = payload(1000)
    bodies = split(data, max_chunk=100, transfer_id="t")
    r = reassembler()
    r.feed("a", bodies[0], 0.0)
    with pytest.raises(CodecError, match="every chunk but the last has 100"):
        r.feed("a", {**bodies[1], "data": bodies[1]["data"] + bodies[2]["data"][:10]}, 0.0)
    assert r.pending_transfers == 0
    # the last chunk first: it fixes where the others must end
    bodies = split(payload(950), max_chunk=100, transfer_id="u")  # last chunk has 50 bytes
    r.feed("a", bodies[-1], 0.0)
    with pytest.raises(CodecError):
        r.feed("a", {**bodies[0], "data": bodies[0]["data"][:99]}, 0.0)  # 9*99 + 50 != 950
    assert r.pending_transfers == 0
    assert feed_all(r, "a", bodies[::-1]) == [payload(950)]


@pytest.mark.parametrize(
    "change",
    [
        {"i": 10},
        {"i": -1},
        {"i": True},
        {"i": 1.0},
        {"n": 0},
        {"n": 1001},
        {"n": "10"},
        {"size": -1},
        {"size": 2**64},
        {"sha256": b"\x00" * 31},
        {"sha256": "0" * 32},
        {"sha256": bytearray(32)},
        {"tid": ""},
        {"tid": "x" * 65},
        {"tid": 5},
        {"tid": "a\x00"},
        {"data": "text"},
        {"data": None},
        {"data": [0] * 100},
        {"data": b""},
        {"data": b"x" * 112},
        {"data": b"x" * 99},
        {"extra": 1},
    ],
)
def test_bad_chunk_bodies(change: dict) -> None:
    body = split(payload(1000), max_chunk=100, transfer_id="t")[3] | change
    r = reassembler()
    with pytest.raises(CodecError):
        r.feed("a", body, 0.0)
    assert r.pending_transfers == 0 and r.pending_bytes == 0


@pytest.mark.parametrize("body", [None, [], "chunk", {"tid": "t"}])
def test_chunk_body_must_be_a_full_map(body: object) -> None:
    with pytest.raises(CodecError):
        reassembler().feed("a", body, 0.0)


@pytest.mark.parametrize("last", [b"", b"x" * 101, b"x" * 51])
def test_impossible_last_chunks(last: bytes) -> None:
    # 1000 bytes in 10 chunks: the last must hold 1000 - 9 * L bytes, 1 <= it <= L.
    body = split(payload(1000), max_chunk=100, transfer_id="t")[-1] | {"data": last}
    with pytest.raises(CodecError, match="cannot end"):
        reassembler().feed("a", body, 0.0)


def test_single_chunk_must_hold_the_whole_payload() -> None:
    (body,) = split(b"abcdef", max_chunk=10, transfer_id="t")
    with pytest.raises(CodecError, match="cannot end"):
        reassembler().feed("a", body | {"data": b"abc"}, 0.0)


# --- limits: refused before allocation -------------------------------------------------


def traced_peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(CodecError):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_oversized_transfer_refused_before_allocation() -> None:
    size = 2**40  # a terabyte, announced in a 100-byte chunk
    body = {"tid": "big", "i": 0, "n": -(-size // 100), "size": size, "sha256": bytes(32), "data": b"x" * 100}
    r = reassembler(max_transfer_bytes=10 * MB)
    assert traced_peak(lambda: r.feed("a", body, 0.0)) < 100_000
    with pytest.raises(CodecError, match="exceeds the limit"):
        r.feed("a", body, 0.0)
    assert r.pending_bytes == 0 and r.pending_transfers == 0
    (single,) = split(payload(2000), max_chunk=4000, transfer_id="one")
    with pytest.raises(CodecError, match="exceeds the limit"):
        reassembler(max_transfer_bytes=1999).feed("a", single, 0.0)
    assert reassembler(max_transfer_bytes=2000).feed("a", single, 0.0) == payload(2000)


def test_pending_budget_checked_before_allocation() -> None:
    r = reassembler(max_transfer_bytes=64 * MB, max_pending_bytes=100 * MB)
    first = split(payload(60 * MB // 1000), max_chunk=1000, transfer_id="1")  # a small real one
    r.feed("a", first[0], 0.0)
    held = r.pending_bytes
    assert held == first[0]["size"] + (first[0]["n"] + 7) // 8
    big = {"tid": "2", "i": 0, "n": 64, "size": 64 * MB, "sha256": bytes(32), "data": b"x" * MB}
    r.feed("b", big, 0.0)  # 64 MB buffer fits
    assert r.pending_bytes == held + 64 * MB + 8
    again = big | {"tid": "3"}
    assert traced_peak(lambda: r.feed("c", again, 0.0)) < 2 * MB  # would need 64 MB more
    with pytest.raises(CodecError, match="already pending"):
        r.feed("c", again, 0.0)
    assert r.drop_sender("b") == ["2"]
    assert r.pending_bytes == held
    assert r.feed("c", again, 0.0) is None  # now it fits
    assert r.pending_transfers == 2


def test_number_of_transfers_is_bounded() -> None:
    r = reassembler(max_transfers=3)
    for k in range(3):
        r.feed("a", split(payload(10), max_chunk=5, transfer_id=str(k))[0], 0.0)
    with pytest.raises(CodecError, match="3 transfers already pending"):
        r.feed("a", split(payload(10), max_chunk=5, transfer_id="3")[0], 0.0)
    # single-chunk transfers need no buffer and pass
    assert r.feed("a", split(b"x", max_chunk=5, transfer_id="4")[0], 0.0) == b"x"


# --- time -----------------------------------------------------------------------------


def test_expiry_frees_memory() -> None:
    bodies = split(payload(10_000), max_chunk=1000, transfer_id="slow")
    r = reassembler(timeout=30.0)
    r.feed("a", bodies[0], 100.0)
    r.feed("a", bodies[1], 110.0)  # activity: idle time counts from here
    r.feed("b", split(payload(10), max_chunk=5, transfer_id="other")[0], 125.0)
    assert r.pending_bytes > 10_000
    assert r.expire(140.0) == []  # exactly timeout idle: kept
    assert r.expire(140.5) == [("a", "slow")]
    assert r.pending_transfers == 1
    assert r.expire(200.0) == [("b", "other")]
    assert r.pending_bytes == 0 and r.pending_transfers == 0
    # a chunk after expiry starts afresh (and would need all chunks again)
    assert r.feed("a", bodies[2], 300.0) is None and r.pending_transfers == 1


def test_duplicates_keep_a_transfer_alive_and_completed_ids_are_forgotten_after_timeout() -> None:
    data = payload(100)
    bodies = split(data, max_chunk=10, transfer_id="t")
    r = reassembler(timeout=10.0)
    r.feed("a", bodies[0], 0.0)
    r.feed("a", bodies[0], 9.0)  # a redelivery is activity
    assert r.expire(15.0) == []
    assert feed_all(r, "a", bodies[1:], 16.0) == [data]
    assert r.feed("a", bodies[3], 20.0) is None and r.pending_transfers == 0  # late duplicate ignored
    r.expire(100.0)
    # after the timeout the id may be used again
    assert feed_all(r, "a", bodies, 101.0) == [data]


def test_remembered_completions_are_bounded() -> None:
    r = reassembler(remember_completed=2)
    for k in range(3):
        assert r.feed("a", split(b"x", max_chunk=5, transfer_id=str(k))[0], 0.0) == b"x"
    assert r.feed("a", split(b"x", max_chunk=5, transfer_id="2")[0], 0.0) is None  # remembered
    assert r.feed("a", split(b"x", max_chunk=5, transfer_id="0")[0], 0.0) == b"x"  # forgotten: oldest


def test_drop_sender() -> None:
    r = reassembler()
    for sender, tid in (("a", "1"), ("a", "2"), ("b", "1")):
        r.feed(sender, split(payload(100), max_chunk=10, transfer_id=tid)[0], 0.0)
    assert sorted(r.drop_sender("a")) == ["1", "2"]
    assert r.pending_transfers == 1 and r.drop_sender("a") == []
    assert r.pending_bytes == 100 + 2


def test_constructor_validates() -> None:
    for kw in ({"max_transfer_bytes": -1}, {"max_pending_bytes": 1.5}, {"timeout": 0}, {"max_transfers": -1}):
        with pytest.raises(ValueError):
            reassembler(**kw)
    with pytest.raises(CodecError):
        reassembler().feed(None, split(b"x", max_chunk=1, transfer_id="t")[0], 0.0)  # type: ignore[arg-type]


# --- copies and hashing in an executor ----------------------------------------------


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch):
    """A one-thread executor, and every transfer large enough to use it."""
    import fedagent.protocols.chunking as chunking

    monkeypatch.setattr(chunking, "OFFLOAD_BYTES", 1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def test_offloaded_reassembly_in_any_order_with_duplicates(worker: ThreadPoolExecutor) -> None:
    for seed in range(60):
        rnd = random.Random(seed)
        data = payload(rnd.randrange(2, 5000), seed)
        bodies = split(data, max_chunk=rnd.randrange(1, 700), transfer_id=f"t{seed}")
        stream = bodies + [rnd.choice(bodies) for _ in range(rnd.randrange(0, 10))]
        rnd.shuffle(stream)
        r = reassembler(executor=worker)
        assert feed_all(r, "a", stream) == [data], seed
        assert r.pending_bytes == 0 and r.pending_transfers == 0


def test_offloaded_hashing_runs_in_the_worker_and_still_catches_a_mismatch(
    worker: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedagent.protocols.chunking as chunking

    threads: set[int] = set()

    class Recording(_CountingSha):
        def update(self, data) -> None:
            if memoryview(data).nbytes:  # not the empty start in the constructor
                threads.add(threading.get_ident())
            super().update(data)

    data = payload(1050)
    bodies = split(data, max_chunk=100, transfer_id="t")
    monkeypatch.setattr(chunking.hashlib, "sha256", Recording)  # the receiver's hashing only
    assert feed_all(reassembler(executor=worker), "a", bodies) == [data]
    assert threads and threading.get_ident() not in threads
    # tampered, in order and out of order (the tampered chunk hashed before or after the
    # ones around it): refused at the last chunk, and nothing is left pending
    for order, tamper in (([*range(10), 10], 5), ([10, *range(1, 10), 0], 0), ([3, 2, 1, 0, *range(4, 11)], 2)):
        fed = [dict(bodies[i], tid=f"o{order[0]}{tamper}") for i in order]
        k = order.index(tamper)
        fed[k] = dict(fed[k], data=bytes(100))
        r = reassembler(executor=worker)
        with pytest.raises(CodecError, match="sha256 mismatch"):
            feed_all(r, "a", fed)
        assert r.pending_transfers == 0 and r.pending_bytes == 0


def test_a_failed_job_drops_the_transfer(worker: ThreadPoolExecutor) -> None:
    class Failing:
        def submit(self, fn, *args):
            f: Future[None] = Future()
            f.set_exception(MemoryError("no room"))
            return f

    bodies = split(payload(1000), max_chunk=100, transfer_id="t")
    r = reassembler(executor=Failing())
    feed_all(r, "a", bodies[:-1])
    with pytest.raises(CodecError, match="could not be reassembled"):
        r.feed("a", bodies[-1], 0.0)
    assert r.pending_transfers == 0 and r.pending_bytes == 0


def test_executor_taken_away_mid_transfer(worker: ThreadPoolExecutor) -> None:
    """Its owner closing: the chunks still to come are placed and hashed in the caller."""
    data = payload(1000)
    bodies = split(data, max_chunk=100, transfer_id="t")
    r = reassembler(executor=worker)
    feed_all(r, "a", bodies[:5])
    r.executor = None
    assert feed_all(r, "a", bodies[5:]) == [data]
    # a transfer smaller than OFFLOAD_BYTES never uses it
    import fedagent.protocols.chunking as chunking

    chunking.OFFLOAD_BYTES = 2000  # restored by the fixture's monkeypatch
    closed = ThreadPoolExecutor(max_workers=1)
    closed.shutdown()  # a submit would raise
    r = reassembler(executor=closed)
    assert feed_all(r, "a", bodies) == [data]
