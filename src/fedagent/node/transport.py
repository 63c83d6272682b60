"""One MQTT 5 connection to the federation's broker, with mutual TLS, over aiomqtt.

What this adds to aiomqtt (2.x, on paho-mqtt 2.x):

* a reconnect loop with exponential backoff and jitter, resubscribing every time,
  with a persistent session (``clean_start=False`` + Session Expiry) so QoS1
  messages addressed to us while we were away are delivered when we come back;
* at-least-once delivery *to the handler*: paho acknowledges a QoS1 message only
  after the handler has returned (manual ack), so a crash in between means the
  broker delivers it again (receivers dedupe by sender and sequence); a handler may
  also return an awaitable, and the message is acknowledged only once that is done
  (the next messages are handled meanwhile; acknowledgements keep the order the
  messages came in);
* publishes that wait for PUBACK and look at its MQTT 5 reason code (aiomqtt ignores
  it), so a publish the broker ACL refuses raises :class:`NotAuthorized` instead of
  vanishing silently;
* a check of the broker's Maximum Packet Size before publishing, so an oversized
  message is a clear error instead of a disconnect-reconnect loop;
* :func:`preflight`, which turns certificate problems that paho reports only as a
  connect timeout (TLS 1.3 sends the server's verdict on our certificate after the
  handshake) into :class:`CertificateRejected` saying what is wrong and how to fix it;
* a read loop that does not stall on large messages (see ``_Client._on_socket_open``);
* a Last Will (retained) for presence, published by the broker when we vanish, and
  a clean :meth:`Transport.close` that publishes the final presence itself.

This module reaches into private attributes of aiomqtt's ``Client`` (``_client``,
``_loop``, ``_connected``, ``_disconnected``, ``_lock``, ``_misc_loop``,
``_misc_task``) and of paho's (``_sock``, ``_in_packet``, ``_sock_recv``); aiomqtt is pinned below 3,
and ``tests/node/test_broker_tls.py`` exercises each of these paths.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import select
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiomqtt
import paho.mqtt.client as mqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt import _packet
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedagent.errors import (
    CertificateRejected,
    ConfigError,
    FedagentError,
    NotAuthorized,
    TransportError,
)
from fedagent.protocols.peerview import PROBE_AFTER, link_state
from fedagent.security import pki

log = logging.getLogger(__name__)
_paho_log = logging.getLogger("fedagent.mqtt")

DEFAULT_PORT = 8883
BACKOFF_INITIAL = 0.5
BACKOFF_CAP = 30.0
RC_NOT_AUTHORIZED = 0x87  # 135
RC_DISCONNECT_WITH_WILL = 0x04
# CONNACK reason codes that no amount of retrying will change.
_FATAL_CONNACK = {0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C}


def parse_broker_uri(uri: str) -> tuple[str, int]:
    """``mqtts://host[:port]`` → ``(host, port)``; the port defaults to 8883."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"broker URI must look like mqtts://HOST:PORT, not {uri!r}")
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid broker URI {uri!r}: {exc}") from None
    if parts.scheme != "mqtts":
        raise ConfigError(f"broker URI {uri!r} must use mqtts:// (fedagent only speaks MQTT over mutual TLS)")
    if (
        not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username
        or parts.password
    ):
        raise ConfigError(f"broker URI must look like mqtts://HOST:PORT, not {uri!r}")
    return parts.hostname, port if port is not None else DEFAULT_PORT


@dataclass(frozen=True)
class TlsFiles:
    """This node's credentials: the federation CA, its certificate and private key."""

    ca: Path
    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for field in ("ca", "cert", "key"):
            object.__setattr__(self, field, Path(getattr(self, field)))


def identity_of(tls: TlsFiles) -> str:
    """The CN of our certificate, which the broker takes as username and client id;
    "" when the file is missing or unreadable (the connection then says why)."""
    try:
        return pki.common_name(tls.cert)
    except ConfigError:
        return ""


