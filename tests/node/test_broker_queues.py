"""What the broker keeps for a client that is away: byte and message
limits on its queue, nothing of a QoS 0 subscription, and no subscription an earlier
version left in its persistent session. Real Mosquitto, mutual TLS."""

from __future__ import annotations

import asyncio

import pytest
from fedfixtures import unique_id

from fedagent.errors import ConfigError
from fedagent.mosquitto import DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_MESSAGES, render_config
from fedagent.protocols import topics

FED = "testfed"


def _conf(tmp_path, **kw) -> list[str]:
    return render_config(
        port=18883,
        bind="127.0.0.1",
        ca=tmp_path / "ca.crt",
        cert=tmp_path / "b.crt",
        key=tmp_path / "b.key",
        acl=tmp_path / "acl",
        persistence_dir=tmp_path / "data",
        **kw,
    ).splitlines()


def test_every_config_bounds_queues_in_bytes_and_messages(tmp_path):
    lines = _conf(tmp_path)
    assert f"max_queued_bytes {DEFAULT_MAX_QUEUED_BYTES}" in lines
    assert f"max_queued_messages {DEFAULT_MAX_QUEUED_MESSAGES}" in lines
    lines = _conf(tmp_path, max_queued_bytes=64 * 2**20, max_queued_messages=500)
    assert "max_queued_bytes 67108864" in lines and "max_queued_messages 500" in lines
    # 0 is Mosquitto's "no limit"; a limit below one packet could not hold one chunk.
    with pytest.raises(ConfigError, match="max_queued_messages"):
        _conf(tmp_path, max_queued_messages=0)
    with pytest.raises(ConfigError, match="max_queued_bytes"):
        _conf(tmp_path, max_queued_bytes=0)
    with pytest.raises(ConfigError, match="max_queued_bytes"):
        _conf(tmp_path, max_queued_bytes=2**20, max_packet_size=4 * 2**20)


