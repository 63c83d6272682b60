"""A site aggregator's presence at the upstream broker follows its agents without
flooding the hub: the hub takes 2 presence frames a second from a member and drops the
rest unread, so a site whose agents connect by the hundred once lost its last one (the
site online) and the hub never started a round (seen with 50 agents per site)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fedagent.coordinator import upstream
from fedagent.coordinator.upstream import UpstreamLink


def _link(sent: list[tuple[int, int]]) -> UpstreamLink:
    # Only what announcing touches: the counts, the pacing, a connected transport.
    link = UpstreamLink.__new__(UpstreamLink)
    link.samples = link.agents = 0
    link._presence_due = asyncio.Event()
    link.transport = SimpleNamespace(connected=True)  # type: ignore[assignment]

    async def publish() -> None:
        sent.append((link.samples, link.agents))

    link._publish_presence = publish  # type: ignore[method-assign]
    return link


async def _settle(sent: list, count: int) -> None:
    for _ in range(1000):
        if len(sent) >= count:
            return
        await asyncio.sleep(0)


def test_presence_upstream_goes_once_per_burst_of_changes_with_the_newest_counts(monkeypatch):
    monkeypatch.setattr(upstream, "PRESENCE_INTERVAL", 0.0)

    async def scenario() -> list[tuple[int, int]]:
        sent: list[tuple[int, int]] = []
        link = _link(sent)
        pacer = asyncio.create_task(link._pace_presence())
        # Below the quorum the presence says offline whatever the count: nothing goes up.
        for k in range(1, 50):
            await link.announce(0, k)
        await _settle(sent, 1)
        assert sent == []
        # The quorum, then more agents, all before the pacer runs again: one presence,
        # the newest.
        for k in range(50, 100):
            await link.announce(10 * k, k)
        await _settle(sent, 1)
        # Below the quorum again: offline, once.
        await link.announce(0, 40)
        await link.announce(0, 39)
        await _settle(sent, 2)
        pacer.cancel()
        await asyncio.gather(pacer, return_exceptions=True)
        return sent

    assert asyncio.run(scenario()) == [(990, 99), (0, 39)]
