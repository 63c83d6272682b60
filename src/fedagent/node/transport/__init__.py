"""The connection to the federation's broker: MQTT 5 over mutual TLS, one idea a module.

* :mod:`.tls`: the ``mqtts://`` URI, this node's certificate files, the TLS context;
* :mod:`.preflight`: a TLS handshake of our own that says why the broker refuses us,
  and the wording of every refusal (CONNECT, publish);
* :mod:`.patches`: everything that reaches into aiomqtt's and paho's private internals
  (the versions it was checked against, and why each patch exists);
* :mod:`.client`: the reconnecting :class:`Transport` the daemons use.

The names below are the package's surface; import them from here.
"""

from fedagent.node.transport.client import (
    BACKOFF_CAP,
    BACKOFF_INITIAL,
    RC_NOT_AUTHORIZED,
    Handler,
    Subscription,
    Transport,
    publish_packet_size,
)
from fedagent.node.transport.patches import read_available
from fedagent.node.transport.preflight import preflight
from fedagent.node.transport.tls import DEFAULT_PORT, TlsFiles, identity_of, make_ssl_context, parse_broker_uri

__all__ = [
    "BACKOFF_CAP",
    "BACKOFF_INITIAL",
    "DEFAULT_PORT",
    "RC_NOT_AUTHORIZED",
    "Handler",
    "Subscription",
    "TlsFiles",
    "Transport",
    "identity_of",
    "make_ssl_context",
    "parse_broker_uri",
    "preflight",
    "publish_packet_size",
    "read_available",
]
