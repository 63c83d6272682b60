"""The replay guard's state on disk: an append-only journal with periodic compaction.

A receiver must make the sequence numbers it accepted durable before it hands a message
on, so that a frame captured before a crash is refused after the restart
(:class:`~fedagent.security.signing.ReplayGuard`). Rewriting the whole snapshot for that — a
temporary file, fsync, rename, directory fsync — cost 19 ms per delivered message with
1,000 senders (590 KB). The journal instead appends, per delivered message, one small
record with the numbers accepted since the previous one, and fsyncs it
(``fdatasync``); when the file has grown to twice the last compacted size (at least
1 MiB) it is rewritten atomically as one record holding the current state
(:func:`fedagent.storage.statefile.atomic_write`). Restoring merges every record in order, which
gives the state a snapshot written at the last append would have given.

File layout: :data:`MAGIC`, then records; a record is a 4-byte big-endian length, the
CRC-32 of the payload (4 bytes, big-endian) and the payload, a msgpack map
``{"n": {sender: [seq, ...]}, "f": fence}`` (``"f"`` optional). A file without the magic
is read as the snapshot format that came before the journal and compacted into a journal.

Loading validates before it allocates or trusts anything: the file size is bounded, each
length is checked against that bound and the bytes left before the payload is looked at,
the CRC before the payload is unpacked, and the payload is unpacked with msgpack limits
(no binary, strings ≤ 256 bytes, ≤ ``keep`` numbers per sender) into
``{str: [int, ...]}`` or refused. Damage is handled so that a replay is never accepted:

* a torn tail — the last record cut short, or failing its CRC with nothing after it (a
  crash during an append; its message was never handed on) — is ignored and cut off (a
  bit flip in a last record that *was* completed looks the same and is treated the same:
  the one case where damage can cost the numbers of one delivered message);
* a damaged record with records after it, or a record whose CRC matches but whose
  content is not a journal record (bit rot, a hand edit, a bug), may hide numbers that
  were delivered. The records that check out are still applied, and a **fence** is set:
  every frame stamped at or before the moment of this restart is refused as ``replay``
  (it may have been delivered before), until the timestamp window (``max_skew``) makes
  them stale anyway. The file is compacted at once, fence included, so a second crash
  inside that window keeps it. The cost is availability, not safety: messages senders
  signed before the restart and the broker still holds for this node are refused, and
  the log says why. (Refusing to start would stop the whole node instead.)
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import msgpack

from fedagent.errors import FedagentError, StateWriteError
from fedagent.security.signing import ReplayGuard
from fedagent.storage import statefile

log = logging.getLogger(__name__)

MAGIC = b"\xc1fedagent replay journal 1\n"  # 0xc1 is never the first byte of msgpack
HEADER = statefile.RECORD_HEADER
MAX_FILE = 64 * 2**20
MIN_COMPACT = 2**20


class JournalDamaged(FedagentError):
    """A record other than a torn tail is unreadable (see the module docstring)."""


def _valid_numbers(doc: object, keep: int) -> dict[str, list[int]]:
    if not isinstance(doc, dict) or not all(
        isinstance(s, str) and s and isinstance(v, list) and 0 < len(v) <= keep and all(type(x) is int for x in v)
        for s, v in doc.items()
    ):
        raise FedagentError("replay numbers are not {sender: [sequence numbers]}")
    return doc


def parse(data: bytes, guard: ReplayGuard) -> tuple[list[dict], int, str | None]:
    """(records, bytes of the good prefix, why the rest is bad or None): the records of
    ``data`` (the journal file), validated. Raises :class:`JournalDamaged` (with the
    records that checked out in ``.records``) for damage other than a torn tail."""
    if not data.startswith(MAGIC):
        raise ValueError("not a journal")
    view = memoryview(data)
    pos, end = len(MAGIC), len(data)
    records: list[dict] = []
    damage: str | None = None
    while pos < end:
        if end - pos < HEADER.size:
            return records, pos, f"torn record header at byte {pos}"
        length, crc = HEADER.unpack_from(view, pos)
        body = pos + HEADER.size
        if length > end - body:
            # Longer than what is left (a crash mid-append), or a corrupted length: either
            # way nothing after it can be found, so it is the tail.
            return records, pos, f"record at byte {pos} claims {length} bytes, {end - body} left"
        payload = view[body : body + length]
        if zlib.crc32(payload) != crc:
            if body + length == end:
                return records, pos, f"torn record at byte {pos} (checksum)"
            damage = damage or f"record at byte {pos} fails its checksum"
            pos = body + length
            continue
        try:
            doc = msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=True,
                max_array_len=guard.keep,
                max_map_len=max(guard.max_senders, 2),
                max_str_len=256,
                max_bin_len=0,
                max_ext_len=0,
            )
            if not isinstance(doc, dict) or set(doc) - {"n", "f"} or "n" not in doc:
                raise FedagentError("not a journal record")
            numbers = _valid_numbers(doc["n"], guard.keep)
            fence = doc.get("f")
            if fence is not None and not (type(fence) is float and math.isfinite(fence)):
                raise FedagentError("fence is not a finite float")
        except (ValueError, msgpack.UnpackException, FedagentError) as exc:
            damage = damage or f"record at byte {pos} is not a journal record ({exc})"
            pos = body + length
            continue
        records.append({"n": numbers, "f": fence})
        pos = body + length
    if damage is not None:
        err = JournalDamaged(damage)
        err.records = records  # type: ignore[attr-defined]
        raise err
    return records, pos, None


class ReplayJournal:
    """The journal of one :class:`~fedagent.security.signing.ReplayGuard` at ``path``."""

    def __init__(self, path: Path, guard: ReplayGuard, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self.guard = guard
        self.clock = clock
        self._fd: int | None = None
        self._size = 0
        self._compacted = 0
        self._failed = False
        guard.track = True
        self.appends = 0
        self.compactions = 0

    # -- loading -------------------------------------------------------------------
    def load(self) -> None:
        """Restore the guard from the file (if any) and open it for appending."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = statefile.read_bytes(self.path, MAX_FILE)
        if data is None:
            self._compact()
            return
        if not data.startswith(MAGIC):
            self._load_snapshot(data)
            return
        try:
            records, good, torn = parse(data, self.guard)
        except JournalDamaged as exc:
            self._apply(exc.records)  # type: ignore[attr-defined]
            self._fence(str(exc))
            return
        self._apply(records)
        if torn is not None:
            # That append never completed, so its message was never handed on.
            log.warning("%s: %s; ignored (an append cut short by a crash)", self.path, torn)
            self._cut(good)
        self._open(good)
        # The first record is the last compaction: the next one is due when the file has
        # doubled from that (not from this size, or restarts would ratchet the limit up).
        self._compacted = good
        if good >= len(MAGIC) + HEADER.size:
            self._compacted = min(good, len(MAGIC) + HEADER.size + HEADER.unpack_from(data, len(MAGIC))[0])

    def _load_snapshot(self, data: bytes) -> None:
        """The whole-snapshot format of earlier versions: taken over, then compacted."""
        try:
            self.guard.restore(data)
        except FedagentError as exc:
            self._fence(f"unreadable replay snapshot: {exc}")
            return
        self._compact()

    def _apply(self, records: list[dict]) -> None:
        for r in records:
            self.guard.merge(r["n"])
            if r["f"] is not None:
                self.guard.fence = max(self.guard.fence, r["f"])
        self.guard.take_fresh()

    def _fence(self, why: str) -> None:
        self.guard.fence = max(self.guard.fence, self.clock())
        log.error(
            "%s: %s. The records that check out are kept; every frame stamped before now "
            "(%.0f) is refused as a replay, since it may have been delivered before the restart "
            "(for the next %.0f s, after which they are stale anyway)",
            self.path,
            why,
            self.guard.fence,
            self.guard.max_skew,
        )
        self._compact()

    def _cut(self, size: int) -> None:
        try:
            with open(self.path, "r+b") as f:
                f.truncate(size)
                os.fsync(f.fileno())
        except OSError as exc:
            raise StateWriteError(f"cannot cut the torn tail of {self.path}: {exc.strerror or exc}") from exc

    def _open(self, size: int) -> None:
        self.close()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise StateWriteError(f"cannot open {self.path}: {exc.strerror or exc}") from exc
        self._size = size

    # -- writing -------------------------------------------------------------------
    def commit(self) -> None:
        """Make every number the guard accepted so far durable (one append + fdatasync,
        now and then a compaction)."""
        if not self.guard.dirty:
            return
        due = min(max(MIN_COMPACT, 2 * self._compacted), MAX_FILE // 2)
        if self._fd is None or self._failed or self._size >= due:
            self._compact()
            return
        record = statefile.record({"n": self.guard.take_fresh()})
        try:
            statefile.append_record(self._fd, record, self._size)
        except OSError as exc:
            # The numbers taken for this record are still in the guard's kept ones: the
            # next commit rewrites the whole state instead.
            self.guard.dirty = True
            self._failed = True
            raise StateWriteError(
                f"cannot append to {self.path}: {exc.strerror or exc}; earlier records are intact"
            ) from exc
        self._size += len(record)
        self.appends += 1

    def _compact(self) -> None:
        doc: dict = {"n": self.guard.tops()}
        if self.guard.fence > -math.inf and self.clock() <= self.guard.fence + self.guard.max_skew:
            doc["f"] = float(self.guard.fence)
        data = MAGIC + statefile.record(doc)
        statefile.atomic_write(self.path, data)
        self.guard.take_fresh()
        self._failed = False
        self.compactions += 1
        self._open(len(data))
        self._compacted = len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
