"""The round journal (fedagent.storage.roundjournal) and resuming a round (RoundMachine.resume)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from fedfixtures import COORDINATOR, FEDERATION

from fedagent.node import messaging
from fedagent.node.messaging import REPLAY_FILE, Messenger
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, decode
from fedagent.protocols.messages import Update
from fedagent.protocols.rounds import (
    AgentOffline,
    AgentOnline,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)
from fedagent.security import replaylog
from fedagent.security.signing import Identity, ReplayGuard
from fedagent.storage.roundjournal import HEADER, MAGIC, InFlight, RoundJournal

TOPIC = "fedagent/v1/lab/node/agent-1/to/coordinator/update"


def journal(tmp_path) -> RoundJournal:
    return RoundJournal(tmp_path / "round-journal", max_frame=1 << 20)


def test_frames_of_the_round_in_flight_survive_a_restart_in_order(tmp_path):
    j = journal(tmp_path)
    j.begin(7, 6, ("agent-1", "agent-2"))
    frames = [(TOPIC, bytes([i]) * (100 + i)) for i in range(5)]
    for t, d in frames:
        j.append(t, d)
    j.close()
    again = journal(tmp_path)
    assert again.recover() == InFlight(7, 6, ("agent-1", "agent-2"))
    assert again.frames == 5
    assert list(again.by_sender) == ["agent-1"] and again.by_sender["agent-1"] == j.by_sender["agent-1"]
    assert list(again.frames_of()) == frames
    again.append(TOPIC, b"late")  # appending goes on after the recovered records
    assert list(journal(tmp_path).frames_of())[-1] == (TOPIC, b"late")


def test_an_ended_round_or_a_missing_or_foreign_file_is_not_resumed(tmp_path):
    j = journal(tmp_path)
    assert j.recover() is None  # no file
    j.begin(1, 0, ("agent-1",))
    j.append(TOPIC, b"x")
    j.end()
    assert journal(tmp_path).recover() is None
    (tmp_path / "round-journal").write_bytes(b"\x81\xa1t\xa5start")  # msgpack, no magic
    assert journal(tmp_path).recover() is None


def test_a_torn_tail_is_cut_off_and_a_damaged_middle_record_skipped(tmp_path):
    path = tmp_path / "round-journal"
    j = journal(tmp_path)
    j.begin(3, 2, ("agent-1",))
    for d in (b"first", b"second", b"third"):
        j.append(TOPIC, d)
    j.close()
    data = bytearray(path.read_bytes())
    # Flip a byte inside the second frame's payload: its CRC fails, the third still counts.
    start_len = HEADER.unpack_from(data, len(MAGIC))[0]
    first_at = len(MAGIC) + HEADER.size + start_len
    second_at = first_at + HEADER.size + HEADER.unpack_from(data, first_at)[0]
    data[second_at + HEADER.size + 3] ^= 0xFF
    # And a record cut short at the end: an append interrupted by a crash.
    torn = HEADER.pack(1000, 0) + b"partial"
    path.write_bytes(bytes(data) + torn)
    j = journal(tmp_path)
    assert j.recover() == InFlight(3, 2, ("agent-1",))
    assert [d for _t, d in j.frames_of()] == [b"first", b"third"]
    assert path.stat().st_size == len(data)  # the torn tail is gone


def test_lying_lengths_and_wrong_records_are_refused_before_allocation(tmp_path):
    path = tmp_path / "round-journal"
    j = journal(tmp_path)
    j.begin(2, 1, ("agent-1",))
    j.close()
    good = path.read_bytes()
    path.write_bytes(good + HEADER.pack(0xFFFFFFF0, 0))  # claims 4 GB
    assert journal(tmp_path).recover() == InFlight(2, 1, ("agent-1",))
    import zlib

    import msgpack

    bad = msgpack.packb({"t": "start", "round": -1, "version": 0, "selected": []})
    path.write_bytes(MAGIC + HEADER.pack(len(bad), zlib.crc32(bad)) + bad)
    assert journal(tmp_path).recover() is None
    odd = msgpack.packb({"t": "frame", "topic": 5, "data": b""})
    path.write_bytes(good + HEADER.pack(len(odd), zlib.crc32(odd)) + odd)
    again = journal(tmp_path)
    assert again.recover() is not None and list(again.frames_of()) == []


def test_replay_guard_records_journaled_numbers_so_a_redelivery_is_a_replay():
    from fedagent.security.signing import AuthError

    g = ReplayGuard()
    g.record("agent-1", 41)
    g.record("agent-1", 41)  # idempotent
    with pytest.raises(AuthError, match="already seen"):
        g.check("agent-1", 41, 0.0, 0.0)
    g.check("agent-1", 42, 0.0, 0.0)


W0 = {"w": np.zeros(4, np.float32)}


def update(sender: str, rnd: int, value: float, n: int = 10) -> UpdateReceived:
    return UpdateReceived(sender, rnd, 4, n, {"w": np.full(4, value, np.float32)}, {"loss": value})


def test_a_resumed_round_keeps_its_number_and_waits_for_the_outstanding_agent():
    cfg = RoundConfig(rounds=10, min_agents=3, min_updates=1, round_timeout=60)
    m = RoundMachine(cfg, W0, model_version=4, completed_rounds=4, last_round=5)
    (start, _wake) = m.resume(5, ("a", "b", "c"), now=0.0)
    assert isinstance(start, StartRound) and start.resumed and start.round == 5 and start.model_version == 4
    # The journal's two updates, then presence (c online), then c's update.
    assert m.handle(update("a", 5, 1.0), 0.1) == []
    assert m.handle(update("b", 5, 2.0), 0.2) == []  # c is assumed online: no early aggregation
    assert m.handle(AgentOnline("c", 10), 0.3) == []
    (agg, *_rest) = m.handle(update("c", 5, 3.0), 0.4)
    assert isinstance(agg, RoundAggregated)
    assert agg.round == 5 and agg.model_version == 5 and agg.participants == ("a", "b", "c")
    np.testing.assert_allclose(agg.weights["w"], 2.0)  # each counted once
    # A redelivered copy of a's update after the restart is refused, never counted again.
    assert [c.reason for c in m.handle(update("a", 5, 1.0), 0.5)] == ["stale"]


def test_a_resumed_round_aggregates_without_an_agent_whose_presence_says_offline():
    cfg = RoundConfig(rounds=10, min_agents=2, min_updates=1, round_timeout=60)
    m = RoundMachine(cfg, W0, model_version=4, completed_rounds=4, last_round=5)
    m.resume(5, ("a", "b"), now=0.0)
    assert m.handle(update("a", 5, 1.0), 0.1) == []
    (agg, *_rest) = m.handle(AgentOffline("b"), 0.2)
    assert isinstance(agg, RoundAggregated) and agg.participants == ("a",)


def test_resume_refuses_a_round_the_machine_is_not_at():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=1), W0, model_version=1, completed_rounds=1, last_round=2)
    with pytest.raises(ValueError):
        m.resume(3, ("a",), now=0.0)


# ---- through the messenger ------------------------------------------------------------
class Capture:
    """A transport that keeps what is published (no broker: the frames are fed by hand)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, **_kw) -> None:
        self.frames.append((topic, bytes(payload)))


