"""Envelopes over the transport: sequence numbers, chunking, validation, typing.

Outgoing: a message becomes an :class:`Envelope`, encoded, and split into ``chunk``
envelopes when it is larger than the broker's packet limit allows.
Incoming: the payload is decoded under limits, chunks are reassembled (digest
checked), the envelope's sender is checked against the topic it came on (the broker
ACL guarantees the topic subtree is the publisher's certificate CN), and the body is
validated into a typed message. Anything wrong is counted and logged with the
sender named, and dropped: a hostile peer never reaches the protocol machines.

Updates are the exception: :meth:`Messenger.send_update` sends them as streams
(:mod:`fedagent.protocols.streaming`, compressed as the round asks), and a receiver that
aggregates (``on_stream`` set) gets their chunks decoded into events as they arrive,
never a reassembled update.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fedagent.errors import CodecError
from fedagent.protocols import topics
from fedagent.protocols.chunking import Reassembler, split
from fedagent.protocols.codec import Envelope, Limits, decode, encode, encode_view
from fedagent.protocols.compression import Compressor
from fedagent.protocols.messages import Message, Update, body_of
from fedagent.protocols.streaming import (HEAD_KIND, STREAM_KIND, StreamEvent, StreamIntake, encode_stream,
                                          head_body, iter_stream_chunks)

log = logging.getLogger(__name__)

CHUNK_KIND = "chunk"


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    sender: str
    envelope: Envelope
    message: Message
    nbytes: int


class Messenger:
    def __init__(self, *, federation: str, node_id: str, transport, max_chunk_bytes: int = 4 * 2**20,
                 max_model_bytes: int = 2**30, reassembly_timeout: float = 120.0, metrics=None,
                 publish_window: int = 8) -> None:
        self.federation = federation
        self.node_id = node_id
        self.transport = transport
        self.max_chunk = max_chunk_bytes
        if publish_window < 1:
            raise ValueError("publish_window must be at least 1")
        self.publish_window = publish_window
        # Per-sender sequence numbers grow across restarts: they start at the clock.
        self._seq = time.time_ns() // 1000
        self._transfer = 0
        chunk_overhead = 4096
        self.wire_limits = Limits(max_message_bytes=max_chunk_bytes + chunk_overhead,
                                  max_bin_len=max_chunk_bytes + chunk_overhead)
        self.model_limits = Limits(max_message_bytes=max_model_bytes, max_bin_len=max_model_bytes,
                                   max_tensor_bytes=max_model_bytes)
        self.reassembler = Reassembler(max_transfer_bytes=max_model_bytes,
                                       max_pending_bytes=2 * max_model_bytes, timeout=reassembly_timeout)
        self.rejected: Counter[str] = Counter()
        # Streamed updates (coordinator side): set on_stream to receive their events. The
        # hold-back budget for chunks arriving out of turn is a few chunks, not N models.
        self.on_stream: Callable[[list[StreamEvent]], Awaitable[None]] | None = None
        self.intake = StreamIntake(federation, max_transfer_bytes=max_model_bytes,
                                   max_pending_bytes=8 * max_chunk_bytes, timeout=reassembly_timeout)
        self._last_expiry = 0.0
        self.metrics = metrics           # a fedagent.metrics.NodeMetrics, or None
        self.bytes_in = 0
        self.bytes_out = 0
        self.messages_in = 0
        self.messages_out = 0

    def envelope(self, message: Message, round_: int = 0) -> Envelope:
        self._seq += 1
        return Envelope(kind=message.kind, federation=self.federation, sender=self.node_id,
                        round=round_, seq=self._seq, ts=time.time(), body=message.to_body())

    async def send(self, topic: str, message: Message, *, round_: int = 0, retain: bool = False,
                   transport=None) -> int:
        """Publish ``message`` (chunked if needed) on ``transport`` (default: this
        messenger's own); returns the bytes put on the wire."""
        transport = transport or self.transport
        big = _is_big(message)
        payload = await asyncio.to_thread(encode_view, self.envelope(message, round_)) \
            if big else encode(self.envelope(message, round_))
        frames = [payload]
        if len(payload) > self.max_chunk:
            if retain:
                raise ValueError("a message larger than one chunk cannot be retained")
            self._transfer += 1
            tid = f"{self._seq:x}-{self._transfer}"
            n = -(-len(payload) // self.max_chunk)
            first = self._seq + 1
            self._seq += n             # reserved here: another send may run meanwhile
            frames = await asyncio.to_thread(self._chunk_frames, payload, tid, first, round_)
        elif big:
            frames = [bytes(payload)]
        await self._publish_all(transport, topic, frames, retain)
        total = sum(len(f) for f in frames)
        self.bytes_out += total
        self.messages_out += 1
        if self.metrics is not None:
            self.metrics.add_bytes(out=total)
            self.metrics.message_out()
        return total

    def _chunk_frames(self, payload, tid: str, first_seq: int, round_: int) -> list[bytes]:
        """The encoded chunk envelopes of ``payload`` (off the event loop: SHA-256 and
        one copy of every byte). Chunk data are views of ``payload``, copied once, by
        the encoder."""
        bodies = split(payload, max_chunk=self.max_chunk, transfer_id=tid, copy=False)
        return [encode(Envelope(kind=CHUNK_KIND, federation=self.federation, sender=self.node_id,
                                round=round_, seq=first_seq + i, ts=time.time(), body=body))
                for i, body in enumerate(bodies)]

    async def _publish_all(self, transport, topic: str, frames: list[bytes], retain: bool) -> None:
        """Publish ``frames`` with up to ``publish_window`` of them awaiting PUBACK at once.

        One chunk at a time left the link idle for a round trip per chunk, and the
        broker idle while the next chunk was being encrypted (bench/pipe.py measures
        it). Chunks may arrive in any order; the reassembler does not care."""
        if len(frames) == 1:
            await transport.publish(topic, frames[0], qos=1, retain=retain)
            return
        window = asyncio.Semaphore(self.publish_window)

        async def one(frame: bytes) -> None:
            async with window:
                await transport.publish(topic, frame, qos=1, retain=retain)

        tasks = [asyncio.ensure_future(one(f)) for f in frames]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def send_update(self, topic: str, update: Update, *, base=None, compressor: Compressor | None = None,
                          transport=None) -> int:
        """Publish ``update`` as a stream the coordinator folds chunk by chunk, compressed
        by ``compressor`` (deltas to ``base``, the round's global model); returns the bytes
        put on the wire."""
        transport = transport or self.transport
        compressor = compressor or Compressor()
        tensors = await asyncio.to_thread(compressor.encode, update.weights, base)
        self._seq += 1
        head = Envelope(kind=HEAD_KIND, federation=self.federation, sender=self.node_id, round=update.round,
                        seq=self._seq, ts=time.time(),
                        body=head_body(update.round, update.base_version, update.num_samples, update.metrics,
                                       update.leaving, tensors))
        payload, digest = await asyncio.to_thread(_stream_payload, head, tensors)
        del tensors
        self._transfer += 1
        tid = f"u{self._seq:x}-{self._transfer}"
        n = max(1, -(-len(payload) // self.max_chunk))
        first = self._seq + 1
        self._seq += n                 # reserved here: another send may run meanwhile
        round_ = update.round
        big = n > 1

        def frame(i: int, body: dict) -> bytes:
            return encode(Envelope(kind=STREAM_KIND, federation=self.federation, sender=self.node_id,
                                   round=round_, seq=first + i, ts=time.time(), body=body))

        # Up to publish_window chunks await their PUBACK at once (as in send()). Frames are
        # encoded off the event loop one after another and published in that order: the
        # coordinator folds a stream in order and holds back only a few chunks that
        # overtake others, so the sender must not reorder them.
        window = asyncio.Semaphore(self.publish_window)
        tasks: list[asyncio.Future] = []
        sizes: list[int] = []

        async def one(data: bytes) -> None:
            try:
                await transport.publish(topic, data, qos=1)
            finally:
                window.release()

        try:
            for i, body in enumerate(iter_stream_chunks(payload, max_chunk=self.max_chunk, transfer_id=tid,
                                                        digest=digest)):
                await window.acquire()
                try:
                    data = await asyncio.to_thread(frame, i, body) if big else frame(i, body)
                except BaseException:
                    window.release()
                    raise
                sizes.append(len(data))
                tasks.append(asyncio.ensure_future(one(data)))
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        total = sum(sizes)
        self.bytes_out += total
        self.messages_out += 1
        if self.metrics is not None:
            self.metrics.add_bytes(out=total)
            self.metrics.message_out()
        return total

    async def _receive_stream(self, env: Envelope) -> None:
        if self.on_stream is None:
            return self._reject("kind", env.sender, "streamed update sent to a node that does not aggregate")
        now = time.monotonic()
        try:
            events = self.intake.feed(env.sender, env.body, now)
        except CodecError as exc:
            return self._reject("chunk", env.sender, str(exc))
        # Expiry scans every transfer in progress: once a second, not per chunk (1,000
        # concurrent updates would make that O(N²) per round).
        if now - self._last_expiry > 1.0:
            self._last_expiry = now
            events += self.intake.expire(now)
        for ev in events:
            if getattr(ev, "ok", True) is False:
                self._reject("stream", ev.sender, ev.reason)
        if events:
            await self.on_stream(events)

    def _reject(self, reason: str, sender: str, detail: str) -> None:
        self.rejected[reason] += 1
        if self.metrics is not None:
            self.metrics.rejected(reason)
        log.warning("rejected message from %s: %s (%s)", sender or "?", reason, detail)

    async def receive(self, topic: str, payload: bytes, deliver: Callable[[Incoming], Awaitable[None]]) -> None:
        self.bytes_in += len(payload)
        if self.metrics is not None:
            self.metrics.add_bytes(in_=len(payload))
        try:
            fed, topic_sender, _receiver, _kind = topics.parse(topic)
        except ValueError as exc:
            return self._reject("topic", "", str(exc))
        if fed != self.federation:
            return self._reject("federation", topic_sender, f"topic of federation {fed}")
        if not payload:
            return None              # a cleared retained message
        try:
            env = decode(payload, self.wire_limits)
        except CodecError as exc:
            return self._reject("codec", topic_sender, str(exc))
        # The ACL makes node/<id>/ writable only by <id>: the envelope must agree.
        if topic_sender and env.sender != topic_sender:
            return self._reject("spoofed", topic_sender, f"envelope claims sender {env.sender}")
        if env.federation != self.federation:
            return self._reject("federation", env.sender, f"envelope for {env.federation}")
        if env.kind == STREAM_KIND:
            return await self._receive_stream(env)
        if env.kind == CHUNK_KIND:
            try:
                whole = self.reassembler.feed(env.sender, env.body, time.monotonic())
            except CodecError as exc:
                return self._reject("chunk", env.sender, str(exc))
            for sender, tid in self.reassembler.expire(time.monotonic()):
                self._reject("chunk-timeout", sender, f"transfer {tid} incomplete, dropped")
            if whole is None:
                return None
            try:
                inner = await asyncio.to_thread(decode, whole, self.model_limits)
            except CodecError as exc:
                return self._reject("codec", env.sender, str(exc))
            if inner.sender != env.sender or inner.federation != self.federation:
                return self._reject("spoofed", env.sender, "reassembled message names another sender")
            env, size = inner, len(whole)
        else:
            size = len(payload)
        try:
            message = body_of(env.kind, env.body, self.model_limits)
        except CodecError as exc:
            return self._reject("schema", env.sender, str(exc))
        self.messages_in += 1
        if self.metrics is not None:
            self.metrics.message_in()
        await deliver(Incoming(topic, env.sender, env, message, size))


def _stream_payload(head: Envelope, tensors) -> tuple[bytearray, bytes]:
    payload = encode_stream(head, tensors)
    return payload, hashlib.sha256(payload).digest()


def _is_big(message: Message) -> bool:
    return hasattr(message, "weights")
