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
        host, port = await a.serve()
        await b.serve()
        samples = await asyncio.to_thread(scrape, f"http://{host}:{port}/metrics")
        assert value(samples, "fedagent_bytes_total", direction="in") == 100
        assert value(samples, "fedagent_rejected_messages_total", reason="codec") == 2
        assert value(samples, "fedagent_last_metric", name="loss") == 0.25
        assert value(samples, "fedagent_round_seconds_count") == 1
        assert value(samples, "fedagent_reconnects_total") == 3
        assert value(samples, "fedagent_federation", federation="fed") == 1
        assert all(dict(ls).get("node") != "agent-b" for _, ls in samples)
        with pytest.raises(urllib.error.HTTPError):
            await asyncio.to_thread(urllib.request.urlopen, f"http://{host}:{port}/other", None, 5)
        await a.close()
        await b.close()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(urllib.request.urlopen, f"http://{host}:{port}/metrics", None, 5)

    arun(main())


def test_non_loopback_bind_needs_consent(arun):
    with pytest.raises(ConfigError, match="reachable from the network"):
        arun(NodeMetrics("agent", "a", "f").serve("0.0.0.0", 0))
