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
node a fresh timeout when it is back. A connection can also stall without going down (a
partition keeps TCP open until the keep-alive runs out): :class:`OwnLink` asks for a sign
of life from the broker before anyone's silence is taken for theirs.

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


#: Nothing from the broker for this long: before declaring anyone silent, ask it for a
#: sign of life (a PINGREQ). A federation with traffic never waits for it.
LINK_QUIET_S = 1.0
#: A probe unanswered for this long: the link itself is stalled.
PROBE_ANSWER_S = 2.0
#: How often a listener whose probe is outstanding looks again.
PROBE_POLL_S = 0.25


class OwnLink:
    """Whether this listener's own broker connection can vouch for others' silence.

    A stalled connection (its network cut, TCP still open) hears nobody, and a
    coordinator that took that for its agents' silence would take them all out of the
    round and drop the updates the broker delivers once the link heals. Before each
    check for silent nodes the caller asks :meth:`verdict` with how long the broker has
    sent nothing (``quiet_for``: None while there is no connection):

    - ``"check"``: the link carried something recently: look for silent nodes now;
    - ``"probe"``: quiet for LINK_QUIET_S: send the broker a PINGREQ and ask again at the
      time given (what it queued meanwhile arrives ahead of its answer);
    - ``"wait"``: a probe is outstanding: ask again at the time given;
    - ``"excuse"``: the link had stalled (a probe went unanswered for PROBE_ANSWER_S) and
      carries traffic again: nobody could be heard meanwhile, so excuse every node
      (:meth:`Liveness.excuse`), then look;
    - ``"down"``: no connection: ask again later (reconnecting excuses everyone anyway).
    """

    def __init__(
        self, *, quiet_after: float = LINK_QUIET_S, answer_within: float = PROBE_ANSWER_S, poll: float = PROBE_POLL_S
    ) -> None:
        self.quiet_after = quiet_after
        self.answer_within = answer_within
        self.poll = poll
        self._probed_at: float | None = None
        self.stalled = False

    def verdict(self, quiet_for: float | None, now: float) -> tuple[str, float]:
        """What to do now (see the class), and when to ask again if not ``"check"``."""
        if quiet_for is None:
            self._probed_at, self.stalled = None, False
            return "down", now + 1.0
        last_heard = now - quiet_for
        if quiet_for < self.quiet_after:
            self._probed_at = None
            if self.stalled:
                self.stalled = False
                return "excuse", now
            return "check", now
        if self._probed_at is None or last_heard >= self._probed_at:
            # No probe yet, or the last was answered and the link has been quiet since.
            self._probed_at = now
            return "probe", now + self.poll
        if now - self._probed_at >= self.answer_within:
            self.stalled = True
        return "wait", now + self.poll
