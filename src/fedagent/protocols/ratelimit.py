"""Per-peer token buckets: how often a peer may ask this node for work it does on request.

A search query costs this site an embedding and a scan of its index; a public-vector
request can cost training its own model (the first time) and sends a matrix back. Any
member with a valid certificate may ask, so one misbehaving or compromised member could
keep a site busy. Each peer gets a bucket of ``burst`` tokens refilled at ``rate`` per
second; a request takes one token or is refused. Pure code: time is passed in.

The table is bounded: peers are certificate holders, but a federation of many members
must not grow it without limit, so past ``max_peers`` the bucket idle longest goes (a
peer whose bucket was dropped starts full again, which costs at most one burst).
"""

from __future__ import annotations

import math
from collections import OrderedDict


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
