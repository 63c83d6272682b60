"""Per-peer token buckets: how often a peer may ask this node for work it does on request.

A search query costs this site an embedding and a scan of its index; a public-vector
request can cost training its own model (the first time) and sends a matrix back. Any
member with a valid certificate may ask, so one misbehaving or compromised member could
keep a site busy. Each peer gets a bucket of ``burst`` tokens refilled at ``rate`` per
second; a request takes one token or is refused. Pure code: time is passed in.

The table is bounded: peers are certificate holders, but a federation of many members
must not grow it without limit, so past ``max_peers`` the bucket idle longest goes (a
peer whose bucket was dropped starts full again, which costs at most one burst).

:class:`SenderBudget` is the same per sender *and* per message kind, for every frame a
daemon receives: what one member may cost it before anything about the frame is
checked (a flood of valid messages is dropped for the price of reading its topic).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


class RateLimiter:
    def __init__(self, rate: float, burst: int, *, max_peers: int = 10_000) -> None:
        """``rate`` tokens per second (0: no limit), at most ``burst`` saved up."""
        if not (math.isfinite(rate) and rate >= 0) or burst < 1 or max_peers < 1:
            raise ValueError("rate must be >= 0, burst and max_peers >= 1")
        self.rate = float(rate)
        self.burst = int(burst)
        self.max_peers = max_peers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)
        self.refused = 0

    def allow(self, peer: str, now: float) -> bool:
        """Take a token of ``peer``'s bucket at time ``now`` (monotonic seconds)."""
        if self.rate == 0:
            return True
        tokens, at = self._buckets.pop(peer, (float(self.burst), now))
        # A clock that went back (it is monotonic: only a caller's mistake) refills nothing.
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        else:
            self.refused += 1
        self._buckets[peer] = (tokens, now)
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return ok

    def retry_after(self, peer: str, now: float) -> float:
        """Seconds until ``peer`` has a token again (0 if it has one)."""
        if self.rate == 0 or peer not in self._buckets:
            return 0.0
        tokens, at = self._buckets[peer]
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate


# ---- what each sender may cost a daemon before its frames are checked ------------------
@dataclass(frozen=True, slots=True)
class Rate:
    """``rate`` messages per second, ``burst`` saved up."""

    rate: float
    burst: int


#: A member's fair use of one daemon, by the kind its topic names (an agent's heartbeats
#: come every keep-alive / 4 ≥ 0.5 s, its presence on each connection, one evaluation
#: and one update per round, a model request per connection; an asynchronous
#: coordinator's task to an agent, one per update the agent sends, and a training takes
#: more than a tenth of a second). Kinds without a rate of their own share ``OTHER``; a
#: sender's kinds together share ``TOTAL``.
RATES: dict[str, Rate] = {
    "presence": Rate(2.0, 10),
    "heartbeat": Rate(5.0, 20),
    "model_request": Rate(2.0, 10),
    "evaluation": Rate(50.0, 100),
    "async_task": Rate(20.0, 100),
}
OTHER = Rate(500.0, 5000)
TOTAL = Rate(1000.0, 10_000)


class SenderBudget:
    """Per-sender, per-kind token buckets, consulted before a frame is decoded, verified
    or written anywhere (the sender is the topic's, which the broker's ACL ties to the
    publisher's certificate, so a member spends only its own budget). Drops are counted
    per sender and reason; the table of counts is bounded like the buckets."""

    def __init__(
        self,
        rates: dict[str, Rate] | None = None,
        *,
        other: Rate = OTHER,
        total: Rate = TOTAL,
        max_peers: int = 10_000,
    ) -> None:
        self.rates = dict(RATES if rates is None else rates)
        self.other = other
        self.total = total
        self.max_peers = max_peers
        self._kinds: dict[str, RateLimiter] = {}
        self._total = RateLimiter(total.rate, total.burst, max_peers=max_peers)
        self.dropped: OrderedDict[str, dict[str, int]] = OrderedDict()  # sender -> reason -> count
        self.dropped_total = 0

    def _limiter(self, kind: str) -> tuple[str, RateLimiter]:
        name = kind if kind in self.rates else "other"
        lim = self._kinds.get(name)
        if lim is None:
            r = self.rates.get(name, self.other)
            lim = self._kinds[name] = RateLimiter(r.rate, r.burst, max_peers=self.max_peers)
        return name, lim

    def allow(self, sender: str, kind: str, now: float) -> str:
        """'' if ``sender`` may send one more ``kind`` message at ``now``, else why not
        (counted as a drop)."""
        name, lim = self._limiter(kind)
        why = ""
        if not lim.allow(sender, now):
            why = f"rate:{name}"
        elif not self._total.allow(sender, now):
            why = "rate:total"
        if why:
            self.count(sender, why)
        return why

    def count(self, sender: str, reason: str) -> None:
        """A drop of ``sender``'s frame for ``reason`` (also for drops decided elsewhere)."""
        per = self.dropped.pop(sender, None) or {}
        per[reason] = per.get(reason, 0) + 1
        self.dropped[sender] = per
        if len(self.dropped) > self.max_peers:
            self.dropped.popitem(last=False)
        self.dropped_total += 1