def identity(pki, name: str) -> Identity:
    tls = pki.issue(name, "coordinator" if name == COORDINATOR else "agent")
    return Identity.load(tls.cert, tls.key, tls.ca)


def coordinator_messenger(pki, state: Path, **kw) -> Messenger:
    """The coordinator's messenger on the state directory ``state``, publishing into a
    :class:`Capture`; the test sets its journal hooks."""
    return Messenger(
        federation=FEDERATION,
        node_id=COORDINATOR,
        transport=Capture(),
        identity=identity(pki, COORDINATOR),
        state_dir=state,
        **kw,
    )


def agent_messenger(pki, wire: Capture, **kw) -> Messenger:
    """Agent "agent-a"'s messenger, publishing into ``wire``."""
    return Messenger(federation=FEDERATION, node_id="agent-a", transport=wire, identity=identity(pki, "agent-a"), **kw)


def test_a_frame_waiting_for_its_sync_keeps_only_its_name_not_its_bytes(pki, tmp_path):
    """While a journaled frame's sync is pending, what waits with it (its gate's
    callbacks) holds the sender and sequence number, not the envelope: the envelope
    holds a view of the frame's bytes, and every frame of a group commit would stay in
    memory until the sync."""
    state = tmp_path / "coord"
    state.mkdir()

    async def run() -> None:
        wire = Capture()
        sender = agent_messenger(pki, wire, max_chunk_bytes=4096)
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        await sender.send(topic, Update(3, 2, 10, {}, {"w": np.arange(3000, dtype=np.float32)}), round_=3)
        m = coordinator_messenger(pki, state, max_chunk_bytes=4096)
        syncs: list[asyncio.Future[None]] = []

        async def journal(topic, payload, env) -> asyncio.Future[None]:
            syncs.append(asyncio.get_running_loop().create_future())
            return syncs[-1]

        m.journal = journal

        async def deliver(inc) -> None:
            pass

        for t, p in wire.frames:
            await m.receive(t, bytearray(p), deliver)
        pending = list(m._awaiting_ack.values())
        assert len(pending) == len(wire.frames) == 3 and not any(f.done() for f in pending)
        for fut in pending:
            for callback, _ctx in fut._callbacks:  # type: ignore[attr-defined]
                cells = [c.cell_contents for c in getattr(callback, "__closure__", None) or ()]
                assert not any(isinstance(v, Envelope) for v in cells), cells
        for f in syncs:
            f.set_result(None)
        await asyncio.wait(pending)
        assert not m._awaiting_ack

    asyncio.run(run())


