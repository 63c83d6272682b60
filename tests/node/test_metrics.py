"""Prometheus endpoints: a unit scrape, and scrapes of a real federation's daemons."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from netfed import scrape, value

from fedagent.errors import ConfigError
from fedagent.node.metrics import NodeMetrics


def test_node_metrics_endpoint_serves_its_own_registry(arun):
    async def main():
        a = NodeMetrics("agent", "agent-a", "fed")
        b = NodeMetrics("agent", "agent-b", "fed")  # same process, no collision
        a.add_bytes(in_=100, out=40)
        a.rejected("codec")
        a.rejected("codec")
        a.round_completed(1.5, {"loss": 0.25})
        a.set_reconnects(3)
        a.set_reconnects(3)
        # one member's frames dropped unread, its update bounded, a late update discarded
        a.dropped("rate:heartbeat")
        a.bounded("mallory", "weight")
        a.bounded("mallory", "norm")
        a.bounded("mallory", "norm")
        a.discarded()
        host, port = await a.serve()
        await b.serve()
        samples = await asyncio.to_thread(scrape, f"http://{host}:{port}/metrics")
        assert value(samples, "fedagent_bytes_total", direction="in") == 100
        assert value(samples, "fedagent_rejected_messages_total", reason="codec") == 2
        assert value(samples, "fedagent_last_metric", name="loss") == 0.25
        assert value(samples, "fedagent_round_seconds_count") == 1
        assert value(samples, "fedagent_reconnects_total") == 3
        assert value(samples, "fedagent_federation", federation="fed") == 1
        assert value(samples, "fedagent_dropped_messages_total", reason="rate:heartbeat") == 1
        assert value(samples, "fedagent_bounded_updates_total", agent="mallory", bound="weight") == 1
        assert value(samples, "fedagent_bounded_updates_total", agent="mallory", bound="norm") == 2
        assert value(samples, "fedagent_discarded_updates_total") == 1
        assert all(dict(ls).get("node") != "agent-b" for _, ls in samples)
        with pytest.raises(urllib.error.HTTPError):
            await asyncio.to_thread(urllib.request.urlopen, f"http://{host}:{port}/other", None, 5)
        await a.close()
        await b.close()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(urllib.request.urlopen, f"http://{host}:{port}/metrics", None, 5)

    arun(main())


def test_what_the_alerting_rules_read(arun, tmp_path):
    # (the rules in prometheus/ are built on these; their unit tests feed them as series)
    async def main():
        m = NodeMetrics("coordinator", "coord", "fed")
        host, port = await m.serve()
        url = f"http://{host}:{port}/metrics"
        m.set_phase("waiting")
        m.set_phase("training")  # one phase at a time
        m.set_round_limits(3, 120.0)
        m.set_agents({"agent-1": False, "agent-2": True, "agent-3": False})
        m.set_state_filesystem(tmp_path)
        m.set_privacy(
            {"epsilon": 1.5, "delta": 1e-5, "clip_norm": 0.8, "epsilon_budget": 2.0, "unclipped_fraction": 0.4}
        )
        m.round_abandoned()
        m.dp_update_clipped()
        before = value(await asyncio.to_thread(scrape, url), "fedagent_progress_timestamp_seconds")
        m.round_completed(0.5, {})
        samples = await asyncio.to_thread(scrape, url)
        await m.close()
        return before, samples

    before, samples = arun(main())
    assert value(samples, "fedagent_phase", phase="training") == 1
    assert not [k for k in samples if k[0] == "fedagent_phase" and ("phase", "waiting") in k[1]]
    assert value(samples, "fedagent_min_agents") == 3 and value(samples, "fedagent_round_timeout_seconds") == 120
    assert value(samples, "fedagent_agent_silent", agent="agent-2") == 1
    assert value(samples, "fedagent_agent_silent", agent="agent-1") == 0
    assert value(samples, "fedagent_agents_live") == 2
    avail = value(samples, "fedagent_state_filesystem_avail_bytes")
    assert 0 < avail <= value(samples, "fedagent_state_filesystem_size_bytes")
    assert value(samples, "fedagent_dp_epsilon") / value(samples, "fedagent_dp_epsilon_budget") == 0.75
    assert value(samples, "fedagent_dp_unclipped_fraction") == 0.4
    assert value(samples, "fedagent_rounds_abandoned_total") == 1
    assert value(samples, "fedagent_dp_clipped_updates_total") == 1
    assert value(samples, "fedagent_progress_timestamp_seconds") >= before > 0


def test_non_loopback_bind_needs_consent(arun):
    with pytest.raises(ConfigError, match="reachable from the network"):
        arun(NodeMetrics("agent", "a", "f").serve("0.0.0.0", 0))
