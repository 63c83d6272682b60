"""The MQTT topic layout, in one place.

Everything of one federation lives under ``fedagent/v1/<federation>/``:

``node/<id>/presence``
    retained ``Presence`` of a node (agent or coordinator); the Last Will overwrites
    it with an offline one when the connection dies.
``node/<sender>/to/<receiver>/<kind>``
    a message addressed to one node (an agent's update to the coordinator, a gossip
    model to a peer). A node may publish only under its own ``node/<id>/`` subtree and
    read only what is addressed to it, so the broker's ACL (``pattern`` rules with
    ``%u`` = certificate CN) keeps agents out of each other's traffic.
``global/<kind>``
    what the coordinator broadcasts (round starts, the global model, round results);
    only coordinator identities may publish there.

Identifiers are validated before they are put into a topic: a ``#``, ``+`` or ``/``
in an id would let a client escape its ACL subtree (Mosquitto CVE-2017-7650).
"""

from __future__ import annotations

import re
from typing import TypeGuard

from fedagent.errors import ConfigError

PREFIX = "fedagent/v1"
_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62})")
_KIND = re.compile(r"[a-z0-9_]{1,32}")


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is a valid federation/node id, else raise ConfigError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid {what} {name!r}: use 1-63 lower-case letters, digits or '-', starting with a letter or digit"
        )
    return name


def is_valid_name(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def check_kind(kind: str) -> str:
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ConfigError(f"invalid message kind {kind!r}")
    return kind


def federation_root(federation: str) -> str:
    return f"{PREFIX}/{check_name(federation, 'federation')}"


def presence(federation: str, node: str) -> str:
    return f"{federation_root(federation)}/node/{check_name(node, 'node id')}/presence"


def all_presence(federation: str) -> str:
    return f"{federation_root(federation)}/node/+/presence"


def direct(federation: str, sender: str, receiver: str, kind: str) -> str:
    return (
        f"{federation_root(federation)}/node/{check_name(sender, 'node id')}"
        f"/to/{check_name(receiver, 'node id')}/{check_kind(kind)}"
    )


def inbox(federation: str, receiver: str) -> str:
    """Subscription filter for everything addressed to ``receiver``."""
    return f"{federation_root(federation)}/node/+/to/{check_name(receiver, 'node id')}/#"


def broadcast(federation: str, kind: str) -> str:
    return f"{federation_root(federation)}/global/{check_kind(kind)}"


def all_broadcasts(federation: str) -> str:
    return f"{federation_root(federation)}/global/#"


def parse(topic: str) -> tuple[str, str, str | None, str | None]:
    """Split a topic into (federation, sender, receiver, kind).

    ``sender`` is ``"*coordinator*"``-free: for ``global/<kind>`` topics it is ``""``
    (the envelope names the sender; the ACL guarantees it is a coordinator).
    Raises ValueError on a topic outside the layout.
    """
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != PREFIX:
        raise ValueError(f"topic outside fedagent/v1: {topic!r}")
    fed = parts[2]
    rest = parts[3:]
    if rest[0] == "global" and len(rest) == 2:
        return fed, "", None, rest[1]
    if rest[0] == "node" and len(rest) == 3 and rest[2] == "presence":
        return fed, rest[1], None, "presence"
    if rest[0] == "node" and len(rest) == 5 and rest[2] == "to":
        return fed, rest[1], rest[3], rest[4]
    raise ValueError(f"topic outside the fedagent layout: {topic!r}")
