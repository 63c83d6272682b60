"""The coordinator's model-sized paths cost what the memory budget allows (3x the model):
a broadcast costs its encoded payload and a window of frames, not every frame at once;
a checkpoint is written from the weights without a model-sized buffer, in the same
format as before."""

from __future__ import annotations

import asyncio
import tracemalloc

import msgpack
import numpy as np
import pytest

from fedagent.coordinator.streams import StreamFeed
from fedagent.node.messaging import Messenger
from fedagent.protocols.codec import encode_weights
from fedagent.protocols.messages import GlobalModel
from fedagent.protocols.streaming import UpdatePart
from fedagent.security.signing import Identity
from fedagent.storage import checkpoint

MODEL_BYTES = 8 * 2**20


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal(MODEL_BYTES // 4 // 8, dtype=np.float32) for i in range(8)}


class _Sink:
    def __init__(self) -> None:
        self.nbytes = 0
        self.count = 0

    async def publish(self, topic, payload, qos=1, retain=False, timeout=None) -> None:
        self.nbytes += len(payload)
        self.count += 1
        await asyncio.sleep(0)


def test_a_broadcast_costs_one_payload_and_a_window_of_frames(pki) -> None:
    t = pki.tls("coord")
    sink = _Sink()
    m = Messenger(
        federation="testfed",
        node_id="coord",
        transport=sink,
        identity=Identity.load(t.cert, t.key, t.ca),
        max_chunk_bytes=256 * 1024,
        publish_window=2,
    )
    weights = _model()
    tracemalloc.start()
    try:
        asyncio.run(m.send("fedagent/v1/testfed/broadcast/model", GlobalModel(1, 1, True, weights), round_=1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sink.count >= 32 and sink.nbytes > MODEL_BYTES
    # Encoded payload (1 model) + a few 256 KiB frames; all frames at once were 2 models.
    assert peak < 1.4 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"


def test_checkpoint_is_written_piece_by_piece_in_the_same_format(tmp_path) -> None:
    weights = {
        **_model(),
        "small": np.arange(5, dtype=np.float32),
        "count": np.array(7, dtype=np.int64),
        "mid": np.ones(20_000, dtype=np.float16),
    }
    meta = {"model_version": 3, "participants": ["a", "b"]}
    path = tmp_path / "global.ckpt"
    tracemalloc.start()
    try:
        checkpoint.save(path, weights, meta)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.1 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"
    assert path.read_bytes() == msgpack.packb(
        {"format": checkpoint.FORMAT, "meta": meta, "weights": encode_weights(weights)}, use_bin_type=True
    )
    back, meta_back = checkpoint.load(path)
    assert meta_back == meta
    for k, v in weights.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype and back[k].shape == v.shape


# ---- the receiving side: what reaches the process, and chunk sizes -------------------------
def _held_tracker(monkeypatch) -> list[int]:
    """Bytes held by the transport each time paho hands it a message."""
    from fedagent.node.transport import patches

    seen: list[int] = []
    orig = patches.MqttClient._on_message

    def on_message(self, client, userdata, message):
        orig(self, client, userdata, message)
        seen.append(self.held_bytes)

    monkeypatch.setattr(patches.MqttClient, "_on_message", on_message)
    return seen


@pytest.mark.parametrize("hold_limit", [None, 1])
def test_a_held_message_stops_reading_whatever_the_broker_sends(broker, arun, peer, monkeypatch, hold_limit):
    """Mosquitto 2.0.11 sends more than Receive Maximum once PUBACKs flow, so the
    coordinator bounds what it holds itself: with hold_limit=1 a second message is not
    read while the first is being handled (the broker and the socket buffer keep it).
    Without it (the control) the broker pushes Receive Maximum messages at once."""
    from fedagent.protocols import topics

    seen = _held_tracker(monkeypatch)
    size, count = 100_000, 12
    inbox = topics.inbox("testfed", "agent-b")

    async def main():
        gate = asyncio.Event()
        handled: list[bytes] = []

        async def slow(_topic, payload):
            await gate.wait()
            handled.append(payload)

        async with (
            peer(broker, "agent-b", subscriptions=[inbox], handler=slow, receive_maximum=4, hold_limit=hold_limit) as b,
            peer(broker, "agent-a") as a,
        ):
            topic = topics.direct("testfed", "agent-a", "agent-b", "update")
            await asyncio.gather(*(a.transport.publish(topic, bytes([i]) * size) for i in range(count)))
            client = b.transport._client
            # Every message is at the broker; the first is in the (blocked) handler.
            await wait_until(lambda: client.held_bytes >= (size if hold_limit else 4 * size))
            if hold_limit:
                assert client._paused and client.held_bytes == size
            gate.set()
            await wait_until(lambda: len(handled) == count, timeout=20)
            assert [p[0] for p in handled] == list(range(count))
            return client.pauses

    pauses = arun(main())
    if hold_limit:
        assert max(seen) == size and pauses >= count - 1, (seen, pauses)
    else:
        assert max(seen) >= 4 * size, seen


def test_a_session_backlog_does_not_starve_the_resubscription(broker, arun, peer):
    """A persistent session's backlog arrives ahead of the SUBACK, and before the handler
    runs nothing releases it: a client that paused reading there got its SUBACK only a
    message per pause, timed out, reconnected, and did so again (a coordinator restarted by
    kill -9 never came back). Reading pauses only once the handler runs."""
    from fedagent.protocols import topics

    size, count = 100_000, 12
    inbox = topics.inbox("testfed", "agent-b")

    async def main():
        async with peer(broker, "agent-b", subscriptions=[inbox], session_expiry=600):
            pass  # a session holding the subscription, now offline
        async with peer(broker, "agent-a") as a:
            topic = topics.direct("testfed", "agent-a", "agent-b", "update")
            await asyncio.gather(*(a.transport.publish(topic, bytes([i]) * size) for i in range(count)))
        handled: list[bytes] = []

        async def handle(_topic, payload):
            handled.append(payload)

        async with peer(
            broker,
            "agent-b",
            subscriptions=[inbox],
            session_expiry=600,
            hold_limit=1,
            connect_timeout=3,
            handler=handle,
        ) as b:
            assert b.transport.session_present
            await wait_until(lambda: len(handled) == count, timeout=20)
            assert sorted(p[0] for p in handled) == list(range(count))
            return b.transport.reconnects

    assert arun(main()) == 0


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_chunks_are_sized_to_the_payload() -> None:
    from fedagent.protocols.chunking import CHUNKS_PER_PAYLOAD, MIN_CHUNK, chunk_size

    max_chunk = 4 * 2**20
    assert chunk_size(44_800_000, max_chunk) == max_chunk  # 11.2M parameters: 11 chunks of 4 MiB
    assert chunk_size(4_400_000, max_chunk) == 1_100_000  # 1.1M parameters: 4 chunks
    assert -(-4_400_000 // chunk_size(4_400_000, max_chunk)) == CHUNKS_PER_PAYLOAD
    assert chunk_size(1_000_000, max_chunk) == MIN_CHUNK  # never below 256 KiB
    assert chunk_size(1_000_000, 100_000) == 100_000  # nor above the configured maximum


def test_segments_are_the_encoded_envelope_without_copying_the_tensors() -> None:
    from fedagent.protocols.chunking import LazyChunks, split
    from fedagent.protocols.codec import Envelope, encode, encode_segments, encode_weights

    rng = np.random.default_rng(1)
    sizes = [0, 3, 65_535, 65_536, 70_001, 300_000, 300_000]
    w = {f"t{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    w["i8"] = np.arange(20, dtype=np.int8).reshape(4, 5)
    body = {"weights": encode_weights(w), "x": [1, "a", None, True, 2.5, b"zz"], "blob": b"q" * 100_000}
    env = Envelope("round_start", "f", "coord", 3, 9, 1.5, body, cert=b"c" * 400, sig=b"s" * 64)
    seg = encode_segments(env)
    wire = encode(env)
    assert b"".join(seg) == wire and seg.nbytes == len(wire)
    # The large tensors are referenced, not copied.
    assert any(p.nbytes and np.shares_memory(np.frombuffer(p, np.uint8), w["t5"]) for p in seg)
    assert not any(p.nbytes and np.shares_memory(np.frombuffer(p, np.uint8), w["t1"]) for p in seg)  # 3 floats
    for start, end in [(0, len(wire)), (5, 70_000), (100, 100), (len(wire) - 3, len(wire) + 10)]:
        assert bytes(seg.read(start, end)) == wire[start:end]
    lazy = LazyChunks(seg, max_chunk=100_000, transfer_id="t-1")
    eager = split(wire, max_chunk=100_000, transfer_id="t-1")
    assert len(lazy) == len(eager)
    for i, body_i in enumerate(eager):
        assert {**lazy[i], "data": bytes(lazy[i]["data"])} == body_i


def test_a_stable_broadcast_costs_a_window_of_chunks_not_a_payload(pki) -> None:
    """RoundStart is sent with stable=True: its chunks are cut from the model itself, so
    the broadcast costs a few chunks instead of the encoded payload (one model), and a
    receiver reassembles exactly the same message."""
    t = pki.tls("coord")
    received: list = []
    sink = _Sink()
    frames: list[bytes] = []

    async def keep(topic, payload, qos=1, retain=False, timeout=None):
        frames.append(payload)

    m = Messenger(
        federation="testfed",
        node_id="coord",
        transport=sink,
        identity=Identity.load(t.cert, t.key, t.ca),
        max_chunk_bytes=256 * 1024,
        publish_window=2,
    )
    weights = _model()
    tracemalloc.start()
    try:
        asyncio.run(m.send("fedagent/v1/testfed/broadcast/model", GlobalModel(1, 1, True, weights), stable=True))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sink.count >= 32 and sink.nbytes > MODEL_BYTES
    # A window of 256 KiB frames and their copies; the payload path costs 1.2 models.
    assert peak < 0.4 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"

    sink.publish = keep  # type: ignore[method-assign]
    asyncio.run(m.send("fedagent/v1/testfed/broadcast/model", GlobalModel(2, 1, True, weights), stable=True))
    pki.issue("agent-r")
    r = pki.tls("agent-r")
    rx = Messenger(federation="testfed", node_id="agent-r", transport=None, identity=Identity.load(r.cert, r.key, r.ca))

    async def deliver(inc):
        received.append(inc.message)

    async def feed():
        for f in frames:
            await rx.receive("fedagent/v1/testfed/node/coord/to/agent-r/model", f, deliver)

    asyncio.run(feed())
    assert len(received) == 1 and received[0].model_version == 2
    for k, v in weights.items():
        np.testing.assert_array_equal(received[0].weights[k], v)


@pytest.mark.parametrize("max_chunk", [4 * 2**20, 256 * 1024])
def test_a_round_start_with_the_int8_step_costs_no_packed_copy_and_arrives_signed(pki, max_chunk) -> None:
    """A round start carrying the model as its int8 step (a quarter of the model) is
    encoded like a model (joined or chunked from the steps, off the event loop), not
    packed by msgpack (its buffer and the bytes taken from it: half a model at 8 MB);
    the envelope inside stays signed, whether the step goes as one frame or in chunks."""
    from fedagent.protocols import topics
    from fedagent.protocols.downlink import quantize_step
    from fedagent.protocols.messages import RoundStart, TrainConfig
    from fedagent.security.signing import signing_digest

    t = pki.tls("coord")
    sink = _Sink()
    m = Messenger(
        federation="testfed",
        node_id="coord",
        transport=sink,
        identity=Identity.load(t.cert, t.key, t.ca),
        max_chunk_bytes=max_chunk,
        publish_window=2,
    )
    old = _model()
    _, delta = quantize_step(old, {k: v + 0.01 for k, v in old.items()}, base_version=0)
    start = RoundStart(2, 1, ("agent-r",), 60.0, TrainConfig(compression="int8"), None, delta=delta)
    topic = topics.broadcast("testfed", "round_start")
    asyncio.run(m.send(topic, start, stable=True))  # worker threads started
    tracemalloc.start()
    try:
        asyncio.run(m.send(topic, start, stable=True))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (sink.count == 2) == (max_chunk > delta.nbytes)
    # The step's bytes once at most (one frame: 0.29 models); packed by msgpack, 0.69.
    assert peak < 0.4 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"

    frames: list[bytes] = []

    async def keep(topic, payload, qos=1, retain=False, timeout=None):
        frames.append(payload)

    sink.publish = keep  # type: ignore[method-assign]
    asyncio.run(m.send(topic, start, stable=True))
    pki.issue("agent-r")
    r = pki.tls("agent-r")
    rx = Messenger(federation="testfed", node_id="agent-r", transport=None, identity=Identity.load(r.cert, r.key, r.ca))
    received: list = []

    async def deliver(inc):
        received.append(inc)

    async def feed():
        for f in frames:
            await rx.receive(topic, f, deliver)

    asyncio.run(feed())
    assert len(received) == 1 and not rx.rejected, rx.recent_rejections
    env = received[0].envelope
    Identity.load(t.cert, t.key, t.ca).key.public_key().verify(env.sig, signing_digest(env))
    got = received[0].message.delta
    for k, (q, scale) in delta.steps.items():
        np.testing.assert_array_equal(got.steps[k][0], q)
        assert got.steps[k][1] == scale


def test_streamed_parts_wait_in_the_queue_as_their_wire_bytes() -> None:
    """The coordinator's queue holds int8 parts undecoded; its budget counts the floats
    they become, so as many values wait as when they were decoded on arrival."""
    parts = [UpdatePart("a", "t", "w", i * 2**16, np.ones(2**16, np.int8), None, True, 0.5) for i in range(16)]

    async def main() -> tuple[int, int, int]:
        feed = StreamFeed(asyncio.Queue(), budget=2**30)
        tracemalloc.start()
        try:
            await feed.put(parts)
            grew, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        waiting = feed.waiting
        while not feed.queue.empty():
            feed.taken(feed.queue.get_nowait())
        return grew, waiting, feed.waiting

    grew, waiting, left = asyncio.run(main())
    assert waiting == 16 * 4 * 2**16 and left == 0
    assert grew < 2**16, f"queueing the parts took {grew} bytes"
    assert np.array_equal(parts[0].values, np.full(2**16, 0.5, np.float32))


def test_the_final_model_is_broadcast_from_where_it_lies() -> None:
    """The FedAvg coordinator's last message, the final model, is sent as a stable message:
    its chunks are cut from the machine's model, without an encoded copy of it first
    (that copy was the largest allocation of a whole run at 4.4 MB models)."""
    from types import SimpleNamespace

    from fedagent.coordinator.fedavg import FedAvgMode
    from fedagent.protocols import rounds as R

    sent: list[tuple[str, object, dict]] = []

    class _Messenger:
        async def send(self, topic: str, message: object, **kw: object) -> int:
            sent.append((topic, message, kw))
            return 0

    async def main() -> None:
        mode = FedAvgMode.__new__(FedAvgMode)
        mode.core = SimpleNamespace(fed="lab", messenger=_Messenger())
        mode.machine = SimpleNamespace(round=3, completed=3)
        mode.done = asyncio.Event()
        await mode._execute(R.Finished(3, _model()))
        assert mode.done.is_set()

    asyncio.run(main())
    ((topic, message, kw),) = sent
    assert isinstance(message, GlobalModel) and message.final and kw["stable"] is True


def test_the_intakes_part_buffers_are_served_by_mmap() -> None:
    """A coordinator has glibc serve 64 KiB and more by mmap: the buffers each streamed
    part needs (its floats, its finiteness mask, the norm sums' blocks) go back to the
    system when freed instead of fragmenting the heap between the intake's small objects."""
    from fedagent.node.runtime import MMAP_THRESHOLD, release_large_frees
    from fedagent.protocols.rounds.bounds import SQ_BLOCK
    from fedagent.protocols.streaming import PART_VALUES

    assert release_large_frees()
    assert MMAP_THRESHOLD <= min(np.empty(SQ_BLOCK, np.float32).nbytes, np.empty(PART_VALUES, np.bool_).nbytes)
