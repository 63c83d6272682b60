"""What of an asynchronous coordinator's round journal a model's checkpoint no longer
needs, and when to rewrite it without that (pure: frames in, byte ranges out; no file,
clock or event loop here).

The journal of an asynchronous coordinator holds every frame of every update since it was
last replaced, and it is replaced at a model only when no journaled frame is on its way
to the machine (:mod:`fedagent.coordinator.fedbuff`): in a busy federation that moment
may never come. So once it is past a size, it is rewritten at a model keeping only the
frames a restart could still need. A restarted coordinator hands every journaled frame
to the buffer machine, which refuses an update the checkpoint holds (its key, (agent,
task, base version), is in the checkpoint's ``accepted``) or one trained from a model
more than ``max_staleness`` versions before the checkpoint's; the frames of those
updates are what a rewrite leaves out. Everything else stays: the updates in the buffer
or in none yet, those in transfer or queued, refused ones still within the staleness
bound (a restart would refuse them again), and the frames of an unfinished transfer for
as long as it may still finish.

:class:`JournalSift` reads the frames (topic, data) of the journal in order and names
the update each belongs to: a whole asynchronous update by its own fields; a streamed
update (chunks of kind ``ustream``) by its header, read from its first chunks; a whole
update cut into chunks (kind ``chunk``) by reassembling it. Whatever cannot be named is
kept, unless no replay could take anything from it (a frame that does not decode, a
message of another kind). An unfinished transfer is kept while it is ``live`` (still
pending in the messenger, queued, or being added by the machine); ``live=None`` means
that is not known, and every unfinished transfer is kept.

:class:`JournalBound` says when a rewrite is due: past ``max_bytes``, and twice the size
the last rewrite left (so a journal that must keep a lot is not copied at every model).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from fedagent.errors import CodecError
from fedagent.protocols import topics
from fedagent.protocols.chunking import Reassembler
from fedagent.protocols.codec import Limits, decode
from fedagent.protocols.fedbuff import Key
from fedagent.protocols.messages import AsyncUpdate
from fedagent.protocols.streaming import MAX_HEADER_BYTES, MAX_TENSORS, STREAM_KIND
from fedagent.security.signing import CHUNK_KIND

__all__ = ["JournalBound", "JournalSift", "Key"]

#: (sender, transfer id)
Transfer = tuple[str, str]

_HEADER_LIMITS = Limits(
    max_message_bytes=MAX_HEADER_BYTES, max_bin_len=1024, max_array_len=max(MAX_TENSORS, 16), max_str_len=4096
)


class JournalBound:
    """When the journal is rewritten at a model: when it is past ``max_bytes`` and past
    twice what the last rewrite left."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.left = 0  # bytes the last rewrite left (0: replaced or never rewritten)

    def due(self, size: int) -> bool:
        return size > self.max_bytes and size > 2 * self.left

    def rewritten(self, size: int) -> None:
        self.left = size

    def replaced(self) -> None:
        """The journal was replaced by a new start record alone."""
        self.left = 0


@dataclass(slots=True)
class _Unit:
    """The frames of one update (a whole frame, or one transfer's chunks)."""

    sender: str
    tid: str | None
    records: list[tuple[int, int]] = field(default_factory=list)
    key: Key | None = None
    useless: bool = False  # no replay could take anything from it
    n: int | None = None
    seen: set[int] = field(default_factory=set)
    head: bytearray | None = None  # a stream's first bytes, until its header is read
    head_next: int = 0  # the chunk whose bytes extend ``head``

    @property
    def complete(self) -> bool:
        return self.n is not None and len(self.seen) == self.n


