"""Updates that are aggregated while they arrive, chunk by chunk (pure code).

An agent's update travels as one *stream payload*::

    u32 big-endian header length | header (an encoded Envelope, kind "update_head") | tensor bytes

The header carries the round fields (round, base_version, num_samples, metrics, leaving)
and one :class:`~fedagent.protocols.compression.TensorSpec` per tensor; the tensor bytes
follow in that order, each laid out by its encoding (raw, fp16, int8, or top-k indices
then values). The payload is cut into chunk envelopes of kind ``"ustream"`` whose bodies
are those of :mod:`~fedagent.protocols.chunking` (tid, i, n, size, sha256, data).

:class:`StreamIntake` turns those chunks into :class:`UpdateHead`, :class:`UpdatePart`
and :class:`UpdateEnd` events *as the chunks arrive*: a part is a run of values of one
tensor (a dense slice, or top-k values with their indices; int8 steps are decoded only
when the part is read), small enough to be folded into the round's running sums and
forgotten. Nothing here holds an update: per transfer it keeps the header (bounded), a
partial element (< 8 bytes), the top-k indices of the tensor being read (at most k·4
bytes), a running SHA-256 and any chunk that arrived ahead of its turn (bounded by
``max_pending_bytes`` over all transfers).

Validity: every count, length and range is checked against the header before it is
used, and the header is checked (sum of tensor byte counts = payload size) before the
first value is emitted. The SHA-256 of the whole payload is only known at the end, so
:class:`UpdateEnd` ``ok=True`` comes after the last chunk *and* a matching digest; the
consumer (the round machine) treats the parts before it as tentative. A transfer that
breaks off (bad chunk, digest mismatch, timeout) ends with ``ok=False``.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.chunking import OFFLOAD_BYTES, Reassembler
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.compression import (
    INDEX_DTYPE,
    TensorSpec,
    check_indices,
    float_nbytes,
    float_values,
    spec_from_wire,
    value_itemsize,
    wire_values,
)

__all__ = [
    "HEAD_KIND",
    "STREAM_KIND",
    "StreamIntake",
    "UpdateEnd",
    "UpdateHead",
    "UpdatePart",
    "encode_stream",
    "iter_stream_chunks",
]

STREAM_KIND = "ustream"
HEAD_KIND = "update_head"
MAX_HEADER_BYTES = 1 * 2**20
MAX_TENSORS = 10_000
MAX_METRICS = 64
#: Values of an int8 run in one part at most (their floats: 256 KiB, one block of the fold).
PART_VALUES = 1 << 16


@dataclass(frozen=True, slots=True)
class UpdateHead:
    sender: str
    tid: str
    round: int
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    leaving: bool
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class UpdatePart:
    """Values of tensor ``name``: a dense run from flat element ``start`` (``indices`` is
    None), or top-k values at ``indices``. ``delta``: the values are differences to the
    round's global model (every encoding but ``raw``).

    ``data`` holds the values as decoded, except int8 steps, which stay as they came (a
    view of the chunk) with their ``scale``: a part waiting for its turn to be folded
    holds a quarter of the memory of its floats, which are made when it is read."""

    sender: str
    tid: str
    name: str
    start: int
    data: np.ndarray = field(repr=False)
    indices: np.ndarray | None = field(default=None, repr=False)
    delta: bool = False
    scale: float | None = None

    @property
    def values(self) -> np.ndarray:
        """The part's values as floats (:func:`~fedagent.protocols.compression.float_values`):
        int8 steps are decoded anew at each read, so a consumer reads them once and lets
        them go with the part."""
        return float_values(self.data, self.scale)

    @property
    def size(self) -> int:
        """Number of values."""
        return int(self.data.size)

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`values`, without making them."""
        return float_nbytes(self.data, self.scale)


@dataclass(frozen=True, slots=True)
class UpdateEnd:
    sender: str
    tid: str
    ok: bool
    reason: str = ""


StreamEvent = UpdateHead | UpdatePart | UpdateEnd