def test_a_chunked_update_journaled_before_a_crash_is_handed_on_once_after_it(pki, tmp_path):
    """An agent's whole update, chunked: every chunk is journaled before it is handed on;
    a new messenger on the same state (the restarted coordinator) hands the update on
    from the journal, and the broker's redelivery of the same chunks is refused."""

    state = tmp_path / "coord"
    state.mkdir()
    weights = {"w": np.arange(3000, dtype=np.float32)}

    def receiver(journal: RoundJournal | None) -> Messenger:
        m = coordinator_messenger(pki, state, max_chunk_bytes=4096)
        if journal is not None:

            async def keep(topic, payload, env) -> None:
                journal.append(topic, payload)

            m.journal = keep
        return m

    async def run() -> None:
        wire = Capture()
        sender = agent_messenger(pki, wire, max_chunk_bytes=4096)
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        await sender.send(topic, Update(3, 2, 10, {"loss": 0.5}, weights), round_=3)
        assert len(wire.frames) == 3  # chunked

        journal = RoundJournal(state / "round-journal", max_frame=1 << 20)
        journal.begin(3, 2, ("agent-a",))
        got: list[Update] = []

        async def deliver(inc) -> None:
            got.append(inc.message)

        first = receiver(journal)
        for t, p in wire.frames:
            await first.receive(t, p, deliver)
        assert len(got) == 1 and journal.frames == len(wire.frames)
        del first  # the crash: only the state directory survives

        again = RoundJournal(state / "round-journal", max_frame=1 << 20)
        assert again.recover() == InFlight(3, 2, ("agent-a",))
        restarted = receiver(None)
        got.clear()
        for t, p in again.frames_of():
            await restarted.receive(t, p, deliver, journaled=True)
        assert len(got) == 1 and got[0].round == 3
        np.testing.assert_array_equal(got[0].weights["w"], weights["w"])
        for t, p in wire.frames:  # the broker sends the chunks again
            await restarted.receive(t, p, deliver)
        assert len(got) == 1 and restarted.rejected["replay"] == len(wire.frames)

    asyncio.run(run())