class JournalSift:
    """The records of a journal a checkpoint still needs.

    ``held``: the updates the checkpoint holds; ``floor``: the oldest base version it
    still takes (its model version − ``max_staleness``); ``live``: the transfers that
    may still finish (None: unknown, keep every unfinished one); ``wire_limits`` and
    ``model_limits``: those the frames and reassembled messages are decoded under."""

    def __init__(
        self,
        *,
        held: Iterable[Key],
        floor: int,
        live: Collection[Transfer] | None,
        wire_limits: Limits,
        model_limits: Limits,
    ) -> None:
        self.held = frozenset(held)
        self.floor = floor
        self.live = None if live is None else frozenset(live)
        self.wire_limits = wire_limits
        self.model_limits = model_limits
        cap = model_limits.max_message_bytes
        self._reassembler = Reassembler(cap, cap, float("inf"), max_sender_bytes=cap)
        self._units: list[_Unit] = []
        self._transfers: dict[tuple[str, str, str], _Unit] = {}
        self.frames = 0

    def feed(self, start: int, end: int, topic: str, data: bytes | bytearray | memoryview) -> None:
        """One frame record of the journal (bytes ``start`` to ``end``), in order."""
        self.frames += 1
        try:
            sender = topics.parse(topic)[1]
        except ValueError:
            sender = ""
        try:
            env = decode(data, self.wire_limits, views=True)
        except CodecError:
            self._units.append(_Unit(sender, None, [(start, end)], useless=True))  # refused on any replay
            return
        if env.kind in (STREAM_KIND, CHUNK_KIND):
            body = env.body
            tid, i, n = body.get("tid"), body.get("i"), body.get("n")
            if not isinstance(tid, str) or type(i) is not int or type(n) is not int:
                self._units.append(_Unit(sender, None, [(start, end)], useless=True))
                return
            unit = self._transfers.get((env.kind, sender, tid))
            if unit is None:
                unit = self._transfers[(env.kind, sender, tid)] = _Unit(sender, tid)
                self._units.append(unit)
                if env.kind == CHUNK_KIND:
                    # An agent sends one update at a time: what it left unfinished before
                    # this one need not hold a model's worth of memory here.
                    self._reassembler.drop_sender(sender)
            unit.records.append((start, end))
            unit.n = n
            unit.seen.add(i)
            if unit.key is not None or unit.useless:
                return
            if env.kind == STREAM_KIND:
                self._stream_head(unit, i, body.get("data"))
            else:
                self._chunk(unit, body)
            return
        unit = _Unit(sender, None, [(start, end)])
        self._units.append(unit)
        if env.kind != AsyncUpdate.kind:
            unit.useless = True  # an asynchronous coordinator takes no other update
            return
        unit.key = _key(sender, env.body.get("task"), env.body.get("base_version"))
        unit.useless = unit.key is None

    def _stream_head(self, unit: _Unit, i: int, data: object) -> None:
        """A stream's key, from its header (``u32`` length, then the header envelope) in
        its first chunks, read while they come in order (else it stays unnamed: kept)."""
        if i != unit.head_next or not isinstance(data, bytes | bytearray | memoryview):
            return
        if unit.head is None:
            unit.head = bytearray()
        unit.head += data
        unit.head_next += 1
        if len(unit.head) < 4:
            return
        hlen = int.from_bytes(unit.head[:4], "big")
        if hlen > MAX_HEADER_BYTES:
            unit.useless, unit.head = True, None  # the intake refuses it at its header
            return
        if len(unit.head) < 4 + hlen:
            return
        raw, unit.head = bytes(unit.head[4 : 4 + hlen]), None
        try:
            b = decode(raw, _HEADER_LIMITS).body
        except CodecError:
            unit.useless = True
            return
        unit.key = _key(unit.sender, b.get("round"), b.get("base_version"))
        unit.useless = unit.key is None

    def _chunk(self, unit: _Unit, body: dict) -> None:
        """A chunk of a whole update: its key once the update is reassembled."""
        try:
            whole = self._reassembler.feed(unit.sender, body, 0.0)
        except CodecError:
            return  # (a transfer the messenger's own reassembly refuses too: kept unnamed)
        if whole is None:
            return
        try:
            env = decode(whole, self.model_limits, views=True)
        except CodecError:
            unit.useless = True
            return
        if env.kind != AsyncUpdate.kind:
            unit.useless = True
            return
        unit.key = _key(unit.sender, env.body.get("task"), env.body.get("base_version"))
        unit.useless = unit.key is None

    def _needed(self, unit: _Unit) -> bool:
        if unit.useless:
            return False
        if unit.key is not None and (unit.key in self.held or unit.key[2] < self.floor):
            return False  # refused on any replay: a duplicate, or too stale
        if unit.tid is None or unit.complete:
            return True
        # Unfinished: of use only while it may still finish (or be read back to take its
        # first parts out of the buffer, while the machine or its queue knows it).
        return self.live is None or (unit.sender, unit.tid) in self.live

    def kept(self) -> list[tuple[int, int, str]]:
        """The byte ranges (start, end, sender) to keep, in the journal's order."""
        out = [(a, b, u.sender) for u in self._units if self._needed(u) for a, b in u.records]
        out.sort()
        return out


def _key(sender: str, task: object, base: object) -> Key | None:
    if type(task) is not int or type(base) is not int or task < 0 or base < 0:
        return None
    return sender, task, base
