"""Envelopes over the transport: sequence numbers, chunking, validation, typing.

Outgoing: a message becomes an :class:`Envelope`, encoded, and split into ``chunk``
envelopes when it is larger than the broker's packet limit allows.
Incoming: the payload is decoded under limits, chunks are reassembled (digest
checked), the envelope's sender is checked against the topic it came on (the broker
ACL guarantees the topic subtree is the publisher's certificate CN), and the body is
validated into a typed message. Anything wrong is counted and logged with the
sender named, and dropped: a hostile peer never reaches the protocol machines.

Every frame is signed with the node's :class:`~fedagent.security.signing.Identity` and every
received frame is authenticated (certificate, signature, freshness) by a
:class:`~fedagent.security.signing.Verifier` before anything else looks at its body, whatever
its kind: see :mod:`fedagent.security.signing` for what is signed and why.

Updates usually travel as streams: :meth:`Messenger.send_update` sends them as signed
``ustream`` chunks (:mod:`fedagent.protocols.streaming`, compressed as the round asks),
and a receiver that aggregates (``on_stream`` set) gets their chunks decoded into events
as they arrive, never a reassembled update. Only a certificate of role ``agent`` may
send one, and the stream's inner header must name the chunks' signer and their signed
round. A round whose aggregator needs whole updates asks for them
(``TrainConfig.stream``) and they go through :meth:`Messenger.send` like any message.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent.errors import AckWithheld, CodecError, FedagentError
from fedagent.protocols import topics
from fedagent.protocols.chunking import LazyChunks, Reassembler, chunk_size, split
from fedagent.protocols.codec import (
    Envelope,
    Limits,
    Segments,
    decode,
    encode,
    encode_segments,
    encode_view,
    weights_nbytes,
)
from fedagent.protocols.compression import Compressor
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.messages import Heartbeat, Message, Update, body_of
from fedagent.protocols.ratelimit import SenderBudget
from fedagent.protocols.streaming import (
    HEAD_KIND,
    STREAM_KIND,
    StreamEvent,
    StreamIntake,
    UpdateEnd,
    UpdateHead,
    encode_stream,
    head_body,
    iter_stream_chunks,
)
from fedagent.security.replaylog import ReplayJournal
from fedagent.security.signing import CHUNK_KIND, AuthError, Identity, SequenceCounter, SteadyClock, sign

log = logging.getLogger(__name__)
SEQ_FILE = "signing-seq"
REPLAY_FILE = "replay-guard.msgpack"
#: Refusals kept for ``fedagent status``.
RECENT_REJECTIONS = 20
#: At most this many seconds between receiving a frame of a kind in
#: ``Messenger.lazy_durable_kinds`` and its sequence number reaching the replay journal.
LAZY_DURABLE_S = 1.0
#: A sender whose frames are dropped is named in the log at most once in this many seconds.
DROP_LOG_EVERY = 10.0
#: Chunk frames larger than this are signed and encoded in a worker thread. A hop costs
#: about 75 µs of CPU here (measured: Intel Xeon, 2026-11-30), more than half of what
#: encoding a 550 KB chunk of a 4.4 MB model takes; the 1.1 MB chunks of such a model
#: stay on the event loop too (measured at 10 x 1.1M against a 1 MiB bound, medians of
#: three runs: 40 ms less CPU per round for the agents, 20 for the coordinator). A
#: frame of a 4 MiB chunk (a larger model's) still goes off the event loop.
THREADED_FRAME_BYTES = 2 << 20
#: Frames that carry (part of) an update or of any chunked message: a daemon may admit
#: them only from the senders it expects them from (``Messenger.admit``).
TRANSFER_KINDS = frozenset({STREAM_KIND, CHUNK_KIND, Update.kind})


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    sender: str
    envelope: Envelope
    message: Message
    nbytes: int
    role: str = ""  # the signer's certificate role (OU): "agent", "coordinator" or "aggregator"
    # It came in a frame of the round journal (written there on arrival, or read back
    # after a restart): the journal must keep that frame until the message is handled.
    journaled: bool = False


#: Certificate roles whose updates a coordinator takes (and journals): agents, and site
#: aggregators at their upstream tier.
PARTICIPANT_ROLES = frozenset({"agent", "aggregator"})


class Messenger:
    def __init__(
        self,
        *,
        federation: str,
        node_id: str,
        transport,
        identity: Identity,
        max_chunk_bytes: int = 4 * 2**20,
        max_model_bytes: int = 2**30,
        reassembly_timeout: float = 120.0,
        metrics=None,
        max_skew: float = 300.0,
        publish_window: int = 2,
        publish_timeout: float = 30.0,
        state_dir=None,
    ) -> None:
        """``state_dir``: where the outgoing sequence reservation and the replay guard's
        state survive a restart (see :mod:`fedagent.security.signing`); None keeps both in memory."""
        if identity.name != node_id:
            raise ValueError(f"the signing identity is {identity.name!r}, not {node_id!r}")
        self.federation = federation
        self.node_id = node_id
        self.transport = transport
        self.identity = identity
        self.clock = SteadyClock(floor=identity.issued)
        self.verifier = identity.verifier(max_skew=max_skew, clock=self.clock)
        self._replay_path = None
        self.replay_journal: ReplayJournal | None = None
        if state_dir is not None:
            self._replay_path = Path(state_dir) / REPLAY_FILE
            # An append-only journal (a damaged one fences off frames stamped before this
            # restart instead of trusting less history): see fedagent.security.replaylog.
            self.replay_journal = ReplayJournal(self._replay_path, self.verifier.replay, self.clock)
            self.replay_journal.load()
        self.max_chunk = max_chunk_bytes
        if publish_window < 1:
            raise ValueError("publish_window must be at least 1")
        self.publish_window = publish_window
        self.publish_timeout = float(publish_timeout)
        # Per-sender sequence numbers grow across restarts, whatever the clock did.
        self._counter = SequenceCounter(None if state_dir is None else Path(state_dir) / SEQ_FILE)
        self._transfer = 0
        chunk_overhead = 4096
        self.wire_limits = Limits(
            max_message_bytes=max_chunk_bytes + chunk_overhead, max_bin_len=max_chunk_bytes + chunk_overhead
        )
        self.model_limits = Limits(
            max_message_bytes=max_model_bytes, max_bin_len=max_model_bytes, max_tensor_bytes=max_model_bytes
        )
        # One worker: the jobs of a transfer (or stream) run in order. Its thread is
        # started by the first large transfer received (a sender never needs it).
        self._intake_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedagent-reassembly")
        self.reassembler = Reassembler(
            max_transfer_bytes=max_model_bytes,
            max_pending_bytes=2 * max_model_bytes,
            timeout=reassembly_timeout,
            # Copying chunks into place and hashing them off the event loop: it reads the
            # next chunk meanwhile (at 10 updates of 4.4 MB, the loop's CPU paced the intake).
            executor=self._intake_worker,
        )
        self.rejected: Counter[str] = Counter()
        # The latest refusals (messages here, or updates the round logic refused through
        # record_rejection): `status` shows these next to the counts, from one source.
        self.recent_rejections: list[dict[str, Any]] = []
        # Sender -> time.time() of its last verified message of any kind ("last seen").
        self.last_heard: dict[str, float] = {}
        # Streamed updates (coordinator side): set on_stream to receive their events. The
        # hold-back budget for chunks arriving out of turn is a few chunks, not N models.
        self.on_stream: Callable[[list[StreamEvent]], Awaitable[None]] | None = None
        self.intake = StreamIntake(
            federation,
            max_transfer_bytes=max_model_bytes,
            max_pending_bytes=8 * max_chunk_bytes,
            timeout=reassembly_timeout,
            executor=self._intake_worker,  # the streams' hashing, as the reassembler's
        )
        self._last_expiry = 0.0
        # Kinds whose sequence numbers may reach the replay journal up to LAZY_DURABLE_S
        # after the message was handed on (one fdatasync a second instead of one per
        # message). Only for kinds whose protocol refuses a replayed frame by itself
        # (Sync-Opt's per-step messages: step numbers are never reused, and a stale step's
        # gradient is refused), so the journal's window adds nothing for them; set by
        # the mode that receives them.
        self.lazy_durable_kinds: frozenset[str] = frozenset()
        self._lazy_commit: asyncio.TimerHandle | None = None
        # Durability before acknowledgement (coordinator side): called with every
        # verified frame from an agent before anything is handed on. It writes the frames
        # it keeps to disk and returns what must be done before the frame is acknowledged
        # (its group's sync: see fedagent.storage.roundjournal), which receive() returns to the
        # transport. Frames read back from that journal skip it.
        self.journal: Callable[[str, bytes | bytearray, Envelope], Awaitable[Awaitable[None] | None]] | None = None
        # Called before the replay guard's numbers are made durable: a number must not be
        # durable before the journal record of its frame (a frame redelivered after a
        # crash would meet its own number and be refused as a replay).
        # (Awaited: the coordinator's flush runs in a worker thread, the event loop goes on.)
        self.before_replay_commit: Callable[[], Awaitable[None]] | None = None
        # Journaled frames being checked and handed on (between the journal and the
        # ``deliver`` callback): a journal must not be replaced while one is.
        self.journaled_in_hand = 0
        self._lazy_tasks: set[asyncio.Task[None]] = set()
        # (sender, sequence number) -> what the acknowledgement of a journaled frame
        # waits for, until it is settled: a copy delivered meanwhile waits for it too.
        self._awaiting_ack: dict[tuple[str, int], asyncio.Future[None]] = {}
        self.metrics = metrics  # a fedagent.node.metrics.NodeMetrics, or None
        # What each sender may cost before its frames are decoded, verified or written
        # anywhere (fedagent.protocols.ratelimit); a daemon narrows it to what it expects.
        self.budget: SenderBudget | None = SenderBudget()
        # Asked, before verification, for every frame of TRANSFER_KINDS (sender, kind,
        # round as the envelope says): False drops it. A coordinator admits update frames
        # only from the agents selected for its round in flight. Frames read back from a
        # journal are not asked about.
        self.admit: Callable[[str, str, int], bool] | None = None
        self._drop_logged: dict[str, float] = {}
        self._expiry: asyncio.TimerHandle | None = None
        # The budget is taken where the transport reads a message, before it is handed
        # over (a transport with a ``screen`` hook: the daemons'); receive() then does not
        # take it again.
        self._screening = False
        if transport is not None and hasattr(transport, "screen"):
            transport.screen = self.screen
            self._screening = True
        # Publishes wait for their PUBACK however long the broker takes (and for the
        # connection to come back), instead of failing after publish_timeout: for a
        # daemon with nothing better to do than get its message out (the coordinator).
        self.patient = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.messages_in = 0
        self.messages_out = 0

    @property
    def _seq(self) -> int:
        return self._counter.value

    def envelope(self, message: Message, round_: int = 0) -> Envelope:
        return Envelope(
            kind=message.kind,
            federation=self.federation,
            sender=self.node_id,
            round=round_,
            seq=self._counter.take(),
            ts=self.clock(),
            body=message.to_body(),
        )

    def frame(self, message: Message, round_: int | None = None) -> bytes:
        """One signed frame for a message that is never chunked (presence, a Last Will)."""
        return encode(sign(self.envelope(message, _round_of(message, round_)), self.identity))

    async def send(
        self,
        topic: str,
        message: Message,
        *,
        round_: int | None = None,
        retain: bool = False,
        transport=None,
        stable: bool = False,
    ) -> int:
        """Publish ``message`` (chunked if needed) on ``transport`` (default: this
        messenger's own); returns the bytes put on the wire. ``round_`` defaults to the
        message's own ``round`` (the envelope's round is signed and must agree).

        ``stable``: the message's tensors do not change until this returns (a model the
        caller never modifies in place), so its chunks are cut from them directly instead
        of from an encoded copy of the whole message made first."""
        transport = transport or self.transport
        env = self.envelope(message, _round_of(message, round_))
        tensors = _tensors(message)
        # A message that will be chunked is authenticated by its signed chunks; signing the
        # inner envelope too would cost one more pass over the model. (A round start with
        # the model as its int8 step stays signed inside, chunked or not: what its
        # receivers get signed does not change.)
        signed = not (tensors is not None and weights_nbytes(tensors) > self.max_chunk)
        payload: bytes | memoryview | Segments
        if tensors is None and not _is_step(message):
            payload = encode(sign(env, self.identity))
        else:
            # Off the event loop and without msgpack's copies: a model's bytes go once into
            # the payload (or are cut into chunks where they lie), and are signed there.
            payload = await asyncio.to_thread(
                _encode_big, env, self.identity if signed else None, stable, self.max_chunk
            )
        if len(payload) > self.max_chunk:
            if retain:
                raise ValueError("a message larger than one chunk cannot be retained")
            self._transfer += 1
            tid = f"{self._seq:x}-{self._transfer}"
            chunk = chunk_size(len(payload), self.max_chunk)
            n = -(-len(payload) // chunk)
            first = self._counter.take(n)  # reserved here: another send may run meanwhile
            round_ = env.round
            bodies: Sequence[dict[str, Any]]
            if isinstance(payload, Segments):
                bodies = await asyncio.to_thread(LazyChunks, payload, max_chunk=chunk, transfer_id=tid)
            else:
                bodies = await asyncio.to_thread(split, payload, max_chunk=chunk, transfer_id=tid, copy=False)

            def frame(i: int) -> bytes:
                return encode(
                    sign(
                        Envelope(
                            kind=CHUNK_KIND,
                            federation=self.federation,
                            sender=self.node_id,
                            round=round_,
                            seq=first + i,
                            ts=self.clock(),
                            body=bodies[i],
                        ),
                        self.identity,
                    )
                )

            total = await self._publish_frames(transport, topic, n, frame, threaded=chunk > THREADED_FRAME_BYTES)
        else:
            data = (
                b"".join(payload)
                if isinstance(payload, Segments)
                else payload
                if isinstance(payload, bytes)
                else bytes(payload)
            )
            await transport.publish(topic, data, qos=1, retain=retain, timeout=self.publish_timeout, **self._patience())
            total = len(data)
        return self._sent(total)

    async def _publish_frames(
        self, transport, topic: str, n: int, frame: Callable[[int], bytes], *, threaded: bool
    ) -> int:
        """Publish frames ``frame(0) … frame(n-1)`` in order, with up to
        ``publish_window`` of them awaiting PUBACK at once; returns their bytes.

        One chunk at a time leaves the link idle for a round trip per chunk, and the
        broker idle while the next chunk is being encrypted. Two are enough to keep the
        broker busy; more only lengthens each PUBACK wait. A frame is encoded only when
        the window has room for it and dropped once acknowledged, so a model sent to
        the broker costs its encoded payload plus a window of frames, not the payload
        twice (all frames made up front were a second copy of the model at the peak:
        measured with the round-start broadcast of 44.8 MB)."""
        window = asyncio.Semaphore(self.publish_window)
        # A chunk's PUBACK comes after the chunks queued before it have gone through:
        # the wait allows for the whole window (with 8 chunks of 4 MiB in flight on a
        # loaded machine, a fixed 30 s expired and the update was lost).
        timeout = self.publish_timeout * self.publish_window
        # Signing and encoding a large chunk (``threaded``: a copy of its bytes) go off the
        # event loop; small ones are cheaper than the thread hop.
        tasks: list[asyncio.Future] = []
        total = 0

        async def one(data: bytes) -> None:
            try:
                await transport.publish(topic, data, qos=1, timeout=timeout, **self._patience())
            finally:
                window.release()

        try:
            for i in range(n):
                await window.acquire()
                try:
                    data = await asyncio.to_thread(frame, i) if threaded else frame(i)
                except BaseException:
                    window.release()
                    raise
                total += len(data)
                tasks.append(asyncio.ensure_future(one(data)))
                del data
                # A failed publish ends the send now, not after every frame was made.
                failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
                if failed is not None:
                    failed.result()
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return total

    def _patience(self) -> dict[str, bool]:
        # Only asked of a transport when set: test doubles of a transport need not know it.
        return {"patient": True} if self.patient else {}

    def bound_transfers(self, nbytes: int) -> None:
        """Refuse transfers announcing more than ``nbytes`` (what this daemon can be sent
        at most: a few times its model), and give each sender as much pending room."""
        n = max(1024, min(int(nbytes), self.model_limits.max_message_bytes))
        self.reassembler.max_transfer_bytes = n
        self.reassembler.max_sender_bytes = n
        self.intake.max_transfer_bytes = n

    def screen(self, topic: str) -> bool:
        """Whether a message on ``topic`` is worth reading: False when its sender is over
        its budget for the kind (the drop is counted). Synchronous and cheap: the transport
        asks as it reads each message."""
        if self.budget is None:
            return True
        try:
            fed, sender, _receiver, kind = topics.parse(topic)
        except ValueError:
            return True  # receive() refuses it, named
        if not sender or fed != self.federation:
            return True
        why = self.budget.allow(sender, kind or "", time.monotonic())
        if why:
            self._drop(sender, why)
            return False
        return True

    def _drop(self, sender: str, reason: str) -> None:
        """A frame dropped before it was checked (a flood, a transfer not expected from
        its sender): counted per sender and reason, logged once in a while per sender."""
        if self.budget is not None and not reason.startswith("rate:"):
            self.budget.count(sender, reason)
        if self.metrics is not None:
            self.metrics.dropped(reason)
        now = time.monotonic()
        last = self._drop_logged.get(sender)
        if last is None or now - last >= DROP_LOG_EVERY:
            if len(self._drop_logged) > 10_000:
                self._drop_logged.clear()
            self._drop_logged[sender] = now
            seen = self.budget.dropped.get(sender, {}) if self.budget is not None else {}
            log.warning(
                "dropping frames from %s before checking them: %s (%s so far)",
                sender,
                reason,
                ", ".join(f"{k} {v}" for k, v in sorted(seen.items())) or "1",
            )

    def _expire_soon(self) -> None:
        """Chunked transfers in progress are expired on a timer, not only when another
        chunk comes (a transfer that stops would otherwise hold its buffer for good)."""
        if self._expiry is not None or not self.reassembler.pending_transfers:
            return
        step = max(1.0, min(5.0, self.reassembler.timeout / 4))
        self._expiry = asyncio.get_running_loop().call_later(step, self._expire_due)

    def _expire_due(self) -> None:
        self._expiry = None
        for sender, tid in self.reassembler.expire(time.monotonic()):
            self.reject("chunk-timeout", sender, f"transfer {tid} incomplete, dropped")
        self._expire_soon()

    def close(self) -> None:
        """Stop the expiry timer and the reassembly worker (a daemon shutting down)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        # A chunk received after this is placed and hashed in the caller's thread.
        self.reassembler.executor = None
        self.intake.executor = None
        self._intake_worker.shutdown(wait=False)

    async def send_update(
        self, topic: str, update: Update, *, base=None, compressor: Compressor | None = None, transport=None
    ) -> int:
        """Publish ``update`` as a stream the coordinator folds chunk by chunk, compressed
        by ``compressor`` (deltas to ``base``, the round's global model); returns the bytes
        put on the wire."""
        transport = transport or self.transport
        compressor = compressor or Compressor()
        tensors = await asyncio.to_thread(compressor.encode, update.weights, base)
        head = Envelope(
            kind=HEAD_KIND,
            federation=self.federation,
            sender=self.node_id,
            round=update.round,
            seq=self._counter.take(),
            ts=self.clock(),
            body=head_body(
                update.round, update.base_version, update.num_samples, update.metrics, update.leaving, tensors
            ),
        )
        payload, digest = await asyncio.to_thread(_stream_payload, head, tensors)
        del tensors
        self._transfer += 1
        tid = f"u{self._seq:x}-{self._transfer}"
        chunk = chunk_size(len(payload), self.max_chunk)
        n = max(1, -(-len(payload) // chunk))
        first = self._counter.take(n)  # reserved here: another send may run meanwhile
        round_ = update.round

        bodies = list(iter_stream_chunks(payload, max_chunk=chunk, transfer_id=tid, digest=digest))

        def frame(i: int) -> bytes:
            # Signed like a chunk: the data are bound by the payload's SHA-256 in the
            # signed body, and the intake treats every part as tentative until it matches.
            return encode(
                sign(
                    Envelope(
                        kind=STREAM_KIND,
                        federation=self.federation,
                        sender=self.node_id,
                        round=round_,
                        seq=first + i,
                        ts=self.clock(),
                        body=bodies[i],
                    ),
                    self.identity,
                )
            )

        # Frames go out in order (the coordinator folds a stream in order and holds back
        # only a few chunks that overtake others, so the sender must not reorder them).
        total = await self._publish_frames(transport, topic, n, frame, threaded=chunk > THREADED_FRAME_BYTES)
        return self._sent(total)

    async def _receive_stream(self, env: Envelope, guarded: bool = False) -> None:
        if self.on_stream is None:
            return self.reject("kind", env.sender, "streamed update sent to a node that does not aggregate")
        now = time.monotonic()
        try:
            events = self.intake.feed(env.sender, env.body, now)
        except CodecError as exc:
            return self.reject("chunk", env.sender, str(exc))
        # Expiry scans every transfer in progress: once a second, not per chunk (1,000
        # concurrent updates would make that O(N²) per round).
        if now - self._last_expiry > 1.0:
            self._last_expiry = now
            events += self.intake.expire(now)
        events = self._bind_round(env, events)
        for ev in events:
            if isinstance(ev, UpdateEnd) and not ev.ok:
                self.reject("stream", ev.sender, ev.reason)
        if events:
            if guarded:
                # In the round journal: its number comes back from there after a crash.
                self._persist_replay_soon()
            elif any(isinstance(ev, UpdateHead) for ev in events):
                # A replayed stream can only start with its header (the intake refuses
                # parts of a transfer it does not know), so the guard is made durable when
                # a stream starts, not fsync'd for every chunk of a large update.
                await self._persist_replay()
            await self.on_stream(events)

    def _bind_round(self, env: Envelope, events: list[StreamEvent]) -> list[StreamEvent]:
        """The stream's inner header is not signed itself; its round must be the one of
        the signed chunk that completed it, as for any message (round binding)."""
        for k, ev in enumerate(events):
            if isinstance(ev, UpdateHead) and ev.round != env.round:
                tail = self.intake.abort(
                    ev.sender, ev.tid, f"stream header for round {ev.round} in chunks signed for round {env.round}"
                )
                kept = [e for e in events[k + 1 :] if e.tid != ev.tid]
                return events[:k] + kept + tail
        return events

    async def persist_replay(self) -> None:
        """Make every number the replay guard accepted so far durable now: before a round
        journal drops frames whose numbers it would otherwise give back after a crash
        (the frames whose commit was left to :meth:`_persist_replay_soon`)."""
        await self._persist_replay()

    async def _persist_replay(self) -> None:
        """Make the replay guard's numbers durable before a message is handed on: a frame
        replayed after a crash must meet them. (Once delivered to this process, an MQTT
        QoS 1 message has been acknowledged, so writing first loses nothing a
        redelivery would have brought.)"""
        if self.replay_journal is not None:
            if self.before_replay_commit is not None and self.replay_journal.guard.dirty:
                await self.before_replay_commit()
                # The frames it made durable release their numbers from their gates'
                # callbacks (see _journal): after one turn of the loop they go with this
                # commit, not a second later.
                await asyncio.sleep(0)
            self.replay_journal.commit()

    def _persist_replay_soon(self) -> None:
        """Commit the replay guard within LAZY_DURABLE_S (a kind of
        ``lazy_durable_kinds``, or a frame in the round journal), unless another message
        commits it first. One append and fdatasync a second instead of one per update:
        at 1,000 small updates a round they were most of a coordinator's disk work."""
        if self.replay_journal is None or self._lazy_commit is not None:
            return
        self._lazy_commit = asyncio.get_running_loop().call_later(LAZY_DURABLE_S, self._lazy_commit_due)

    def _lazy_commit_due(self) -> None:
        self._lazy_commit = None
        task = asyncio.get_running_loop().create_task(self._lazy_commit_now())
        self._lazy_tasks.add(task)
        task.add_done_callback(self._lazy_tasks.discard)

    async def _lazy_commit_now(self) -> None:
        # (A frame still on its way into the round journal may be waiting meanwhile: its
        # number is held out of this commit, see _journal.)
        try:
            await self._persist_replay()
        except FedagentError as exc:  # the next commit writes the whole state again
            log.error("replay guard not saved: %s", exc)

    def _sent(self, total: int) -> int:
        self.bytes_out += total
        self.messages_out += 1
        if self.metrics is not None:
            self.metrics.add_bytes(out=total)
            self.metrics.message_out()
        return total

    def count_rejected(self, reason: str) -> None:
        """Count a refusal in status and metrics without logging it (for callers that log
        a flood once rather than per message)."""
        self.rejected[reason] += 1
        if self.metrics is not None:
            self.metrics.rejected(reason)

    def record_rejection(self, sender: str, reason: str, detail: str, **where: Any) -> None:
        """Count a refusal and keep it among the recent ones (the round logic's refusals
        come here too, so `rejected` and `recent_rejections` always agree)."""
        self.count_rejected(reason)
        entry: dict[str, Any] = {
            "sender": sender or "?",
            **where,
            "reason": reason,
            "detail": detail,
            "at": time.time(),
        }
        self.recent_rejections = [*self.recent_rejections, entry][-RECENT_REJECTIONS:]

    def reject(self, reason: str, sender: str, detail: str) -> None:
        """Refuse a message: count it under ``reason`` (in ``status`` and the metrics), keep
        it among the recent refusals ``status`` shows, and log it with its sender.

        The messenger refuses what fails its own checks (topic, codec, signature, schema)
        here; a daemon calls it for a message that passed them but must not be acted on:
        from the wrong role, on the wrong topic, for a mode it does not run. ``detail``
        says what was wrong in words an operator can act on; ``sender`` is "" when not
        even the topic named one. A refusal is data, never an exception: the frame is
        still acknowledged, so the broker does not deliver it again."""
        self.record_rejection(sender, reason, detail)
        log.warning("rejected message from %s: %s (%s)", sender or "?", reason, detail)

    async def receive(
        self,
        topic: str,
        payload: bytes | bytearray,
        deliver: Callable[[Incoming], Awaitable[None]],
        *,
        journaled: bool = False,
    ) -> Awaitable[None] | None:
        """Check one frame as received from the broker and hand what it completes to
        ``deliver``. ``journaled``: a frame read back from this node's round journal after
        a restart (accepted once already: see :meth:`Verifier.check`). Returns what must be
        done before the frame is acknowledged (the ``journal`` hook's answer, or for a copy
        of a frame still waiting for it, the first's), or None."""
        self.bytes_in += len(payload)
        if self.metrics is not None:
            self.metrics.add_bytes(in_=len(payload))
        try:
            fed, topic_sender, _receiver, kind = topics.parse(topic)
        except ValueError as exc:
            self.reject("topic", "", str(exc))
            return None
        if fed != self.federation:
            self.reject("federation", topic_sender, f"topic of federation {fed}")
            return None
        if not payload:
            return None  # a cleared retained message
        if topic_sender and not journaled and not self._screening and self.budget is not None:
            # Before anything else is done with it: a flood costs its reading, no more.
            why = self.budget.allow(topic_sender, kind or "", time.monotonic())
            if why:
                self._drop(topic_sender, why)
                return None
        try:
            # Views: a chunk's data is copied once, into its transfer, not first out of
            # the payload by the decoder.
            env = decode(payload, self.wire_limits, views=True)
        except CodecError as exc:
            self.reject("codec", topic_sender, str(exc))
            return None
        # The ACL makes node/<id>/ writable only by <id>: the envelope must agree.
        if topic_sender and env.sender != topic_sender:
            self.reject("spoofed", topic_sender, f"envelope claims sender {env.sender}")
            return None
        if env.federation != self.federation:
            self.reject("federation", env.sender, f"envelope for {env.federation}")
            return None
        if (
            self.admit is not None
            and not journaled
            and env.kind in TRANSFER_KINDS
            and not self.admit(env.sender, env.kind, env.round)
        ):
            self._drop(env.sender, "unexpected-transfer")
            return None
        try:
            role = self.verifier.check(env, journaled=journaled)
        except AuthError as exc:
            self.reject(exc.reason, env.sender, exc.detail)
            # A copy of a frame whose record is still on its way to the disk (the broker
            # sends it again when the connection comes back meanwhile): acknowledged with
            # the first, not before, and withheld with it, or the broker would forget a
            # frame whose record then failed. The next copy is taken (see _journal).
            return self._awaiting_ack.get((env.sender, env.seq)) if exc.reason == "replay" else None
        if not journaled:  # a frame read back from the journal says nothing about its sender now
            self.last_heard[env.sender] = time.time()
        gate = None
        if self.journal is not None and not journaled and role in PARTICIPANT_ROLES:
            gate = await self._journal(self.journal, topic, payload, env)
        held = journaled or gate is not None
        # In the round journal (written now, or read back from it): after a crash the
        # journal gives the replay guard this frame's number back (Verifier.check with
        # journaled=True), so the number need not be durable before the frame is handed
        # on. A frame the journal could not take (its gate failed already) is not.
        guarded = journaled or (gate is not None and not _failed(gate))
        if held:
            self.journaled_in_hand += 1
        try:
            await self._hand_on(topic, payload, env, role, deliver, held, guarded)
        except Exception:
            if gate is not None:
                # The transport acknowledges a frame whose handling failed: not before
                # its record is durable. (Waited for, not awaited: its own failure, a
                # withheld acknowledgement, is the transport's to read, and this
                # exception the caller's.)
                await asyncio.wait([asyncio.ensure_future(gate)])
            raise
        finally:
            if held:
                self.journaled_in_hand -= 1
        return gate

    async def _journal(
        self,
        hook: Callable[[str, bytes | bytearray, Envelope], Awaitable[Awaitable[None] | None]],
        topic: str,
        payload: bytes | bytearray,
        env: Envelope,
    ) -> Awaitable[None] | None:
        """The ``journal`` hook's answer for a verified frame, its sequence number kept
        out of the replay guard's saves until the frame is taken. A number saved while
        the frame's journal record failed (a full disk refuses the frame's record, not
        the guard's small append) would refuse the broker's redelivery of the frame after
        the restart, and lose it: it is saved once the record is durable, or at once if
        the hook does not journal the frame (then handled as any other message)."""
        guard = self.verifier.replay
        guard.hold(env.sender, env.seq)
        try:
            gate = await hook(topic, payload, env)
        except asyncio.CancelledError:
            # The transport's reader stopped with it: not acknowledged, delivered again.
            guard.withdraw(env.sender, env.seq)
            raise
        except Exception:
            guard.release(env.sender, env.seq)  # acknowledged after a failed handling
            raise
        if gate is None:
            guard.release(env.sender, env.seq)
            return None
        taken = asyncio.ensure_future(gate)
        # Only the frame's name waits with the sync: the envelope holds a view of the
        # frame's bytes, and a callback holding it kept every frame of a group commit
        # in memory until its sync (the coordinator's peak at 10 x 4.4 MB went from
        # 2.6 to 3.4-3.6 models).
        key = sender, seq = env.sender, env.seq
        self._awaiting_ack[key] = taken

        def settled(done: asyncio.Future[None]) -> None:
            if self._awaiting_ack.get(key) is done:
                del self._awaiting_ack[key]
            # Withheld or cancelled (shutdown), the acknowledgement is never sent: the
            # broker delivers the frame again, after a restart or a reconnection, and
            # either must take it. Its number stays out of every save and leaves the
            # numbers this process has seen.
            if done.cancelled() or isinstance(done.exception(), AckWithheld):
                guard.withdraw(sender, seq)
                return
            guard.release(sender, seq)
            self._persist_replay_soon()

        taken.add_done_callback(settled)
        return taken

    async def _hand_on(
        self,
        topic: str,
        payload: bytes | bytearray,
        env: Envelope,
        role: str,
        deliver: Callable[[Incoming], Awaitable[None]],
        journaled: bool = False,
        guarded: bool = False,
    ) -> None:
        if env.kind == STREAM_KIND:
            if role != "agent":
                # Only agents train: a stream from another role (a coordinator's
                # certificate) would let it inject an update into its own round.
                return self.reject("role", env.sender, f"streamed update signed by a {role!r} certificate")
            return await self._receive_stream(env, guarded)
        if env.kind == CHUNK_KIND:
            try:
                whole = self.reassembler.feed(env.sender, env.body, time.monotonic())
            except CodecError as exc:
                return self.reject("chunk", env.sender, str(exc))
            for sender, tid in self.reassembler.expire(time.monotonic()):
                self.reject("chunk-timeout", sender, f"transfer {tid} incomplete, dropped")
            self._expire_soon()
            if whole is None:
                return None
            try:
                # The tensors stay views of the reassembled buffer (handed over by the
                # reassembler, held by nothing else): the model is not copied again.
                inner = await asyncio.to_thread(decode, whole, self.model_limits, views=True)
            except CodecError as exc:
                return self.reject("codec", env.sender, str(exc))
            if inner.sender != env.sender or inner.federation != self.federation:
                return self.reject("spoofed", env.sender, "reassembled message names another sender")
            env, size = inner, len(whole)
        else:
            size = len(payload)
        try:
            message = body_of(env.kind, env.body, self.model_limits)
        except CodecError as exc:
            return self.reject("schema", env.sender, str(exc))
        body_round = getattr(message, "round", None)
        if type(body_round) is int and body_round != env.round:
            # The signed envelope round binds the message to its round: a body naming
            # another one was not produced by the sender's messenger.
            return self.reject("round", env.sender, f"body for round {body_round} in an envelope of round {env.round}")
        self.messages_in += 1
        if self.metrics is not None:
            self.metrics.message_in()
        if guarded or env.kind in self.lazy_durable_kinds:
            self._persist_replay_soon()
        elif env.kind != Heartbeat.kind:
            # Heartbeats (several a second at a busy coordinator) are not worth an fsync
            # each: their numbers become durable with the next other message. Replayed
            # after a crash, one could only make its sender look alive for a moment.
            await self._persist_replay()
        await deliver(Incoming(topic, env.sender, env, message, size, role, journaled))


def _failed(gate: Awaitable[None]) -> bool:
    """Whether an acknowledgement's gate has failed already (a frame the journal could
    not take)."""
    return isinstance(gate, asyncio.Future) and gate.done() and not gate.cancelled() and gate.exception() is not None


def _encode_big(
    env: Envelope, identity: Identity | None, stable: bool, max_chunk: int
) -> bytes | memoryview | Segments:
    """A message with tensors, signed by ``identity`` (if given) and encoded for
    :meth:`Messenger.send`: one frame's bytes (joined straight from the tensors: one
    copy, where packing and then taking the packed bytes made two), or, for a message
    that will be chunked, the segments of a ``stable`` one or a view of an encoded copy."""
    if identity is not None:
        env = sign(env, identity)
    segments = encode_segments(env)
    if len(segments) <= max_chunk:
        return b"".join(segments)
    return segments if stable else encode_view(env)


def _stream_payload(head: Envelope, tensors) -> tuple[bytearray, bytes]:
    payload = encode_stream(head, tensors)
    return payload, hashlib.sha256(payload).digest()


def _is_step(message: Message) -> bool:
    """The message carries a model as its int8 step (a round start's ``delta``)."""
    return isinstance(getattr(message, "delta", None), ModelDelta)


def _tensors(message: Message):
    """The tensors a message carries (a model or a gradient), or None."""
    for name in ("weights", "gradient"):
        t = getattr(message, name, None)
        if t is not None:
            return t
    return None


def _round_of(message: Message, round_: int | None) -> int:
    own = getattr(message, "round", None)
    if type(own) is not int:
        return 0 if round_ is None else round_
    if round_ is not None and round_ != own:
        raise ValueError(f"{message.kind} of round {own} sent with envelope round {round_}")
    return own
