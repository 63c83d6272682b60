"""Mosquitto for a federation: the configuration text (:mod:`.conf`: listener, ACL,
bridges) and a private instance fedagent starts and owns (:mod:`.embedded`)."""

from fedagent.mosquitto.conf import (
    DEFAULT_MAX_PACKET_SIZE,
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_MESSAGES,
    DEFAULT_PORT,
    acl_members,
    check_queue_limits,
    render_acl,
    render_bridge,
    render_config,
    write_site_config,
)
from fedagent.mosquitto.embedded import BROKER_MALLOC_ENV, EmbeddedBroker, find_mosquitto, free_port

__all__ = [
    "BROKER_MALLOC_ENV",
    "DEFAULT_MAX_PACKET_SIZE",
    "DEFAULT_MAX_QUEUED_BYTES",
    "DEFAULT_MAX_QUEUED_MESSAGES",
    "DEFAULT_PORT",
    "EmbeddedBroker",
    "acl_members",
    "check_queue_limits",
    "find_mosquitto",
    "free_port",
    "render_acl",
    "render_bridge",
    "render_config",
    "write_site_config",
]
