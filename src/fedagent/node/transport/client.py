"""One MQTT 5 connection to the federation's broker, with mutual TLS, over aiomqtt.

What :class:`Transport` adds to aiomqtt (2.x, on paho-mqtt 2.x):

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
* :func:`~fedagent.node.transport.preflight.preflight` before the first connection and
  after a failed one, which turns certificate problems that paho reports only as a
  connect timeout into :class:`CertificateRejected` saying what is wrong;
* a Last Will (retained) for presence, published by the broker when we vanish, and
  a clean :meth:`Transport.close` that publishes the final presence itself.

What needs paho's and aiomqtt's private internals (the PUBACK reason codes, manual
acks, read pausing, the stall-free read loop) is in
:mod:`fedagent.node.transport.patches`; this module uses only its :class:`MqttClient`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedagent.errors import (
    AckWithheld,
    CertificateRejected,
    ConfigError,
    FedagentError,
    NotAuthorized,
    TransportError,
)
from fedagent.node.transport.patches import ConnectionLost, MqttClient
from fedagent.node.transport.preflight import FATAL_CONNACK, connack_refused, describe_client_cert, preflight
from fedagent.node.transport.tls import TlsFiles, identity_of, make_ssl_context, parse_broker_uri
from fedagent.protocols.peerview import PROBE_AFTER, link_state

log = logging.getLogger("fedagent.node.transport")
_paho_log = logging.getLogger("fedagent.mqtt")

BACKOFF_INITIAL = 0.5
BACKOFF_CAP = 30.0
#: The longest single wait of a patient publish for its PUBACK before it warns again.
PATIENCE_CAP = 300.0
RC_NOT_AUTHORIZED = 0x87  # 135


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
        self._client: MqttClient | None = None
        self._connected = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        # Called with the topic of every message as it is read, before it is handed to the
        # handler: False drops it unread (acknowledged in its turn). A flood of a member's
        # messages then costs their parsing, not the handler's way through the event loop.
        self.screen: Callable[[str], bool] | None = None
        # (client, mid, qos, gate) of messages handled whose acknowledgement waits for its
        # turn (see _dispatch); dropped messages take their turn here too.
        self._pending: collections.deque[tuple[MqttClient, int, int, asyncio.Future[Any] | None]] = collections.deque()
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

    def probe(self) -> None:
        """Ask the broker for a sign of life now (a PINGREQ; its answer refreshes
        :meth:`silent_for`). Nothing happens without a connection."""
        c = self._client
        if c is not None and self.connected:
            try:
                c.probe()
            except Exception as exc:  # noqa: BLE001 - paho reports the broken socket itself
                log.debug("link probe failed: %s", exc)

    @property
    def link_state(self) -> str:
        """``state``, or ``"unresponsive"`` while a connection hears nothing from the
        broker for longer than a live one can (see :mod:`fedagent.protocols.peerview`)."""
        return link_state(self.state, self.silent_for(), self.keepalive)

    async def _watch_link(self, client: MqttClient) -> None:
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
    def _new_client(self) -> MqttClient:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry
        if self.receive_maximum is not None:
            props.ReceiveMaximum = self.receive_maximum
        will = None
        if self.will is not None:
            will = aiomqtt.Will(self.will[0], self.will[1], qos=1, retain=True)
        client = MqttClient(
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
        client.screen = self.screen
        client.on_dropped = lambda mid, qos: self._dropped(client, mid, qos)
        return client

    def _dropped(self, client: MqttClient, mid: int, qos: int) -> None:
        """A message ``screen`` dropped: acknowledged now, or after those before it."""
        if not self._pending:
            client.ack(mid, qos)
        else:
            self._pending.append((client, mid, qos, None))

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
        inbox: asyncio.Queue[tuple[MqttClient, aiomqtt.Message]] = asyncio.Queue()
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
                client.when_lost(self._connected.clear)
                try:
                    if self._closing:
                        # close() came while we were connecting and published nothing:
                        # leave as if we had died, so the Will keeps presence right.
                        await client.leave(with_will=True)
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
                    if not client.lost:
                        # Leaving for any reason but close() (cancelled, a fatal error, a
                        # failed subscribe): DISCONNECT with reason 4, so the broker
                        # publishes our Will and nobody sees a stale "online".
                        await client.leave(with_will=not self._closing)
                    await client.exit_if_entered()
            except (CertificateRejected, NotAuthorized, ConfigError):
                raise
            except MqttConnectError as exc:
                code = getattr(exc.rc, "value", exc.rc)
                if isinstance(code, int) and code in FATAL_CONNACK:
                    raise connack_refused(code, f"{self.host}:{self.port}") from exc
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

    async def _enter(self, client: MqttClient) -> None:
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
                client.send_disconnect(with_will=True)

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
        pending = self._pending
        pending.clear()

        def drain(_done: object = None) -> None:
            while pending and (pending[0][3] is None or pending[0][3].done()):
                client, mid, qos, gate = pending.popleft()
                if gate is not None and gate.cancelled():
                    continue  # shutting down: not acknowledged, the broker delivers it again
                if gate is not None and isinstance(gate.exception(), AckWithheld):
                    # Kept by the broker (in flight in this session): delivered again
                    # after the next connection, a restart's included.
                    log.warning("message %d not acknowledged: %s", mid, gate.exception())
                    continue
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

    async def _subscribe(self, client: MqttClient, topics: list[tuple[str, int]]) -> None:
        if not topics:
            return
        granted = await client.subscribe(
            [(t, SubscribeOptions(qos=qos)) for t, qos in topics], timeout=self.connect_timeout
        )
        for (topic, _qos), rc in zip(topics, granted):
            value = getattr(rc, "value", rc)
            if isinstance(value, int) and value >= 0x80:
                raise NotAuthorized(f"the broker refused our subscription to {topic}: {rc}")

    # --- operations ------------------------------------------------------------------
    async def _wait_connected(self, deadline: float, what: str, timeout: float) -> MqttClient:
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
                await client.wait_lost(min(remaining, 1.0))
                continue
            try:
                await asyncio.wait_for(self._connected.wait(), remaining)
            except TimeoutError:
                pass

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 30,
        patient: bool = False,
    ) -> None:
        """Publish and, for QoS 1, wait for the broker's PUBACK.

        Raises :class:`NotAuthorized` if the broker ACL refuses it (reason code 135),
        TransportError for another refusal, a message above the broker's maximum
        packet size, or no connection/PUBACK within ``timeout``. A connection lost
        before PUBACK is retried on the next one (at least once; receivers dedupe).

        ``patient``: a late PUBACK or a connection that is down is never an error: after
        ``timeout`` the wait goes on, ``timeout`` doubled each time up to
        :data:`PATIENCE_CAP` (with a warning), and a connection lost is waited for. A
        broker busy delivering a flood to us answers late, not never; giving up would
        only turn its backlog into an exit. Only a refusal or :meth:`close` ends it.
        """
        if qos not in (0, 1):
            raise ValueError("fedagent publishes with QoS 0 or 1")
        payload = bytes(payload) if not isinstance(payload, bytes) else payload
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if not patient else float("inf")
        waited = [float(timeout)]

        def on_slow() -> float:
            log.warning("no PUBACK from %s for %s within %.0fs; still waiting", self.uri, topic, waited[0])
            step = min(PATIENCE_CAP, waited[0] * 2)
            waited[0] += step
            return step

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
                    topic,
                    payload,
                    qos=qos,
                    retain=retain,
                    timeout=max(0.0, deadline - loop.time()) if not patient else timeout,
                    on_slow=on_slow if patient else None,
                )
            except ConnectionLost:
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
            _, name, _ = describe_client_cert(self.tls)
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
            await client.leave(with_will=False, timeout=timeout)
        if self._running:
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout)
            except TimeoutError:
                log.warning("the MQTT loop did not stop within %gs", timeout)
        self.state = "closed"
