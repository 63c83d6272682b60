"""Where the broker is and who we are to it: the ``mqtts://`` URI and the TLS context.

fedagent speaks MQTT only over mutual TLS: the client presents this node's certificate,
trusts only the federation's CA and checks that the broker's certificate names the host
in the URI. A missing or mismatched file is a :class:`~fedagent.errors.ConfigError`
that says which file and how to get a right one.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fedagent.errors import ConfigError
from fedagent.security import pki

DEFAULT_PORT = 8883


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
