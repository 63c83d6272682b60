"""What an attacker does to a broker, with real MQTT clients: ``from attacker import ...``.

``login(host, port, ctx, client_id, clean_start=True)``
    One MQTT 5 login with paho (its own socket, no fedagent code): returns the CONNACK
    reason code's value, or None when the connection died before a CONNACK (no
    certificate, a foreign one, ...). Disconnects again at once.

``takeovers(host, port, ctx, client_ids, times, limit)``
    ``times`` logins under each of ``client_ids`` with clean start, all within
    ``limit`` seconds; returns how many the broker accepted (CONNACK success). With
    ``use_username_as_clientid`` an accepted login is one under the certificate's own
    identity, never under the requested id: the caller checks the victims.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence

import paho.mqtt.client as paho


def login(host: str, port: int, ctx: ssl.SSLContext, client_id: str, *, clean_start: bool = True, timeout: float = 5.0):
    result: dict[str, object] = {}
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    c.tls_set_context(ctx)

    def on_connect(_c, _u, _flags, rc, _props) -> None:
        result["rc"] = rc.value

    def on_disconnect(_c, _u, _flags, rc, _props) -> None:
        result.setdefault("gone", True)

    c.on_connect = on_connect
    c.on_disconnect = on_disconnect
    try:
        c.connect(host, port, keepalive=10, clean_start=clean_start)
    except (OSError, ssl.SSLError):
        return None
    deadline = time.monotonic() + timeout
    try:
        while "rc" not in result and "gone" not in result and time.monotonic() < deadline:
            if c.loop(0.05) not in (paho.MQTT_ERR_SUCCESS,):
                break
        if result.get("rc") == 0:
            c.disconnect()
            c.loop(0.05)
    finally:
        c.socket() and c.socket().close()  # type: ignore[union-attr]
    rc = result.get("rc")
    return rc if isinstance(rc, int) else None


def takeovers(host: str, port: int, ctx: ssl.SSLContext, client_ids: Sequence[str], times: int, limit: float) -> int:
    accepted = 0
    deadline = time.monotonic() + limit
    for _ in range(times):
        for cid in client_ids:
            if time.monotonic() > deadline:
                raise AssertionError(f"{times} x {len(client_ids)} logins did not fit in {limit}s")
            if login(host, port, ctx, cid) == 0:
                accepted += 1
    return accepted
