"""The copy-saving paths of the transport: each gives the same bytes as the
plain path, and the publish window bounds what is in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from fedfixtures import ident

from fedagent.errors import TransportError
from fedagent.node import messaging
from fedagent.node.messaging import Messenger
from fedagent.node.transport import patches
from fedagent.protocols.chunking import CHUNKS_PER_PAYLOAD, Reassembler, split
from fedagent.protocols.codec import Envelope, decode, decode_tensor, encode, encode_tensor, encode_view
from fedagent.protocols.messages import Update
from fedagent.security.signing import CHUNK_KIND


def _update_envelope(n: int = 50_000) -> Envelope:
    rng = np.random.default_rng(1)
    weights = {
        "w": rng.standard_normal(n, dtype=np.float32),
        "t": np.arange(12, dtype=np.int64).reshape(3, 4).T,
    }  # not C-contiguous
    return Envelope(
        kind="update",
        federation="testfed",
        sender="agent-a",
        round=1,
        seq=1,
        ts=0.0,
        body=Update(1, 0, 3, {"loss": 0.5}, weights).to_body(),
    )


def test_encode_view_is_byte_identical_to_encode():
    env = _update_envelope()
    view = encode_view(env)
    assert isinstance(view, memoryview)
    assert bytes(view) == encode(env)
    assert decode(view) == decode(encode(env))
    # A signed envelope keeps its signature and certificate through either encoder.
    signed = dataclasses.replace(env, sig=b"s" * 64, cert=b"c" * 300)
    assert bytes(encode_view(signed)) == encode(signed)
    back = decode(encode_view(signed))
    assert back.sig == signed.sig and back.cert == signed.cert


def test_encode_tensor_views_contiguous_arrays_and_copies_others():
    a = np.arange(6, dtype=np.float32)
    wire = encode_tensor(a)
    assert isinstance(wire["data"], memoryview) and wire["data"] == a.tobytes()
    t = np.arange(12, dtype=np.int64).reshape(3, 4).T
    wire_t = encode_tensor(t)
    assert wire_t["data"] == t.tobytes(order="C")
    np.testing.assert_array_equal(decode_tensor(wire_t), t)
    zero_d = np.array(2.5, dtype=np.float32)
    np.testing.assert_array_equal(decode_tensor(encode_tensor(zero_d)), zero_d)


def test_split_without_copy_gives_views_of_the_same_chunks():
    payload = bytes(range(256)) * 40
    copied = split(payload, max_chunk=1000, transfer_id="t")
    viewed = split(payload, max_chunk=1000, transfer_id="t", copy=False)
    assert all(isinstance(b["data"], memoryview) for b in viewed)
    assert [{**b, "data": bytes(b["data"])} for b in viewed] == copied


def test_reassembler_hands_over_its_buffer_after_the_digest_check():
    payload = bytes(range(256)) * 40
    r = Reassembler(max_transfer_bytes=2**20, max_pending_bytes=2**21, timeout=10)
    bodies = split(payload, max_chunk=1000, transfer_id="t")
    out = [r.feed("a", b, 0.0) for b in bodies]
    assert out[:-1] == [None] * (len(bodies) - 1)
    # Its own buffer, handed over without a copy: a writable view, not bytes.
    assert type(out[-1]) is memoryview and not out[-1].readonly and out[-1] == payload
    assert r.pending_bytes == 0
    bad = split(payload, max_chunk=1000, transfer_id="u")
    bad[-1] = {**bad[-1], "data": b"\0" * len(bad[-1]["data"])}
    with pytest.raises(Exception, match="sha256"):
        for b in bad:
            r.feed("a", b, 0.0)


class _RecordingTransport:
    """A pure stand-in for Transport.publish: records how many publishes wait at once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.frames: list[bytes] = []
        self.in_flight = 0
        self.peak = 0
        self.fail_at = fail_at

    async def publish(self, topic, payload, *, qos=1, retain=False, timeout=30):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.001)  # the PUBACK round trip
            if self.fail_at is not None and len(self.frames) == self.fail_at:
                raise TransportError("no PUBACK")
            self.frames.append(payload)
        finally:
            self.in_flight -= 1


