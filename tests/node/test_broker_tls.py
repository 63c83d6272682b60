"""Mosquitto with mutual TLS and the fedagent ACL, through the agent transport.

Bad certificates, the ACL, the packet size limit, a broker restart with persistent
sessions, the Last Will and a clean stop, and large messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

import aiomqtt
import paho.mqtt.client as paho
import pytest
from fedfixtures import unique_id

from fedagent.errors import CertificateRejected, ConfigError, NotAuthorized, TransportError
from fedagent.mosquitto import EmbeddedBroker, render_acl, render_config
from fedagent.node import transport as tr
from fedagent.node.transport import TlsFiles, Transport, parse_broker_uri, patches, preflight
from fedagent.protocols import topics
from fedagent.security import pki as pki_mod

FED = "testfed"
ROOT = f"fedagent/v1/{FED}"
CHILD = Path(__file__).resolve().parents[1] / "mqtt_child.py"


def payloads(messages):
    return [p for _, p in messages]


async def wait_for_log(broker, text: str, timeout: float = 5.0, *, after: int = 0) -> None:
    """Wait until the broker's log contains ``text`` (Mosquitto's own account) more than
    ``after`` times."""
    deadline = time.monotonic() + timeout
    while broker.log_path.read_text(errors="replace").count(text) <= after:
        if time.monotonic() > deadline:
            raise AssertionError(f"broker log never said {text!r}:\n{broker.log_tail()}")
        await asyncio.sleep(0.02)


async def noop(_topic: str, _payload: bytes) -> None:
    return None


# --- configuration -----------------------------------------------------------------


def test_acl_implements_the_topic_layout():
    acl = render_acl(["fed-1"], ["coord", "coord-2"], bridges=["bridge-s1"])
    rules = [line for line in acl.splitlines() if line and not line.startswith("#")]
    assert rules == [
        "pattern write fedagent/v1/fed-1/node/%u/#",
        "pattern read fedagent/v1/fed-1/node/+/presence",
        "pattern read fedagent/v1/fed-1/node/+/to/%u/#",
        "pattern read fedagent/v1/fed-1/global/#",
        "user coord",
        "topic readwrite fedagent/v1/fed-1/#",
        "user coord-2",
        "topic readwrite fedagent/v1/fed-1/#",
        # A bridge relays nodes' traffic up and the coordinators' messages down; it
        # cannot broadcast.
        "user bridge-s1",
        "topic write fedagent/v1/fed-1/node/#",
        "topic read fedagent/v1/fed-1/global/#",
        "topic read fedagent/v1/fed-1/node/coord/to/#",
        "topic read fedagent/v1/fed-1/node/coord-2/to/#",
    ]
    # A `topic` line before the first `user` line would apply to anonymous clients only.
    first_user = next(i for i, r in enumerate(rules) if r.startswith("user "))
    assert not any(r.startswith("topic ") for r in rules[:first_user])
    # The rules agree with the topic helpers.
    assert topics.all_presence("fed-1") in acl and topics.all_broadcasts("fed-1") in acl
    assert topics.inbox("fed-1", "x").replace("/x/", "/%u/") in acl


def test_acl_of_several_federations_gives_each_identity_its_own_federation():
    members = {"coord": ("coordinator", "fed-1"), "a1": ("agent", "fed-1"), "b1": ("agent", "fed-2")}
    with pytest.raises(ConfigError, match="several federations on one broker need per-identity rules"):
        render_acl(["fed-1", "fed-2"], ["coord"])
    acl = render_acl(["fed-1", "fed-2"], ["coord"], members={**members, "c1": ("agent", "fed-3")})
    rules = [line for line in acl.splitlines() if line and not line.startswith("#")]
    assert rules == [
        "user a1",
        "topic write fedagent/v1/fed-1/node/a1/#",
        "topic read fedagent/v1/fed-1/node/+/presence",
        "topic read fedagent/v1/fed-1/node/+/to/a1/#",
        "topic read fedagent/v1/fed-1/global/#",
        "user b1",
        "topic write fedagent/v1/fed-2/node/b1/#",
        "topic read fedagent/v1/fed-2/node/+/presence",
        "topic read fedagent/v1/fed-2/node/+/to/b1/#",
        "topic read fedagent/v1/fed-2/global/#",
        "user coord",
        "topic readwrite fedagent/v1/fed-1/#",
    ]
    assert not any(r.startswith("pattern") for r in rules)  # nothing for everyone
    with pytest.raises(ConfigError, match="not in the CA's register"):
        render_acl(["fed-1", "fed-2"], ["coord-9"], members=members)


@pytest.mark.parametrize(
    "feds,coords", [(["fed/#"], []), (["fed"], ["a+b"]), (["fed"], ["Coord"]), ([""], []), ("fed", [])]
)
def test_acl_refuses_names_that_would_escape_it(feds, coords):
    with pytest.raises((ConfigError, TypeError)):
        render_acl(feds, coords)


def test_config_requires_certificates_and_limits_packets(tmp_path):
    conf = render_config(
        port=18883,
        bind="127.0.0.1",
        ca=tmp_path / "ca.crt",
        cert=tmp_path / "b.crt",
        key=tmp_path / "b.key",
        acl=tmp_path / "acl",
        persistence_dir=tmp_path / "data",
        max_packet_size=2**20,
        log_path=tmp_path / "log",
    )
    lines = conf.splitlines()
    for expected in [
        "listener 18883 127.0.0.1",
        "require_certificate true",
        "use_identity_as_username true",
        "allow_anonymous false",
        "tls_version tlsv1.2",
        "max_packet_size 1048576",
        "persistence true",
        f"persistence_location {tmp_path / 'data'}/",
        f"acl_file {tmp_path / 'acl'}",
    ]:
        assert expected in lines
    assert any(line.startswith("persistent_client_expiration ") for line in lines)
    with pytest.raises(ConfigError, match="line break"):
        render_config(
            port=1,
            bind="127.0.0.1",
            ca=tmp_path / "x\nallow_anonymous true",
            cert=tmp_path,
            key=tmp_path,
            acl=tmp_path,
            persistence_dir=None,
        )


@pytest.mark.parametrize(
    "uri,expected",
    [
        ("mqtts://127.0.0.1:8884", ("127.0.0.1", 8884)),
        ("mqtts://broker.local", ("broker.local", 8883)),
        ("mqtts://[::1]:9000", ("::1", 9000)),
    ],
)
def test_parse_broker_uri(uri, expected):
    assert parse_broker_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "mqtt://127.0.0.1:1883",
        "tcp://h:1",
        "127.0.0.1:8883",
        "mqtts://",
        "mqtts://h:99999",
        "mqtts://h:1/path",
        "",
        "mqtts://user:pw@h:1",
    ],
)
def test_parse_broker_uri_refuses_anything_else(uri):
    with pytest.raises(ConfigError):
        parse_broker_uri(uri)


def test_broker_runs_as_the_invoking_user_and_owns_its_port(broker):
    assert broker.running and broker.pid
    assert broker.uri == f"mqtts://127.0.0.1:{broker.port}"
    status = Path(f"/proc/{broker.pid}/status").read_text()
    uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
    assert int(uid) == os.getuid()


def test_broker_start_failure_reports_mosquittos_log(pki, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        b = EmbeddedBroker(tmp_path, federations=[FED], coordinators=[], ca_dir=pki.ca_dir, port=taken.getsockname()[1])
        with pytest.raises(TransportError, match="(?s)mosquitto exited with code .*Address already in use"):
            b.start()
        assert not b.running and b.pid is None


# --- certificates ------------------------------------------------------------------


def test_t1_client_without_certificate_is_refused(broker, arun):
    no_cert = ssl.create_default_context(cafile=str(broker.pki.ca))
    with pytest.raises(CertificateRejected) as err:
        arun(preflight(broker.uri, broker.tls("agent-a"), ssl_context=no_cert))
    msg = str(err.value)
    assert "requires a client certificate and we sent none" in msg
    assert "CERTIFICATE_REQUIRED" in msg and "fedagent ca issue" in msg


def test_t1_certificate_from_another_ca_is_refused(broker, arun):
    foreign = broker.tls("agent-a", foreign=True)
    # What the broker says (local checks off):
    with pytest.raises(CertificateRejected) as err:
        arun(preflight(broker.uri, foreign, check_local=False))
    msg = str(err.value)
    assert "rejected our client certificate (UNKNOWN_CA)" in msg
    assert "agent-a.crt was not issued by this federation's CA" in msg
    # What an agent sees (local check first), and run() gives up instead of retrying.
    t = Transport(uri=broker.uri, tls=foreign)
    started = time.monotonic()
    with pytest.raises(CertificateRejected, match="not issued by this federation's CA"):
        arun(t.run(noop), timeout=10)
    assert time.monotonic() - started < 5
    assert t.state == "failed"


def test_t1_expired_certificate_is_refused(broker, arun):
    old = broker.tls("agent-old")
    with pytest.raises(CertificateRejected) as err:
        arun(preflight(broker.uri, old, check_local=False))
    msg = str(err.value)
    assert "rejected our client certificate (CERTIFICATE_EXPIRED)" in msg
    assert "agent-old.crt for agent-old expired on" in msg
    assert "`fedagent ca issue agent-old --role agent`" in msg
    with pytest.raises(CertificateRejected, match="certificate for agent-old expired on"):
        arun(Transport(uri=broker.uri, tls=old).run(noop), timeout=10)


def test_t1_a_clock_behind_the_certificate_is_waited_for_not_fatal(broker, arun, tmp_path):
    """A device that boots before NTP has set its clock sees its own certificate as not
    valid yet: the transport keeps retrying (with the reason) instead of failing the
    daemon with a configuration error, which systemd would never restart."""
    now = dt.datetime.now(dt.UTC)
    cert, key = pki_mod.issue(broker.pki.ca_dir, tmp_path, "agent-a", "agent", not_before=now + dt.timedelta(days=1))
    t = Transport(uri=broker.uri, tls=TlsFiles(broker.pki.ca, cert, key))

    async def watch() -> None:
        task = asyncio.create_task(t.run(noop))
        while not (t.last_error and "is the clock set" in t.last_error):
            assert not task.done(), task
            await asyncio.sleep(0.05)
        assert t.state in ("connecting", "backoff")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    arun(watch(), timeout=20)
    assert "not valid before" in (t.last_error or "")


def test_t1_broker_itself_refuses_bad_certificates(broker, arun):
    """Without preflight or local checks, the broker must still refuse (0 accepted),
    and the MQTT client fails at once instead of waiting out its connect timeout."""

    async def attempt(tls: TlsFiles) -> None:
        client = patches.MqttClient(
            broker.host,
            broker.port,
            identifier=unique_id("raw"),
            protocol=aiomqtt.ProtocolVersion.V5,
            timeout=8,
            tls_context=tr.make_ssl_context(tls),
        )
        async with client:
            pass

    for tls in (broker.tls("agent-a", foreign=True), broker.tls("agent-old")):
        started = time.monotonic()
        with pytest.raises(aiomqtt.MqttError):
            arun(attempt(tls), timeout=10)
        assert time.monotonic() - started < 2
    assert "u'agent-old'" not in broker.log_path.read_text()
    arun(attempt(broker.tls("agent-a")), timeout=10)


def test_t1_broker_with_a_certificate_from_another_ca_is_refused(broker, arun):
    ours = broker.tls("agent-a", foreign=True)
    # Trusting the foreign CA, our broker's certificate is the stranger.
    tls = TlsFiles(ca=broker.pki.foreign_ca, cert=ours.cert, key=ours.key)
    with pytest.raises(CertificateRejected, match="broker's certificate .* is not signed by our CA"):
        arun(preflight(broker.uri, tls))


def test_t1_broker_certificate_must_name_the_host(broker_factory, arun):
    b = broker_factory(sans=["broker.example"])
    with pytest.raises(
        CertificateRejected, match="broker's certificate .* is not valid for '127.0.0.1'.*--san 127.0.0.1"
    ):
        arun(preflight(b.uri, b.tls("agent-a")))


def test_t1_nothing_listening_is_a_transport_error(broker, arun):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(TransportError, match=f"cannot reach broker at 127.0.0.1:{free}: connection refused") as err:
        arun(preflight(f"mqtts://127.0.0.1:{free}", broker.tls("agent-a")))
    assert not isinstance(err.value, CertificateRejected)


def test_t1_valid_certificate_connects_as_its_common_name(broker, arun, peer):
    async def main():
        async with peer(broker, "agent-a") as a:
            assert a.transport.client_id == "agent-a"
            assert a.transport.state == "connected"
            await a.transport.publish(topics.presence(FED, "agent-a"), b"", retain=True)
            await a.transport.publish(topics.direct(FED, "agent-a", "coord", "hello"), b"hi")
            # %u is "agent-a": the neighbouring subtree is someone else's.
            with pytest.raises(NotAuthorized):
                await a.transport.publish(topics.direct(FED, "agent-b", "coord", "hello"), b"hi")
        await wait_for_log(broker, "as agent-a (p5, c0, k10, u'agent-a')")

    arun(main())


# --- the ACL -------------------------------------------------------------------------


def test_t2_agent_cannot_publish_as_another_node_or_as_coordinator(broker, arun, peer):
    async def main():
        async with (
            peer(broker, "coord", subscriptions=[f"{ROOT}/#", "fedagent/#"]) as coord,
            peer(broker, "agent-a") as a,
        ):
            forged = [
                topics.presence(FED, "agent-b"),
                topics.broadcast(FED, "x"),
                topics.direct(FED, "agent-b", "coord", "update"),
                topics.presence("otherfed", "agent-a"),
                "fedagent/v1/testfed/evil",
            ]
            for topic in forged:
                with pytest.raises(NotAuthorized) as err:
                    await a.transport.publish(topic, b"forged", retain=True)
                assert f"refused our publish to {topic}: reason code 135" in str(err.value)
                assert "not authorized by the broker ACL" in str(err.value)
            # Same connection, an allowed publish afterwards: everything before it has
            # been through the broker, so the coordinator must have nothing forged.
            marker = topics.direct(FED, "agent-a", "coord", "marker")
            await a.transport.publish(marker, b"marker")
            seen = await coord.until(lambda t, p: t == marker)
            assert b"forged" not in payloads(seen)
            assert a.transport.state == "connected"  # a refusal is not a disconnect

    arun(main())


def test_t2_agent_cannot_read_another_agents_inbox(broker, arun, peer):
    async def main():
        async with (
            peer(broker, "coord") as coord,
            peer(broker, "agent-a", subscriptions=["#", topics.inbox(FED, "agent-b"), "fedagent/v1/otherfed/#"]) as a,
            peer(broker, "agent-b", subscriptions=[topics.inbox(FED, "agent-b")]) as b,
        ):
            c = coord.transport
            await c.publish(topics.direct(FED, "coord", "agent-b", "secret"), b"for-b")
            await c.publish(topics.broadcast(FED, "round"), b"for-all")
            await c.publish(topics.direct(FED, "coord", "agent-a", "marker"), b"for-a")
            seen = await a.until(lambda t, p: p == b"for-a")
            assert b"for-b" not in payloads(seen)
            assert b"for-all" in payloads(seen)  # coordinators may write global/
            assert all(not t.startswith("fedagent/v1/otherfed/") for t, _ in seen)
            assert (await b.until(lambda t, p: p == b"for-b"))[-1][0].endswith("/to/agent-b/secret")

    arun(main())


def test_t2_acl_reload_takes_effect_on_live_connections(broker_factory, arun, peer):
    b = broker_factory(coordinators=())
    topic = topics.broadcast(FED, "round")

    async def main():
        async with peer(b, "coord") as c:
            with pytest.raises(NotAuthorized):
                await c.transport.publish(topic, b"1")
            await asyncio.to_thread(b.reload_acl, coordinators=["coord"])
            await c.transport.publish(topic, b"2")
            await asyncio.to_thread(b.reload_acl, coordinators=[])
            with pytest.raises(NotAuthorized):
                await c.transport.publish(topic, b"3")
            assert c.transport.reconnects == 0

    arun(main())


def test_subscriptions_added_at_runtime_deliver_and_survive_reconnects(broker_factory, arun, peer):
    b = broker_factory()
    other = FED  # a filter the peer did not start with

    async def main():
        # Persistent sessions (a private broker): the subscription must outlive the restart.
        async with peer(b, "coord", session_expiry=3600) as c, peer(b, "agent-a", session_expiry=3600) as a:
            assert a.transport.update_subscriptions([]) is None
            task = a.transport.update_subscriptions([topics.all_broadcasts(other)])
            await asyncio.wait_for(task, 5)
            assert topics.all_broadcasts(other) in a.transport.subscriptions
            await c.transport.publish(topics.broadcast(other, "round"), b"joined")
            await a.until(lambda t, p: p == b"joined")
            await asyncio.to_thread(b.restart)
            await c.transport.publish(topics.broadcast(other, "round"), b"again", timeout=15)
            await a.until(lambda t, p: p == b"again", timeout=15)

    arun(main(), timeout=40)


# --- Last Will and clean stop -------------------------------------------------------------


def child_config(broker, name: str, token: str, keepalive: int) -> dict:
    tls = broker.tls(name)
    return {
        "uri": broker.uri,
        "ca": str(tls.ca),
        "cert": str(tls.cert),
        "key": str(tls.key),
        "presence": topics.presence(FED, name),
        "online": f"online {token}",
        "will": f"offline-will {token}",
        "final": f"offline-clean {token}",
        "keepalive": keepalive,
    }


async def start_child(cfg: dict) -> asyncio.subprocess.Process:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHILD),
        json.dumps(cfg),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    if line.strip() != b"READY":
        proc.kill()
        await proc.wait()
        raise AssertionError(f"child did not start: {line!r}")
    return proc


async def stop_child(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.wait()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_t6_last_will_marks_a_dead_agent_offline(broker, arun, peer, how, record_property):
    keepalive = 2
    token = unique_id("t6")

    async def main():
        cfg = child_config(broker, "agent-a", token, keepalive)
        async with peer(broker, "coord", subscriptions=[topics.all_presence(FED)]) as coord:
            proc = await start_child(cfg)
            try:
                await coord.until(lambda t, p: p == f"online {token}".encode())
                started = time.monotonic()
                # SIGKILL: the kernel closes the socket; SIGSTOP: silence, so only the
                # broker's keep-alive timeout (1.5 x keep-alive) can notice.
                proc.send_signal(getattr(signal, how))
                seen = await coord.until(
                    lambda t, p: token.encode() in p and b"offline" in p, timeout=1.5 * keepalive + 8
                )
                took = time.monotonic() - started
            finally:
                await stop_child(proc)
        assert seen[-1] == (cfg["presence"], f"offline-will {token}".encode())
        record_property("will_delay_s", round(took, 3))
        if how == "SIGKILL":
            assert took < 1.5 * keepalive  # measured: 4-10 ms
        else:
            # Mosquitto 2.0.x runs its keep-alive check only when more than 5 s have
            # passed since the last one (keepalive.c: `last_keepalive_check + 5 <
            # now`), so a silent client is dropped 1.5 x keep-alive to ~1.5 x
            # keep-alive + 6 s after its last packet (measured: 4.2-5.4 s here).
            assert took < 1.5 * keepalive + 7

    arun(main())


def test_t6_clean_close_publishes_offline_itself_and_no_will(broker, arun, peer):
    token = unique_id("t6c")

    async def main():
        cfg = child_config(broker, "agent-b", token, 10)
        async with peer(broker, "coord", subscriptions=[f"{ROOT}/#"]) as coord:
            proc = await start_child(cfg)
            try:
                await coord.until(lambda t, p: p == f"online {token}".encode())
                before = broker.log_path.read_text(errors="replace").count("Client agent-b disconnected.")
                proc.stdin.write(b"close\n")
                await proc.stdin.drain()
                assert await asyncio.wait_for(proc.wait(), 10) == 0
            finally:
                await stop_child(proc)
            await wait_for_log(broker, "Client agent-b disconnected.", after=before)
            # Anything the broker did about that disconnect is done: a Will would be
            # delivered before this marker.
            marker = topics.direct(FED, "coord", "coord", "marker")
            await coord.transport.publish(marker, token.encode())
            seen = [
                p
                for t, p in await coord.until(lambda t, p: t == marker)
                if token.encode() in p and t == cfg["presence"]
            ]
        assert seen == [f"offline-clean {token}".encode()]

    arun(main())


def test_t6_cancelling_run_without_close_leaves_the_will(broker, arun, peer):
    token = unique_id("t6x")

    async def main():
        presence = topics.presence(FED, "agent-a")
        async with peer(broker, "coord", subscriptions=[topics.all_presence(FED)]) as coord:
            t = Transport(
                uri=broker.uri,
                tls=broker.tls("agent-a"),
                will=(presence, f"will {token}".encode()),
            )
            ready = asyncio.Event()
            task = asyncio.create_task(t.run(noop, ready))
            await asyncio.wait_for(ready.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await coord.until(lambda t_, p: p == f"will {token}".encode())

    arun(main())


# --- broker restart, persistent sessions ------------------------------------------------


def test_t5_reconnect_after_broker_restart_and_queued_qos1_delivery(broker_factory, arun, peer):
    b = broker_factory()
    b_id = unique_id("agent-b")
    inbox = topics.inbox(FED, b_id)

    async def main():
        connects: asyncio.Queue[str] = asyncio.Queue()

        def counting(name):
            async def on_connect():
                connects.put_nowait(name)

            return on_connect

        async def next_connects(n):
            return sorted([await asyncio.wait_for(connects.get(), 15) for _ in range(n)])

        async with (
            peer(b, "agent-b", client_id=b_id, subscriptions=[inbox], on_connect=counting("b")) as rb,
            peer(b, "agent-a", on_connect=counting("a")) as sa,
        ):
            assert await next_connects(2) == ["a", "b"]
            await asyncio.to_thread(b.restart)
            assert await next_connects(2) == ["a", "b"]
            assert rb.transport.reconnects == 1 and sa.transport.reconnects == 1
            assert rb.transport.session_present
            await sa.transport.publish(topics.direct(FED, "agent-a", b_id, "x"), b"after")
            await rb.until(lambda t, p: p == b"after")
        # agent-b is gone (cleanly) but its session stays; a QoS1 message to it is
        # queued, survives a broker restart, and is delivered when it comes back.
        async with peer(b, "agent-a") as sa:
            await sa.transport.publish(topics.direct(FED, "agent-a", b_id, "x"), b"queued")
        await asyncio.to_thread(b.restart)
        async with peer(b, "agent-b", client_id=b_id, subscriptions=[inbox]) as rb:
            assert rb.transport.session_present
            await rb.until(lambda t, p: p == b"queued")

    arun(main(), timeout=60)


def test_qos1_message_is_redelivered_if_the_handler_never_finished(broker, arun, peer):
    """Acks go out after the handler returns: a crash in between loses nothing."""
    cid = unique_id("agent-b")
    inbox = topics.inbox(FED, cid)

    async def main():
        got = asyncio.Event()

        async def stuck(_topic, _payload):
            got.set()
            await asyncio.Event().wait()

        async with (
            peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=stuck) as first,
            peer(broker, "agent-a") as a,
        ):
            await a.transport.publish(topics.direct(FED, "agent-a", cid, "update"), b"u1")
            await asyncio.wait_for(got.wait(), 5)
            first.task.cancel()  # "crash" while handling
            with pytest.raises(asyncio.CancelledError):
                await first.task
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox]) as again:
                assert again.transport.session_present
                assert (await again.get())[1] == b"u1"

    arun(main())


def test_an_acknowledgement_waits_for_what_the_handler_returned_and_keeps_the_order(broker, arun, peer):
    """A handler may return an awaitable (the coordinator: a frame written to its round
    journal, its sync still to come): the next messages are handled meanwhile, but none
    is acknowledged before it is done, and the ones after it wait too (acknowledgements
    in order). A crash before then: the broker delivers them all again; after it, none."""
    cid = unique_id("agent-b")
    inbox = topics.inbox(FED, cid)
    to_b = topics.direct(FED, "agent-a", cid, "update")

    async def main():
        handled: asyncio.Queue[bytes] = asyncio.Queue()
        gates: dict[bytes, asyncio.Future[None]] = {}

        async def gated(_topic, payload):
            handled.put_nowait(bytes(payload))
            if bytes(payload).startswith(b"gated"):
                gates[bytes(payload)] = asyncio.get_running_loop().create_future()
                return gates[bytes(payload)]
            return None

        async def next_handled() -> bytes:
            return await asyncio.wait_for(handled.get(), 10)

        async with peer(broker, "agent-a") as a:
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=gated) as first:
                await a.transport.publish(to_b, b"gated-1")
                await a.transport.publish(to_b, b"plain-2")
                # the second was handled while the first one's gate was open
                assert [await next_handled(), await next_handled()] == [b"gated-1", b"plain-2"]
                first.task.cancel()  # a crash before the gate is done
                with pytest.raises(asyncio.CancelledError):
                    await first.task
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=gated) as again:
                assert again.transport.session_present
                # both again: the second one's acknowledgement was held behind the first's
                assert sorted([await next_handled(), await next_handled()]) == [b"gated-1", b"plain-2"]
                gates[b"gated-1"].set_result(None)  # now durable: acknowledged
                await a.transport.publish(to_b, b"gated-3")
                assert await next_handled() == b"gated-3"
                await a.transport.publish(to_b, b"plain-4")
                assert await next_handled() == b"plain-4"
                gates[b"gated-3"].set_result(None)
                await asyncio.sleep(0)  # the done-callback sends the acknowledgements
                await again.transport.publish(topics.presence(FED, cid), b"", retain=True)  # a round trip
                again.task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await again.task
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=gated) as last:
                assert last.transport.session_present
                await a.transport.publish(to_b, b"plain-5")
                # nothing acknowledged came back: the first message now is the new one
                assert await next_handled() == b"plain-5"

    arun(main(), timeout=60)


def test_a_withheld_acknowledgement_is_never_sent_and_the_broker_delivers_it_again(broker, arun, peer):
    """A handler's awaitable that fails with AckWithheld (a coordinator that could not
    journal the frame): the message is never acknowledged, the ones after it are; after a
    reconnection on the same session the broker delivers that one again, and only it."""
    from fedagent.errors import AckWithheld

    cid = unique_id("agent-b")
    inbox = topics.inbox(FED, cid)
    to_b = topics.direct(FED, "agent-a", cid, "update")

    async def main():
        handled: asyncio.Queue[bytes] = asyncio.Queue()

        async def withholding(_topic, payload):
            handled.put_nowait(bytes(payload))
            if bytes(payload).startswith(b"full"):
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(AckWithheld("not written to the round journal: disk full"))
                return fut
            return None

        async def next_handled() -> bytes:
            return await asyncio.wait_for(handled.get(), 10)

        async with peer(broker, "agent-a") as a:
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=withholding) as first:
                await a.transport.publish(to_b, b"full-1")
                await a.transport.publish(to_b, b"plain-2")
                assert [await next_handled(), await next_handled()] == [b"full-1", b"plain-2"]
                await first.transport.publish(topics.presence(FED, cid), b"", retain=True)  # a round trip
                first.task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first.task
            async with peer(broker, "agent-b", client_id=cid, subscriptions=[inbox], handler=withholding) as again:
                assert again.transport.session_present
                assert await next_handled() == b"full-1"  # delivered again, withheld again
                await a.transport.publish(to_b, b"plain-3")
                # plain-2 was acknowledged: not delivered again
                assert await next_handled() == b"plain-3"

    arun(main(), timeout=60)


def test_t5_publish_waits_for_the_connection(broker_factory, arun, peer):
    b = broker_factory()

    async def main():
        async with peer(b, "agent-a") as a:
            await asyncio.to_thread(b.stop)
            with pytest.raises(TransportError, match="not connected to the broker .* within 0.5s"):
                await a.transport.publish(topics.presence(FED, "agent-a"), b"x", timeout=0.5)
            assert a.transport.state in ("connecting", "backoff")
            assert a.transport.last_error
            await asyncio.to_thread(b.start)
            await a.transport.publish(topics.presence(FED, "agent-a"), b"", retain=True, timeout=15)

    arun(main(), timeout=40)


# --- large messages and the packet limit -------------------------------------------------


def test_large_messages_arrive_promptly(broker, arun, peer, record_property):
    count, size = 20, 6 * 2**20
    body = bytearray(os.urandom(size))

    async def main():
        arrivals: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

        async def on_message(topic, payload):
            assert len(payload) == size
            arrivals.put_nowait((int.from_bytes(payload[:4], "big"), time.monotonic()))

        async with (
            peer(broker, "agent-b", subscriptions=[topics.inbox(FED, "agent-b")], handler=on_message),
            peer(broker, "agent-a") as tx,
        ):
            took = []
            topic = topics.direct(FED, "agent-a", "agent-b", "model")
            for i in range(count):
                body[:4] = i.to_bytes(4, "big")
                started = time.monotonic()
                await tx.transport.publish(topic, bytes(body))
                index, at = await asyncio.wait_for(arrivals.get(), 5)
                assert index == i
                took.append(at - started)
        return took

    took = arun(main(), timeout=60)
    record_property("large_max_s", round(max(took), 3))
    record_property("large_median_s", round(sorted(took)[len(took) // 2], 3))
    assert max(took) < 5


class _FakeSocket:
    """A non-blocking socket that returns at most ``chunk`` bytes per recv()."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk = bytearray(data), chunk

    def recv(self, n: int) -> bytes:
        if not self.data:
            raise BlockingIOError
        out = bytes(self.data[: min(n, self.chunk)])
        del self.data[: len(out)]
        return out

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        self.data.clear()


