"""Preflight: a TLS handshake of our own, to say *why* the broker won't have us.

paho reports a certificate the broker refuses only as a connect timeout: with TLS 1.3
the server's verdict on our certificate comes after the handshake, as an alert that
races our first packet and is lost to the TCP reset that follows. :func:`preflight`
does the handshake itself, reads that verdict, and turns it into a
:class:`~fedagent.errors.CertificateRejected` naming the file and the command that fixes
it. The explanations of a refused CONNECT and of a refused publish live here too: what
the broker says, in words an operator can act on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import select
import socket
import ssl

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from fedagent.errors import (
    CertificateRejected,
    ClockBehind,
    ConfigError,
    FedagentError,
    NotAuthorized,
    TransportError,
)
from fedagent.node.transport.tls import TlsFiles, make_ssl_context, parse_broker_uri
from fedagent.security import pki

# CONNACK reason codes that no amount of retrying will change.
FATAL_CONNACK = {0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C}


def describe_client_cert(tls: TlsFiles | None) -> tuple[str, str, str]:
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
    file, name, cmd = describe_client_cert(tls)
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


def _utcnow() -> str:
    return f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"


def _server_cert_rejected(
    exc: ssl.SSLCertVerificationError, tls: TlsFiles | None, host: str, where: str
) -> TransportError:
    code, msg = exc.verify_code, exc.verify_message or str(exc)
    ca = tls.ca if tls is not None else "our CA"
    if code == 62 or "hostname" in msg.lower() or "IP address mismatch" in msg:
        return CertificateRejected(
            f"the broker's certificate at {where} is not valid for {host!r} ({msg}): issue the "
            f"broker a certificate naming it (`fedagent ca issue broker --role broker --san "
            f"{host}`) or connect with the name in its certificate"
        )
    if code == 9:
        # Not valid *yet*: this machine's clock is behind (it is retried, not fatal).
        return ClockBehind(
            f"the broker's certificate at {where} is not valid yet by this machine's clock "
            f"({msg}; the clock says {_utcnow()}): is the clock set (timedatectl)? Retrying"
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


def connack_refused(code: int, where: str) -> TransportError:
    name = ReasonCode(PacketTypes.CONNACK, identifier=code).getName()
    text = f"the broker at {where} refused our connection: {name} ({code})"
    if code in FATAL_CONNACK:
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
            # refused CONNECT is reported by the real connection (connack_refused).
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
        except ClockBehind:
            raise  # retried: the clock may be set any moment
        except ConfigError as exc:
            raise CertificateRejected(str(exc)) from exc
    await asyncio.to_thread(_probe, host, port, ssl_context, timeout, tls)