def _chunked_update(messenger: Messenger) -> None:
    weights = {"w": np.arange(30_000, dtype=np.float32)}  # 120 kB: 30 chunks of 4 kB
    return asyncio.run(
        messenger.send("fedagent/v1/testfed/node/agent-a/to/coord/update", Update(1, 0, 3, {}, weights), round_=1)
    )


def test_chunks_are_published_with_a_bounded_window_and_reassemble(pki):
    t = _RecordingTransport()
    m = Messenger(
        federation="testfed",
        node_id="agent-a",
        transport=t,
        max_chunk_bytes=4096,
        publish_window=5,
        identity=ident(pki, "agent-a"),
    )
    _chunked_update(m)
    assert len(t.frames) > 25
    assert t.peak == 5
    r = Messenger(
        federation="testfed", node_id="coord", transport=None, max_chunk_bytes=4096, identity=ident(pki, "coord")
    )
    got = []

    async def deliver(inc):
        got.append(inc)

    async def receive_all():
        for f in t.frames:
            await r.receive("fedagent/v1/testfed/node/agent-a/to/coord/update", f, deliver)

    asyncio.run(receive_all())
    assert len(got) == 1 and not r.rejected
    np.testing.assert_array_equal(got[0].message.weights["w"], np.arange(30_000, dtype=np.float32))


def test_a_failed_chunk_publish_fails_the_send(pki):
    t = _RecordingTransport(fail_at=3)
    m = Messenger(
        federation="testfed",
        node_id="agent-a",
        transport=t,
        max_chunk_bytes=4096,
        publish_window=4,
        identity=ident(pki, "agent-a"),
    )
    with pytest.raises(TransportError):
        _chunked_update(m)
    assert t.in_flight == 0


@pytest.mark.parametrize(
    ("params", "max_chunk", "threaded"), [(1_100_000, 4 * 2**20, False), (2_500_000, 4 * 2**20, True)]
)
def test_chunk_frames_leave_the_event_loop_only_when_large(pki, monkeypatch, params, max_chunk, threaded):
    """A model of 4.4 MB goes in chunks of 1.1 MB, each signed and encoded on the event
    loop (a thread hop would cost more than the frame); one of 10 MB in chunks of 2.5 MB,
    whose frames are made in a worker thread."""
    signers: list[int] = []
    real_sign = messaging.sign

    def recording_sign(env, identity):
        if env.kind == CHUNK_KIND:
            signers.append(threading.get_ident())
        return real_sign(env, identity)

    monkeypatch.setattr(messaging, "sign", recording_sign)
    t = _RecordingTransport()
    m = Messenger(
        federation="testfed",
        node_id="agent-a",
        transport=t,
        identity=ident(pki, "agent-a"),
        max_chunk_bytes=max_chunk,
    )
    weights = {"w": np.arange(params, dtype=np.float32)}

    async def send() -> int:
        await m.send("fedagent/v1/testfed/node/agent-a/to/coord/update", Update(1, 0, 3, {}, weights), round_=1)
        return threading.get_ident()

    loop_thread = asyncio.run(send())
    chunk = len(t.frames[0])
    assert len(t.frames) == len(signers) == CHUNKS_PER_PAYLOAD
    assert (chunk > messaging.THREADED_FRAME_BYTES) is threaded
    assert all((s != loop_thread) is threaded for s in signers)


def test_socket_reads_are_bounded():
    asked: list[int] = []

    class FakePaho:
        _sock = None

        def __init__(self) -> None:
            self._in_packet = {"remaining_length": 40 * 2**20, "have_remaining": 0, "packet": bytearray()}

        def _sock_recv(self, bufsize: int) -> bytes:
            asked.append(bufsize)
            return b"x"

    c = FakePaho()
    patches._bound_reads(c)
    c._sock_recv(40 * 2**20)
    c._sock_recv(100)
    assert asked == [patches.READ_SIZE, 100]


