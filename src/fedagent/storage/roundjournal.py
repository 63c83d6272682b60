"""The round in flight on disk: what a restarted coordinator needs to finish it.

A coordinator acknowledges an update frame to the broker (MQTT PUBACK) once its handler
returns; from then on the broker forgets it. Before this journal, a crash or a restart
between that moment and the round's aggregation lost the update, and the restarted
coordinator started a new round, refusing the late updates of the old one as stale. Now:

* when a round starts, the journal is rewritten atomically with a *start* record: the
  round number, the model version it trains from and the agents selected;
* every frame of an update for that round (a whole update, a chunk of one, a streamed
  update's chunk) is appended as a *frame* record when it arrives, and acknowledged only
  once the record is durable (``fdatasync``). The syncs are grouped: a frame is handed on
  as soon as it is written, and one sync makes every frame written before it durable
  (:class:`fedagent.protocols.groupcommit.GroupCommit` decides when; the transport holds
  the acknowledgements until then, in the order the frames came);
* when the round ends (aggregated and checkpointed, or abandoned) the journal is emptied.

A coordinator that starts with a journal whose start record trains from the version of
its checkpoint takes that round up again under the same number: it feeds the journaled
frames through the same decoding and signature checks as network input (their
sequence numbers go into the replay guard, so a broker's redelivery of one is refused)
and accepts the outstanding agents' updates as usual. Each update thus reaches the round
machine once, which aggregates it once.

File layout: :data:`MAGIC`, then records; a record is a 4-byte big-endian length, the
CRC-32 of the payload (4 bytes) and the payload, a msgpack map:
``{"t": "start", "round": int, "version": int, "selected": [str, ...]}`` (first and only
once) or ``{"t": "frame", "topic": str, "data": bytes}``. Reading validates before it
allocates: each length against the frame limit and the bytes left, the CRC before the
payload is unpacked, the payload with msgpack limits, then its fields. A torn tail (a
crash during an append: that frame was never acknowledged, so the broker sends it again)
is cut off; a damaged record in the middle is skipped with an error in the log (the
frame it held cannot be recovered; the round goes on without it).

A journal that must outlive its round (an asynchronous coordinator's, where some update
is always on its way) is *rewritten* instead of emptied: :meth:`RoundJournal.rewrite_mark`
notes how far it reaches, :meth:`~RoundJournal.rewrite_write` copies the records the
caller still needs from before that point into a new file after a new start record and
syncs it, and :meth:`~RoundJournal.rewrite_commit` (while nothing is appended) copies
every record appended since, syncs, renames the new file over the journal and syncs the
directory. A crash at any point leaves the old journal or the new one, each complete for
what the caller still needs; a new file a crash left behind is a temporary file of the
state directory, removed when the coordinator starts.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from fedagent.errors import FedagentError, StateWriteError
from fedagent.protocols import topics
from fedagent.protocols.codec import bin_header
from fedagent.protocols.topics import is_valid_name
from fedagent.storage import statefile

log = logging.getLogger(__name__)

MAGIC = b"\xc1fedagent round journal 1\n"  # 0xc1 is never the first byte of msgpack
HEADER = statefile.RECORD_HEADER
MAX_SELECTED = 100_000
MAX_TOPIC = 512


@dataclass(frozen=True, slots=True)
class InFlight:
    """The round a journal describes."""

    round: int
    model_version: int
    selected: tuple[str, ...]
    # The same as a set: every update frame asks whether its sender is selected.
    members: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", frozenset(self.selected))


def _start(doc: object) -> InFlight:
    if not isinstance(doc, dict) or doc.get("t") != "start" or set(doc) != {"t", "round", "version", "selected"}:
        raise FedagentError("the first record is not a round start")
    rnd, version, selected = doc["round"], doc["version"], doc["selected"]
    if type(rnd) is not int or type(version) is not int or not (rnd > 0 and version >= 0):
        raise FedagentError("round and version must be non-negative integers")
    if not isinstance(selected, list) or not all(is_valid_name(a) for a in selected):
        raise FedagentError("selected must be a list of node ids")
    return InFlight(rnd, version, tuple(selected))


@dataclass(slots=True)
class Rewrite:
    """A rewrite of the journal under way: where the journal ended when it was marked
    (``upto``, in bytes, with the counts of frames up to there), the file being written
    and the counts of the frames copied into it."""

    upto: int
    generation: int
    frames: int
    bytes: int
    by_sender: dict[str, int]
    start: InFlight | None = None
    tmp: str | None = None
    size: int = 0
    kept_frames: int = 0
    kept_bytes: int = 0
    kept_by_sender: dict[str, int] = field(default_factory=dict)


def _frame(doc: object) -> tuple[str, bytes]:
    if not isinstance(doc, dict) or doc.get("t") != "frame" or set(doc) != {"t", "topic", "data"}:
        raise FedagentError("not a frame record")
    topic, data = doc["topic"], doc["data"]
    if not isinstance(topic, str) or not isinstance(data, bytes):
        raise FedagentError("a frame is a topic and bytes")
    return topic, data


def _sender(topic: str) -> str:
    try:
        return topics.parse(topic)[1]
    except ValueError:
        return ""


def _rest(parts: list, done: int) -> list:
    """What is left of ``parts`` after ``done`` bytes of them were written."""
    while parts and done >= len(parts[0]):
        done -= len(parts[0])
        parts = parts[1:]
    if parts and done:
        parts = [memoryview(parts[0])[done:], *parts[1:]]
    return parts


def _copy(src, out, a: int, b: int) -> None:
    """Bytes ``a`` to ``b`` of ``src`` to the end of ``out``, a block at a time."""
    src.seek(a)
    while a < b:
        block = src.read(min(b - a, 1 << 22))
        if not block:
            raise OSError(f"the journal ends at byte {a}, before {b}")
        out.write(block)
        a += len(block)


class RoundJournal:
    """The journal at ``path``; frames of at most ``max_frame`` bytes."""

    def __init__(self, path: Path, *, max_frame: int) -> None:
        self.path = Path(path)
        self.max_frame = max_frame
        self.round: InFlight | None = None  # the round being journaled, None when idle
        self.frames = 0
        self.bytes = 0
        self.by_sender: dict[str, int] = {}  # bytes journaled per sender (a bound per member)
        self._fd: int | None = None
        self._size = 0
        self._durable = 0  # bytes of the open file known to be on disk
        # The file open for appending is replaced by begin()/end()/recover(), which may run
        # in a worker thread while a group's sync runs in another: the lock keeps a sync
        # from meeting a closed (or reused) descriptor. Each opening is a new generation.
        self._fd_lock = threading.Lock()
        self.generation = 0
        self.syncs = 0  # fdatasync calls for frames (the status shows them)
        self._packer = msgpack.Packer(use_bin_type=True)

    # -- reading -------------------------------------------------------------------
    def _unpack(self, payload: memoryview) -> object:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_bin_len=self.max_frame,
            max_str_len=max(MAX_TOPIC, 64),
            max_array_len=MAX_SELECTED,
            max_map_len=8,
            max_ext_len=0,
        )

    def _records(self, f, upto: int | None = None) -> Iterator[tuple[int, memoryview | None, str | None]]:
        """(offset, payload or None, damage) per record (before byte ``upto``, if given);
        a torn tail ends the walk. After each, ``f.tell()`` is where the record ends."""
        end = os.fstat(f.fileno()).st_size
        if upto is not None:
            end = min(end, upto)
        pos = len(MAGIC)
        while pos < end:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                yield pos, None, "torn"
                return
            length, crc = HEADER.unpack(head)
            body = pos + HEADER.size
            if length > max(self.max_frame + 4096, 8 * 2**20) or length > end - body:
                yield pos, None, "torn"
                return
            payload = memoryview(f.read(length))
            if zlib.crc32(payload) != crc:
                if body + length == end:
                    yield pos, None, "torn"
                    return
                yield pos, None, f"record at byte {pos} fails its checksum"
            else:
                yield pos, payload, None
            pos = body + length

    def recover(self) -> InFlight | None:
        """The round the journal holds (None: empty, absent or unreadable). Opens the file
        for appending after its last good record; :meth:`frames_of` reads the frames."""
        self.close()
        self.round = None
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateWriteError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        with f:
            if f.read(len(MAGIC)) != MAGIC:
                log.error("%s is not a round journal; the round in flight (if any) cannot be resumed", self.path)
                return None
            good = len(MAGIC)
            frames = nbytes = 0
            by_sender: dict[str, int] = {}
            for pos, payload, damage in self._records(f):
                if damage == "torn":
                    log.warning("%s: a record cut short at byte %d (an append interrupted): cut off", self.path, pos)
                    break
                good = f.tell()
                if payload is None:
                    log.error("%s: %s; skipped (its update is lost)", self.path, damage)
                    continue
                try:
                    doc = self._unpack(payload)
                    if self.round is None:
                        self.round = _start(doc)
                    else:
                        topic, _data = _frame(doc)
                        frames += 1
                        nbytes += len(payload)
                        sender = _sender(topic)
                        by_sender[sender] = by_sender.get(sender, 0) + len(payload)
                except (ValueError, msgpack.UnpackException, FedagentError) as exc:
                    if self.round is None:
                        log.error("%s: unreadable round start (%s); not resumed", self.path, exc)
                        return None
                    log.error("%s: record at byte %d is not a frame (%s); skipped", self.path, pos, exc)
        if self.round is None:
            return None
        if good < os.path.getsize(self.path):
            with open(self.path, "r+b") as tail:
                tail.truncate(good)
                os.fsync(tail.fileno())
        self._open(good, durable=False)
        self.frames, self.bytes, self.by_sender = frames, nbytes, by_sender
        return self.round

    def frames_of(self) -> Iterator[tuple[str, bytes]]:
        """The frames of the recovered round, in the order they were received (read one
        at a time: a journal of N model-sized updates is never in memory at once)."""
        with open(self.path, "rb") as f:
            for _pos, _end, topic, data in self._frames(f):
                yield topic, data

    def frame_records(self, upto: int) -> Iterator[tuple[int, int, str, bytes]]:
        """(start, end, topic, data) of each readable frame record before byte ``upto``
        (a mark's), in order, one at a time; damaged records are left out."""
        try:
            f = open(self.path, "rb")
        except OSError as exc:
            raise StateWriteError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        with f:
            yield from self._frames(f, upto)

    def _frames(self, f, upto: int | None = None) -> Iterator[tuple[int, int, str, bytes]]:
        """(start, end, topic, data) of each readable frame record after the start record
        (before byte ``upto``, if given); damaged ones are left out, a torn tail ends it."""
        if f.read(len(MAGIC)) != MAGIC:
            return
        first = True
        for pos, payload, damage in self._records(f, upto):
            if damage == "torn":
                return
            end = f.tell()
            if payload is None:
                continue
            if first:
                first = False
                continue
            try:
                topic, data = _frame(self._unpack(payload))
            except (ValueError, msgpack.UnpackException, FedagentError):
                continue
            yield pos, end, topic, data

    # -- rewriting -----------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes of the journal open for appending (0 when none is)."""
        return self._size if self._fd is not None else 0

    def rewrite_mark(self) -> Rewrite:
        """Where a rewrite starts from: every record written so far (call it where no
        append can run at the same time, the event loop that appends)."""
        if self._fd is None or self.round is None:
            raise StateWriteError(f"{self.path}: no journal is open to rewrite")
        return Rewrite(self._size, self.generation, self.frames, self.bytes, dict(self.by_sender))

    def rewrite_write(self, rw: Rewrite, start: InFlight, kept: Iterable[tuple[int, int, str]]) -> None:
        """A new journal: ``start``'s record, then the records at the byte ranges ``kept``
        (``(start, end, sender)``, in order, all before ``rw.upto``) copied from this one
        as they are, synced. Appending goes on in this journal meanwhile."""
        head = MAGIC + statefile.record(
            {"t": "start", "round": start.round, "version": start.model_version, "selected": list(start.selected)}
        )
        try:
            fd, rw.tmp = tempfile.mkstemp(prefix=statefile.TEMP_PREFIX, dir=self.path.parent)
            with os.fdopen(fd, "wb") as out, open(self.path, "rb") as src:
                out.write(head)
                rw.size = len(head)
                for a, b, sender in kept:
                    if not (len(MAGIC) <= a < b <= rw.upto):
                        raise StateWriteError(f"{self.path}: bytes {a}..{b} are not a record before {rw.upto}")
                    _copy(src, out, a, b)
                    rw.size += b - a
                    rw.kept_frames += 1
                    rw.kept_bytes += b - a - HEADER.size
                    rw.kept_by_sender[sender] = rw.kept_by_sender.get(sender, 0) + b - a - HEADER.size
                out.flush()
                os.fsync(out.fileno())
        except StateWriteError:
            self.rewrite_abandon(rw)
            raise
        except OSError as exc:
            self.rewrite_abandon(rw)
            raise StateWriteError(f"cannot rewrite {self.path}: {exc.strerror or exc}") from exc
        rw.start = start

    def rewrite_commit(self, rw: Rewrite) -> None:
        """The new journal replaces this one: the records appended since the mark are
        copied after the kept ones, the file synced, renamed over the journal and the
        directory synced; appends go on in it. The caller makes sure nothing is appended
        while this runs. Every frame written so far is durable on return."""
        if rw.tmp is None or rw.start is None:
            raise StateWriteError(f"{self.path}: no rewrite written")
        with self._fd_lock:
            if self._fd is None or self.generation != rw.generation:
                self.rewrite_abandon(rw)
                raise StateWriteError(f"{self.path}: replaced while it was rewritten")
            end = self._size
            try:
                with open(rw.tmp, "r+b") as out, open(self.path, "rb") as src:
                    out.seek(rw.size)
                    _copy(src, out, rw.upto, end)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(rw.tmp, self.path)
            except OSError as exc:
                self.rewrite_abandon(rw)
                raise StateWriteError(f"cannot rewrite {self.path}: {exc.strerror or exc}") from exc
            rw.tmp = None
            # From here the journal is the new file, whatever follows.
            os.close(self._fd)
            self._fd = None
            self.generation += 1
            self.frames = rw.kept_frames + self.frames - rw.frames
            self.bytes = rw.kept_bytes + self.bytes - rw.bytes
            by_sender = dict(rw.kept_by_sender)
            for sender, n in self.by_sender.items():
                tail = n - rw.by_sender.get(sender, 0)
                if tail:
                    by_sender[sender] = by_sender.get(sender, 0) + tail
            self.by_sender = by_sender
            self.round = rw.start
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except OSError as exc:
                raise StateWriteError(f"cannot reopen {self.path}: {exc.strerror or exc}") from exc
            self._size = self._durable = rw.size + end - rw.upto
            try:
                statefile.sync_dir(self.path.parent)
            except OSError as exc:
                # Both files are complete for what the caller needs, and a sync that
                # failed acknowledges frames all the same elsewhere too: said, not fatal.
                log.error("%s: the rename of its rewrite not synced: %s", self.path, exc.strerror or exc)

    def rewrite_abandon(self, rw: Rewrite) -> None:
        """The rewrite is given up: its new file goes, the journal stays as it is."""
        if rw.tmp is not None:
            try:
                os.unlink(rw.tmp)
            except OSError:
                pass
            rw.tmp = None

    # -- writing -------------------------------------------------------------------
    def begin(self, round_: int, model_version: int, selected: tuple[str, ...]) -> None:
        """A round starts: the journal becomes its start record alone."""
        data = MAGIC + statefile.record(
            {"t": "start", "round": round_, "version": model_version, "selected": list(selected)}
        )
        statefile.atomic_write(self.path, data)
        self._open(len(data))
        self.round = InFlight(round_, model_version, tuple(selected))
        self.frames = self.bytes = 0
        self.by_sender = {}

    def end(self) -> None:
        """The round is aggregated (and checkpointed) or abandoned: nothing to resume."""
        self.close()
        if self.round is None and not self.path.exists():
            return
        statefile.atomic_write(self.path, MAGIC)
        self.round = None
        self.frames = self.bytes = 0
        self.by_sender = {}

    def append(self, topic: str, data: bytes | bytearray) -> None:
        """Make one received frame durable (write + fdatasync)."""
        self.write(topic, data)
        self.sync()

    def write(self, topic: str, data: bytes | bytearray | memoryview) -> None:
        """Append one received frame's record, without syncing it (:meth:`sync` makes it
        durable). The record is the same as ``statefile.record({"t": "frame", "topic":
        topic, "data": data})`` but never built: its header and msgpack prefix are a few
        bytes, the data goes to the file from where it lies and into the CRC as it is
        (building it cost two frame-sized copies, each a fresh mmap'd block: about 1 ms of
        CPU per 540 KB frame)."""
        if self._fd is None or self.round is None:
            raise StateWriteError(f"{self.path}: no round is being journaled")
        view = memoryview(data).cast("B")
        n = view.nbytes
        pk = self._packer
        prefix = (
            pk.pack_map_header(3)
            + pk.pack("t")
            + pk.pack("frame")
            + pk.pack("topic")
            + pk.pack(topic)
            + pk.pack("data")
            + bin_header(n)
        )
        length = len(prefix) + n
        head = HEADER.pack(length, zlib.crc32(view, zlib.crc32(prefix)))
        try:
            parts = [head + prefix, view]
            written = 0
            while written < HEADER.size + length:
                done = os.writev(self._fd, parts)
                written += done
                parts = _rest(parts, done)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._size)  # a half record would hide every later one
            except OSError:
                pass
            raise StateWriteError(f"cannot append to {self.path}: {exc.strerror or exc}") from exc
        self._size += HEADER.size + length
        self.frames += 1
        self.bytes += length
        sender = _sender(topic)
        self.by_sender[sender] = self.by_sender.get(sender, 0) + length

    def sync(self, generation: int | None = None) -> bool:
        """fdatasync the records written so far; False (and nothing done) when the file
        was replaced since ``generation`` (its frames no longer need it) or none is open.
        Safe to call from a worker thread while the event loop writes."""
        with self._fd_lock:
            if self._fd is None or (generation is not None and generation != self.generation):
                return False
            size = self._size  # records appended in full before this call
            if size <= self._durable:
                return True  # already on disk: a group or a barrier that found nothing new
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                raise StateWriteError(f"cannot sync {self.path}: {exc.strerror or exc}") from exc
            self._durable = size
            self.syncs += 1
            return True

    def _open(self, size: int, *, durable: bool = True) -> None:
        self.close()
        with self._fd_lock:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except OSError as exc:
                raise StateWriteError(f"cannot open {self.path}: {exc.strerror or exc}") from exc
            self._size = size
            # begin() and end() hand over a file atomic_write synced; what recover() read
            # back may still be only in the page cache after a crash of the process.
            self._durable = size if durable else 0
            self.generation += 1

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self.generation += 1

    def __del__(self) -> None:
        self.close()

    def status(self) -> dict[str, int | None]:
        return {
            "round": self.round.round if self.round else None,
            "frames": self.frames,
            "bytes": self.bytes,
            "syncs": self.syncs,
        }