def test_with_grouped_syncs_no_sequence_number_is_durable_before_its_frames_record(pki, tmp_path, monkeypatch):
    """Frames are written unsynced and acknowledged after their group's sync; the replay
    guard's numbers of journaled frames go to disk later (the journal gives them back
    after a crash): not on the receive path, but within LAZY_DURABLE_S, and at once when
    the journal is about to drop frames (``persist_replay``). Each time the messenger
    asks for the journal's flush first, so after a power cut (unsynced writes gone) no
    frame the broker delivers again meets a number already on disk."""

    state = tmp_path / "coord"
    state.mkdir()
    weights = {"w": np.arange(3000, dtype=np.float32)}

    async def run() -> None:
        wire = Capture()
        for name in ("agent-a", "agent-b"):
            sender = Messenger(
                federation=FEDERATION, node_id=name, transport=wire, identity=identity(pki, name), max_chunk_bytes=4096
            )
            await sender.send_update(
                topics.direct(FEDERATION, name, COORDINATOR, "ustream"), Update(3, 2, 10, {}, weights)
            )
        assert len(wire.frames) >= 6
        m = coordinator_messenger(pki, state, max_chunk_bytes=4096)
        journal = RoundJournal(state / "round-journal", max_frame=1 << 20)
        journal.begin(3, 2, ("agent-a", "agent-b"))
        order: list[str] = []
        written = synced = 0

        async def keep(topic, payload, env):
            nonlocal written
            journal.write(topic, payload)
            written += 1
            order.append(f"write {written}")
            return asyncio.get_running_loop().create_future()  # acknowledged after a later sync

        async def flush() -> None:
            nonlocal synced
            journal.sync()
            synced = written
            order.append(f"sync {synced}")

        commit = m.replay_journal.commit

        def recorded_commit() -> None:
            if m.replay_journal.guard.dirty:  # (otherwise it writes nothing)
                order.append(f"replay commit (frames synced: {synced}, written: {written})")
                assert synced == written, "the replay guard's numbers would be durable before their frames"
            commit()

        m.journal = keep
        m.before_replay_commit = flush
        m.replay_journal.commit = recorded_commit  # type: ignore[method-assign]
        m.on_stream = lambda events: asyncio.sleep(0)
        monkeypatch.setattr(messaging, "LAZY_DURABLE_S", 0.05)
        half = len(wire.frames) // 2
        gates = [await m.receive(t, p, lambda inc: asyncio.sleep(0)) for t, p in wire.frames[:half]]
        assert all(g is not None and not g.done() for g in gates)  # none acknowledged by receive itself
        assert not any(o.startswith("replay commit") for o in order)  # not one per stream start
        await asyncio.sleep(0.3)  # the lazy commit, after a flush
        assert order[-2:] == [f"sync {half}", f"replay commit (frames synced: {half}, written: {half})"]
        for t, p in wire.frames[half:]:
            await m.receive(t, p, lambda inc: asyncio.sleep(0))
        await m.persist_replay()  # a round journal about to drop its frames
        n = len(wire.frames)
        assert order[-2:] == [f"sync {n}", f"replay commit (frames synced: {n}, written: {n})"]
        assert not m.replay_journal.guard.dirty
        await asyncio.sleep(0.2)  # the lazy commit still due finds nothing to do
        assert sum(o.startswith("replay commit") for o in order) == 2

    asyncio.run(run())


def test_a_lazy_replay_commit_leaves_out_a_frame_on_its_way_into_the_journal(pki, tmp_path, monkeypatch):
    """A frame whose number the replay guard took but that waits to be written (the
    journal is busy starting a round) while a lazy commit falls due: its number durable
    before its record, the broker's redelivery after a crash would be refused as a
    replay. Pass: every commit saves only numbers of frames whose records were synced
    (the waiting one is held out of the guard's saves); once through, it is saved too."""

    state = tmp_path / "coord"
    state.mkdir()
    monkeypatch.setattr(messaging, "LAZY_DURABLE_S", 0.02)

    async def run() -> None:
        wire = Capture()
        sender = agent_messenger(pki, wire)
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        for r in (3, 4):
            await sender.send(topic, Update(r, 2, 10, {}, {"w": np.ones(10, np.float32)}), round_=r)
        (t1, p1), (t2, p2) = wire.frames
        first, second = decode(p1).seq, decode(p2).seq
        m = coordinator_messenger(pki, state)
        journal = RoundJournal(state / "round-journal", max_frame=1 << 20)
        journal.begin(3, 2, ("agent-a",))
        busy = asyncio.Event()
        written: list[tuple[int, asyncio.Future[None]]] = []
        synced: set[int] = set()
        commits: list[set[int]] = []

        async def keep(topic, payload, env):
            if env.round == 4:
                await busy.wait()  # the journal's lock, held while a round starts
            journal.write(topic, payload)
            durable = asyncio.get_running_loop().create_future()
            written.append((env.seq, durable))
            return durable

        async def flush() -> None:
            journal.sync()
            for seq, durable in written:
                synced.add(seq)
                if not durable.done():
                    durable.set_result(None)  # acknowledged once durable

        commit = m.replay_journal.commit

        def recorded_commit() -> None:
            commit()
            records, _good, _torn = replaylog.parse((state / REPLAY_FILE).read_bytes(), m.verifier.replay)
            saved = {n for r in records for n in r["n"].get("agent-a", ())}
            assert saved <= synced, "a number durable before its frame's record"
            commits.append(saved)

        m.journal = keep
        m.before_replay_commit = flush
        m.replay_journal.commit = recorded_commit  # type: ignore[method-assign]
        await m.receive(t1, p1, lambda inc: asyncio.sleep(0))
        waiting = asyncio.create_task(m.receive(t2, p2, lambda inc: asyncio.sleep(0)))
        await asyncio.sleep(0.2)  # the lazy commit falls due while the second frame waits
        assert commits and commits[-1] == {first}
        busy.set()
        await waiting
        await flush()  # the journal's own group commit: the frame is acknowledged ...
        await asyncio.sleep(0.2)
        assert commits[-1] == {first, second}  # ... and its number saved within the lazy delay

    asyncio.run(run())