def _publish_packet(topic: bytes, payload: bytes) -> bytes:
    """An MQTT 5 PUBLISH, QoS 0, no properties, as on the wire."""
    body = len(topic).to_bytes(2, "big") + topic + b"\x00" + payload
    n, length = len(body), b""
    while True:
        n, byte = divmod(n, 128)
        length += bytes([byte | (0x80 if n else 0)])
        if not n:
            return b"\x30" + length + body


@pytest.mark.parametrize("in_place", [True, False])
def test_large_packets_are_read_in_place_and_handed_on_uncopied(monkeypatch, in_place):
    """A packet body of READ_IN_PLACE bytes or more is read into one buffer of its size,
    which becomes the message's payload; small packets keep paho's own path, and so does
    a packet longer than READ_IN_PLACE_MAX (no buffer allocated on a header's word)."""
    if not in_place:
        monkeypatch.setattr(patches, "READ_IN_PLACE_MAX", patches.READ_IN_PLACE * 2)
    import select
    import socket
    import threading

    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTProtocolVersion.MQTTv5)
    patches._bound_reads(client)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client._sock = ours
    got: list = []
    client.on_message = lambda _c, _u, m: got.append((m.topic, m.payload))
    big = bytes(range(256)) * (patches.READ_IN_PLACE // 256 * 3 + 1)
    wire = _publish_packet(b"t/big", big) + _publish_packet(b"t/small", b"hi") + _publish_packet(b"t/big2", big[::-1])
    writer = threading.Thread(target=theirs.sendall, args=(wire,))
    writer.start()
    try:
        while len(got) < 3:
            assert select.select([ours], [], [], 10)[0], f"stalled after {len(got)} messages"
            try:
                patches.read_available(client)
            except BlockingIOError:
                pass
    finally:
        writer.join()
        ours.close()
        theirs.close()
    assert [t for t, _ in got] == ["t/big", "t/small", "t/big2"]
    assert got[0][1] == big and got[2][1] == big[::-1] and got[1][1] == b"hi"
    assert isinstance(got[0][1], patches._PacketBuffer) is in_place and type(got[1][1]) is bytes


def test_tls_records_read_in_place_and_an_eof_without_close_notify(tmp_path):
    """A large packet over TLS is read record by record into its buffer (through the
    socket's TLS object); a peer whose connection ends without close_notify reads as a
    closed connection (0), as SSLSocket.recv_into has it, not as an error."""
    import select
    import socket
    import ssl

    import paho.mqtt.client as mqtt

    from fedagent.security import pki

    pki.create_ca(tmp_path / "ca", "t")
    pki.issue(tmp_path / "ca", tmp_path / "certs", "srv", "agent")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "certs" / "srv.crt", tmp_path / "certs" / "srv.key")
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    ours, theirs = socket.socketpair()
    big = bytes(range(256)) * (patches.READ_IN_PLACE // 256 * 2)
    wire = _publish_packet(b"t/big", big)
    cut = len(wire) - 1000  # the second packet ends early: its sender's connection drops

    served: list[ssl.SSLSocket] = []

    def serve() -> None:
        s = server_ctx.wrap_socket(theirs, server_side=True)
        served.append(s)
        s.sendall(wire + wire[:cut])
        s.shutdown(socket.SHUT_RDWR)  # the TCP connection ends, without close_notify

    writer = threading.Thread(target=serve)
    writer.start()
    sock = client_ctx.wrap_socket(ours, server_hostname="srv")
    sock.setblocking(False)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTProtocolVersion.MQTTv5)
    patches._bound_reads(client)
    client._sock = sock
    got: list = []
    client.on_message = lambda _c, _u, m: got.append(m.payload)
    try:
        closed = False
        while not closed:
            assert select.select([sock], [], [], 10)[0] or sock.pending(), f"stalled after {len(got)} messages"
            try:
                closed = client.loop_read() == mqtt.MQTT_ERR_CONN_LOST
            except BlockingIOError:
                pass
            while not closed and sock.pending():
                closed = client.loop_read() == mqtt.MQTT_ERR_CONN_LOST
    finally:
        writer.join()
        sock.close()
        for s in served:
            s.close()
    assert len(got) == 1 and got[0] == big