def make_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """A client context that presents our certificate and trusts only the federation
    CA, with hostname checking on (the broker certificate must name the host in the
    URI: ``fedagent ca issue broker --role broker --san HOST``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=str(tls.ca))
    except FileNotFoundError:
        raise ConfigError(
            f"the federation CA certificate {tls.ca} is missing; copy the federation's ca.crt there"
        ) from None
    except ssl.SSLError as exc:
        raise ConfigError(f"{tls.ca} is not a PEM CA certificate ({exc.reason})") from exc
    for path, what in ((tls.cert, "certificate"), (tls.key, "private key")):
        if not path.exists():
            raise ConfigError(
                f"no client certificate: the {what} file {path} is missing; "
                f"issue one with `fedagent ca issue {tls.cert.stem} --role agent`"
            )
    try:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    except ssl.SSLError as exc:
        raise ConfigError(
            f"cannot use {tls.cert} with {tls.key} ({exc.reason}): the key must be the certificate's, unencrypted PEM"
        ) from exc
    return ctx


# --- preflight: a handshake of our own, to say *why* the broker won't have us --------


def _describe_client_cert(tls: TlsFiles | None) -> tuple[str, str, str]:
    """(file name, node name, re-issue command) for messages about our certificate."""
    if tls is None:
        return "our certificate", "NAME", "`fedagent ca issue NAME --role agent`"
    name, role = tls.cert.stem, "agent"
    try:
        name = pki.common_name(tls.cert) or name
        role = pki.role_of(tls.cert) or role
    except ConfigError:
        pass
    role = role if role in pki.ROLES else "agent"
    return tls.cert.name, name, f"`fedagent ca issue {name} --role {role}`"


def _client_cert_rejected(exc: ssl.SSLError, tls: TlsFiles | None, where: str) -> FedagentError:
    reason = (exc.reason or "").upper()
    short = reason.split("ALERT_", 1)[-1] if "ALERT_" in reason else (reason or str(exc))
    file, name, cmd = _describe_client_cert(tls)
    ca = tls.ca if tls is not None else "the federation CA"
    if "CERTIFICATE_REQUIRED" in reason or (tls is None and "HANDSHAKE_FAILURE" in reason):
        return CertificateRejected(
            f"the broker at {where} requires a client certificate and we sent none "
            f"({short}): configure tls.cert and tls.key with this node's certificate, "
            f"issued with `fedagent ca issue NAME --role agent`"
        )
    if "UNKNOWN_CA" in reason:
        return CertificateRejected(
            f"the broker at {where} rejected our client certificate ({short}): {file} was not "
            f"issued by this federation's CA (the one the broker trusts); get a certificate "
            f"from the federation's CA with {cmd}, and check that tls.ca ({ca}) is that "
            "federation's ca.crt"
        )
    if "EXPIRED" in reason:
        when = ""
        if tls is not None:
            try:
                when = f" on {pki.not_after(tls.cert):%Y-%m-%d}"
            except ConfigError:
                pass
        return CertificateRejected(
            f"the broker at {where} rejected our client certificate ({short}): {file} for "
            f"{name} expired{when}; issue a new one with {cmd}"
        )
    if "REVOKED" in reason:
        return CertificateRejected(
            f"the broker at {where} rejected our client certificate ({short}): {file} for "
            f"{name} has been revoked; ask the federation operator for a new one"
        )
    if "PROTOCOL_VERSION" in reason or "VERSION" in reason:
        return TransportError(
            f"the broker at {where} refused our TLS version ({short}); fedagent needs TLS 1.2 or newer on both sides"
        )
    if "ALERT" in reason or "CERTIFICATE" in reason:
        return CertificateRejected(
            f"the broker at {where} rejected our client certificate ({short}): check that "
            f"{file} was issued for {name} by this federation's CA ({cmd})"
        )
    return TransportError(f"TLS with the broker at {where} failed: {exc}")


def _server_cert_rejected(
    exc: ssl.SSLCertVerificationError, tls: TlsFiles | None, host: str, where: str
) -> CertificateRejected:
    code, msg = exc.verify_code, exc.verify_message or str(exc)
    ca = tls.ca if tls is not None else "our CA"
    if code == 62 or "hostname" in msg.lower() or "IP address mismatch" in msg:
        return CertificateRejected(
            f"the broker's certificate at {where} is not valid for {host!r} ({msg}): issue the "
            f"broker a certificate naming it (`fedagent ca issue broker --role broker --san "
            f"{host}`) or connect with the name in its certificate"
        )
    if code == 10:
        return CertificateRejected(
            f"the broker's certificate at {where} has expired ({msg}): the broker needs a new "
            "one (`fedagent ca issue broker --role broker`)"
        )
    return CertificateRejected(
        f"the broker's certificate at {where} is not signed by our CA ({ca}): {msg}. Is "
        f"{where} this federation's broker, and is {ca} the federation's ca.crt?"
    )


def _connack_refused(code: int, where: str) -> TransportError:
    name = ReasonCode(PacketTypes.CONNACK, identifier=code).getName()
    text = f"the broker at {where} refused our connection: {name} ({code})"
    if code in _FATAL_CONNACK:
        return NotAuthorized(text)
    return TransportError(text)


def _await_verdict(conn: ssl.SSLSocket, wait: float, tls: TlsFiles | None, where: str) -> None:
    """TLS 1.3 only: the server checks our certificate *after* the handshake and
    answers with either session tickets (accepted) or an alert (rejected). Read that
    answer before sending anything: an alert racing our own first packet is lost to
    the TCP reset that follows it."""
    readable, _, _ = select.select([conn], [], [], wait)
    if not readable:
        return  # a server that sends no tickets: CONNECT will tell
    conn.setblocking(False)
    try:
        data = conn.recv(64)
    except ssl.SSLWantReadError:
        return  # only session tickets: our certificate was accepted
    except ssl.SSLEOFError as exc:
        raise TransportError(
            f"the broker at {where} closed the connection right after the TLS "
            "handshake without saying why; see the broker's log"
        ) from exc
    except ssl.SSLError as exc:
        raise _client_cert_rejected(exc, tls, where) from exc
    except OSError as exc:
        raise TransportError(
            f"the broker at {where} dropped the connection after the TLS handshake ({exc}); see the broker's log"
        ) from exc
    if not data:
        raise TransportError(
            f"the broker at {where} closed the connection right after the TLS handshake; see the broker's log"
        )
    raise TransportError(f"the broker at {where} sent data before CONNECT ({data[:8].hex()})")


def _probe(host: str, port: int, ctx: ssl.SSLContext, timeout: float, tls: TlsFiles | None) -> None:
    where = f"{host}:{port}"
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise TransportError(
            f"cannot reach broker at {where}: connection refused (is it running and listening there?)"
        ) from None
    except TimeoutError:
        raise TransportError(f"cannot reach broker at {where}: no answer within {timeout:g}s") from None
    except OSError as exc:
        raise TransportError(f"cannot reach broker at {where}: {exc.strerror or exc}") from exc
    with raw:
        try:
            conn = ctx.wrap_socket(raw, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            raise _server_cert_rejected(exc, tls, host, where) from exc
        except ssl.SSLError as exc:  # TLS 1.2: the verdict on our certificate comes here
            raise _client_cert_rejected(exc, tls, where) from exc
        except TimeoutError:
            raise TransportError(f"TLS handshake with {where} timed out after {timeout:g}s") from None
        except OSError as exc:
            raise TransportError(f"TLS handshake with {where} failed: {exc}") from exc
        with conn:
            # No MQTT CONNECT: the broker takes the client id from our certificate
            # (use_username_as_clientid), so any CONNECT, even with an empty id, would
            # log in as this node, take over its live connection and, with clean start,
            # end its persistent session. The TLS verdict is all a preflight needs; a
            # refused CONNECT is reported by the real connection (_connack_refused).
            if conn.version() == "TLSv1.3":
                _await_verdict(conn, min(timeout, 2.0), tls, where)


async def preflight(
    uri: str,
    tls: TlsFiles,
    timeout: float = 5.0,
    *,
    check_local: bool = True,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Check that the broker at ``uri`` accepts our certificate, explaining if not.

    Checks the local files first (``check_local``), then does a TLS handshake of its
    own and waits for the broker's verdict on our certificate (TLS 1.3 gives it after
    the handshake). It sends no MQTT packet: the broker would take the connection for
    this node's (the client id is the certificate's CN) and drop the real one. Raises
    :class:`CertificateRejected` for certificate problems on either side and
    :class:`TransportError` when the broker cannot be reached. ``ssl_context``
    replaces the context built from ``tls`` (diagnostics and tests).
    """
    host, port = parse_broker_uri(uri)
    if ssl_context is None:
        try:
            if check_local:
                pki.check_certificate(tls.cert, tls.key, tls.ca)
            ssl_context = make_ssl_context(tls)
        except ConfigError as exc:
            raise CertificateRejected(str(exc)) from exc
    await asyncio.to_thread(_probe, host, port, ssl_context, timeout, tls)


