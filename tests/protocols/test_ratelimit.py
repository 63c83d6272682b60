"""Per-peer token buckets (protocols/ratelimit.py) and their [search] configuration."""

from __future__ import annotations

import pytest

from fedagent.config import SearchSettings
from fedagent.errors import ConfigError
from fedagent.protocols.ratelimit import RateLimiter


def test_a_burst_then_one_request_per_refill_interval():
    r = RateLimiter(rate=0.5, burst=3)  # 30 a minute
    assert [r.allow("a", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert r.refused == 2 and r.retry_after("a", 0.0) == pytest.approx(2.0)
    assert not r.allow("a", 1.9)
    assert r.allow("a", 2.1) and not r.allow("a", 2.2)
    # Saved-up tokens stop at the burst, however long the peer was quiet.
    assert [r.allow("a", 1000.0 + i * 1e-3) for i in range(4)] == [True, True, True, False]


def test_peers_have_their_own_buckets():
    r = RateLimiter(rate=1.0, burst=1)
    assert r.allow("a", 0.0) and not r.allow("a", 0.1)
    assert r.allow("b", 0.1)


def test_rate_zero_means_no_limit():
    r = RateLimiter(rate=0, burst=1)
    assert all(r.allow("a", 0.0) for _ in range(1000)) and r.refused == 0


def test_the_table_is_bounded_and_forgets_the_idlest_peer():
    r = RateLimiter(rate=1.0, burst=1, max_peers=3)
    for i, p in enumerate("abcd"):
        assert r.allow(p, float(i) * 1e-3)
    assert len(r._buckets) == 3 and "a" not in r._buckets
    assert not r.allow("d", 0.01)


def test_a_clock_going_back_refills_nothing():
    r = RateLimiter(rate=1.0, burst=1)
    assert r.allow("a", 10.0)
    assert not r.allow("a", 5.0)


@pytest.mark.parametrize("kw", [{"rate": -1, "burst": 1}, {"rate": float("nan"), "burst": 1}, {"rate": 1, "burst": 0}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        RateLimiter(**kw)


def test_search_settings_default_and_validation():
    s = SearchSettings()
    assert s.requests_per_minute == 30.0 and s.request_burst == 10
    assert SearchSettings(requests_per_minute=0).requests_per_minute == 0
    for bad in (
        {"requests_per_minute": -1},
        {"request_burst": 0},
        {"request_burst": 1.5},
        {"requests_per_minute": "fast"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SearchSettings(**bad)
