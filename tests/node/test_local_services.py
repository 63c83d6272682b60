"""Control socket, sd_notify, atomic state files and mDNS discovery, with real sockets
and real processes."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from fedagent.errors import ConfigError, FedagentError, TransportError
from fedagent.node import sdnotify
from fedagent.node.control import ControlServer, arequest, request
from fedagent.node.discovery import Advert, Discovery, parse_txt
from fedagent.storage.statefile import atomic_write, cleanup_temp_files, read_bytes


# -- control socket ----------------------------------------------------------------------
def test_control_socket_roundtrip_errors_and_unknown_commands(tmp_path, arun):
    path = tmp_path / "run" / "agent.sock"

    async def status(args):
        return {"echo": args.get("x")}

    async def broken(args):
        raise RuntimeError("boom")

    async def main():
        async with ControlServer(path, {"status": status, "broken": broken}):
            assert oct(path.stat().st_mode & 0o777) == "0o660"
            assert (await arequest(path, "status", {"x": 7})) == {"echo": 7}
            sync = await asyncio.to_thread(request, path, "status", {"x": "y"})
            assert sync == {"echo": "y"}
            with pytest.raises(FedagentError, match="unknown command"):
                await arequest(path, "nope")
            with pytest.raises(FedagentError, match="internal error: RuntimeError: boom"):
                await arequest(path, "broken")
            # A garbage line gets an error reply; the server keeps serving.
            r, w = await asyncio.open_unix_connection(str(path))
            w.write(b"not json\n")
            await w.drain()
            assert json.loads(await r.readline())["ok"] is False
            w.close()
            assert (await arequest(path, "status")) == {"echo": None}
            with pytest.raises(ConfigError, match="already answers"):
                await ControlServer(path, {}).start()
        assert not path.exists()

    arun(main())


def test_request_without_daemon_names_the_fix(tmp_path):
    with pytest.raises(TransportError, match="no daemon is running.*fedagent agent --config"):
        request(tmp_path / "missing.sock", "status")


def test_stale_socket_file_is_replaced(tmp_path, arun):
    path = tmp_path / "agent.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # a file nobody answers on

    async def main():
        async with ControlServer(path, {"status": lambda a: asyncio.sleep(0, {"ok": 1})}):
            assert await arequest(path, "status") == {"ok": 1}

    arun(main())


# -- sd_notify ---------------------------------------------------------------------------
def test_notify_datagrams_reach_the_socket(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    assert sdnotify.ready("serving")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    assert sdnotify.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sdnotify.status("nobody listens")
    sock.close()


def test_watchdog_pings_from_the_event_loop(tmp_path, monkeypatch, arun):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))

    async def main():
        task = asyncio.create_task(sdnotify.watchdog_loop())
        got = [await asyncio.to_thread(sock.recv, 100) for _ in range(3)]
        task.cancel()
        return got

    assert arun(main()) == [b"WATCHDOG=1"] * 3
    monkeypatch.setenv("WATCHDOG_PID", "1")  # pings meant for another process
    assert sdnotify.watchdog_interval() is None
    sock.close()


def test_coordinator_daemon_notifies_ready_and_status(tmp_path, broker):
    """A real coordinator process under a fake systemd notify socket."""
    from fedagent import config
    from fedagent.config import TlsConfig

    tls = broker.tls("coord")
    cfg = tmp_path / "coordinator.toml"
    cfg.write_text(
        config.render(
            node_id="coord",
            federation="testfed",
            broker=broker.uri,
            tls=TlsConfig(tls.ca, tls.cert, tls.key),
            state_dir=tmp_path / "state",
            runtime_dir=tmp_path / "run",
            rounds={"rounds": 1},
        )
    )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedagent", "coordinator", "--config", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        env.pop("WATCHDOG_PID", None)
        seen = []
        while not any(m.startswith(b"READY=1") for m in seen):
            seen.append(sock.recv(4096))
        ready = next(m for m in seen if m.startswith(b"READY=1"))
        assert b"STATUS=coordinator of testfed" in ready
        while b"WATCHDOG=1" not in seen:
            seen.append(sock.recv(4096))
        proc.send_signal(signal.SIGTERM)
        while b"STOPPING=1" not in seen:
            seen.append(sock.recv(4096))
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def test_config_error_exits_78(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('id = "Bad Id"\n')
    out = subprocess.run(
        [sys.executable, "-m", "fedagent", "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 78 and "invalid id" in out.stderr


# -- atomic state files ------------------------------------------------------------------
def test_atomic_write_and_read(tmp_path):
    p = tmp_path / "state.bin"
    assert read_bytes(p, 10) is None
    atomic_write(p, b"hello")
    assert read_bytes(p, 10) == b"hello" and oct(p.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FedagentError, match="more than"):
        read_bytes(p, 2)


def test_failed_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "state.bin"
    atomic_write(p, b"old")
    with pytest.raises(FedagentError, match="previous version is intact"):
        atomic_write(tmp_path / "missing-dir" / "x", b"new")
    os.chmod(tmp_path, 0o500)
    try:
        if os.geteuid() != 0:  # root ignores directory permissions
            with pytest.raises(FedagentError):
                atomic_write(p, b"new")
    finally:
        os.chmod(tmp_path, 0o700)
    assert p.read_bytes() == b"old"


WRITER = textwrap.dedent("""
    import sys, zlib
    from pathlib import Path
    from fedagent.storage.statefile import atomic_write
    path = Path(sys.argv[1])
    i = 0
    print("ready", flush=True)
    while True:
        body = bytes([65 + i % 2]) * 1_000_000
        atomic_write(path, zlib.crc32(body).to_bytes(4, "big") + body)
        i += 1