def test_a_frame_whose_handling_is_cancelled_in_the_journal_hook_is_taken_when_sent_again(pki, tmp_path):
    """The transport's reader is cancelled while a frame waits in the journal hook: the
    frame is never acknowledged, so the broker delivers it again. Pass: its number is in
    no save, and the next copy is taken and journaled."""

    state = tmp_path / "coord"
    state.mkdir()

    async def run() -> None:
        wire = Capture()
        sender = agent_messenger(pki, wire)
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        await sender.send(topic, Update(3, 2, 10, {}, {"w": np.ones(10, np.float32)}), round_=3)
        ((t, p),) = wire.frames
        m = coordinator_messenger(pki, state)
        blocked = asyncio.Event()
        kept: list[int] = []

        async def keep(topic, payload, env):
            if not kept and not blocked.is_set():
                blocked.set()
                await asyncio.Event().wait()  # the journal's lock, never given: cancelled here
            kept.append(env.seq)
            durable = asyncio.get_running_loop().create_future()
            durable.set_result(None)
            return durable

        m.journal = keep
        reading = asyncio.create_task(m.receive(t, p, lambda inc: asyncio.sleep(0)))
        await blocked.wait()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await m.persist_replay()
        seq = decode(p).seq
        assert seq not in m.verifier.replay.tops().get("agent-a", [])
        gate = await m.receive(t, p, lambda inc: asyncio.sleep(0))
        assert m.rejected["replay"] == 0 and kept == [seq] and gate is not None
        await gate
        assert await m.receive(t, p, lambda inc: asyncio.sleep(0)) is None and m.rejected["replay"] == 1

    asyncio.run(run())


def test_a_journaled_update_is_counted_in_hand_until_delivered_and_marked_journaled(pki, tmp_path):
    """A journal may be replaced only when no journaled frame is on its way to the round
    logic: the messenger counts a journaled frame from the journal's hook until its
    message is delivered, and marks the delivered message as journaled (the queue that
    holds it counts it next); a frame it does not journal is neither counted nor marked,
    and its number is made durable (the replay guard's flush) before it is delivered."""

    state = tmp_path / "coord"
    state.mkdir()

    async def run() -> None:
        wire = Capture()
        sender = agent_messenger(pki, wire)
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        await sender.send(topic, Update(3, 2, 10, {}, {"w": np.ones(10, np.float32)}), round_=3)
        await sender.send(topic, Update(4, 3, 10, {}, {"w": np.ones(10, np.float32)}), round_=4)
        (t1, p1), (t2, p2) = wire.frames
        m = coordinator_messenger(pki, state)
        seen: list[tuple[str, int]] = []

        async def keep(topic, payload, env):
            if env.round != 3:
                return None  # not journaled (a stale round, say)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

        async def flush() -> None:
            seen.append(("flush", m.journaled_in_hand))

        async def deliver(inc) -> None:
            seen.append(("deliver", m.journaled_in_hand))
            assert inc.journaled == (inc.message.round == 3)

        m.journal = keep
        m.before_replay_commit = flush
        await m.receive(t1, p1, deliver)
        # (journaled: its number is committed later, the journal gives it back after a crash)
        assert seen == [("deliver", 1)] and m.journaled_in_hand == 0
        seen.clear()
        await m.receive(t2, p2, deliver)
        assert seen == [("flush", 0), ("deliver", 0)] and m.journaled_in_hand == 0

    asyncio.run(run())


