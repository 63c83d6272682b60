"""What a node knows about its peers and its broker link, as ``status`` and ``peers`` show it.

Both commands print this one table, so they cannot disagree. A peer's row merges its
retained presence over MQTT, its mDNS advert and the time of the last verified message of
any kind from it (an update, a chunk, a presence: whatever came last). While this node's
own broker link is down or silent, what presence says about others is stale: their
``online`` is then unknown (None), not "yes". No I/O here: the daemons pass in what they
hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: A live MQTT connection receives something at least every keep-alive (paho pings after
#: that long without traffic). The transport pings on its own after PROBE_AFTER × keep-alive
#: of silence; no answer within PROBE_GRACE × keep-alive (at least MIN_GRACE s) means the
#: broker is unreachable, well before the keep-alive itself runs out.
PROBE_AFTER = 0.5
PROBE_GRACE = 0.25
MIN_GRACE = 0.5


def silence_limit(keepalive: float) -> float:
    """Seconds without a packet from the broker after which the link counts as lost."""
    return PROBE_AFTER * keepalive + max(MIN_GRACE, PROBE_GRACE * keepalive)


def link_state(state: str, silent_for: float | None, keepalive: float) -> str:
    """The connection as an operator should read it: the transport's own state, except
    that a connection that has heard nothing from the broker for longer than
    :func:`silence_limit` is ``"unresponsive"`` (a partition keeps TCP open for minutes)."""
    if state == "connected" and silent_for is not None and silent_for > silence_limit(keepalive):
        return "unresponsive"
    return state


def peer_table(
    self_id: str,
    *,
    presence: Mapping[str, Mapping[str, Any]],
    heard: Mapping[str, float],
    adverts: Mapping[str, Mapping[str, Any]],
    broker: str,
    link_ok: bool,
) -> dict[str, dict[str, Any]]:
    """One row per peer: role, online (None: unknown), broker, mdns, last_seen (epoch s).

    ``presence``: id -> {role, online, last_seen, model_version?, samples?} from retained
    presence messages; ``heard``: id -> time of the last verified message of any kind;
    ``adverts``: id -> {role, broker, last_seen} from mDNS (this federation only);
    ``broker``: this node's broker (peers heard over MQTT are reachable through it);
    ``link_ok``: this node's broker link is up and answering.
    """
    rows: dict[str, dict[str, Any]] = {}
    for pid, ad in adverts.items():
        if pid == self_id:
            continue
        rows[pid] = {
            "role": ad.get("role"),
            "online": None,
            "broker": ad.get("broker") or None,
            "mdns": True,
            "last_seen": ad.get("last_seen"),
        }
    for pid, p in presence.items():
        if pid == self_id:
            continue
        row = rows.setdefault(pid, {"role": p.get("role"), "broker": None, "mdns": False, "last_seen": None})
        row["role"] = p.get("role") or row["role"]
        row["online"] = bool(p.get("online")) if link_ok else None
        row["broker"] = row["broker"] or (p.get("broker") or broker or None)
        row["last_seen"] = _latest(row["last_seen"], p.get("last_seen"))
        for key in ("model_version", "samples"):
            if p.get(key) is not None:
                row[key] = p[key]
    for pid, t in heard.items():
        if pid == self_id:
            continue
        row = rows.setdefault(pid, {"role": None, "online": None, "broker": broker or None, "mdns": False})
        row["last_seen"] = _latest(row.get("last_seen"), t)
    return dict(sorted(rows.items()))


def _latest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def online_count(table: Mapping[str, Mapping[str, Any]]) -> int:
    return sum(1 for row in table.values() if row.get("online"))
