"""The round in flight, durable before any of its updates is acknowledged.

Every frame that carries (part of) an agent's update for the round in flight is written
to the round journal (:mod:`fedagent.storage.roundjournal`) before it is handed on, and
its acknowledgement to the broker waits until a sync has made it durable: whatever was
acknowledged survives a crash, whatever was not the broker delivers again. A restarted
coordinator reads the journal back and takes the round up where it was
(:meth:`DurableJournal.recover`), and restores a history line a crash left out
(:func:`reconcile_history`).

The syncs are grouped (:mod:`fedagent.protocols.groupcommit` decides when one is due and
which frames it covers): frames are written into the page cache as they come, on the
event loop; a sync runs in a worker thread, one at a time, and releases the
acknowledgements of the frames it covered. :class:`DurableJournal` carries that out; the
FedAvg mode (:mod:`fedagent.coordinator.fedavg`) hands it the messenger's hooks and
tells it when a round begins and ends.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from fedagent.errors import AckWithheld, CodecError, StateWriteError
from fedagent.protocols.codec import Envelope, Limits, decode
from fedagent.protocols.groupcommit import GroupCommit, GroupPolicy
from fedagent.protocols.messages import Update
from fedagent.protocols.streaming import STREAM_KIND
from fedagent.security.replaylog import ReplayJournal
from fedagent.security.signing import CHUNK_KIND
from fedagent.storage.history import History
from fedagent.storage.roundjournal import InFlight, Rewrite, RoundJournal

log = logging.getLogger("fedagent.coordinator")

# Frames that carry (part of) an agent's update: journaled before they are acknowledged.
JOURNALED_KINDS = frozenset({Update.kind, CHUNK_KIND, STREAM_KIND})


class DurableJournal:
    """The round journal with group commit: frames written as they come, synced several
    at a time, each one's acknowledgement held until the sync that covers it.

    ``max_frame``: the largest frame the journal takes (the wire's message limit);
    ``per_sender``: bytes one agent may have journaled in a round (an update's worth);
    ``policy``: when a sync is due (:class:`~fedagent.protocols.groupcommit.GroupPolicy`);
    ``replay``: the replay guard's journal, whose syncs a round's disk cost counts too;
    ``kinds`` and ``belongs``: which frames are journaled (by default, those that carry an
    update for the round in flight from an agent selected for it)."""

    def __init__(
        self,
        path: Path,
        *,
        max_frame: int,
        per_sender: int,
        policy: GroupPolicy | None = None,
        replay: ReplayJournal | None = None,
        kinds: frozenset[str] = JOURNALED_KINDS,
        belongs: Callable[[Envelope, InFlight], bool] | None = None,
    ) -> None:
        self.journal = RoundJournal(path, max_frame=max_frame)
        self.kinds = kinds
        self.belongs = belongs or _in_round
        self.replay = replay
        self._syncs_at: dict[str, int] = {}
        self.per_sender = per_sender
        self.group = GroupCommit(policy)
        self._lock = asyncio.Lock()
        # (frame number, the future its acknowledgement waits for), in frame order.
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._sync_task: asyncio.Task[None] | None = None
        self._sync_timer: asyncio.TimerHandle | None = None
        # Makes the replay guard's numbers durable (the messenger's persist_replay). The
        # numbers of journaled frames are committed lazily: after a crash the journal
        # gives them back. So before it drops frames (a round begins or ends, a rewrite)
        # their numbers go to the replay guard's own journal.
        self.before_drop: Callable[[], Awaitable[None]] | None = None

    # -- the messenger's hooks -----------------------------------------------------------
    async def frame(self, topic: str, payload: bytes | bytearray, env: Envelope) -> asyncio.Future[None] | None:
        """A verified frame from an agent, before it is handed on: written to the round
        journal if it belongs to the round in flight; returns what its acknowledgement
        waits for (the sync that makes it durable), or None (acknowledge it when handled)."""
        if env.kind not in self.kinds:
            return None
        try:
            async with self._lock:
                inflight = self.journal.round
                if inflight is None or not self.belongs(env, inflight):
                    return None  # refused when its turn comes: stale, or not selected
                if self.journal.by_sender.get(env.sender, 0) + len(payload) > self.per_sender:
                    # More than an update's worth from one member: a bug or a flood. The
                    # disk is not the place to find out which; the round machine will.
                    log.warning("round %d: %s sent more than an update's worth; not journaled", env.round, env.sender)
                    return None
                # Into the page cache (a frame-sized memcpy, no sync): on the event loop.
                self.journal.write(topic, payload)
        except StateWriteError as exc:
            # Handed on all the same (the round can still use it) but never acknowledged:
            # the broker keeps it and delivers it again after the next connection. A full
            # disk stops this coordinator at its next write (exit 74); acknowledged, the
            # frame would then be lost for good, in no journal and at no broker.
            log.error("round %d: update frame from %s not journaled: %s; not acknowledged", env.round, env.sender, exc)
            return _withheld(exc)
        n = self.group.write(len(payload), time.monotonic())
        durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, durable))
        self._commit_soon()
        return durable

    async def flush(self) -> None:
        """Make every frame written so far durable now (a barrier: the replay guard's
        numbers are about to become durable, and must not be before their frames). In a
        worker thread: a sync of several frames on a busy disk must not stall the event
        loop (reads, keep-alive, the round's other work). Returns only once every frame
        written is durable: another task (the lazy replay commit) may hand frames on while
        this one waits, and the caller commits the replay guard without awaiting again."""
        while self.group.durable < self.group.written:
            upto = self.group.written
            try:
                await asyncio.to_thread(self.journal.sync)  # waits for a sync in flight on the same file, if any
            except StateWriteError as exc:
                log.error("round journal: frames not made durable (%s); not acknowledged", exc)
                self._withhold(upto, exc)
            self.group.flushed(upto)
            self._release()

    def recover(self, round_: int, model_version: int, *, resumable: bool, checkpoint_round: int) -> InFlight | None:
        """After a restart: the round the journal holds, if it is round ``round_`` started
        from ``model_version`` (the checkpointed model: never aggregated) and the machine
        can take it up (``resumable``); otherwise the journal is past, and ended."""
        inflight = self.journal.recover()
        if inflight is None:
            return None
        if resumable and inflight.round == round_ and inflight.model_version == model_version:
            return inflight
        log.info(
            "round journal of round %d (from version %d) is past: the checkpoint has version %d after round %d",
            inflight.round,
            inflight.model_version,
            model_version,
            checkpoint_round,
        )
        self.end_past()
        return None

    def end_past(self) -> None:
        """After a restart, a journal whose frames are not handed on again: their numbers
        go into the replay guard's journal first (they are committed lazily, and a crash
        may have come before), then the journal is ended."""
        if self.replay is not None and self.journal.frames:
            limits = Limits(max_message_bytes=self.journal.max_frame, max_bin_len=self.journal.max_frame)
            for _topic, payload in self.journal.frames_of():
                try:
                    # (its own CRC-checked file: each frame was verified when it came)
                    env = decode(payload, limits, views=True)
                except CodecError:
                    continue
                self.replay.guard.record(env.sender, env.seq)
            self.replay.commit()
        self.journal.end()

    # -- the round's start and end -------------------------------------------------------
    async def begin(self, round_: int, model_version: int, selected: tuple[str, ...]) -> None:
        """A new round: its start record replaces the journal, durable on return."""
        async with self._lock:
            await self._before_drop()
            await asyncio.to_thread(self.journal.begin, round_, model_version, selected)
            self._settled()

    async def end(self) -> None:
        """The round is in the checkpoint, or abandoned: the journal is ended."""
        async with self._lock:
            await self._before_drop()
            await asyncio.to_thread(self.journal.end)
            self._settled()

    async def end_round(self, round_: int) -> None:
        """:meth:`end`, if the journal is still round ``round_``'s (a site aggregator keeps
        a round's journal until its result has gone up, by when the next may have begun)."""
        async with self._lock:
            inflight = self.journal.round
            if inflight is None or inflight.round != round_:
                return
            await self._before_drop()
            await asyncio.to_thread(self.journal.end)
            self._settled()

    async def rewrite(
        self,
        mark: Rewrite,
        start: InFlight,
        choose: Callable[[Iterable[tuple[int, int, str, bytes]]], list[tuple[int, int, str]]],
    ) -> bool:
        """The journal rewritten with ``start``'s record, the records ``choose`` picks of
        those before ``mark`` (given ``(start, end, topic, data)`` of each, it returns
        the ``(start, end, sender)`` to keep) and every record written since the mark,
        durable on return (False: not rewritten, the journal is as it was). Frames are
        written meanwhile, and wait for the lock only while the last ones are copied."""
        journal = self.journal

        def write() -> None:
            kept = choose(journal.frame_records(mark.upto))
            journal.rewrite_write(mark, start, kept)

        try:
            # The frames before the mark may be dropped: their numbers first.
            await self._before_drop()
            # (a worker thread: the event loop goes on reading and journaling frames)
            await asyncio.to_thread(write)
            async with self._lock:
                await asyncio.to_thread(journal.rewrite_commit, mark)
                # Every frame written so far is in the new file, which is synced.
                self._settled()
        except StateWriteError as exc:
            journal.rewrite_abandon(mark)
            log.error("round journal not rewritten (%s); it goes on as it was", exc)
            return False
        except BaseException:
            journal.rewrite_abandon(mark)
            raise
        return True

    async def _before_drop(self) -> None:
        if self.before_drop is not None:
            await self.before_drop()

    def _settled(self) -> None:
        # The frames written so far belong to a round that is now in the checkpoint (or
        # was abandoned): none of them needs its sync any more.
        self.group.settle()
        self._release()

    # -- a round's disk cost ---------------------------------------------------------------
    def _sync_counts(self) -> dict[str, int]:
        replay = self.replay
        return {
            "journal": self.journal.syncs,
            "replay": 0 if replay is None else replay.appends + replay.compactions,
        }

    def count_round(self) -> None:
        """A round starts: :meth:`round_syncs` counts from here."""
        self._syncs_at = self._sync_counts()

    def round_syncs(self) -> dict[str, int]:
        """fdatasync calls of the round journal and of the replay guard's journal since
        :meth:`count_round`, and the frames journaled in the round."""
        return {
            **{k: v - self._syncs_at.get(k, 0) for k, v in self._sync_counts().items()},
            "frames": self.journal.frames,
        }

    def close(self) -> None:
        """On shutdown: stop syncing. Frames not yet durable stay unacknowledged, and the
        broker delivers them again."""
        if self._sync_timer is not None:
            self._sync_timer.cancel()
        if self._sync_task is not None:
            self._sync_task.cancel()

    # -- group commit --------------------------------------------------------------------
    def _commit_soon(self) -> None:
        """Start the journal's next sync if it is due, else make sure it starts when it is."""
        now = time.monotonic()
        if self.group.due(now):
            self._start_sync()
            return
        at = self.group.deadline()
        if at is not None and self._sync_timer is None:
            self._sync_timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._sync_timer_due)

    def _sync_timer_due(self) -> None:
        self._sync_timer = None
        self._commit_soon()

    def _start_sync(self) -> None:
        if self._sync_timer is not None:
            self._sync_timer.cancel()
            self._sync_timer = None
        upto = self.group.start()
        self._sync_task = asyncio.get_running_loop().create_task(self._sync(upto, self.journal.generation))

    async def _sync(self, upto: int, generation: int) -> None:
        try:
            # Off the event loop: frames go on being read, written and handed on meanwhile.
            await asyncio.to_thread(self.journal.sync, generation)
        except StateWriteError as exc:
            log.error("round journal: frames not made durable (%s); not acknowledged", exc)
            self._withhold(upto, exc)
        except asyncio.CancelledError:
            raise  # shutting down: their acknowledgements are never sent, the broker keeps them
        self._sync_task = None
        self.group.finished(upto)
        self._release()
        self._commit_soon()

    def _withhold(self, upto: int, exc: StateWriteError) -> None:
        """The frames up to ``upto`` are not durable (their sync failed): their
        acknowledgements are never sent, so the broker delivers them again."""
        waiters = self._waiters
        while waiters and waiters[0][0] <= upto:
            _n, fut = waiters.popleft()
            if not fut.done():
                fut.set_exception(AckWithheld(f"its round journal record is not durable: {exc}"))

    def _release(self) -> None:
        """Let the acknowledgements of the frames now durable go."""
        waiters, durable = self._waiters, self.group.durable
        while waiters and waiters[0][0] <= durable:
            _n, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)


def _withheld(exc: StateWriteError) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_exception(AckWithheld(f"not written to the round journal: {exc}"))
    return fut


def _in_round(env: Envelope, inflight: InFlight) -> bool:
    """A frame of the round in flight from an agent selected for it."""
    return env.round == inflight.round and env.sender in inflight.members


def reconcile_history(history: History, meta: dict[str, Any]) -> None:
    """The checkpoint is written before the history line of its round; a crash or a
    full disk between the two leaves a model version the history lacks. Restore the
    line from the checkpoint's own record (``meta``) so the history stays one line per
    version."""
    last = 0
    for line in history.tail(65536):  # (across a rotation just made)
        if b'"event": "round"' in line:
            try:
                last = max(last, int(json.loads(line).get("model_version", 0)))
            except (ValueError, AttributeError):
                continue
    version = int(meta.get("model_version", 0))
    if version == last + 1:
        log.warning(
            "history lacks model version %d (the process stopped between checkpoint and "
            "history); restored from the checkpoint",
            version,
        )
        history.append(
            {
                "event": "round",
                "round": meta.get("round"),
                "model_version": version,
                "participants": meta.get("participants", []),
                "metrics": meta.get("metrics", {}),
                "recovered": True,
            }
        )