# ---- sender side -----------------------------------------------------------------------
def encode_stream(head: Envelope, tensors: list[tuple[TensorSpec, Any]]) -> bytearray:
    """The stream payload: one buffer, tensor bytes copied once."""
    header = encode(head)
    total = 4 + len(header) + sum(s.nbytes for s, _ in tensors)
    out = bytearray(total)
    out[:4] = len(header).to_bytes(4, "big")
    out[4 : 4 + len(header)] = header
    pos = 4 + len(header)
    for spec, data in tensors:
        mv = memoryview(data).cast("B")
        if mv.nbytes != spec.nbytes:
            raise ValueError(f"tensor {spec.name}: {mv.nbytes} bytes, spec says {spec.nbytes}")
        out[pos : pos + spec.nbytes] = mv
        pos += spec.nbytes
    return out


def head_body(
    round_: int,
    base_version: int,
    num_samples: int,
    metrics: dict[str, float],
    leaving: bool,
    tensors: list[tuple[TensorSpec, Any]],
) -> dict[str, Any]:
    return {
        "round": round_,
        "base_version": base_version,
        "num_samples": num_samples,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "leaving": bool(leaving),
        "tensors": [s.to_wire() for s, _ in tensors],
    }


def iter_stream_chunks(
    payload: bytes | bytearray | memoryview, *, max_chunk: int, transfer_id: str, digest: bytes | None = None
) -> Iterator[dict[str, Any]]:
    """Chunk bodies for ``payload``, made one at a time; their data are views of it
    (the encoder copies them once, into the chunk envelope). ``digest``: its SHA-256
    if the caller computed it already."""
    view = memoryview(payload).cast("B")
    size = view.nbytes
    if digest is None:
        digest = hashlib.sha256(view).digest()
    n = max(1, -(-size // max_chunk))
    for i in range(n):
        yield {
            "tid": transfer_id,
            "i": i,
            "n": n,
            "size": size,
            "sha256": digest,
            "data": view[i * max_chunk : (i + 1) * max_chunk],
        }


# ---- receiver side ---------------------------------------------------------------------
class _Transfer:
    __slots__ = (
        "carry",
        "chunk_len",
        "elem",
        "hasher",
        "hbuf",
        "headed",
        "held",
        "held_bytes",
        "hlen",
        "idx",
        "idx_buf",
        "job",
        "last_seen",
        "n",
        "next_i",
        "pos",
        "sender",
        "sha256",
        "size",
        "specs",
        "t",
        "tid",
        "toff",
    )

    def __init__(self, sender: str, tid: str, n: int, size: int, digest: bytes, now: float) -> None:
        self.sender, self.tid, self.n, self.size, self.sha256 = sender, tid, n, size, digest
        self.hasher = hashlib.sha256()
        self.next_i = 0
        self.chunk_len = 0
        self.held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.pos = 0
        self.hlen = -1
        self.hbuf = bytearray()
        self.specs: tuple[TensorSpec, ...] = ()
        self.t = 0  # tensor being read
        self.toff = 0  # bytes of it read
        self.elem = 0  # dense: next element index; topk: next value index
        self.carry = bytearray()  # a partial element split across chunks
        self.idx_buf = bytearray()
        self.idx: np.ndarray | None = None
        self.headed = False
        self.last_seen = now
        # The latest hashing job in the intake's executor (None: hashed in feed()).
        self.job: Future[None] | None = None


def _hash_after(hasher: Any, data: memoryview, before: Future[None] | None) -> None:
    """An executor's job: feed ``hasher`` one chunk, after the stream's job ``before``."""
    if before is not None:
        before.result()
    hasher.update(data)


class StreamIntake:
    """Decode ``ustream`` chunks of any number of concurrent transfers into events."""

    def __init__(
        self,
        federation: str,
        *,
        max_transfer_bytes: int,
        max_pending_bytes: int,
        timeout: float,
        max_transfers: int = 4096,
        remember_completed: int = 8192,
        max_header_bytes: int = MAX_HEADER_BYTES,
        executor: Executor | None = None,
    ) -> None:
        """``executor`` (one worker thread): where the running SHA-256 of a stream of
        ``chunking.OFFLOAD_BYTES`` or more is computed, while the caller decodes and
        folds its chunks; a stream's end waits for it. None: in :meth:`feed`."""
        self.federation = federation
        self.executor = executor
        self.max_transfer_bytes = max_transfer_bytes
        self.max_pending_bytes = max_pending_bytes
        self.timeout = timeout
        self.max_transfers = max_transfers
        self.remember_completed = remember_completed
        self.header_limits = Limits(
            max_message_bytes=max_header_bytes, max_bin_len=1024, max_array_len=max(MAX_TENSORS, 16), max_str_len=4096
        )
        self._transfers: dict[tuple[str, str], _Transfer] = {}
        self._completed: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.pending_bytes = 0  # chunks held because they arrived ahead of their turn

    @property
    def pending_transfers(self) -> int:
        return len(self._transfers)

    def transfers(self) -> list[tuple[str, str]]:
        """(sender, transfer id) of each transfer in progress."""
        return list(self._transfers)

    def feed(self, sender: str, body: Any, now: float) -> list[StreamEvent]:
        """Events this chunk completes. A chunk that cannot be attributed to a transfer
        raises CodecError; a chunk that breaks a known transfer ends it (``ok=False``)."""
        tid, i, n, size, digest, data = Reassembler._fields(body)
        key = (sender, tid)
        if key in self._completed:
            return []  # QoS 1 redelivery of a finished transfer
        if size > self.max_transfer_bytes:
            raise CodecError(f"stream {tid!r} of {size} bytes exceeds the limit of {self.max_transfer_bytes}")
        t = self._transfers.get(key)
        if t is None:
            if len(self._transfers) >= self.max_transfers:
                raise CodecError(f"stream {tid!r} refused: {len(self._transfers)} transfers in progress")
            t = self._transfers[key] = _Transfer(sender, tid, n, size, digest, now)
        elif (t.n, t.size, t.sha256) != (n, size, digest):
            return [*self._fail(t, "chunk disagrees with earlier chunks (n/size/sha256)")]
        t.last_seen = now
        if i < t.next_i or i in t.held:
            return []  # duplicate
        out: list[StreamEvent] = []
        try:
            if i != t.next_i:
                length = len(data)
                if self.pending_bytes + length > self.max_pending_bytes:
                    raise CodecError(
                        f"chunk {i} arrived ahead of {t.next_i} and the hold-back limit "
                        f"of {self.max_pending_bytes} bytes is reached"
                    )
                t.held[i] = bytes(data)
                t.held_bytes += length
                self.pending_bytes += length
                return []
            self._chunk(t, i, data, out)
            while t.next_i in t.held:
                held = t.held.pop(t.next_i)
                t.held_bytes -= len(held)
                self.pending_bytes -= len(held)
                self._chunk(t, t.next_i, held, out)
        except CodecError as exc:
            return out + self._fail(t, str(exc))
        if t.next_i == t.n:
            self._forget(t, now)
            if t.job is not None:
                try:
                    t.job.result()
                except Exception as exc:  # noqa: BLE001 - whatever failed, the stream cannot be vouched for
                    out.append(UpdateEnd(sender, tid, False, f"stream not hashed: {exc}"))
                    return out
            if t.hasher.digest() != t.sha256:
                out.append(UpdateEnd(sender, tid, False, "sha256 mismatch"))
            else:
                out.append(UpdateEnd(sender, tid, True))
        return out

    def expire(self, now: float) -> list[UpdateEnd]:
        out: list[UpdateEnd] = []
        for t in [t for t in self._transfers.values() if now - t.last_seen > self.timeout]:
            out += self._fail(t, f"no chunk for {self.timeout:.0f}s")
        while self._completed and now - next(iter(self._completed.values())) > self.timeout:
            self._completed.popitem(last=False)
        return out

    def abort(self, sender: str, tid: str, reason: str) -> list[UpdateEnd]:
        """End transfer ``tid`` of ``sender`` as failed (a check above the intake refused
        it); it is remembered as finished, so its later chunks are ignored."""
        t = self._transfers.get((sender, tid))
        if t is None:  # ended with this very chunk
            return [UpdateEnd(sender, tid, False, reason)]
        return self._fail(t, reason)

    def drop_sender(self, sender: str, reason: str) -> list[UpdateEnd]:
        out: list[UpdateEnd] = []
        for t in [t for (s, _), t in self._transfers.items() if s == sender]:
            out += self._fail(t, reason)
        return out

    # -- internals ---------------------------------------------------------------------
    def _fail(self, t: _Transfer, reason: str) -> list[UpdateEnd]:
        self._forget(t, t.last_seen)
        return [UpdateEnd(t.sender, t.tid, False, reason)]

    def _forget(self, t: _Transfer, now: float) -> None:
        self._transfers.pop((t.sender, t.tid), None)
        self.pending_bytes -= t.held_bytes
        t.held.clear()
        t.held_bytes = 0
        self._completed[(t.sender, t.tid)] = now
        while len(self._completed) > self.remember_completed:
            self._completed.popitem(last=False)

    def _chunk(self, t: _Transfer, i: int, data: bytes | bytearray | memoryview, out: list[StreamEvent]) -> None:
        mv = memoryview(data).cast("B")
        length = mv.nbytes
        if i < t.n - 1:
            if i == 0:
                if length < 1 or not (t.n - 1) * length < t.size <= t.n * length:
                    raise CodecError(f"{length}-byte chunks cannot make {t.n} chunks of {t.size} bytes")
                t.chunk_len = length
            elif length != t.chunk_len:
                raise CodecError(f"chunk {i} has {length} bytes, the others {t.chunk_len}")
        elif length != t.size - (t.n - 1) * t.chunk_len:
            raise CodecError(f"last chunk has {length} bytes, does not end a {t.size}-byte payload")
        if self.executor is not None and t.size >= OFFLOAD_BYTES:
            # Its parts are tentative until the digest matches at the end anyway; the
            # job holds a view of the chunk until it has hashed it.
            t.job = self.executor.submit(_hash_after, t.hasher, mv, t.job)
        elif t.job is not None:  # the executor was taken away meanwhile (closing)
            _hash_after(t.hasher, mv, t.job)
            t.job = None
        else:
            t.hasher.update(mv)
        t.next_i += 1
        self._consume(t, mv, out)

    def _consume(self, t: _Transfer, mv: memoryview, out: list[StreamEvent]) -> None:
        while mv.nbytes:
            if not t.headed:
                mv = self._header_bytes(t, mv, out)
                continue
            if t.t >= len(t.specs):
                raise CodecError("bytes after the last tensor")
            spec = t.specs[t.t]
            take = mv[: spec.nbytes - t.toff]
            mv = mv[take.nbytes :]
            self._tensor_bytes(t, spec, take, out)
            t.toff += take.nbytes
            t.pos += take.nbytes
            if t.toff == spec.nbytes:
                t.t, t.toff, t.elem, t.idx = t.t + 1, 0, 0, None
                t.carry.clear()
                t.idx_buf = bytearray()
        self._skip_empty(t)

    def _skip_empty(self, t: _Transfer) -> None:
        while t.headed and t.t < len(t.specs) and t.specs[t.t].nbytes == 0:
            t.t += 1

    def _header_bytes(self, t: _Transfer, mv: memoryview, out: list[StreamEvent]) -> memoryview:
        if t.hlen < 0:
            need = 4 - len(t.hbuf)
            t.hbuf += mv[:need]
            mv = mv[min(need, mv.nbytes) :]
            if len(t.hbuf) < 4:
                return mv
            t.hlen = int.from_bytes(t.hbuf, "big")
            t.hbuf = bytearray()
            if t.hlen > self.header_limits.max_message_bytes or 4 + t.hlen > t.size:
                raise CodecError(f"stream header of {t.hlen} bytes is too large")
        need = t.hlen - len(t.hbuf)
        t.hbuf += mv[:need]
        mv = mv[min(need, mv.nbytes) :]
        if len(t.hbuf) == t.hlen:
            out.append(self._parse_header(t, bytes(t.hbuf)))
            t.hbuf = bytearray()
            t.pos = 4 + t.hlen
            t.headed = True
            self._skip_empty(t)
        return mv

    def _parse_header(self, t: _Transfer, raw: bytes) -> UpdateHead:
        env = decode(raw, self.header_limits)
        if env.kind != HEAD_KIND or env.sender != t.sender or env.federation != self.federation:
            raise CodecError("stream header: wrong kind, sender or federation")
        b = env.body
        if set(b) != {"round", "base_version", "num_samples", "metrics", "leaving", "tensors"}:
            raise CodecError(
                "stream header: fields must be round, base_version, num_samples, metrics, leaving, tensors"
            )
        for k in ("round", "base_version", "num_samples"):
            if type(b[k]) is not int or b[k] < 0:
                raise CodecError(f"stream header: {k} must be a non-negative int")
        if b["num_samples"] == 0:
            raise CodecError("stream header: num_samples must be positive")
        metrics = b["metrics"]
        if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
            raise CodecError(f"stream header: metrics must be a map of at most {MAX_METRICS} numbers")
        clean: dict[str, float] = {}
        for k, v in metrics.items():
            if type(v) not in (int, float) or not math.isfinite(v) or len(k) > 64:
                raise CodecError(f"stream header: metric {k[:64]!r} must be a finite number")
            clean[k] = float(v)
        if type(b["leaving"]) is not bool:
            raise CodecError("stream header: leaving must be a bool")
        wire = b["tensors"]
        if not isinstance(wire, list) or len(wire) > MAX_TENSORS:
            raise CodecError(f"stream header: at most {MAX_TENSORS} tensors")
        specs = tuple(spec_from_wire(s) for s in wire)
        if len({s.name for s in specs}) != len(specs):
            raise CodecError("stream header: duplicate tensor names")
        if 4 + len(raw) + sum(s.nbytes for s in specs) != t.size:
            raise CodecError("stream header: tensor byte counts do not add up to the payload size")
        t.specs = specs
        return UpdateHead(t.sender, t.tid, b["round"], b["base_version"], b["num_samples"], clean, b["leaving"], specs)

    def _tensor_bytes(self, t: _Transfer, spec: TensorSpec, take: memoryview, out: list[StreamEvent]) -> None:
        """The next bytes of tensor ``spec`` (every encoding): a top-k tensor's indices are
        kept until all have come; values become parts as soon as whole values are in (a
        value split across chunks waits in ``t.carry``)."""
        if spec.enc == "topk":
            take = self._topk_indices(t, spec, take)
        isz = value_itemsize(spec)
        if t.carry:
            need = isz - len(t.carry)
            t.carry += take[:need]
            take = take[min(need, take.nbytes) :]
            if len(t.carry) < isz:
                return
            out.append(self._part(t, spec, bytes(t.carry)))
            t.carry.clear()
        whole = (take.nbytes // isz) * isz
        # An int8 run is decoded when its part is folded: in parts of at most PART_VALUES,
        # a part's floats are 256 KiB, where a 4 MiB chunk's would be 16 MB.
        step = PART_VALUES * isz if spec.enc == "int8" else max(whole, 1)
        for s in range(0, whole, step):
            out.append(self._part(t, spec, take[s : min(whole, s + step)]))
        t.carry += take[whole:]

    def _topk_indices(self, t: _Transfer, spec: TensorSpec, take: memoryview) -> memoryview:
        """Collect a top-k tensor's indices (they precede its values); the rest of ``take``."""
        idx_bytes = int(spec.param) * INDEX_DTYPE.itemsize
        if t.toff < idx_bytes:
            part = take[: idx_bytes - t.toff]
            t.idx_buf += part
            take = take[part.nbytes :]
            if len(t.idx_buf) == idx_bytes:
                t.idx = np.frombuffer(bytes(t.idx_buf), dtype=INDEX_DTYPE)
                t.idx_buf = bytearray()
                check_indices(t.idx, spec.size, spec.name)
        return take

    def _part(self, t: _Transfer, spec: TensorSpec, data: bytes | memoryview) -> UpdatePart:
        """The part for ``data`` (whole values), from value ``t.elem`` on."""
        values, scale = wire_values(spec, data)
        n = values.size
        if spec.enc == "topk":
            assert t.idx is not None  # values come after all the indices
            part = UpdatePart(t.sender, t.tid, spec.name, 0, values, t.idx[t.elem : t.elem + n], True, scale)
        else:
            part = UpdatePart(t.sender, t.tid, spec.name, t.elem, values, None, spec.enc != "raw", scale)
        t.elem += n
        return part