def test_a_frame_the_journal_cannot_take_is_handed_on_but_never_acknowledged(tmp_path, monkeypatch):
    """A full disk: the frame's write fails. It still goes to the round, but what its
    acknowledgement waits for fails with AckWithheld, so the transport never sends it
    and the broker delivers the frame again after the coordinator's restart (acknowledged,
    the exit at the next write would lose it). A failed sync withholds its frames too."""
    from types import SimpleNamespace

    from fedagent.coordinator.durability import JOURNALED_KINDS, DurableJournal
    from fedagent.errors import AckWithheld, StateWriteError

    kind = sorted(JOURNALED_KINDS)[0]
    env = SimpleNamespace(kind=kind, round=1, sender="agent-1")

    async def run() -> None:
        durable = DurableJournal(tmp_path / "round-journal", max_frame=1 << 20, per_sender=1 << 30)
        await durable.begin(1, 0, ("agent-1",))
        ok = await durable.frame(TOPIC, b"frame-1", env)  # type: ignore[arg-type]
        assert ok is not None
        await ok  # durable: acknowledged
        real_write = durable.journal.write

        def failing(why: str):
            def fail(*_a: object) -> None:
                raise StateWriteError(why)

            return fail

        monkeypatch.setattr(
            durable.journal, "write", failing("cannot append to round-journal: No space left on device")
        )
        gate = await durable.frame(TOPIC, b"frame-2", env)  # type: ignore[arg-type]
        assert gate is not None
        with pytest.raises(AckWithheld, match="No space left"):
            await gate
        monkeypatch.setattr(durable.journal, "write", real_write)

        monkeypatch.setattr(durable.journal, "sync", failing("fdatasync round-journal: Input/output error"))
        gate = await durable.frame(TOPIC, b"frame-3", env)  # type: ignore[arg-type]
        assert gate is not None
        with pytest.raises(AckWithheld, match="not durable"):
            await asyncio.wait_for(gate, 10)
        durable.close()
        durable.journal.close()

    asyncio.run(run())


def test_a_past_journal_gives_its_numbers_to_the_replay_guard_before_it_is_ended(pki, tmp_path):
    """The numbers of journaled frames reach the replay guard's file lazily: a restart
    that finds the journal past (its round already in the checkpoint) records them before
    it ends the journal, so a frame of that round sent again is still a replay."""

    from fedagent.coordinator.durability import DurableJournal
    from fedagent.security.replaylog import ReplayJournal
    from fedagent.security.signing import AuthError

    tls = pki.issue("agent-a", "agent")

    async def frames() -> list[tuple[str, bytes]]:
        wire = Capture()
        sender = Messenger(
            federation=FEDERATION, node_id="agent-a", transport=wire, identity=Identity.load(tls.cert, tls.key, tls.ca)
        )
        topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
        await sender.send(topic, Update(3, 2, 10, {}, {"w": np.ones(10, np.float32)}), round_=3)
        return wire.frames

    sent = asyncio.run(frames())
    journal = RoundJournal(tmp_path / "round-journal", max_frame=1 << 20)
    journal.begin(3, 2, ("agent-a",))
    for t, p in sent:
        journal.write(t, p)
    journal.sync()
    journal.close()

    guard = ReplayGuard()
    replay = ReplayJournal(tmp_path / "replay-guard.msgpack", guard, clock=lambda: 0.0)
    replay.load()
    durable = DurableJournal(tmp_path / "round-journal", max_frame=1 << 20, per_sender=1 << 30, replay=replay)
    assert durable.recover(4, 3, resumable=True, checkpoint_round=3) is None  # past: round 3 is checkpointed
    assert durable.journal.round is None
    replay.close()

    restarted = ReplayGuard()
    again = ReplayJournal(tmp_path / "replay-guard.msgpack", restarted, clock=lambda: 0.0)
    again.load()
    env = decode(sent[0][1])
    with pytest.raises(AuthError, match="replay"):
        restarted.check(env.sender, env.seq, env.ts, env.ts)
    again.close()
