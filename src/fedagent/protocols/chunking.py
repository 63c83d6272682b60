"""Payloads larger than the broker's packet limit, sent as numbered chunks.

:func:`split` cuts an encoded envelope into chunk *bodies*; the caller wraps each in
an envelope of kind ``"chunk"``. Every chunk carries the whole transfer's count, size
and SHA-256, so the receiver can check any chunk on its own, in any order.

:class:`Reassembler` is pure (time is passed in) and keyed by ``(sender, tid)``: two
senders using the same transfer id never mix, and the sender is the envelope's, which
the broker ACL ties to the publisher's certificate. Memory is checked before it is
allocated: a transfer's buffer (``size`` bytes, plus a one-bit-per-chunk map) is
made on its first chunk only after ``size`` has been checked against
``max_transfer_bytes`` and the sum of pending transfers against ``max_pending_bytes``.

Duplicates are ignored (QoS 1 redelivers), including a chunk of a transfer that was
completed recently (so a sender must not reuse a transfer id within ``timeout``). A chunk that contradicts what came before (count, size, digest or
chunk length) drops the whole transfer with a CodecError, as does a digest mismatch.

Given an ``executor`` (one worker thread), a large transfer's byte work (copying each
chunk into place, the running SHA-256) runs there while the caller reads the next
chunk: both release the GIL, so a receiver's event loop only checks and books chunks,
and waits at a transfer's last chunk for the digest of what came before it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.codec import Segments

__all__ = ["MAX_TID_LEN", "LazyChunks", "Reassembler", "chunk_size", "split"]

MAX_TID_LEN = 64
#: A model-sized payload is cut into at least this many chunks (unless they would be
#: smaller than MIN_CHUNK): what a receiver holds at once is a chunk or two, so chunks
#: of a fixed 4 MiB cost a 4.4 MB model's receiver about a model each. Not more: every
#: chunk costs a signature, a check, an MQTT message and its acknowledgement on each
#: side and at the broker. Measured at 10 x 1.1M (Intel Xeon, 2026-11-30, loaded):
#: 8 chunks of 550 KB against 4 of 1.1 MB, 70 ms more CPU per round (agents 45,
#: coordinator 25), with the coordinator's peak memory the same within the noise at
#: 10 and 50 x 4.4 MB streamed int8 (chunks of MIN_CHUNK either way) and 2.58 against
#: 2.72 models at 10 x 44.8 MB.
CHUNKS_PER_PAYLOAD = 4
MIN_CHUNK = 256 * 1024
_DIGEST_LEN = 32
_CHUNK_KEYS = frozenset(("tid", "i", "n", "size", "sha256", "data"))
#: A transfer at least this large has its copies and hashing done by the executor (if
#: the reassembler has one): a job costs the caller ~20 µs to hand over, and a chunk of a
#: transfer this size (256 KiB at least: MIN_CHUNK) about 0.2 ms to copy and hash.
OFFLOAD_BYTES = 1 << 20


def chunk_size(total: int, max_chunk: int) -> int:
    """Chunk size for a payload of ``total`` bytes: ``max_chunk`` at most, small enough for
    :data:`CHUNKS_PER_PAYLOAD` chunks, but not below :data:`MIN_CHUNK` (each chunk costs a
    signature, a check and an MQTT message: measured ~0.15 ms of the receiver's CPU)."""
    return max(1, min(max_chunk, max(MIN_CHUNK, -(-total // CHUNKS_PER_PAYLOAD))))


def split(
    payload: bytes | bytearray | memoryview, *, max_chunk: int, transfer_id: str, copy: bool = True
) -> list[dict[str, Any]]:
    """Chunk bodies ``{"tid", "i", "n", "size", "sha256", "data"}`` for ``payload``.

    All chunks but the last hold exactly ``max_chunk`` bytes; an empty payload is one
    empty chunk. The payload is copied once, into the chunks; with ``copy=False`` each
    chunk's data is a view of ``payload`` instead (for a sender that encodes the chunks
    at once, so the model is not copied one more time).
    """
    if type(max_chunk) is not int or max_chunk < 1:
        raise ValueError(f"max_chunk must be a positive int, not {max_chunk!r}")
    if not _valid_tid(transfer_id):
        raise ValueError(f"transfer id must be 1-{MAX_TID_LEN} printable characters, not {transfer_id!r}")
    view = memoryview(payload).cast("B")
    size = view.nbytes
    digest = hashlib.sha256(view).digest()
    n = max(1, -(-size // max_chunk))
    return [
        {
            "tid": transfer_id,
            "i": i,
            "n": n,
            "size": size,
            "sha256": digest,
            "data": bytes(view[i * max_chunk : (i + 1) * max_chunk])
            if copy
            else view[i * max_chunk : (i + 1) * max_chunk],
        }
        for i in range(n)
    ]


class LazyChunks(Sequence[dict[str, Any]]):
    """The chunk bodies :func:`split` would make for the joined ``payload``
    (:class:`~fedagent.protocols.codec.Segments`), each made when it is asked for: its
    data is a view of the caller's buffers, or a copy of one chunk where it spans two.
    The SHA-256 is computed here, in one pass over the runs."""

    def __init__(self, payload: Segments, *, max_chunk: int, transfer_id: str) -> None:
        if type(max_chunk) is not int or max_chunk < 1:
            raise ValueError(f"max_chunk must be a positive int, not {max_chunk!r}")
        if not _valid_tid(transfer_id):
            raise ValueError(f"transfer id must be 1-{MAX_TID_LEN} printable characters, not {transfer_id!r}")
        h = hashlib.sha256()
        for part in payload:
            h.update(part)
        self.payload = payload
        self.max_chunk = max_chunk
        self.tid = transfer_id
        self.size = payload.nbytes
        self.sha256 = h.digest()
        self.n = max(1, -(-self.size // max_chunk))

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if not 0 <= i < self.n:
            raise IndexError(i)
        c = self.max_chunk
        return {
            "tid": self.tid,
            "i": i,
            "n": self.n,
            "size": self.size,
            "sha256": self.sha256,
            "data": self.payload.read(i * c, (i + 1) * c),
        }


@dataclass(slots=True)
class _Transfer:
    n: int
    size: int
    sha256: bytes
    cost: int  # bytes charged against max_pending_bytes
    buffer: memoryview  # of an uninitialised numpy array: every byte is written by a chunk
    seen: bytearray  # one bit per chunk
    received: int = 0
    chunk_len: int = 0  # length of every chunk but the last; 0 until one arrives
    last_len: int = 0  # length of the last chunk; 0 until it arrives
    last_seen: float = 0.0
    # SHA-256 of the chunks 0 .. hashed-1, fed as they become a complete prefix: chunks
    # arrive in order as a rule (one publisher, one connection), so the digest is ready
    # when the last one lands instead of costing a pass over the whole payload then.
    sha: Any = None
    hashed: int = 0
    # Set when the transfer's byte work runs in the reassembler's executor: the array
    # under ``buffer`` (numpy copies into it release the GIL, a memoryview's do not) and
    # the latest job, which waits for the one before it (copies land before the hash
    # reads them, and hashing stays in order).
    array: Any = None
    job: Future[None] | None = None


class Reassembler:
    """Reassemble chunked transfers, bounded in memory, count and time."""

    def __init__(
        self,
        max_transfer_bytes: int,
        max_pending_bytes: int,
        timeout: float,
        *,
        max_transfers: int = 1024,
        remember_completed: int = 4096,
        max_sender_bytes: int | None = None,
        executor: Executor | None = None,
    ) -> None:
        """``max_sender_bytes``: what one sender's pending transfers may hold together
        (default ``max_transfer_bytes``: one transfer's worth), so that one member cannot
        take the whole of ``max_pending_bytes``. ``executor``: where transfers of
        :data:`OFFLOAD_BYTES` or more are copied and hashed (see the module's docstring);
        None does it in :meth:`feed`."""
        for name, value in (
            ("max_transfer_bytes", max_transfer_bytes),
            ("max_pending_bytes", max_pending_bytes),
            ("max_transfers", max_transfers),
            ("remember_completed", remember_completed),
        ):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, not {value!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        self.max_transfer_bytes = max_transfer_bytes
        self.max_pending_bytes = max_pending_bytes
        self.timeout = float(timeout)
        self.max_transfers = max_transfers
        self.remember_completed = remember_completed
        self.max_sender_bytes = max_sender_bytes
        self.executor = executor
        self._by_sender: dict[str, int] = {}  # sender -> bytes its pending transfers hold
        self._transfers: dict[tuple[str, str], _Transfer] = {}
        # Recently finished transfers -> when: a QoS 1 redelivery of one of their chunks
        # must not start a new transfer that would only time out (or deliver twice).
        self._completed: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._pending = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes held by incomplete transfers (their buffers and chunk bitmaps)."""
        return self._pending

    @property
    def pending_transfers(self) -> int:
        return len(self._transfers)

    def transfers(self) -> list[tuple[str, str]]:
        """(sender, transfer id) of each transfer in progress."""
        return list(self._transfers)

    def feed(self, sender: str, body: Any, now: float) -> bytes | memoryview | None:
        """Take one chunk body; the whole payload when this chunk completes a transfer
        whose digest matches, else ``None``. Raises CodecError on a bad chunk."""
        if type(sender) is not str:
            raise CodecError("chunk: sender must be a string")
        tid, i, n, size, digest, data = self._fields(body)
        key = (sender, tid)
        if key in self._completed:
            return None
        length = data.nbytes if isinstance(data, memoryview) else len(data)
        last = i == n - 1
        # Checks that need no state, before anything is looked up or allocated.
        if last:
            # size = (n - 1) * L + length with 1 <= length <= L, L the other chunks' length.
            if n == 1:
                fits = length == size
            else:
                fits = 1 <= length and (size - length) % (n - 1) == 0 and (size - length) // (n - 1) >= length
            if not fits:
                raise CodecError(
                    f"chunk {i}/{n} of transfer {tid!r}: last chunk of {length} bytes cannot end a {size}-byte payload"
                )
        elif length < 1 or not (n - 1) * length < size <= n * length:
            raise CodecError(
                f"chunk {i}/{n} of transfer {tid!r}: {length} bytes per chunk "
                f"cannot make {n} chunks of a {size}-byte payload"
            )
        if size > self.max_transfer_bytes:
            raise CodecError(f"transfer {tid!r} of {size} bytes exceeds the limit of {self.max_transfer_bytes}")

        t = self._transfers.get(key)
        if t is None:
            if n == 1:
                return self._finish(key, tid, digest, data, now)
            t = self._start(key, tid, n, size, digest, now)
        elif (t.n, t.size, t.sha256) != (n, size, digest):
            self._drop(key)
            raise CodecError(
                f"chunk {i}/{n} of transfer {tid!r} disagrees with earlier chunks (n/size/sha256); transfer dropped"
            )

        if t.seen[i >> 3] & (1 << (i & 7)):
            t.last_seen = now
            return None  # a duplicate: QoS 1 may redeliver
        if last:
            if t.chunk_len and (n - 1) * t.chunk_len + length != size:
                self._drop(key)
                raise CodecError(
                    f"last chunk of transfer {tid!r} has {length} bytes, inconsistent "
                    f"with {t.chunk_len}-byte chunks; transfer dropped"
                )
            t.last_len = length
            start = size - length
        else:
            if t.chunk_len == 0:
                if t.last_len and (n - 1) * length + t.last_len != size:
                    self._drop(key)
                    raise CodecError(
                        f"chunk {i} of transfer {tid!r} has {length} bytes, inconsistent "
                        f"with its last chunk; transfer dropped"
                    )
                t.chunk_len = length
            elif length != t.chunk_len:
                self._drop(key)
                raise CodecError(
                    f"chunk {i} of transfer {tid!r} has {length} bytes where every chunk "
                    f"but the last has {t.chunk_len}; transfer dropped"
                )
            start = i * length
        t.seen[i >> 3] |= 1 << (i & 7)
        t.received += 1
        t.last_seen = now
        ranges = self._hash_prefix(t) if i == t.hashed else ()
        if t.array is None:
            t.buffer[start : start + length] = data
            for a, b in ranges:
                t.sha.update(t.buffer[a:b])
        elif self.executor is not None:
            t.job = self.executor.submit(_place, t.array, t.sha, start, data, ranges, t.job)
        else:  # the executor was taken away meanwhile (its owner is closing)
            _place(t.array, t.sha, start, data, ranges, t.job)
            t.job = None
        if t.received < n:
            return None
        self._drop(key)
        if t.job is not None:
            try:
                t.job.result()
            except Exception as exc:  # whatever failed (no memory for a copy?), the transfer is lost
                raise CodecError(f"transfer {tid!r} could not be reassembled: {exc}; transfer dropped") from exc
        return self._finish(key, tid, digest, t.buffer, now, own=True, computed=t.sha.digest())

    @staticmethod
    def _hash_prefix(t: _Transfer) -> list[tuple[int, int]]:
        """The byte ranges of every chunk from ``t.hashed`` on that has arrived, up to
        the first one missing, in order: what the transfer's hash is fed next."""
        ranges = []
        while t.hashed < t.n and t.seen[t.hashed >> 3] & (1 << (t.hashed & 7)):
            k = t.hashed
            # Every chunk but the last starts at k * chunk_len; the last ends the payload
            # (and chunk_len is known once any chunk before it has arrived).
            start = k * t.chunk_len if k < t.n - 1 else t.size - t.last_len
            end = start + t.chunk_len if k < t.n - 1 else t.size
            ranges.append((start, end))
            t.hashed += 1
        return ranges

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop transfers idle for longer than ``timeout``; their ``(sender, tid)``."""
        stale = [key for key, t in self._transfers.items() if now - t.last_seen > self.timeout]
        for key in stale:
            self._drop(key)
        while self._completed and now - next(iter(self._completed.values())) > self.timeout:
            self._completed.popitem(last=False)
        return stale

    def drop_sender(self, sender: str) -> list[str]:
        """Forget every incomplete transfer of ``sender``; their transfer ids."""
        keys = [key for key in self._transfers if key[0] == sender]
        for key in keys:
            self._drop(key)
        return [tid for _, tid in keys]

    # --- internals -----------------------------------------------------------------

    @staticmethod
    def _fields(body: Any) -> tuple[str, int, int, int, bytes, bytes | bytearray | memoryview]:
        if not isinstance(body, dict):
            raise CodecError("chunk body must be a map")
        if body.keys() != _CHUNK_KEYS:
            raise CodecError("chunk body must have exactly the fields tid, i, n, size, sha256, data")
        tid, i, n, size, digest, data = (body[k] for k in ("tid", "i", "n", "size", "sha256", "data"))
        if not _valid_tid(tid):
            raise CodecError(f"chunk: transfer id must be 1-{MAX_TID_LEN} printable characters")
        for name, value in (("i", i), ("n", n), ("size", size)):
            if type(value) is not int:
                raise CodecError(f"chunk: {name} must be an int")
        if size < 0:
            raise CodecError("chunk: negative size")
        # At least one byte per chunk, except the single chunk of an empty payload.
        if not 1 <= n <= max(1, size):
            raise CodecError(f"chunk: {n} chunks for a {size}-byte payload")
        if not 0 <= i < n:
            raise CodecError(f"chunk: index {i} outside 0..{n - 1}")
        if type(digest) is not bytes or len(digest) != _DIGEST_LEN:
            raise CodecError("chunk: sha256 must be 32 bytes")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CodecError("chunk: data must be binary")
        return tid, i, n, size, digest, data

    def _start(self, key: tuple[str, str], tid: str, n: int, size: int, digest: bytes, now: float) -> _Transfer:
        if len(self._transfers) >= self.max_transfers:
            raise CodecError(f"transfer {tid!r} refused: {len(self._transfers)} transfers already pending")
        cost = size + (n + 7) // 8
        if self._pending + cost > self.max_pending_bytes:
            raise CodecError(
                f"transfer {tid!r} of {size} bytes refused: {self._pending} bytes already "
                f"pending, limit {self.max_pending_bytes}"
            )
        mine = self._by_sender.get(key[0], 0)
        own_limit = self.max_transfer_bytes if self.max_sender_bytes is None else self.max_sender_bytes
        if mine + size > own_limit:
            raise CodecError(
                f"transfer {tid!r} of {size} bytes refused: the sender's transfers already hold {mine} bytes, "
                f"its limit is {own_limit}"
            )
        # Not bytearray(size): that zeroes (one more pass over a model) a buffer whose
        # every byte a chunk overwrites before it is handed over, and calloc'd memory is
        # fresh pages each time where malloc'd is reused (measured: 50 vs 5 ms per
        # 44.8 MB transfer).
        array = np.empty(size, np.uint8)
        t = _Transfer(
            n=n,
            size=size,
            sha256=digest,
            cost=cost,
            buffer=array.data,
            seen=bytearray((n + 7) // 8),
            last_seen=now,
            sha=hashlib.sha256(),
            array=array if self.executor is not None and size >= OFFLOAD_BYTES else None,
        )
        self._transfers[key] = t
        self._pending += cost
        self._by_sender[key[0]] = mine + cost
        return t

    def _finish(
        self,
        key: tuple[str, str],
        tid: str,
        digest: bytes,
        data: bytes | bytearray | memoryview,
        now: float,
        *,
        own: bool = False,
        computed: bytes | None = None,
    ) -> bytes | memoryview:
        """``computed``: the digest of ``data`` if already known."""
        if (computed if computed is not None else hashlib.sha256(data).digest()) != digest:
            raise CodecError(f"transfer {tid!r}: sha256 mismatch; transfer dropped")
        if self.remember_completed:
            self._completed[key] = now
            self._completed.move_to_end(key)
            while len(self._completed) > self.remember_completed:
                self._completed.popitem(last=False)
        # The transfer's own buffer (``own``) is handed over, not copied: nothing else
        # holds it. A single chunk's data may be a view of the frame: copied.
        if own and isinstance(data, memoryview):
            return data
        return bytes(data)

    def _drop(self, key: tuple[str, str]) -> None:
        t = self._transfers.pop(key, None)
        if t is not None:
            self._pending -= t.cost
            left = self._by_sender.pop(key[0], 0) - t.cost
            if left > 0:
                self._by_sender[key[0]] = left


def _place(
    array: np.ndarray,
    sha: Any,
    start: int,
    data: bytes | bytearray | memoryview,
    ranges: Sequence[tuple[int, int]],
    before: Future[None] | None,
) -> None:
    """An executor's job: copy one chunk's ``data`` to ``start`` in ``array``, then feed
    ``sha`` the ``ranges`` of it that have become a complete prefix; after the
    transfer's job ``before`` (its copies may be among those ranges)."""
    if before is not None:
        before.result()
    src = np.frombuffer(data, np.uint8)
    np.copyto(array[start : start + src.size], src)
    for a, b in ranges:
        sha.update(array[a:b])


def _valid_tid(tid: object) -> bool:
    return type(tid) is str and 1 <= len(tid) <= MAX_TID_LEN and tid.isprintable()