def test_reader_handles_a_packet_completed_by_pahos_last_read():
    """paho's loop_read() stops after 100 body reads; if the 100th completes the packet
    and nothing else arrives, it sits unhandled (seen with large messages)."""
    topic = b"t/x"
    body_len = 100 * 1000  # 100 reads of 1000 bytes exactly
    payload = bytes(body_len - 2 - len(topic) - 1)  # MQTT 5: topic, properties len, payload
    remaining = 2 + len(topic) + 1 + len(payload)
    assert remaining == body_len
    length = bytearray()
    n = remaining
    while True:
        byte, n = n % 128, n // 128
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    packet = bytes([0x30]) + bytes(length) + len(topic).to_bytes(2, "big") + topic + b"\0" + payload

    def client_with(data: bytes):
        got = []
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        c.on_message = lambda _c, _u, m: got.append(len(m.payload))
        c._sock = _FakeSocket(data, 1000)
        return c, got

    stock, got = client_with(packet)
    stock.loop_read()  # what one readable event does in aiomqtt
    assert got == []  # the stall: complete but unhandled

    ours, got = client_with(packet)
    tr.read_available(ours)
    assert got == [len(payload)]


def test_publish_above_the_broker_packet_limit_is_a_clear_error(broker_factory, arun, peer):
    limit = 2**20
    b = broker_factory(max_packet_size=limit)

    async def main():
        async with peer(b, "agent-a") as a:
            t = a.transport
            assert t.max_packet_size == limit  # announced in CONNACK
            topic = topics.direct(FED, "agent-a", "coord", "model")
            started = time.monotonic()
            with pytest.raises(
                TransportError,
                match=r"exceeds the broker's maximum packet size "
                r"of 1048576 bytes; split it into chunks",
            ):
                await t.publish(topic, bytes(limit))
            assert time.monotonic() - started < 1
            fits = limit - tr.publish_packet_size(topic, 0, 1)
            while tr.publish_packet_size(topic, fits, 1) > limit:
                fits -= 1
            await t.publish(topic, bytes(fits))  # exactly at the limit: accepted
            assert t.state == "connected" and t.reconnects == 0
            # The broker enforces it too: a client that ignores CONNACK is dropped (no
            # PUBACK with a reason code: Mosquitto 2.0.11 disconnects, and it counts only
            # the fixed header's first byte plus the remaining length).
            with pytest.raises(patches.ConnectionLost):
                await t._client.publish_acked(topic, bytes(limit), qos=1, retain=False, timeout=5)
            await t.publish(topic, b"small", timeout=15)  # and we come back
            assert t.reconnects == 1

    arun(main(), timeout=40)


def test_client_sockets_send_small_packets_at_once(broker, arun, peer):
    """TCP_NODELAY on the client's socket: with Nagle's algorithm a PUBACK or a small
    message behind unacknowledged data waits for the broker's delayed ACK (40 ms)."""

    async def main():
        async with peer(broker, "agent-a") as p:
            client = p.transport._client
            assert client is not None
            sock = client.paho.socket()
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1

    arun(main())


def test_the_broker_fedagent_starts_keeps_freed_message_buffers(broker_factory, monkeypatch):
    """Mosquitto runs with glibc told to serve message buffers from its heap and keep
    them (BROKER_MALLOC_ENV); a value already in the environment wins."""
    from fedagent.mosquitto import BROKER_MALLOC_ENV

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    b = broker_factory()
    proc = b.embedded._proc
    assert proc is not None
    env = dict(item.split("=", 1) for item in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in item)
    assert env["MALLOC_MMAP_THRESHOLD_"] == BROKER_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20)
    assert env["MALLOC_TRIM_THRESHOLD_"] == "4096"