""")


def test_kill_9_during_writes_never_tears_the_file(tmp_path):
    """Kill -9 during writes, bounded: 50 kills at random moments of a writer loop."""
    target = tmp_path / "ckpt"
    rng = secrets.SystemRandom()
    for _ in range(50):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.05))  # a random moment to kill, not synchronisation
        proc.kill()
        proc.wait()
        proc.stdout.close()
        data = target.read_bytes() if target.exists() else None
        if data is not None:
            body = data[4:]
            assert len(body) == 1_000_000 and zlib.crc32(body).to_bytes(4, "big") == data[:4]
            assert body in (b"A" * 1_000_000, b"B" * 1_000_000)
        cleanup_temp_files(tmp_path)
        assert [p.name for p in tmp_path.iterdir() if p.name != "ckpt"] == []


# -- mDNS ----------------------------------------------------------------------------------
ADVERTISER = textwrap.dedent("""
    import asyncio, sys
    from fedagent.node.discovery import Advert, Discovery
    async def main():
        async with Discovery(["127.0.0.1"]) as d:
            await d.register(Advert(federation=sys.argv[1], node_id="coord-x", role="coordinator",
                                    broker_uri="mqtts://127.0.0.1:8883", fingerprint="ab12"))
            print("registered", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
    asyncio.run(main())
""")


def test_discovery_between_processes_add_remove_readd(arun):
    fed = f"disc-{secrets.token_hex(3)}"

    def advertiser():
        p = subprocess.Popen([sys.executable, "-c", ADVERTISER, fed], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"registered\n"
        return p

    def stop(p):
        p.stdin.write(b"\n")  # clean exit: goodbye packets
        p.stdin.flush()
        assert p.wait(20) == 0
        p.stdout.close()
        p.stdin.close()

    async def main():
        changes: asyncio.Queue = asyncio.Queue()
        async with Discovery(["127.0.0.1"], on_change=lambda k, a: changes.put_nowait((k, a))) as d:
            d.start_browsing(fed)
            p = await asyncio.to_thread(advertiser)
            found = await d.find(fed, "coordinator", 15)
            assert (found.node_id, found.broker_uri, found.fingerprint) == ("coord-x", "mqtts://127.0.0.1:8883", "ab12")
            await asyncio.to_thread(stop, p)
            while True:
                kind, advert = await asyncio.wait_for(changes.get(), 15)
                if kind == "removed":
                    break
            assert "coord-x" not in d.peers
            p = await asyncio.to_thread(advertiser)  # back again (the mDNS restart case)
            while True:
                kind, advert = await asyncio.wait_for(changes.get(), 15)
                if kind == "added":
                    break
            assert d.peers["coord-x"].role == "coordinator"
            await asyncio.to_thread(stop, p)
            with pytest.raises(FedagentError, match=r"searched on 127\.0\.0\.1.*--interface.*--broker"):
                await d.find(f"other-{fed}", "coordinator", 0.5)

    arun(main(), timeout=90)


@pytest.mark.parametrize(
    "props",
    [
        {b"fed": b"f", b"id": b"a", b"role": b"king", b"broker": b"mqtts://h:1"},
        {b"fed": b"f", b"id": b"a/#", b"role": b"agent", b"broker": b"mqtts://h:1"},
        {b"fed": b"F!", b"id": b"a", b"role": b"agent", b"broker": b""},
        {b"fed": b"f", b"id": b"a", b"role": b"agent", b"broker": b"http://h:1"},
        {b"fed": b"f", b"id": b"a", b"role": b"agent", b"broker": b"mqtts://h:1", b"proto": b"x"},
        {b"fed": b"\xff", b"id": b"a", b"role": b"agent"},
        {b"fed": b"f", b"id": b"a", b"role": b"agent", b"fp": b"zz"},
    ],
)
def test_malformed_adverts_are_ignored(props):
    assert parse_txt(props) is None


def test_wellformed_advert_parses():
    a = Advert(federation="f", node_id="a", role="agent", broker_uri="mqtts://h:1", fingerprint="ab")
    assert parse_txt({k.encode(): v.encode() for k, v in a.txt().items()}) == a
