"""Trust boundaries on a real Mosquitto with mutual TLS: a client id is its
certificate's identity (no takeover), federations on one broker are isolated."""

from __future__ import annotations

import asyncio
import time

from attacker import takeovers
from conftest import unique_id

from fedagent.node import transport as tr
from fedagent.protocols import topics

FED = "testfed"


def test_no_certificate_takes_over_another_nodes_client_id(broker, arun, peer, record_property):
    """agent-a's certificate logs in 50 times as `coord` and 50 times as a victim agent,
    with clean start: the broker makes every one of them `agent-a`; neither victim loses
    its connection, and a QoS 1 message queued for the victim while it is away survives
    50 more attempts on its (persistent) session."""
    victim = unique_id("agent-b")
    inbox = topics.inbox(FED, victim)
    ctx = tr.make_ssl_context(broker.tls("agent-a"))
    host, port = broker.host, broker.port
    times = 50

    def log() -> str:
        return broker.log_path.read_text(errors="replace")

    async def main() -> None:
        async with (
            peer(broker, "coord", subscriptions=[topics.inbox(FED, "coord")]) as coord,
            peer(broker, "agent-b", client_id=victim, subscriptions=[inbox]) as v,
        ):
            logins_before = log().count("as agent-a (p5, c1")
            started = time.monotonic()
            accepted = await asyncio.to_thread(takeovers, host, port, ctx, ["coord", victim], times, 120)
            record_property("takeover_logins_s", round(time.monotonic() - started, 2))
            # Every login was accepted, under agent-a's own identity.
            assert accepted == 2 * times
            assert log().count("as agent-a (p5, c1") - logins_before == 2 * times
            for name, p in (("coord", coord), (victim, v)):
                assert f"Client {name} already connected" not in log()
                assert p.transport.reconnects == 0 and p.transport.connected, name
            # Both still receive: one message each through the same connections.
            await coord.transport.publish(topics.direct(FED, "coord", victim, "ping"), b"to-victim")
            await v.transport.publish(topics.direct(FED, victim, "coord", "ping"), b"to-coord")
            await v.until(lambda t, p: p == b"to-victim")
            await coord.until(lambda t, p: p == b"to-coord")
        # The victim is away, its session kept; a message waits for it at the broker.
        async with peer(broker, "agent-a") as a:
            await a.transport.publish(topics.direct(FED, "agent-a", victim, "update"), b"queued")
        accepted = await asyncio.to_thread(takeovers, host, port, ctx, [victim], times, 120)
        assert accepted == times
        async with peer(broker, "agent-b", client_id=victim, subscriptions=[inbox]) as back:
            assert back.transport.session_present
            await back.until(lambda t, p: p == b"queued")
        assert f"Client {victim} already connected" not in log()

    arun(main(), timeout=300)
