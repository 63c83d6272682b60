"""Liveness from application heartbeats, as pure code.

An MQTT broker notices a silent client only after 1.5 × its keep-alive, and Mosquitto
checks keep-alives on its own schedule: a paused (``SIGSTOP``) agent's Last Will came
4-5 s after it stopped with a 2 s keep-alive. A round waiting on that agent waits as
long. So agents also publish a small signed :class:`~fedagent.protocols.messages.Heartbeat`
every ``keep-alive / 4`` seconds, and the coordinator keeps a :class:`Liveness`: a node
heard from within ``timeout`` is live, one that has been silent for longer is *silent*
and taken out of the round as if it had gone offline, until it is heard again.

Only nodes that have sent a heartbeat are tracked (an older agent without heartbeats is
left to its Last Will); anything the node sends counts as hearing from it (a large
update in transit can hold its heartbeats back on the same connection).

A wake-up that comes late means this process was not reading its input either (a
stalled event loop, a paused coordinator); nodes are then given ``grace`` seconds to be
heard before any is declared silent, so a coordinator's own stall never evicts the
agents it failed to listen to. For the same reason the caller does not look for silent
nodes while its own broker connection is down, and :meth:`Liveness.excuse` gives every
node a fresh timeout when it is back.

No clock or I/O here: the caller passes the monotonic time and asks for a wake-up at
:meth:`Liveness.next_check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Heartbeats per timeout: an agent sends every timeout / BEATS seconds, so up to
# BEATS - 1 of them may be lost or late before it is declared silent.
BEATS = 4


# The longest heartbeat interval (a keep-alive of hours still beats every 15 minutes).
MAX_INTERVAL = 900.0


def heartbeat_interval(keepalive: float) -> float:
    """How often an agent with MQTT keep-alive ``keepalive`` sends a heartbeat."""
    return min(keepalive / BEATS, MAX_INTERVAL)


@dataclass(slots=True)
class _Node:
    heard: float  # monotonic time last heard
    timeout: float
    silent: bool = False


class Liveness:
    """Which heartbeating nodes have been heard from recently enough."""

    def __init__(self, *, min_timeout: float = 0.5, max_timeout: float = 3600.0) -> None:
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout
        self._nodes: dict[str, _Node] = {}
        self._not_before = -math.inf  # no eviction before this (after a late wake-up)

    def heartbeat(self, node: str, interval: float, now: float) -> bool:
        """A heartbeat announcing ``interval``: track ``node`` with timeout BEATS × interval
        (clamped). Returns True if the node was silent and is live again."""
        timeout = min(max(BEATS * interval, self.min_timeout), self.max_timeout)
        n = self._nodes.get(node)
        if n is None:
            self._nodes[node] = _Node(now, timeout)
            return False
        n.timeout = timeout
        return self._heard(n, now)

    def heard(self, node: str, now: float) -> bool:
        """Any other message from ``node``. Returns True if it was silent and is live again."""
        n = self._nodes.get(node)
        return False if n is None else self._heard(n, now)

    @staticmethod
    def _heard(n: _Node, now: float) -> bool:
        n.heard = max(n.heard, now)
        if n.silent:
            n.silent = False
            return True
        return False

    def excuse(self, now: float) -> None:
        """This listener could not hear anyone until ``now`` (its own connection was down):
        every live node gets a full timeout from now before it can be declared silent."""
        for n in self._nodes.values():
            if not n.silent:
                n.heard = max(n.heard, now)

    def forget(self, node: str) -> None:
        """The node went offline (its presence said so): stop tracking it until it beats again."""
        self._nodes.pop(node, None)

    def expire(self, now: float, *, late: float = 0.0) -> list[str]:
        """Nodes that have become silent at ``now``, each reported once. ``late``: how
        long after the requested time this check runs; a check later than the shortest
        heartbeat interval only postpones evictions (see the module docstring)."""
        if late > self.grace:
            self._not_before = now + self.grace
            return []
        if now < self._not_before:
            return []
        gone = []
        for node, n in self._nodes.items():
            if not n.silent and now - n.heard >= n.timeout:
                n.silent = True
                gone.append(node)
        return sorted(gone)

    @property
    def grace(self) -> float:
        """One heartbeat interval of the most frequent sender."""
        if not self._nodes:
            return math.inf
        return min(n.timeout for n in self._nodes.values()) / BEATS

    def next_check(self) -> float:
        """When the next node could become silent (``inf`` when none can)."""
        due = [n.heard + n.timeout for n in self._nodes.values() if not n.silent]
        return max(min(due), self._not_before) if due else math.inf

    def is_silent(self, node: str) -> bool:
        n = self._nodes.get(node)
        return n is not None and n.silent

    def tracked(self, node: str) -> bool:
        return node in self._nodes

    def status(self, now: float) -> dict[str, dict[str, float | bool]]:
        """Per tracked node: seconds since it was heard, its timeout, and whether it is silent."""
        return {
            node: {"age": round(now - n.heard, 3), "timeout": n.timeout, "silent": n.silent}
            for node, n in sorted(self._nodes.items())
        }