def test_site_config_and_cli_carry_the_queue_limits(pki, tmp_path):
    from click.testing import CliRunner

    from fedagent.cli import main
    from fedagent.security import pki as pki_mod

    pki_mod.issue(pki.ca_dir, pki.ca_dir, "broker", "broker")
    out = tmp_path / "mosq"
    result = CliRunner().invoke(
        main,
        [
            "ca",
            "broker-config",
            "--dir",
            str(pki.ca_dir),
            "--federation",
            FED,
            "--coordinator",
            "coord",
            "--max-queued-bytes",
            str(256 * 2**20),
            "--max-queued-messages",
            "2000",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = (out / "mosquitto.conf").read_text().splitlines()
    assert "max_queued_bytes 268435456" in lines and "max_queued_messages 2000" in lines


def test_an_absent_clients_queue_stops_at_max_queued_bytes(broker_factory, arun, peer):
    """Eight 256 KiB messages for a client that is away, with a 1 MiB limit: the broker
    keeps what fits and drops the rest; what is sent after it is back arrives."""
    b = broker_factory(max_packet_size=2**20, max_queued_bytes=2**20)
    cid = unique_id("agent-b")  # an identity of its own: a fresh persistent session
    inbox, to_b = topics.inbox(FED, cid), topics.direct(FED, "agent-a", cid, "x")
    size = 256 * 1024

    async def main():
        async with peer(b, "agent-b", client_id=cid, subscriptions=[inbox]):
            pass  # a persistent session, now without a connection
        async with peer(b, "agent-a") as a:
            for i in range(8):
                await a.transport.publish(to_b, bytes([i]) * size)
        async with peer(b, "agent-b", client_id=cid, subscriptions=[inbox]) as rb, peer(b, "agent-a") as a:
            assert rb.transport.session_present
            await a.transport.publish(to_b, b"after")
            got = [p for _, p in await rb.until(lambda t, p: p == b"after", timeout=15)]
        queued = [p[0] for p in got[:-1]]
        assert all(len(p) == size for p in got[:-1])
        # The oldest messages were kept in order, up to the limit (4 × 256 KiB = 1 MiB).
        assert queued == list(range(len(queued))) and 1 <= len(queued) <= 4

    arun(main(), timeout=60)


def test_a_qos0_subscription_is_not_queued_and_retired_filters_are_removed(broker_factory, arun, peer):
    """The agent's round starts (QoS 0) are delivered while it is connected and never
    queued while it is away; its inbox (QoS 1) is. A session left by an earlier version
    that subscribed to all of global/ with QoS 1 loses that subscription."""
    broker = broker_factory()  # its own: no other test's session or queue for agent-b
    cid = unique_id("agent-b")
    old = [topics.all_broadcasts(FED), topics.inbox(FED, cid)]
    new = [(topics.broadcast(FED, "round_start"), 0), topics.inbox(FED, cid)]
    retired = [topics.all_broadcasts(FED)]
    start, to_b = topics.broadcast(FED, "round_start"), topics.direct(FED, "coord", cid, "x")

    async def away_then_back(coord, subscriptions, **kw) -> list[bytes]:
        await coord.transport.publish(start, b"missed")
        await coord.transport.publish(to_b, b"queued")
        async with peer(broker, "agent-b", client_id=cid, subscriptions=subscriptions, **kw) as rb:
            assert rb.transport.session_present
            await coord.transport.publish(start, b"live")
            got = await rb.until(lambda t, p: p == b"live", timeout=10)
            return [p for _, p in got]

    async def main():
        async with peer(broker, "agent-b", client_id=cid, subscriptions=old):
            pass
        async with peer(broker, "coord") as coord:
            # An earlier version's session: everything on global/ was queued.
            assert await away_then_back(coord, new, retired_subscriptions=retired) == [b"missed", b"queued", b"live"]
            # Its global/# subscription is gone now: a round start sent while the agent
            # is away is not kept; the message addressed to it is.
            assert await away_then_back(coord, new, retired_subscriptions=retired) == [b"queued", b"live"]
            assert await away_then_back(coord, new) == [b"queued", b"live"]

    arun(main(), timeout=60)


def test_queue_limits_are_checked_before_the_broker_starts(tmp_path, pki):
    from fedagent.mosquitto import EmbeddedBroker

    with pytest.raises(ConfigError, match="max_queued_bytes"):
        EmbeddedBroker(tmp_path, federations=[FED], coordinators=["coord"], ca_dir=pki.ca_dir, max_queued_bytes=1024)
    assert not (tmp_path / "mosquitto.conf").exists()


def test_the_limit_also_applies_to_a_connected_client_behind_on_its_acks(broker_factory, arun, peer):
    """Why the limit must fit the coordinator's backlog of a round (docs/operators.md): a
    connected client that acknowledges slowly (Receive Maximum 1, a stalled handler)
    has the rest queued, and what exceeds the limit is dropped, logged by Mosquitto."""
    b = broker_factory(max_packet_size=2**20, max_queued_bytes=2**20)
    inbox, to_b = topics.inbox(FED, "agent-b"), topics.direct(FED, "agent-a", "agent-b", "x")
    size = 256 * 1024
    release = asyncio.Event()
    got: list[bytes] = []

    async def slow(_topic: str, payload: bytes) -> None:
        got.append(payload)
        await release.wait()

    async def main():
        async with (
            peer(b, "agent-b", subscriptions=[inbox], receive_maximum=1, handler=slow),
            peer(b, "agent-a") as a,
        ):
            for i in range(10):
                await a.transport.publish(to_b, bytes([i]) * size)
            await a.transport.publish(to_b, b"last")
            deadline = asyncio.get_running_loop().time() + 10
            while "dropped" not in b.log_path.read_text(errors="replace"):
                assert asyncio.get_running_loop().time() < deadline, b.log_tail()
                await asyncio.sleep(0.05)
            release.set()
            # Once the backlog has drained a new message gets through again.
            while not got or got[-1] != b"after":
                assert asyncio.get_running_loop().time() < deadline + 10, [len(p) for p in got]
                await a.transport.publish(to_b, b"after")
                await asyncio.sleep(0.2)
        # In flight (1) + what fits in 1 MiB were delivered in order; the rest was dropped.
        firsts = [p[0] for p in got if len(p) == size]
        assert b"last" not in got
        assert firsts == list(range(len(firsts))) and 2 <= len(firsts) <= 6

    arun(main(), timeout=60)
