"""Every place fedagent reaches into aiomqtt's and paho's private internals, in one module.

Checked against aiomqtt 2.5.1 and paho-mqtt 2.2.0 (pyproject pins both below 3; a new
major version may rename any of these, and ``tests/node/test_broker_tls.py``,
``test_transport_copies.py``, ``test_fast_path.py`` and ``test_memory_paths.py``
exercise each path). Nothing outside this module names a private attribute of either
library: :class:`MqttClient` is the surface the reconnecting
:class:`~fedagent.node.transport.client.Transport` uses.

What is patched, and why:

* :class:`MqttClient` subclasses ``aiomqtt.Client`` and overrides its paho callbacks
  (``_on_connect``, ``_on_disconnect``, ``_on_publish``, ``_on_message``,
  ``_on_socket_open``, ``_on_socket_close``) and reads its state (``_client``,
  ``_loop``, ``_connected``, ``_disconnected``, ``_lock``, ``_misc_loop``,
  ``_misc_task``):

  - PUBACK reason codes: aiomqtt drops them, so a publish the broker ACL refuses
    would vanish silently instead of raising :class:`~fedagent.errors.NotAuthorized`;
  - CONNACK properties and the session-present flag: the broker's Maximum Packet Size
    (checked before publishing) and whether our persistent session survived;
  - manual acknowledgements: paho acknowledges a QoS 1 message only once the handler
    is done with it, so a crash in between means the broker delivers it again;
  - fast failure: a connection that dies before CONNACK (a TLS 1.3 alert about our
    certificate, a broker going down) is reported at once, not after aiomqtt's timeout;
  - the socket's reader, installed when it opens: :func:`read_available` in place of
    aiomqtt's loop, and TCP_NODELAY (a PUBACK must not wait for the broker's delayed ACK);
  - read pausing: the socket is not read while the messages handed over hold
    ``hold_limit`` bytes, so the backlog waits at the broker, not in this process;
  - a link probe (paho's ``_send_simple_command``) that sends PINGREQ early without
    touching paho's own keep-alive bookkeeping.

* paho's read path (``_sock_recv``, ``_in_packet``, ``_sock``,
  ``_call_socket_register_write``): :func:`read_available` does not stall on a large
  message paho has read but not handled; :func:`_bound_reads` bounds each read and reads
  a large packet body in place.

* the standard library's ``ssl.SSLSocket._sslobj``: :func:`_recv_into` reads a large
  packet's TLS records through it.

* paho's write path (``_packet_queue``): :func:`_view_writes` queues large packets as
  memoryviews, so a partial write does not copy the unsent rest.

* ``paho.mqtt._packet.decode_publish``, replaced for the whole process by
  :func:`_decode_publish`: the same fields and checks, without copying the packet four
  or five times (its payload, when large, is the packet buffer itself).
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiomqtt
import paho.mqtt.client as mqtt
from paho.mqtt import _packet
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode

from fedagent.errors import TransportError

RC_DISCONNECT_WITH_WILL = 0x04


class ConnectionLost(Exception):
    """The connection died before the broker acknowledged a publish."""


class MqttClient(aiomqtt.Client):
    """aiomqtt.Client plus PUBACK reason codes, CONNACK properties, manual acks, fast
    failure when the connection dies before CONNACK, and a stall-free read loop."""

    def __init__(self, *args: Any, hold_limit: int | None = None, max_pause: float = 2.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acks: dict[int, asyncio.Future[ReasonCode]] = {}
        self.connack_properties: Properties | None = None
        self.session_present = False
        # QoS1 messages are acknowledged once the handler is done with them.
        self._client.manual_ack_set(True)
        _bound_reads(self._client)
        _view_writes(self._client)
        # time.monotonic() of the last bytes from the broker (any packet: PINGRESP too).
        self.last_rx = time.monotonic()
        # Read pausing (see Transport's hold_limit): bytes of messages handed over and not
        # yet acknowledged, and the socket's reader while it is registered.
        self.hold_limit = hold_limit
        self.max_pause = max_pause
        self.held_bytes = 0
        self.pauses = 0
        self._reader: tuple[int, Callable[[], None]] | None = None
        self._paused = False
        self._pause_timer: asyncio.TimerHandle | None = None
        # Pausing starts only once the connection hands messages to their handler (armed),
        # and never while a SUBACK/UNSUBACK is awaited: messages redelivered from a
        # persistent session arrive ahead of it, and before the handler runs nothing
        # releases them, so a pause there would starve the subscription until it times out.
        self.hold_armed = False
        self._control_waits = 0
        # Asked about every message as paho hands it over, before aiomqtt (or anything
        # else) sees it: False drops it, and ``on_dropped(mid, qos)`` acknowledges it
        # (see Transport.screen).
        self.screen: Callable[[str], bool] | None = None
        self.on_dropped: Callable[[int, int], None] | None = None

    @property
    def paho(self) -> mqtt.Client:
        return self._client

    @property
    def is_connected(self) -> bool:
        return (
            self._connected.done()
            and not self._connected.exception()
            and not self._disconnected.done()
            and self._client.is_connected()
        )

    @property
    def max_packet_size(self) -> int | None:
        props = self.connack_properties
        return getattr(props, "MaximumPacketSize", None) if props is not None else None

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        self.connack_properties = properties
        self.session_present = bool(getattr(flags, "session_present", False))
        super()._on_connect(client, userdata, flags, reason_code, properties)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties=None) -> None:
        # paho reports a connection that dies before CONNACK (a TLS 1.3 alert about our
        # certificate, a broker going down) only here; aiomqtt would wait out its timeout.
        if not self._connected.done():

            def fail() -> None:
                if not self._connected.done():
                    self._connected.set_exception(aiomqtt.MqttCodeError(reason_code, "Connection lost before CONNACK"))

            self._loop.call_soon_threadsafe(fail)
            return
        super()._on_disconnect(client, userdata, flags, reason_code, properties)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        fut = self._acks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(reason_code)
        super()._on_publish(client, userdata, mid, reason_code, properties)

    def _on_socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # aiomqtt's own version, with read_available() as the reader.
        _no_delay(sock)

        def on_readable() -> None:
            self.last_rx = time.monotonic()
            try:
                read_available(client, lambda: self._paused)
            except Exception as exc:  # noqa: BLE001 - a broken socket: report as disconnect
                if not self._disconnected.done():
                    self._disconnected.set_exception(exc)

        def create_misc_task() -> None:
            self._misc_task = self._loop.create_task(self._misc_loop())

        self._reader = (sock.fileno(), on_readable)
        # Called from the executor thread that runs paho's connect().
        self._loop.call_soon_threadsafe(self._loop.add_reader, sock.fileno(), on_readable)
        self._loop.call_soon_threadsafe(create_misc_task)

    def _on_socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._reader = None
        self._paused = False
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None
        super()._on_socket_close(client, userdata, sock)

    # -- read pausing ----------------------------------------------------------------------
    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        screen = self.screen
        if screen is not None and self.on_dropped is not None:
            try:
                keep = screen(message.topic)
            except Exception:  # noqa: BLE001 - an undecodable topic: the handler refuses it, named
                keep = True
            if not keep:
                # Dropped as it is read: no message object, no queue, no pause of the reads.
                self.on_dropped(message.mid, message.qos)
                return
        self.held_bytes += len(message.payload)
        super()._on_message(client, userdata, message)
        # Never while a PUBACK is awaited: it may be queued behind the messages not read,
        # and the handler may be waiting for whatever awaits it.
        if (
            self.hold_limit is not None
            and self.hold_armed
            and self.held_bytes >= self.hold_limit
            and not self._acks
            and not self._control_waits
        ):
            self._pause_reading()

    async def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        self._control_waits += 1
        self._resume_reading()  # the SUBACK must be read, whatever is held
        try:
            return await super().subscribe(*args, **kwargs)
        finally:
            self._control_waits -= 1

    async def unsubscribe(self, *args: Any, **kwargs: Any) -> Any:
        self._control_waits += 1
        self._resume_reading()
        try:
            return await super().unsubscribe(*args, **kwargs)
        finally:
            self._control_waits -= 1

    def _pause_reading(self) -> None:
        if self._paused or self._reader is None:
            return
        self._paused = True
        self.pauses += 1
        self._loop.remove_reader(self._reader[0])
        # Bounded, so that a handler stuck for long cannot starve the keep-alive: paho
        # drops a connection from which nothing was read for a keep-alive interval.
        self._pause_timer = self._loop.call_later(self.max_pause, self._resume_reading)

    def _resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None
        if self._reader is None:
            return
        fd, on_readable = self._reader
        self._loop.add_reader(fd, on_readable)
        # TLS may hold decrypted bytes already: the descriptor would not signal them.
        self._loop.call_soon(on_readable)

    def release(self, nbytes: int) -> None:
        """A handed-over message of ``nbytes`` is done with (acknowledged or not)."""
        self.held_bytes = max(0, self.held_bytes - nbytes)
        if self._paused and (self.hold_limit is None or self.held_bytes < self.hold_limit):
            self._resume_reading()

    async def publish_acked(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int,
        retain: bool,
        timeout: float,
        on_slow: Callable[[], float] | None = None,
    ) -> ReasonCode | None:
        """Publish and wait for PUBACK; returns its reason code (None for QoS 0).
        ``on_slow``: called when ``timeout`` passes without one; returns how much longer
        to wait for the same PUBACK (the message is not sent again on a live connection:
        the broker has it and answers when it gets to it)."""
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            if info.rc == mqtt.MQTT_ERR_NO_CONN or self._disconnected.done():
                raise ConnectionLost()
            raise TransportError(f"cannot publish to {topic}: {mqtt.error_string(info.rc)}")
        if qos == 0:
            return None
        fut: asyncio.Future[ReasonCode] = self._loop.create_future()
        self._acks[info.mid] = fut
        self._resume_reading()  # the PUBACK must be read, whatever is held
        try:
            while True:
                await asyncio.wait((fut, self._disconnected), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if fut.done() or self._disconnected.done() or on_slow is None:
                    break
                timeout = on_slow()
                self._resume_reading()
        finally:
            self._acks.pop(info.mid, None)
        if fut.done():
            return fut.result()
        if self._disconnected.done():
            raise ConnectionLost()
        raise TimeoutError

    def ack(self, mid: int, qos: int) -> None:
        if qos > 0 and self.is_connected:
            self._client.ack(mid, qos)

    def probe(self) -> None:
        """Ask the broker for a PINGRESP now. paho's own keep-alive bookkeeping
        (``_ping_t``) is left alone, so when paho gives up on the connection is unchanged;
        the answer only refreshes :attr:`last_rx`."""
        if self.is_connected:
            self._client._send_simple_command(mqtt.PINGREQ)

    # -- the connection's end, as the reconnect loop sees it ---------------------------
    @property
    def lost(self) -> bool:
        """The connection has ended (aiomqtt's ``_disconnected`` is done)."""
        return self._disconnected.done()

    def when_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` the moment the connection ends."""
        self._disconnected.add_done_callback(lambda _f: callback())

    async def wait_lost(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the connection to end."""
        await asyncio.wait((self._disconnected,), timeout=timeout)

    def send_disconnect(self, *, with_will: bool) -> bool:
        """Send DISCONNECT, reason 0 or 4 ("publish my Will"); False if paho could not."""
        rc = ReasonCode(PacketTypes.DISCONNECT, identifier=RC_DISCONNECT_WITH_WILL if with_will else 0)
        return self._client.disconnect(reasoncode=rc) == mqtt.MQTT_ERR_SUCCESS

    async def leave(self, *, with_will: bool, timeout: float = 2.0) -> None:
        """Send DISCONNECT (reason 0, or 4 = "publish my Will") and wait briefly; the
        connection counts as ended afterwards either way."""
        if self._disconnected.done():
            return
        if self.send_disconnect(with_will=with_will):
            await asyncio.wait((self._disconnected,), timeout=timeout)
        if self._disconnected.done():
            self._disconnected.exception()  # retrieved: we are leaving either way
        else:
            self._disconnected.set_result(None)

    async def exit_if_entered(self) -> None:
        """``__aexit__`` if ``__aenter__`` succeeded and nothing has exited since
        (aiomqtt holds its ``_lock`` in between)."""
        if self._lock.locked():
            await self.__aexit__(None, None, None)


def read_available(client: mqtt.Client, paused: Callable[[], bool] = lambda: False) -> None:
    """Let paho read until it has handled everything the socket has delivered, or
    until ``paused()`` (checked after each packet).

    paho reads a packet body with at most 100 recv() calls per loop_read(); when the
    100th completes a large message, paho returns with the packet read but not
    handled. If TLS has nothing more buffered and no more bytes arrive, the fd never
    becomes readable again and the message waits for the next keep-alive (measured
    here: about 1 in 150 messages of 4-8 MiB over TLS, delayed up to the keep-alive).
    aiomqtt's reader only loops while ``pending()`` is non-zero; this also loops while
    paho holds a complete, unhandled packet.
    """
    reads = 0
    while True:
        client.loop_read()
        reads += 1
        s = client._sock
        if s is None or paused():
            return
        if hasattr(s, "pending") and s.pending() > 0:
            continue  # decrypted bytes the fd will never signal
        if _holds_complete_packet(client):
            continue
        # More small messages already in the socket are read now rather than one per turn
        # of the event loop (a flood of small messages cost more in loop turns than in
        # reading them); a large packet in progress gives the loop its turn, as before.
        if reads >= SMALL_READS_PER_TURN or _large_packet_in_progress(client) or not _readable(s):
            return


#: Acknowledgements joined into one write at most (a TLS record holds 16 KiB).
ACK_BATCH = 16 * 1024
PUBACK = 0x40

#: Reads in one turn of the event loop while only small messages come.
SMALL_READS_PER_TURN = 64


def _readable(sock: Any) -> bool:
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError, TypeError):  # closed, or not a socket with a file descriptor
        return False


def _large_packet_in_progress(client: mqtt.Client) -> bool:
    p = getattr(client, "_in_packet", None)
    return bool(p and p["command"] != 0 and p["remaining_length"] > READ_SIZE)


# One socket read never asks for more than this. paho asks for the whole rest of the
# packet (megabytes for a model chunk); Python allocates a buffer of that size for each
# read and then shrinks it, although TLS hands over at most one 16 KiB record per
# read. Measured on a 44.8 MB TLS transfer: ~2x the throughput of 4 MiB reads.
READ_SIZE = 64 * 1024


def _view_writes(client: mqtt.Client) -> None:
    """Queue outgoing packets as memoryviews. paho writes a packet with
    ``sock.send(packet[pos:])``, which for a bytearray copies the whole unsent rest
    before every partial write: a 4 MiB chunk going out in a few dozen TLS writes was
    copied a few dozen times. A view of it is sliced for free (paho never resizes a
    queued packet)."""
    queue = client._packet_queue

    def queued(command: int, packet: Any, mid: int, qos: int, info: Any = None) -> Any:
        if command & 0xF0 == PUBACK and info is None:
            # Acknowledgements queued while messages are read go out in one write (one
            # TLS record, one syscall), not one each: a flood of small messages is mostly
            # their acknowledgements. paho does nothing with a PUBACK once written.
            out = client._out_packet
            last = out[-1] if out else None
            if (
                last is not None
                and last["command"] & 0xF0 == PUBACK
                and last["pos"] == 0
                and isinstance(last["packet"], bytearray)
                and len(last["packet"]) < ACK_BATCH
            ):
                last["packet"] += packet
                last["to_process"] += len(packet)
                return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
            packet = bytearray(packet)
        elif len(packet) > READ_SIZE:
            packet = memoryview(packet)  # paho only slices and sends it
        return queue(command, packet, mid, qos, info)

    client._packet_queue = queued  # type: ignore[method-assign]  # on purpose: this client's writes only


#: A packet body at least this long is read straight into a buffer of its size
#: (:class:`_PacketBuffer`) instead of being appended to paho's packet 64 KiB at a time.
READ_IN_PLACE = 256 * 1024
#: ... and at most this many: the buffer is allocated when the fixed header gives the
#: length, before the bytes arrive, so a header claiming more (MQTT allows 256 MB) is read
#: by paho's own path, whose buffer grows only with bytes actually received. fedagent's
#: own packets are one chunk each ([transfer] max_chunk_bytes, 4 MiB by default).
READ_IN_PLACE_MAX = 64 * 2**20
#: At most this much of such a body is read in one call from paho (then paho looks at
#: its state and the event loop gets its turn).
READ_IN_PLACE_STEP = 1024 * 1024


class _PacketBuffer(bytearray):
    """paho's packet buffer for a large packet, allocated at its full size once the fixed
    header has given its length and filled by ``recv_into``: paho appends every piece it
    reads to its packet (``packet += data``: one more copy of every byte received, into a
    buffer regrown as it goes); the pieces it is given here are :class:`_Filled` markers
    of bytes already in place, which appending ignores."""

    def __iadd__(self, other: Any) -> _PacketBuffer:  # type: ignore[misc]  # takes only _Filled
        if isinstance(other, _Filled):
            return self
        raise TypeError("a packet read in place takes no appended bytes")


class _Filled:
    """``n`` bytes read into the packet's :class:`_PacketBuffer` (paho only takes its length)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _no_delay(sock: Any) -> None:
    """Send small packets at once (TCP_NODELAY; paho leaves Nagle's algorithm on). With
    Nagle, a PUBACK or a small message written while a large one is still unacknowledged
    waits for the broker's delayed ACK: up to 40 ms on Linux, seen as a bimodal
    exchange time (38 or 78 ms for a 4.4 MB gossip exchange). The broker side is set by
    ``set_tcp_nodelay`` in its config."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError, ValueError):  # not a TCP socket (a unix socket, a wrapper)
        pass


def _bound_reads(client: mqtt.Client) -> None:
    """Bound every socket read to READ_SIZE, and read a large packet's body in place.

    paho asks for the whole rest of the packet; Python allocates a buffer of that size
    for each read and shrinks it, although TLS hands over at most one 16 KiB record per
    read. A body of READ_IN_PLACE bytes or more goes by ``recv_into`` into a buffer of
    the packet's size that paho then handles as its packet (and that
    :func:`_decode_publish` hands on as the payload): each byte is copied once, by the
    decryption, instead of three times (into a bytes object, into paho's packet, into
    the payload)."""
    recv = client._sock_recv

    def bounded(bufsize: int) -> Any:
        p = client._in_packet
        length = p["remaining_length"]
        packet = p["packet"]
        if (
            READ_IN_PLACE <= length <= READ_IN_PLACE_MAX
            and p["have_remaining"]
            and (isinstance(packet, _PacketBuffer) or not packet)
            and hasattr(client._sock, "recv_into")
        ):
            if not isinstance(packet, _PacketBuffer):
                packet = p["packet"] = _PacketBuffer(length)
            pos = length - p["to_process"]
            return _Filled(_recv_into(client, memoryview(packet)[pos : pos + min(bufsize, READ_IN_PLACE_STEP)]))
        return recv(min(bufsize, READ_SIZE))

    client._sock_recv = bounded  # type: ignore[method-assign]  # on purpose: this client's reads only


def _recv_into(client: mqtt.Client, into: memoryview) -> int:
    """paho's ``_sock_recv``, reading into ``into`` until it is full or the socket has
    nothing more for now; the number of bytes read (0: the connection was closed).

    TLS gives at most one 16 KiB record per read: reading on here instead of returning
    to paho after each saves paho's per-read bookkeeping (a dict update, a lock and a
    clock read per record: 2,800 records per 44.8 MB). An ``ssl.SSLSocket`` is read
    through its ``_sslobj`` (what its ``recv_into`` ends in, past two Python wrappers and
    their checks: measured 39 -> 34 ms of CPU per 80 packets of 550 KB), with the same
    handling of an EOF without close_notify."""
    sock: Any = client._sock  # an ssl.SSLSocket (checked by the caller)
    if sock is None:
        raise ConnectionError("the socket is closed")
    tls = getattr(sock, "_sslobj", None) if isinstance(sock, ssl.SSLSocket) else None
    got, want = 0, len(into)
    with into:
        while got < want:
            try:
                n = tls.read(want - got, into[got:]) if tls is not None else sock.recv_into(into[got:])
            except ssl.SSLEOFError:
                if tls is None or not sock.suppress_ragged_eofs:
                    raise
                n = 0  # as SSLSocket.recv_into returns it
            except ssl.SSLWantReadError as err:
                if got:
                    break
                raise BlockingIOError() from err
            except ssl.SSLWantWriteError as err:
                client._call_socket_register_write()
                if got:
                    break
                raise BlockingIOError() from err
            except BlockingIOError:
                if got:
                    break
                raise
            if n == 0:
                break  # closed: what was read counts; paho sees 0 on its next read
            got += n
    return got


def _holds_complete_packet(client: mqtt.Client) -> bool:
    p = getattr(client, "_in_packet", None)
    if not p:
        return False
    return bool(p["command"] != 0 and p["have_remaining"] and p["to_process"] == 0)


#: A received payload at least this large is handed on as the ``bytearray`` paho read
#: the packet into (bytes-like, never modified), not copied into ``bytes``: one pass less
#: over every model chunk received (measured: 24 ms of CPU per 44.8 MB, in 4 MiB
#: chunks). Smaller ones stay ``bytes``.
STEAL_PAYLOAD = 64 * 1024


#: The properties of every received PUBLISH that has none (read, never changed, by its readers).
_NO_PROPERTIES = Properties(PacketTypes.PUBLISH)


def _decode_publish(header: int, packet: bytes | bytearray, protocol: mqtt.MQTTProtocolVersion) -> Any:
    """paho's ``_packet.decode_publish``, reading through a memoryview.

    paho's own cuts the packet with ``struct.unpack`` and slices three or four times,
    each time copying the rest of it, and the properties parser copies it again for
    each byte of their length (measured: 4-5 copies of every model chunk received,
    the coordinator's largest CPU cost after TLS at 44.8 MB per update). Here the
    topic and the properties are copied out (a few bytes) and a small payload once (a
    large one not at all: :data:`STEAL_PAYLOAD`). Same
    fields, same checks: a packet too short for what it claims is MalformedPacket."""
    view = memoryview(packet)
    end = len(view)
    qos = (header & 0x06) >> 1
    if end < 2:
        raise MalformedPacket("PUBLISH packet too short for its topic length")
    slen = int.from_bytes(view[0:2], "big")
    pos = 2 + slen
    if pos > end:
        raise MalformedPacket("PUBLISH topic runs past the end of the packet")
    topic = bytes(view[2:pos])
    if protocol != mqtt.MQTTProtocolVersion.MQTTv5 and slen == 0:
        raise MalformedPacket("topic can't be empty in MQTTv3")
    mid = 0
    if qos > 0:
        if pos + 2 > end:
            raise MalformedPacket("PUBLISH packet too short for its packet identifier")
        mid = int.from_bytes(view[pos : pos + 2], "big")
        pos += 2
    properties = None
    if protocol == mqtt.MQTTProtocolVersion.MQTTv5:
        if pos < end and view[pos] == 0:
            # No properties (what fedagent's nodes publish): one shared empty set, not a
            # new one parsed per message (a third of the CPU a flood of small messages cost).
            properties = _NO_PROPERTIES
            pos += 1
        else:
            properties = Properties(PacketTypes.PUBLISH)
            try:
                plen, vlen = VariableByteIntegers.decode(bytes(view[pos : pos + 4]))
                if pos + vlen + plen > end:
                    raise MalformedPacket("PUBLISH properties run past the end of the packet")
                _props, used = properties.unpack(bytes(view[pos : pos + vlen + plen]))
            except MalformedPacket:
                raise
            except _packet.DECODE_ERRORS as exc:
                raise MalformedPacket(str(exc)) from exc
            pos += used
    payload: bytes | bytearray | None = None
    if end - pos >= STEAL_PAYLOAD and isinstance(packet, bytearray):
        # A large payload is not copied out of the packet: the packet becomes the payload.
        # paho starts a new buffer for the next packet and never touches this one again,
        # and deleting from the front of a bytearray only moves its start (O(1)).
        view.release()
        try:
            del packet[:pos]
            payload = packet
        except BufferError:  # a view of it is still held somewhere: copy, as paho would
            view = memoryview(packet)
    if payload is None:
        payload = bytes(view[pos:])
    return _packet.PublishPacket(
        dup=((header & 0x08) >> 3) != 0,
        qos=qos,
        retain=(header & 0x01) != 0,
        topic=topic,
        mid=mid,
        properties=properties,
        payload=payload,  # bytes-like; see STEAL_PAYLOAD
    )


# paho's client calls it through the module (``_packet.decode_publish``): replaced for
# every paho client in the process, with the same results (tests/node/test_transport_copies.py).
_paho_decode_publish = _packet.decode_publish
_packet.decode_publish = _decode_publish