# --- the aiomqtt client, with what fedagent needs from paho below it ---------------


class _ConnectionLost(Exception):
    pass


class _Client(aiomqtt.Client):
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
        self, topic: str, payload: bytes, *, qos: int, retain: bool, timeout: float
    ) -> ReasonCode | None:
        """Publish and wait for PUBACK; returns its reason code (None for QoS 0)."""
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            if info.rc == mqtt.MQTT_ERR_NO_CONN or self._disconnected.done():
                raise _ConnectionLost()
            raise TransportError(f"cannot publish to {topic}: {mqtt.error_string(info.rc)}")
        if qos == 0:
            return None
        fut: asyncio.Future[ReasonCode] = self._loop.create_future()
        self._acks[info.mid] = fut
        self._resume_reading()  # the PUBACK must be read, whatever is held
        try:
            await asyncio.wait((fut, self._disconnected), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._acks.pop(info.mid, None)
        if fut.done():
            return fut.result()
        if self._disconnected.done():
            raise _ConnectionLost()
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
    while True:
        client.loop_read()
        s = client._sock
        if s is None or paused():
            return
        if hasattr(s, "pending") and s.pending() > 0:
            continue  # decrypted bytes the fd will never signal
        if _holds_complete_packet(client):
            continue
        return


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
        if len(packet) > READ_SIZE:
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
    clock read per record: 2,800 records per 44.8 MB)."""
    sock: Any = client._sock  # an ssl.SSLSocket (checked by the caller)
    if sock is None:
        raise ConnectionError("the socket is closed")
    got, want = 0, len(into)
    with into:
        while got < want:
            try:
                n = sock.recv_into(into[got:])
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


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n //= 128
        size += 1
    return size


def publish_packet_size(topic: str, payload_len: int, qos: int) -> int:
    """Bytes of an MQTT 5 PUBLISH without properties: what Maximum Packet Size limits."""
    remaining = 2 + len(topic.encode()) + (2 if qos else 0) + 1 + payload_len
    return 1 + _varint_len(remaining) + remaining


#: A received payload at least this large is handed on as the ``bytearray`` paho read
#: the packet into (bytes-like, never modified), not copied into ``bytes``: one pass less
#: over every model chunk received (measured: 24 ms of CPU per 44.8 MB, in 4 MiB
#: chunks). Smaller ones stay ``bytes``.
STEAL_PAYLOAD = 64 * 1024


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


# --- the transport ------------------------------------------------------------------

#: What a handler is given: the topic and the payload, ``bytes`` or, when large, a
#: ``bytearray`` that nothing else holds (see STEAL_PAYLOAD); never to be modified. What
#: it returns: None (acknowledge the message now) or an awaitable that must be done
#: before the message is acknowledged (see ``Transport._dispatch``).
Handler = Callable[[str, bytes | bytearray], Awaitable[Awaitable[None] | None]]
Subscription = str | tuple[str, int]


def _subscription(sub: Subscription) -> tuple[str, int]:
    topic, qos = (sub, 1) if isinstance(sub, str) else sub
    if qos not in (0, 1):
        raise ValueError(f"fedagent subscribes with QoS 0 or 1, not {qos!r} ({topic})")
    return topic, qos


class Transport:
    """One resilient MQTT 5 + mutual-TLS connection.

    ``run(handler)`` owns the connection until it is cancelled or :meth:`close`
    is called; :meth:`publish` may be called from any task meanwhile.
    """

    def __init__(
        self,
        *,
        uri: str,
        tls: TlsFiles,
        client_id: str | None = None,
        will: tuple[str, bytes] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        subscriptions: Sequence[Subscription] = (),
        keepalive: int = 10,
        session_expiry: int = 3600,
        connect_timeout: float = 10,
        receive_maximum: int | None = None,
        retired_subscriptions: Sequence[str] = (),
        hold_limit: int | None = None,
    ) -> None:
        """``client_id`` is the certificate's CN (the default): the broker replaces any
        other id with it (``use_username_as_clientid``), so a different one is refused
        here rather than silently changed there. ``receive_maximum``: QoS 1 messages the
        broker may have sent us unacknowledged (MQTT 5 Receive Maximum). A message is
        acknowledged once the handler is done with it, so this would bound what waits in
        this process, but Mosquitto 2.0.11 does not keep to it: each in-order PUBACK
        releases up to Receive Maximum more messages (``db__message_delete_outgoing``
        counts only the messages in flight ahead of the acknowledged one), so a steady
        stream piles up here (measured: 76 unacknowledged with Receive Maximum 4; 31
        chunks of 4 MiB in the coordinator).

        ``hold_limit``: stop reading from the socket while the messages handed to the
        handler and not yet done with hold at least this many bytes (1: one message at a
        time), so the rest waits in the kernel's socket buffer and at the broker, whatever
        the broker does with Receive Maximum. Reading resumes while a PUBACK is awaited
        (it may be queued behind them) and after at most a quarter of the keep-alive
        (the keep-alive needs bytes read). None: read everything as it comes.

        ``subscriptions``: topic filters, subscribed with QoS 1, or ``(filter, qos)``
        pairs. A QoS 0 subscription is delivered while we are connected and never queued
        for us while we are away (Mosquitto's ``queue_qos0_messages`` is off): for
        broadcasts that a returning node replaces by fetching the current state.
        ``retired_subscriptions``: filters an earlier version subscribed to, removed from
        a persistent session found on the broker (MQTT keeps a session's subscriptions)."""
        self.uri = uri
        self.host, self.port = parse_broker_uri(uri)
        cn = identity_of(tls)
        if client_id is None:
            client_id = cn or tls.cert.stem
        elif cn and client_id != cn:
            raise ConfigError(
                f"client id {client_id!r} differs from the identity in {tls.cert} ({cn!r}); the broker "
                "uses the certificate's CN as the client id, so connect as that (or with another certificate)"
            )
        if not client_id or any(c in client_id for c in "#+/\0"):
            raise ConfigError(f"invalid MQTT client id {client_id!r}")
        self.client_id = client_id
        self.tls = tls
        self.will = will
        self.on_connect = on_connect
        self.keepalive = int(keepalive)
        self.session_expiry = int(session_expiry)
        self.connect_timeout = float(connect_timeout)
        if receive_maximum is not None and not 1 <= receive_maximum <= 65535:
            raise ValueError("receive_maximum must be 1..65535")
        self.receive_maximum = receive_maximum
        if hold_limit is not None and hold_limit < 1:
            raise ValueError("hold_limit must be at least 1 byte")
        self.hold_limit = hold_limit
        self._subscriptions: dict[str, int] = {}
        for sub in subscriptions:
            topic, qos = _subscription(sub)
            self._subscriptions.setdefault(topic, qos)
        self._retired = [t for t in retired_subscriptions if t not in self._subscriptions]

        self.state = "idle"  # idle, connecting, connected, backoff, closed, failed
        self.reconnects = 0
        self.last_error: str | None = None
        self.connected_since: float | None = None
        self.session_present = False
        self.max_packet_size: int | None = None
        self._client: _Client | None = None
        self._connected = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._running = False
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    # --- status ----------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        c = self._client
        return c is not None and self._connected.is_set() and c.is_connected

    @property
    def subscriptions(self) -> tuple[str, ...]:
        return tuple(self._subscriptions)

    def silent_for(self) -> float | None:
        """Seconds since the broker last sent anything on the current connection (None
        while there is none)."""
        c = self._client
        if c is None or not self.connected:
            return None
        return max(0.0, time.monotonic() - c.last_rx)

    @property
    def link_state(self) -> str:
        """``state``, or ``"unresponsive"`` while a connection hears nothing from the
        broker for longer than a live one can (see :mod:`fedagent.protocols.peerview`)."""
        return link_state(self.state, self.silent_for(), self.keepalive)

    async def _watch_link(self, client: _Client) -> None:
        """Probe a silent broker early: after half a keep-alive without a packet, one
        PINGREQ (again whenever something arrived since), so a partition shows in
        ``link_state`` well within the keep-alive."""
        probed_at = -1.0
        step = max(0.2, min(1.0, self.keepalive / 8))
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            if now - client.last_rx >= PROBE_AFTER * self.keepalive and probed_at < client.last_rx:
                probed_at = now
                try:
                    client.probe()
                except Exception as exc:  # noqa: BLE001 - paho reports the broken socket itself
                    log.debug("link probe failed: %s", exc)

    def subscription_qos(self, topic: str) -> int | None:
        """The QoS ``topic`` (a filter as given) is subscribed with; None if it is not."""
        return self._subscriptions.get(topic)

    def status(self) -> dict[str, Any]:
        return {
            "broker": self.uri,
            "state": self.state,
            "link": self.link_state,
            "silent_for": self.silent_for(),
            "reconnects": self.reconnects,
            "last_error": self.last_error,
            "connected_since": self.connected_since,
            "session_present": self.session_present,
            "max_packet_size": self.max_packet_size,
        }

    # --- the connection loop ---------------------------------------------------------
    def _new_client(self) -> _Client:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry
        if self.receive_maximum is not None:
            props.ReceiveMaximum = self.receive_maximum
        will = None
        if self.will is not None:
            will = aiomqtt.Will(self.will[0], self.will[1], qos=1, retain=True)
        return _Client(
            self.host,
            self.port,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
            properties=props,
            keepalive=self.keepalive,
            timeout=self.connect_timeout,
            will=will,
            tls_context=make_ssl_context(self.tls),
            logger=_paho_log,
            hold_limit=self.hold_limit,
            max_pause=max(0.5, self.keepalive / 4),
        )

    async def run(self, handler: Handler, ready: asyncio.Event | None = None) -> None:
        """Stay connected and feed every incoming message to ``await handler(topic,
        payload)`` until cancelled or closed.

        Certificate problems (ours or the broker's) and refused credentials raise
        (:class:`CertificateRejected`, :class:`NotAuthorized`, ConfigError): those are
        configuration errors that retrying cannot fix. Everything else is retried with
        backoff. Cancelling ``run`` without :meth:`close` disconnects so that the broker
        publishes the Last Will.
        """
        if self._running:
            raise RuntimeError("Transport.run() is already running")
        self._running = True
        self._closing = False
        self._stopped.clear()
        inbox: asyncio.Queue[tuple[_Client, aiomqtt.Message]] = asyncio.Queue()
        dispatcher = asyncio.create_task(self._dispatch(handler, inbox), name=f"mqtt-dispatch-{self.client_id}")
        try:
            await self._connection_loop(inbox, ready)
        except FedagentError:
            self.state = "failed"
            raise
        finally:
            dispatcher.cancel()
            try:
                await dispatcher
            except asyncio.CancelledError:
                pass
            if self.state != "failed":
                self.state = "closed" if self._closing else "idle"
            self._running = False
            self._connected.clear()
            self._client = None
            self._stopped.set()

    async def _connection_loop(self, inbox: asyncio.Queue, ready: asyncio.Event | None) -> None:
        attempt = 0
        check_first = True
        ever_connected = False
        while not self._closing:
            self.state = "connecting"
            connected_now = False
            try:
                if check_first:
                    # Before the first connect, and after any failed one: a TLS 1.3
                    # certificate rejection looks like a timeout to paho.
                    await preflight(self.uri, self.tls, timeout=min(self.connect_timeout, 5.0))
                    check_first = False
                client = self._new_client()
                await self._enter(client)
                connected_now = True
                # Publishers stop waiting on this connection the moment it is gone.
                client._disconnected.add_done_callback(lambda _f: self._connected.clear())
                try:
                    if self._closing:
                        # close() came while we were connecting and published nothing:
                        # leave as if we had died, so the Will keeps presence right.
                        await self._disconnect(client, with_will=True)
                        break
                    attempt = 0
                    if ever_connected:
                        self.reconnects += 1
                    ever_connected = True
                    self._client = client
                    self.session_present = client.session_present
                    self.max_packet_size = client.max_packet_size
                    self.connected_since = time.time()
                    self.last_error = None
                    log.info(
                        "connected to %s as %s (session present: %s)", self.uri, self.client_id, client.session_present
                    )
                    await self._subscribe(client, list(self._subscriptions.items()))
                    if client.session_present and self._retired:
                        await client.unsubscribe(self._retired, timeout=self.connect_timeout)
                    self.state = "connected"
                    self._connected.set()
                    watch = asyncio.create_task(self._watch_link(client), name=f"mqtt-link-{self.client_id}")
                    try:
                        if self.on_connect is not None:
                            await self.on_connect()
                        if ready is not None:
                            ready.set()
                        client.hold_armed = True  # from here on the dispatcher releases what it holds
                        async for message in client.messages:
                            inbox.put_nowait((client, message))
                    finally:
                        watch.cancel()
                finally:
                    self._connected.clear()
                    self._client = None
                    self.connected_since = None
                    if not client._disconnected.done():
                        # Leaving for any reason but close() (cancelled, a fatal error, a
                        # failed subscribe): DISCONNECT with reason 4, so the broker
                        # publishes our Will and nobody sees a stale "online".
                        await self._disconnect(client, with_will=not self._closing)
                    if client._lock.locked():
                        await client.__aexit__(None, None, None)
            except (CertificateRejected, NotAuthorized, ConfigError):
                raise
            except MqttConnectError as exc:
                code = getattr(exc.rc, "value", exc.rc)
                if isinstance(code, int) and code in _FATAL_CONNACK:
                    raise _connack_refused(code, f"{self.host}:{self.port}") from exc
                self.last_error = str(exc)
            except (aiomqtt.MqttError, TransportError, OSError, TimeoutError) as exc:
                if self._closing:
                    break
                self.last_error = str(exc) or type(exc).__name__
                if not connected_now:
                    check_first = True
                log.warning("connection to %s %s: %s", self.uri, "lost" if connected_now else "failed", self.last_error)
            if self._closing:
                break
            self.state = "backoff"
            delay = min(BACKOFF_CAP, BACKOFF_INITIAL * 2 ** min(attempt, 16))
            delay = random.uniform(delay / 2, delay)
            attempt += 1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass

    async def _enter(self, client: _Client) -> None:
        """``client.__aenter__()``, safe to cancel: paho's connect() runs in a thread that
        cannot be interrupted, so a cancelled connect is left to finish and is then
        disconnected (with the Will) instead of lingering half-open."""
        enter = asyncio.ensure_future(client.__aenter__())
        try:
            await asyncio.shield(enter)
        except asyncio.CancelledError:

            def abandon(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    return
                rc = ReasonCode(PacketTypes.DISCONNECT, identifier=RC_DISCONNECT_WITH_WILL)
                client.paho.disconnect(reasoncode=rc)

            enter.add_done_callback(abandon)
            raise

    async def _dispatch(self, handler: Handler, inbox: asyncio.Queue) -> None:
        """Hand the messages to ``handler`` one at a time. A message is acknowledged when
        the handler returns, or, if it returns an awaitable (a frame written to a journal
        whose sync is still to come), once that is done; the next messages are handled
        meanwhile. Acknowledgements go out in the order the messages came (MQTT 5 §4.6),
        so one waiting for its awaitable holds back those after it. The bytes a message
        holds (``hold_limit``) are released when the handler returns either way: what
        waits then is an acknowledgement, not data. Messages not acknowledged when the
        connection or this task ends are delivered again by the broker."""
        pending: collections.deque[tuple[_Client, int, int, asyncio.Future[Any] | None]] = collections.deque()

        def drain(_done: object = None) -> None:
            while pending and (pending[0][3] is None or pending[0][3].done()):
                client, mid, qos, gate = pending.popleft()
                if gate is not None and gate.cancelled():
                    continue  # shutting down: not acknowledged, the broker delivers it again
                if gate is not None and gate.exception() is not None:
                    log.error("acknowledging message %d after its gate failed: %s", mid, gate.exception())
                client.ack(mid, qos)

        try:
            while True:
                client, message = await inbox.get()
                topic = message.topic.value
                payload = message.payload
                if not isinstance(payload, bytes | bytearray):
                    payload = b"" if payload is None else bytes(payload)
                gate: asyncio.Future[Any] | None = None
                try:
                    after = await handler(topic, payload)
                    if after is not None:
                        gate = asyncio.ensure_future(after)
                except asyncio.CancelledError:
                    raise  # not acked: the broker redelivers it
                except Exception:
                    log.exception("handler failed on a message from %s", topic)
                client.release(len(payload))
                if gate is None and not pending:
                    client.ack(message.mid, message.qos)
                    continue
                pending.append((client, message.mid, message.qos, gate))
                if gate is not None:
                    gate.add_done_callback(drain)
                drain()
        finally:
            for _client, _mid, _qos, gate in pending:
                if gate is not None:
                    gate.remove_done_callback(drain)

    async def _subscribe(self, client: _Client, topics: list[tuple[str, int]]) -> None:
        if not topics:
            return
        granted = await client.subscribe(
            [(t, SubscribeOptions(qos=qos)) for t, qos in topics], timeout=self.connect_timeout
        )
        for (topic, _qos), rc in zip(topics, granted):
            value = getattr(rc, "value", rc)
            if isinstance(value, int) and value >= 0x80:
                raise NotAuthorized(f"the broker refused our subscription to {topic}: {rc}")

    async def _disconnect(self, client: _Client, *, with_will: bool, timeout: float = 2.0) -> None:
        """Send DISCONNECT (reason 0, or 4 = "publish my Will") and wait briefly."""
        if client._disconnected.done():
            return
        rc = ReasonCode(PacketTypes.DISCONNECT, identifier=RC_DISCONNECT_WITH_WILL if with_will else 0)
        if client.paho.disconnect(reasoncode=rc) == mqtt.MQTT_ERR_SUCCESS:
            await asyncio.wait((client._disconnected,), timeout=timeout)
        if client._disconnected.done():
            client._disconnected.exception()  # retrieved: we are leaving either way
        else:
            client._disconnected.set_result(None)

    # --- operations ------------------------------------------------------------------
    async def _wait_connected(self, deadline: float, what: str, timeout: float) -> _Client:
        loop = asyncio.get_running_loop()
        while True:
            client = self._client
            if client is not None and self._connected.is_set() and client.is_connected:
                return client
            if self._closing or self.state in ("closed", "failed"):
                raise TransportError(f"cannot {what}: the transport to {self.uri} is {self.state}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransportError(
                    f"cannot {what}: not connected to the broker at {self.uri} within "
                    f"{timeout:g}s (state {self.state}; last error: {self.last_error or 'none'})"
                )
            if client is not None and self._connected.is_set():
                # The connection just died and the run loop has not noticed yet.
                await asyncio.wait((client._disconnected,), timeout=min(remaining, 1.0))
                continue
            try:
                await asyncio.wait_for(self._connected.wait(), remaining)
            except TimeoutError:
                pass

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, timeout: float = 30
    ) -> None:
        """Publish and, for QoS 1, wait for the broker's PUBACK.

        Raises :class:`NotAuthorized` if the broker ACL refuses it (reason code 135),
        TransportError for another refusal, a message above the broker's maximum
        packet size, or no connection/PUBACK within ``timeout``. A connection lost
        before PUBACK is retried on the next one (at least once; receivers dedupe).
        """
        if qos not in (0, 1):
            raise ValueError("fedagent publishes with QoS 0 or 1")
        payload = bytes(payload) if not isinstance(payload, bytes) else payload
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            client = await self._wait_connected(deadline, f"publish to {topic}", timeout)
            limit = client.max_packet_size
            size = publish_packet_size(topic, len(payload), qos)
            if limit is not None and size > limit:
                raise TransportError(
                    f"cannot publish {len(payload)} bytes to {topic}: the packet ({size} bytes) "
                    f"exceeds the broker's maximum packet size of {limit} bytes; split it into "
                    "chunks below that limit"
                )
            try:
                rc = await client.publish_acked(
                    topic, payload, qos=qos, retain=retain, timeout=max(0.0, deadline - loop.time())
                )
            except _ConnectionLost:
                log.info("connection lost before PUBACK for %s; publishing again after reconnecting", topic)
                continue
            except TimeoutError:
                raise TransportError(
                    f"no PUBACK from the broker at {self.uri} for {topic} within {timeout:g}s"
                ) from None
            if rc is not None and rc.value >= 0x80:
                raise self._refused(topic, rc)
            return

    def _refused(self, topic: str, rc: ReasonCode) -> TransportError:
        if rc.value == RC_NOT_AUTHORIZED:
            _, name, _ = _describe_client_cert(self.tls)
            return NotAuthorized(
                f"the broker refused our publish to {topic}: reason code {rc.value} "
                f"({rc.getName()}) - not authorized by the broker ACL; {name} may publish only "
                f"under fedagent/v1/<federation>/node/{name}/ (and global/ if a coordinator)"
            )
        return TransportError(f"the broker refused our publish to {topic}: reason code {rc.value} ({rc.getName()})")

    def update_subscriptions(self, add: Sequence[Subscription]) -> asyncio.Task | None:
        """Add subscriptions (kept across reconnects; filters or ``(filter, qos)`` as in
        the constructor). If connected, they are made at once; the returned task
        finishes on SUBACK (await it to be sure)."""
        new = [(t, q) for t, q in map(_subscription, add) if t not in self._subscriptions]
        self._subscriptions.update(new)
        client = self._client
        if not new or client is None or not self.connected:
            return None

        async def subscribe() -> None:
            try:
                await self._subscribe(client, new)
            except (aiomqtt.MqttError, TransportError) as exc:
                # The next connection subscribes to everything again.
                log.warning("subscribing to %s failed: %s", new, exc)

        task = asyncio.get_running_loop().create_task(subscribe())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, final: tuple[str, bytes] | None = None, timeout: float = 5.0) -> None:
        """Stop cleanly: publish ``final`` (retained, e.g. an offline presence) if we
        are connected, then disconnect normally so the broker drops the Will."""
        self._closing = True
        self._wake.set()
        client = self._client
        if client is not None and self.connected:
            if final is not None:
                try:
                    await self.publish(final[0], final[1], qos=1, retain=True, timeout=timeout)
                except TransportError as exc:
                    log.warning("could not publish the final message to %s: %s", final[0], exc)
            await self._disconnect(client, with_will=False, timeout=timeout)
        if self._running:
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout)
            except TimeoutError:
                log.warning("the MQTT loop did not stop within %gs", timeout)
        self.state = "closed"
