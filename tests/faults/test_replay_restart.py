"""Replay protection survives a crash: a kill -9 of the receiver, then replayed frames.

The receiver's replay guard keeps, per sender, the largest sequence numbers it accepted
in its state directory (written atomically before a message is handed on), and a
sender's numbers never go back across restarts. The pure part is tested here on the
classes; the end-to-end part runs a real federation over Mosquitto with mutual TLS: a
frame an agent sent to the coordinator is captured off the broker, the coordinator is
killed with ``kill -9`` and restarted, and the captured frame is published again (the
broker, or anyone holding a broker login with read access, can do this). Pass: the
restarted coordinator refuses it as a ``replay`` naming the agent, and the federation
still completes every round exactly once.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from netfed import observer, running, wait_for

from fedagent.errors import FedagentError
from fedagent.local.federation import Federation
from fedagent.node.transport import Transport
from fedagent.protocols import topics
from fedagent.protocols.codec import decode
from fedagent.security.replaylog import ReplayJournal
from fedagent.security.signing import AuthError, ReplayGuard, SequenceCounter, SteadyClock


# ---- pure ----------------------------------------------------------------------------
def test_snapshot_restores_every_accepted_number_as_a_replay():
    g = ReplayGuard(window=4096, max_skew=10, keep=8)
    accepted = [1000, 1003, 1001, 1010, 1007, 1020, 1015, 1011, 1030, 1025]
    for s in accepted:
        g.check("a", s, 0.0, 0.0)
    g.check("b", 5, 0.0, 0.0)
    assert g.dirty
    fresh = ReplayGuard(window=4096, max_skew=10, keep=8)
    fresh.restore(g.snapshot())
    for s in accepted:
        with pytest.raises(AuthError, match="replay"):
            fresh.check("a", s, 0.0, 0.0)
    with pytest.raises(AuthError, match="replay"):
        fresh.check("b", 5, 0.0, 0.0)
    # Numbers never seen above the kept floor still pass (out-of-order delivery).
    fresh.check("a", 1012, 0.0, 0.0)
    fresh.check("a", 1031, 0.0, 0.0)
    fresh.check("c", 1, 0.0, 0.0)


@pytest.mark.parametrize("bad", [b"\xc1", b"\x91\x01", b"\x81\xa1a\x90", b"\x81\xa1a\x91\xa1x"])
def test_a_corrupt_snapshot_is_refused_not_trusted(bad):
    with pytest.raises(FedagentError):
        ReplayGuard().restore(bad)


def test_sequence_numbers_never_go_back_across_restarts(tmp_path, monkeypatch):
    path = tmp_path / "seq"
    c = SequenceCounter(path, block=10)
    used = [c.take() for _ in range(25)]
    assert used == sorted(set(used))
    # The clock goes back a day before the restart: the reservation still rules.
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 86_400 * 10**9)
    again = SequenceCounter(path, block=10)
    assert again.take() > used[-1]


def test_steady_clock_ignores_wall_clock_jumps(monkeypatch):
    clock = SteadyClock()
    before = clock()
    monkeypatch.setattr(time, "time", lambda: before + 6 * 3600)
    assert abs(clock() - before) < 5


def test_steady_clock_waits_for_a_clock_that_starts_before_its_certificate():
    # A device without a real-time clock boots at 1970; NTP sets the clock later.
    issued = 1_800_000_000.0
    wall = [86_400.0]
    clock = SteadyClock(floor=issued, read=lambda: wall[0])
    assert clock.unset and clock() == 86_400.0  # followed while it is before the floor
    wall[0] = 90_000.0
    assert clock() == 90_000.0
    wall[0] = issued + 60  # NTP stepped it: anchored there ...
    assert clock() == pytest.approx(issued + 60, abs=1) and not clock.unset
    wall[0] = issued + 6 * 3600  # ... and later jumps are not followed
    assert clock() == pytest.approx(issued + 60, abs=1)


def test_steady_clock_with_a_clock_past_its_floor_never_follows_it():
    wall = [2_000_000_000.0]
    clock = SteadyClock(floor=1_800_000_000.0, read=lambda: wall[0])
    assert not clock.unset
    wall[0] = 1_000.0
    assert clock() == pytest.approx(2_000_000_000.0, abs=1)


# ---- messengers over the real broker (CI) --------------------------------------------------
def test_a_new_messenger_on_the_same_state_refuses_frames_its_predecessor_took(broker, peer, arun, tmp_path):
    """The messenger layer over Mosquitto with mutual TLS: a receiver with a state
    directory takes a frame; a second receiver on the same directory (what a restart
    builds) gets the same bytes again and refuses them as ``replay``; a fresh frame
    from the same sender still goes through. (The process-level run is the slow test
    below.)"""
    import numpy as np

    from fedagent.node.messaging import Messenger
    from fedagent.protocols.messages import Update
    from fedagent.security.signing import Identity

    fed = "testfed"
    ident = lambda n: Identity.load(broker.pki.tls(n).cert, broker.pki.tls(n).key, broker.pki.ca)  # noqa: E731
    topic = topics.direct(fed, "agent-a", "coord", "update")
    weights = {"w": np.arange(6, dtype=np.float32)}

    async def main():
        got: asyncio.Queue = asyncio.Queue()
        handler = {"recv": None}
        async with (
            peer(
                broker,
                "coord",
                subscriptions=[topics.inbox(fed, "coord")],
                handler=lambda t, p: handler["recv"].receive(t, p, got.put),
            ) as c,
            peer(broker, "agent-a") as a,
        ):
            first = Messenger(
                federation=fed, node_id="coord", transport=c.transport, identity=ident("coord"), state_dir=tmp_path
            )
            handler["recv"] = first
            send = Messenger(
                federation=fed,
                node_id="agent-a",
                transport=a.transport,
                identity=ident("agent-a"),
                state_dir=tmp_path / "agent-a",
            )
            frame = send.frame(Update(1, 0, 10, {}, weights))
            await a.transport.publish(topic, frame)
            assert (await asyncio.wait_for(got.get(), 10)).message.round == 1
            second = Messenger(
                federation=fed, node_id="coord", transport=c.transport, identity=ident("coord"), state_dir=tmp_path
            )
            handler["recv"] = second
            await a.transport.publish(topic, frame)  # the captured frame
            await send.send(topic, Update(2, 0, 10, {}, weights))  # then a fresh one
            assert (await asyncio.wait_for(got.get(), 10)).message.round == 2 and got.empty()
            assert dict(second.rejected) == {"replay": 1}

    arun(main(), timeout=60)


# ---- real processes, real broker ------------------------------------------------------
@pytest.mark.slow
def test_restarted_coordinator_refuses_a_frame_replayed_from_before_its_crash(tmp_path):
    with running(tmp_path, start=False, agents=2, rounds=4, alpha=0.5, round_timeout=20) as fed:
        asyncio.run(asyncio.wait_for(_replay_after_restart(fed), 240))
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        rounds = [json.loads(line) for line in hist.read_text().splitlines()]
        assert [r["model_version"] for r in rounds if r["event"] == "round"] == list(range(1, 5))


async def _poll(predicate, timeout: float, what: str, fed: Federation):
    return await asyncio.to_thread(wait_for, predicate, timeout, what, fed)


def _taken_evaluation(fed: Federation, captured: list[tuple[str, bytes]]) -> tuple[str, bytes] | None:
    """A captured evaluation frame of a model version the coordinator's status counts
    from its sender, or None."""
    held = (fed.status("coordinator") or {}).get("held_out") or {}
    for topic, payload in reversed(list(captured)):
        env = decode(payload)
        if (
            env.kind == "evaluation"
            and env.sender in held.get("agents", [])
            and env.body.get("model_version") == held.get("model_version")
        ):
            return topic, payload
    return None


def _refused_by_saved_guard(fed: Federation, sender: str, seq: int) -> bool:
    """The coordinator's replay guard, as its state file restores it, refuses ``seq`` of
    ``sender`` as a replay (read from a copy: the running coordinator appends to it)."""
    path = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "replay-guard.msgpack"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        try:
            shutil.copyfile(path, copy)
        except FileNotFoundError:
            return False
        guard = ReplayGuard()
        try:
            ReplayJournal(copy, guard, time.time).load()
        except FedagentError:
            return False
        if guard.fence != -math.inf:
            return False  # a damaged copy refuses everything: it says nothing about seq
        try:
            guard.check(sender, seq, 0.0, 0.0)
        except AuthError as exc:
            return exc.reason == "replay"
        return False


async def _replay_after_restart(fed: Federation) -> None:
    captured: list[tuple[str, bytes]] = []

    async def keep(topic: str, payload: bytes) -> None:
        captured.append((topic, payload))

    # A coordinator-level login reads every topic of the federation: it stands in for a
    # compromised broker here (an identity of its own: the broker takes the client id
    # from the certificate, so the coordinator's would log in as the daemon and kick it).
    sniffer = Transport(
        uri=fed.broker.uri,
        tls=await asyncio.to_thread(observer, fed, "hd-replayer"),
        subscriptions=[topics.inbox(fed.fed, "coordinator")],
    )
    ready = asyncio.Event()
    task = asyncio.create_task(sniffer.run(keep, ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        fed.start_all()
        coord = fed.procs[0]
        # The frame replayed is an agent's evaluation that the coordinator's status shows
        # it took. Not an update: after the restart the coordinator reads the round's
        # updates back from its journal (or the round is over), so a frame of that
        # transfer is dropped as unexpected before the replay guard sees it, in some
        # orderings and not others; an evaluation always reaches the guard. Its number
        # reaches the guard's file within a second of its being taken (a lazily durable
        # kind): the kill waits until the file holds it, read from a copy, so that only
        # the numbers persisted across the kill can refuse the replay (it is inside the
        # window and the skew), and the test fails if they are not restored.
        topic, frame = await _poll(
            lambda: _taken_evaluation(fed, captured), 180, "an evaluation the coordinator took", fed
        )
        env = decode(frame)
        victim = env.sender
        await _poll(
            lambda: _refused_by_saved_guard(fed, victim, env.seq), 30, "the evaluation's number to be saved", fed
        )
        coord.popen.send_signal(signal.SIGKILL)
        coord.popen.wait(10)
        fed.procs.remove(coord)
        assert (fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "replay-guard.msgpack").exists()
        start = coord.log.stat().st_size  # the restarted process appends to the same log
        restarted = fed.spawn("coordinator")
        await _poll(lambda: fed.status("coordinator"), 60, "the restarted coordinator", fed)
        await sniffer.publish(topic, frame)
        line = f"rejected message from {victim}: replay"
        await _poll(
            lambda: line in restarted.log.read_text(errors="replace")[start:], 30, "the replay to be refused", fed
        )
        await _poll(
            lambda: (lambda s: s if s and s["phase"] == "done" else None)(fed.status("coordinator")),
            150,
            "the federation to finish",
            fed,
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_lazily_durable_kind_reaches_the_journal_within_a_second_and_other_kinds_before_delivery(pki, arun, tmp_path):
    """Sync-Opt's per-step frames (``Messenger.lazy_durable_kinds``) are handed on before
    their sequence numbers are written and reach the replay journal within
    ``LAZY_DURABLE_S``; a messenger restarted on the same state then refuses the frame as
    a replay. Every other kind is still written before it is handed on."""
    import numpy as np

    from fedagent.node import messaging
    from fedagent.node.messaging import Messenger
    from fedagent.protocols.messages import SyncGradient, Update
    from fedagent.security.signing import Identity

    fed = "testfed"
    ident = lambda n: Identity.load(pki.tls(n).cert, pki.tls(n).key, pki.ca)  # noqa: E731
    grads = {"w": np.arange(6, dtype=np.float32)}

    def writes(m: Messenger) -> int:
        assert m.replay_journal is not None
        return m.replay_journal.appends + m.replay_journal.compactions

    async def main():
        got: list = []

        async def deliver(inc) -> None:
            got.append(inc)

        def receiver() -> Messenger:
            m = Messenger(federation=fed, node_id="coord", transport=None, identity=ident("coord"), state_dir=tmp_path)
            m.lazy_durable_kinds = frozenset({SyncGradient.kind})
            return m

        send = Messenger(federation=fed, node_id="agent-a", transport=None, identity=ident("agent-a"))
        recv = receiver()
        before = writes(recv)
        frame = send.frame(SyncGradient(1, 0, 10, 0.5, grads), round_=1)
        t0 = time.monotonic()
        await recv.receive(topics.direct(fed, "agent-a", "coord", "sync_gradient"), frame, deliver)
        assert len(got) == 1 and writes(recv) == before  # handed on, not yet written
        while writes(recv) == before and time.monotonic() - t0 < 10 * messaging.LAZY_DURABLE_S:
            await asyncio.sleep(0.02)
        assert writes(recv) > before, "the lazily durable number never reached the journal"
        assert time.monotonic() - t0 < 5 * messaging.LAZY_DURABLE_S

        restarted = receiver()
        await restarted.receive(topics.direct(fed, "agent-a", "coord", "sync_gradient"), frame, deliver)
        assert len(got) == 1 and dict(restarted.rejected) == {"replay": 1}

        # Any other kind: written before it is handed on.
        before = writes(restarted)
        update = send.frame(Update(2, 0, 10, {}, grads))
        await restarted.receive(topics.direct(fed, "agent-a", "coord", "update"), update, deliver)
        assert len(got) == 2 and writes(restarted) > before

    arun(main(), timeout=60)
