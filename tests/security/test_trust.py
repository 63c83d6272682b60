"""Trust boundaries on a real Mosquitto with mutual TLS: a client id is its
certificate's identity (no takeover), federations on one broker are isolated."""

from __future__ import annotations

import asyncio
import contextlib
import time

from attacker import takeovers
from fedfixtures import unique_id

from fedagent.errors import NotAuthorized
from fedagent.mosquitto import EmbeddedBroker
from fedagent.node import transport as tr
from fedagent.protocols import topics
from fedagent.security import pki

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


def test_two_federations_on_one_broker_are_isolated(tmp_path, arun, peer, record_property):
    """One CA issues for fed-a and fed-b, one broker serves both: each federation's
    coordinator and agent try the other federation's topics, publishing (broadcast,
    presence, an update, a forged peer's presence and inbox) and subscribing: 0 accepted."""
    ca = tmp_path / "ca"
    pki.create_ca(ca, "fed-a")
    names = {"fed-a": ("coord-a", "agent-a1"), "fed-b": ("coord-b", "agent-b1")}
    tls = {}
    for fed, (coord, agent) in names.items():
        for name, role in ((coord, "coordinator"), (agent, "agent")):
            cert, key = pki.issue(ca, ca, name, role, federation=fed)
            tls[name] = tr.TlsFiles(ca / pki.CA_CERT, cert, key)
    other = {"fed-a": "fed-b", "fed-b": "fed-a"}
    fed_of = {name: fed for fed, pair in names.items() for name in pair}
    b = EmbeddedBroker(tmp_path / "broker", federations=list(names), coordinators=["coord-a", "coord-b"], ca_dir=ca)
    b.start()
    assert "\npattern " not in b.acl_path.read_text()  # rules per identity, from the register
    attempts = {"publish": 0, "subscribe": 0}
    accepted = {"publish": 0, "subscribe": 0}

    def filters(name: str) -> list[str]:
        g = other[fed_of[name]]
        gc, ga = names[g]
        return [
            "#",
            f"fedagent/v1/{g}/#",
            topics.all_broadcasts(g),
            topics.all_presence(g),
            topics.inbox(g, ga),
            topics.inbox(g, name),
        ]

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            peers = {n: await stack.enter_async_context(peer(b, n, tls=tls[n], subscriptions=filters(n))) for n in tls}
            for name, p in peers.items():
                g = other[fed_of[name]]
                gc, ga = names[g]
                for topic in (
                    topics.broadcast(g, "model"),
                    topics.presence(g, name),
                    topics.direct(g, name, gc, "update"),
                    topics.presence(g, ga),
                    topics.direct(g, gc, ga, "update"),
                    topics.direct(g, ga, gc, "update"),
                ):
                    attempts["publish"] += 1
                    try:
                        await p.transport.publish(topic, b"cross " + name.encode())
                        accepted["publish"] += 1
                    except NotAuthorized:
                        pass
            # Each federation's own traffic, which the other federation must not see.
            for fed, (coord, agent) in names.items():
                secret = f"secret of {fed}".encode()
                await peers[coord].transport.publish(topics.broadcast(fed, "model"), secret)
                await peers[agent].transport.publish(topics.presence(fed, agent), secret, retain=True)
                await peers[agent].transport.publish(topics.direct(fed, agent, coord, "update"), secret)
                await peers[coord].transport.publish(topics.direct(fed, coord, agent, "answer"), secret)
            for fed, (coord, _agent) in names.items():
                await peers[coord].transport.publish(topics.broadcast(fed, "marker"), b"marker")
            for name, p in peers.items():
                seen = await p.until(lambda t, pl: pl == b"marker")
                g = other[fed_of[name]]
                attempts["subscribe"] += len(filters(name))
                leaked = {t for t, pl in seen if t.startswith(f"fedagent/v1/{g}/") or pl.startswith(b"cross ")}
                accepted["subscribe"] += len(leaked)
                # ... while its own federation works.
                assert any(pl == f"secret of {fed_of[name]}".encode() for _, pl in seen), name

    try:
        arun(main(), timeout=60)
    finally:
        b.stop()
    print(f"cross-federation attempts {attempts}, accepted {accepted}")
    record_property("cross_federation", {"attempts": attempts, "accepted": accepted})
    assert attempts == {"publish": 24, "subscribe": 24}
    assert accepted == {"publish": 0, "subscribe": 0}


def test_a_certificate_issued_later_needs_the_acl_written_again(tmp_path, arun, peer):
    """On a broker of several federations the ACL lists every identity: one issued after
    it was written can do nothing until the ACL is written again and reloaded."""
    ca = tmp_path / "ca"
    pki.create_ca(ca, "fed-a")
    pki.issue(ca, ca, "coord-a", "coordinator")
    pki.issue(ca, ca, "coord-b", "coordinator", federation="fed-b")
    b = EmbeddedBroker(
        tmp_path / "broker", federations=["fed-a", "fed-b"], coordinators=["coord-a", "coord-b"], ca_dir=ca
    )
    b.start()
    cert, key = pki.issue(ca, ca, "late", "agent", federation="fed-b")
    tls = tr.TlsFiles(ca / pki.CA_CERT, cert, key)

    async def publish() -> bool:
        async with peer(b, "late", tls=tls) as p:
            try:
                await p.transport.publish(topics.presence("fed-b", "late"), b"here")
                return True
            except NotAuthorized:
                return False

    try:
        assert arun(publish()) is False
        b.reload_acl()
        assert "user late" in b.acl_path.read_text()
        assert arun(publish()) is True
    finally:
        b.stop()
