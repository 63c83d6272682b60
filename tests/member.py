"""A member that turns its certificate against the federation: ``from member import Mallory``.

:class:`Mallory` is a light agent (``bench.swarm.LightAgent``: its own MQTT connection and
certificate, a retained presence, the participant machine, updates as signed streams) in
a thread of its own (:func:`running_mallory`). Every frame it sends is made and signed by
the project's own library, so nothing about it is invalid but what it says. What it does
when selected for a round is ``mallory.attack``, changed at run time:

``"honest"``    sends the global model back (a null step)
``"noise"``     the global model plus N(0, ``noise``²) per weight, claiming ``claim`` samples
``"stall"``     the stream's header and 3 of its 5 chunks, then silence
``"digest"``    a whole stream whose chunks name a wrong SHA-256 (found at its end, after
                its parts were folded)

In an asynchronous federation (``mode = "async"``) it answers each task at once, with
``"honest"`` a null step and with ``"noise"`` N(0, ``noise``²) per weight as its change,
claiming ``claim`` samples, streamed as int8 deltas from ``shapes`` (zeros of the
model's tensors, which the test gives it; a change needs no model).

and at any time: :meth:`Mallory.flood` (signed frames of one kind, as fast as the broker
takes them), :meth:`Mallory.publish_once`, :meth:`Mallory.big_transfer` (chunk frames of
a 1 GiB transfer), :meth:`Mallory.announce` (its presence again, with another sample
count or without the int8 steps). Counters: ``rounds_sent``, ``attacked`` (rounds it
attacked), ``flooded`` (frames published by floods), ``errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from bench.swarm import LightAgent, _presence
from fedagent.local.federation import Federation
from fedagent.node.messaging import Incoming
from fedagent.node.transport import TlsFiles
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, encode
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.messages import AsyncTask, GlobalModel, Heartbeat, Message, ModelRequest, RoundStart, Update
from fedagent.protocols.participant import SendUpdate, Train, TrainingDone
from fedagent.protocols.streaming import HEAD_KIND, STREAM_KIND, encode_stream, head_body, iter_stream_chunks
from fedagent.security import pki
from fedagent.security.signing import CHUNK_KIND, sign

T = TypeVar("T")


@dataclass
class Mallory(LightAgent):
    attack: str = "honest"
    claim: int = 0  # samples claimed in its updates (0: the announced ones)
    noise: float = 1.0
    step: float = 0.0
    attacked: int = 0
    flooded: int = 0
    last_round: int = 0
    rounds_seen: list[int] = field(default_factory=list)
    shapes: dict[str, np.ndarray] | None = None  # asynchronous: zeros of the model's tensors

    # -- rounds ------------------------------------------------------------------------
    async def _deliver(self, inc: Incoming) -> None:
        """As a light agent, but one that joins a running federation: a round start it
        cannot rebuild (it missed the step's base) makes it ask for the model, as the
        agent daemon does."""
        msg = inc.message
        if isinstance(msg, AsyncTask) and inc.role == "coordinator" and self.shapes is not None:
            self.coordinator = inc.sender
            t = asyncio.create_task(self._answer_task(msg))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            return
        if isinstance(msg, GlobalModel) and msg.weights is not None and inc.role == "coordinator":
            self.coordinator = inc.sender
            self.held = (msg.model_version, msg.weights)
            start = self.steps.on_model(msg.model_version, msg.weights)
            if start is not None:
                await self._start(start)
            return
        if isinstance(msg, RoundStart) and msg.delta is not None and inc.role == "coordinator":
            self.coordinator = inc.sender
            resolved, _why = self.steps.resolve(msg, self.held)
            if resolved is None:
                have = self.held[0] if self.held is not None and self.held[0] < msg.model_version else 0
                topic = topics.direct(self.federation, self.id, inc.sender, "model_request")
                await self.transport.publish(topic, self.messenger.frame(ModelRequest(have)), qos=1)
                return
            await self._start(resolved)
            return
        await super()._deliver(inc)

    async def _start(self, start: RoundStart) -> None:
        assert start.weights is not None
        self.held = (start.model_version, start.weights)
        for cmd in self.participant.handle(start):
            if isinstance(cmd, Train):
                t = asyncio.create_task(self._train(cmd))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _train(self, cmd: Train) -> None:
        attack = self.attack
        self.rounds_seen.append(cmd.round)
        try:
            if attack == "honest" or not self.coordinator:
                await super()._train(cmd)
                return
            rng = np.random.default_rng(cmd.round)
            weights = cmd.weights
            if attack == "noise":
                weights = {
                    k: (v + rng.normal(0.0, self.noise, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                    for k, v in cmd.weights.items()
                }
            samples = self.claim or self.samples
            for c in self.participant.handle(
                TrainingDone(cmd.round, cmd.base_version, samples, {"loss": 0.0}, weights)
            ):
                if not isinstance(c, SendUpdate):
                    continue
                self.attacked += 1
                if attack == "noise":
                    await self.messenger.send_update(self._update_topic(), c.update, base=cmd.weights)
                elif attack == "stall":
                    await self._stream(c.update, cmd.weights, keep=3)
                elif attack == "digest":
                    await self._stream(c.update, cmd.weights, digest=bytes(32))
                self.rounds_sent += 1
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def _answer_task(self, task: AsyncTask) -> None:
        """An asynchronous task answered at once: a null step, or noise as the change."""
        assert self.shapes is not None
        attack = self.attack
        self.rounds_seen.append(task.task)
        try:
            base = self.shapes
            weights = base
            samples = self.samples
            if attack == "noise":
                rng = np.random.default_rng(task.task)
                weights = {
                    k: (v + rng.normal(0.0, self.noise, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                    for k, v in base.items()
                }
                samples = self.claim or self.samples
                self.attacked += 1
            update = Update(task.task, task.model_version, samples, {"loss": 0.0}, weights)
            await self.messenger.send_update(
                self._update_topic(), update, base=base, compressor=Compressor(CompressionConfig("int8"))
            )
            self.rounds_sent += 1
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _update_topic(self) -> str:
        assert self.coordinator is not None
        return topics.direct(self.federation, self.id, self.coordinator, "update")

    async def _stream(self, update: Update, base: dict[str, np.ndarray], *, keep: int = 5, digest: bytes = b"") -> None:
        """The update as an int8 stream of 5 chunks, signed like the real one; only the
        first ``keep`` chunks sent; ``digest`` instead of the payload's SHA-256."""
        m = self.messenger
        tensors = Compressor(CompressionConfig("int8")).encode(update.weights, base)
        head = Envelope(
            kind=HEAD_KIND,
            federation=self.federation,
            sender=self.id,
            round=update.round,
            seq=m._counter.take(),
            ts=m.clock(),
            body=head_body(
                update.round, update.base_version, update.num_samples, update.metrics, update.leaving, tensors
            ),
        )
        payload = encode_stream(head, tensors)
        chunk = -(-len(payload) // 5)
        real = hashlib.sha256(payload).digest()
        bodies = list(iter_stream_chunks(payload, max_chunk=chunk, transfer_id=f"m{m._seq:x}", digest=digest or real))
        for body in bodies[:keep]:
            env = Envelope(STREAM_KIND, self.federation, self.id, update.round, m._counter.take(), m.clock(), body)
            await self.transport.publish(self._update_topic(), encode(sign(env, m.identity)), qos=1)

    # -- at any time -----------------------------------------------------------------------
    def frames(self, message: Message, count: int) -> list[bytes]:
        """``count`` signed frames of ``message``, each with a sequence number of its own."""
        return [self.messenger.frame(message) for _ in range(count)]

    async def flood(
        self, topic: str, frames: list[bytes], seconds: float, *, retain: bool = False, rate: float = 0.0
    ) -> int:
        """Publish ``frames`` (QoS 1, many in flight) for at most ``seconds``, at most
        ``rate`` a second (0: as fast as the broker takes them); returns how many."""
        start = time.monotonic()
        deadline = start + seconds
        it = iter(frames)
        sent = 0

        async def worker() -> None:
            nonlocal sent
            for frame in it:
                now = time.monotonic()
                if now > deadline:
                    return
                if rate:
                    ahead = start + sent / rate - now
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                await self.transport.publish(topic, frame, qos=1, retain=retain, timeout=60)
                sent += 1
                self.flooded += 1

        await asyncio.gather(*(worker() for _ in range(32)))
        return sent

    async def publish_once(self, topic: str, message: Message) -> None:
        await self.transport.publish(topic, self.messenger.frame(message), qos=1)

    async def big_transfer(self, chunks: int, *, size: int = 2**30, chunk: int = 256 * 1024) -> None:
        """``chunks`` chunk frames of a transfer announcing ``size`` bytes, outside any round."""
        assert self.coordinator is not None
        m = self.messenger
        n = -(-size // chunk)
        data = bytes(chunk)
        topic = topics.direct(self.federation, self.id, self.coordinator, "update")
        for i in range(chunks):
            body = {"tid": "big", "i": i, "n": n, "size": size, "sha256": bytes(32), "data": data}
            env = Envelope(CHUNK_KIND, self.federation, self.id, 0, m._counter.take(), m.clock(), body)
            await self.transport.publish(topic, encode(sign(env, m.identity)), qos=1)

    async def heartbeats(self, interval: float = 2.5) -> None:
        """Heartbeats to the coordinator, as an agent daemon sends them (a member that
        flooded heartbeats is tracked by them from then on)."""
        while True:
            if self.coordinator is not None and self.transport.connected:
                topic = topics.direct(self.federation, self.id, self.coordinator, "heartbeat")
                try:
                    await self.transport.publish(topic, self.messenger.frame(Heartbeat(interval)), qos=1)
                except Exception as exc:
                    self.errors.append(f"heartbeat: {exc}")
            await asyncio.sleep(interval)

    async def announce(self, samples: int, *, reads_steps: bool = True) -> None:
        """Its retained presence again."""
        self.samples = samples
        self.reads_steps = reads_steps
        await self.transport.publish(
            topics.presence(self.federation, self.id),
            _presence(self.messenger, True, samples, reads_steps),
            retain=True,
        )


class Runner:
    """Mallory on an event loop in a thread: ``runner.call(coro_fn, *args)`` runs a
    coroutine there and returns its result."""

    def __init__(self, mallory: Mallory) -> None:
        self.mallory = mallory
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout: float = 120, **kw: Any) -> T:
        return asyncio.run_coroutine_threadsafe(fn(*args, **kw), self.loop).result(timeout)


def mallory_tls(fed: Federation) -> TlsFiles:
    """A valid agent certificate for ``mallory``, issued by the federation's own CA."""
    ca = fed.work / "pki"
    cert, key = pki.issue(ca, ca, "mallory", "agent")
    return TlsFiles(ca / pki.CA_CERT, cert, key)


@contextlib.contextmanager
def running_mallory(uri: str, tls: TlsFiles, federation: str, **kw: Any) -> Iterator[Runner]:
    """Mallory connected (its presence out) until the block ends."""
    mallory = Mallory("mallory", uri, tls, federation=federation, keepalive=10, **kw)
    r = Runner(mallory)
    r.thread.start()
    runs: list[asyncio.Task[None]] = []

    async def connect() -> None:
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        runs.append(loop.create_task(mallory.run(ready)))
        await asyncio.wait_for(ready.wait(), 60)
        runs.append(loop.create_task(mallory.heartbeats()))

    try:
        r.call(connect)
        yield r
    finally:
        with contextlib.suppress(Exception):
            r.call(mallory.close, timeout=30)
        r.loop.call_soon_threadsafe(r.loop.stop)
        r.thread.join(30)
