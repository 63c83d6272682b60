"""An asynchronous coordinator's round journal rewritten at a model (fedagent.coordinator.compaction,
RoundJournal.rewrite_*, DurableJournal.rewrite): bounded while some update is always in
transfer, and never without a frame a restart still needs."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import powercut
import pytest
from fedfixtures import COORDINATOR, FEDERATION, ident

from fedagent.coordinator.compaction import JournalBound, JournalSift, Key
from fedagent.coordinator.durability import DurableJournal
from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.codec import decode
from fedagent.protocols.limits import Limits
from fedagent.protocols.messages import AsyncUpdate, Update
from fedagent.protocols.streaming import UpdateEnd, UpdateHead
from fedagent.storage import statefile
from fedagent.storage.roundjournal import InFlight, RoundJournal

CHUNK = 4096
WIRE = Limits(max_message_bytes=CHUNK + 4096, max_bin_len=CHUNK + 4096)
MODEL = Limits(max_message_bytes=1 << 20, max_bin_len=1 << 20, max_tensor_bytes=1 << 20)
MAX_STALENESS = 4


class Capture:
    """A transport that keeps what is published (no broker)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, **_kw) -> None:
        self.frames.append((topic, bytes(payload)))


class Agent:
    """An agent's messenger; each call returns the frames of one update and its transfer id."""

    def __init__(self, pki, name: str) -> None:
        self.name = name
        pki.issue(name, "agent")
        self.wire = Capture()
        self.m = Messenger(
            federation=FEDERATION,
            node_id=name,
            transport=self.wire,
            identity=ident(pki, name),
            max_chunk_bytes=CHUNK,
        )
        self.topic = topics.direct(FEDERATION, name, COORDINATOR, "update")

    def _sent(self, before: int) -> list[tuple[str, bytes]]:
        return self.wire.frames[before:]

    async def stream(self, task: int, base: int, size: int = 3000) -> list[tuple[str, bytes]]:
        before = len(self.wire.frames)
        await self.m.send_update(self.topic, Update(task, base, 10, {}, {"w": np.full(size, task, np.float32)}))
        return self._sent(before)

    async def whole(self, task: int, base: int, size: int) -> list[tuple[str, bytes]]:
        before = len(self.wire.frames)
        msg = AsyncUpdate(task, base, 10, {}, {"w": np.full(size, task, np.float32)})
        await self.m.send(self.topic, msg, round_=task)
        return self._sent(before)


def test_a_busy_journal_rewritten_at_each_model_stays_bounded_and_keeps_every_frame_a_restart_needs(pki, tmp_path):
    """Forty models; at each one agent c's update is half sent (its other half comes while
    the journal is rewritten), so the journal is never quiet enough to be replaced. Agents
    a and b stream updates the model takes, w sends whole updates (chunked, or one frame),
    d sends one the buffer refused, e leaves a transfer unfinished for good. Pass: the
    journal never holds more than a few models' frames while 40 models' go through it;
    after each rewrite it holds every frame of every update the checkpoint neither holds
    nor makes too stale (c's in transfer, d's until it is too stale), and none of the
    others; its counters are what a restart reads; a restarted coordinator's messenger
    reads c's update back whole from it."""
    path = tmp_path / "round-journal"

    async def run() -> None:
        agents = {n: Agent(pki, n) for n in ("a", "b", "c", "d", "e", "w")}
        durable = DurableJournal(path, max_frame=1 << 20, per_sender=1 << 30)
        journal = durable.journal
        journal.begin(1, 0, ())
        bound = JournalBound(48 * 1024)
        updates: dict[Key, list[tuple[str, bytes]]] = {}  # every update written, by key
        accepted: dict[Key, int] = {}  # key -> the model that took it
        orphan: list[tuple[str, bytes]] = []
        task = 0
        written = peak = rewrites = 0

        def write(frames: list[tuple[str, bytes]]) -> None:
            nonlocal written
            for t, d in frames:
                journal.write(t, d)
                written += len(d)
            journal.sync()  # durable: acknowledged

        c_next: list[tuple[str, bytes]] = []  # the rest of c's update in transfer
        c_key: Key | None = None
        c_tid = ""
        for v in range(1, 41):
            for name in ("a", "b"):
                task += 1
                k = (name, task, v - 1)
                updates[k] = await agents[name].stream(task, v - 1)
                write(updates[k])
                accepted[k] = v
            if v % 3 == 0:
                task += 1
                k = ("w", task, v - 1)
                updates[k] = await agents["w"].whole(task, v - 1, 3000)  # chunked
                assert len(updates[k]) > 1
                write(updates[k])
                accepted[k] = v
            if v % 5 == 0:
                task += 1
                k = ("w", task, v - 1)
                updates[k] = await agents["w"].whole(task, v - 1, 20)  # one frame
                assert len(updates[k]) == 1
                write(updates[k])
                accepted[k] = v
            if v == 2:
                task += 1
                k = ("d", task, 1)
                updates[k] = await agents["d"].stream(task, 1)  # refused: never in a model
                write(updates[k])
            if v == 3:
                task += 1
                orphan = (await agents["e"].stream(task, 2))[:1]  # its link went for good
                write(orphan)
            # c: the update begun at the model before is taken by this one; a new one starts.
            if c_key is not None:
                accepted[c_key] = v
            task += 1
            c_key = ("c", task, v - 1)
            updates[c_key] = await agents["c"].stream(task, v - 1, size=6000)
            half = len(updates[c_key]) // 2
            write(updates[c_key][:half])
            c_next = updates[c_key][half:]
            c_tid = _tid(updates[c_key][0][1])

            # Model v is checkpointed: it holds what it took within the staleness bound.
            floor = v - MAX_STALENESS
            held = [k for k, at in accepted.items() if at <= v and k[2] >= floor]
            peak = max(peak, journal.size)
            if not bound.due(journal.size):
                write(c_next)
                continue
            mark = journal.rewrite_mark()
            sift = JournalSift(held=held, floor=floor, live={("c", c_tid)}, wire_limits=WIRE, model_limits=MODEL)

            def choose(records, sift=sift, tail=c_next):
                for rec in records:
                    sift.feed(*rec)
                write(tail)  # frames go on being journaled while the rewrite runs
                return sift.kept()

            assert await durable.rewrite(mark, InFlight(v + 1, v, ()), choose)
            rewrites += 1
            bound.rewritten(journal.size)
            on_disk = set(journal.frames_of())
            for k, frames in updates.items():
                needed = k not in held and k[2] >= floor
                if needed:
                    assert set(frames) <= on_disk, f"model {v}: frames of {k} lost"
                else:
                    assert not set(frames) & on_disk, f"model {v}: frames of {k} kept"
            assert not set(orphan) & on_disk
            again = RoundJournal(path, max_frame=1 << 20)
            assert again.recover() == InFlight(v + 1, v, ())
            assert (again.frames, again.bytes, again.by_sender) == (journal.frames, journal.bytes, journal.by_sender)
            again.close()

        assert rewrites >= 10
        per_model = written / 40
        assert peak < 6 * per_model, (peak, per_model)  # a few models' worth, not forty
        journal.close()

        # The restart: every frame of c's update in transfer is read back, and it is whole.
        state = tmp_path / "restarted"
        state.mkdir()
        restarted = Messenger(
            federation=FEDERATION,
            node_id=COORDINATOR,
            transport=Capture(),
            identity=ident(pki, COORDINATOR),
            max_chunk_bytes=CHUNK,
            state_dir=state,
        )
        events: list[object] = []

        async def on_stream(evs) -> None:
            events.extend(evs)

        async def deliver(inc) -> None:
            events.append(inc.message)

        restarted.on_stream = on_stream
        again = RoundJournal(path, max_frame=1 << 20)
        assert again.recover() is not None
        for t, d in again.frames_of():
            await restarted.receive(t, d, deliver, journaled=True)
        heads = {(e.sender, e.round, e.base_version) for e in events if isinstance(e, UpdateHead)}
        assert c_key in heads
        assert UpdateEnd("c", c_tid, True) in events
        again.close()

    asyncio.run(run())


def _tid(frame: bytes) -> str:
    return str(decode(frame, WIRE, views=True).body["tid"])


def test_an_unfinished_transfer_is_kept_unless_known_to_be_over(pki, tmp_path):
    """A transfer with frames missing is kept while it may still finish (``live``), or
    when that is not known (``live=None``: a frame in the messenger's hands); one known
    to be over is left out. Frames that no replay could take (not an envelope, another
    kind of update) are left out; an update the checkpoint holds, or too stale, too."""

    async def run() -> None:
        e, a = Agent(pki, "e"), Agent(pki, "a")
        partial = (await e.stream(7, 3))[:2]
        stale = await a.stream(8, 1)
        mine = await a.stream(9, 3)
        before = len(a.wire.frames)
        await a.m.send(a.topic, Update(10, 3, 10, {}, {"w": np.ones(5, np.float32)}), round_=10)
        other_kind = a.wire.frames[before:]  # a round's update: an asynchronous coordinator takes none
        frames = [*partial, *stale, *mine, *other_kind, (a.topic, b"\x00not an envelope")]
        pos = 0
        spans = []
        for t, d in frames:
            spans.append((pos, pos + len(d), t, d))
            pos += len(d)

        def kept(live, held=()) -> set[bytes]:
            sift = JournalSift(held=held, floor=2, live=live, wire_limits=WIRE, model_limits=MODEL)
            for rec in spans:
                sift.feed(*rec)
            keep = {(s, e_) for s, e_, _ in sift.kept()}
            return {d for s, e_, _t, d in spans if (s, e_) in keep}

        tid = _tid(partial[0][1])
        assert kept({("e", tid)}) == {d for _t, d in partial + mine}
        assert kept(None) == {d for _t, d in partial + mine}
        assert kept(set()) == {d for _t, d in mine}
        assert kept(set(), held=[("a", 9, 3)]) == set()

    asyncio.run(run())


class Cut(Exception):
    """The power goes."""


@pytest.mark.parametrize("seed", [1, 2])
def test_a_power_cut_at_any_point_of_a_rewrite_leaves_a_journal_with_every_needed_frame(tmp_path, seed):
    """A rewrite cut by a power loss before each of its syncs and renames in turn (and
    once after all of them), with the unsynced bytes partly kept at random: the journal
    found after each cut is the old one or the new one, whole, with every frame the
    checkpoint does not hold (including one acknowledged while the rewrite ran); a
    leftover new file is a temporary file the coordinator removes when it starts."""
    rng = random.Random(seed)
    frames = [("fedagent/v1/f/node/a/to/coordinator/update", bytes([i]) * (300 + i)) for i in range(8)]
    needed = frames[5:]  # the first five are in the checkpoint
    late = ("fedagent/v1/f/node/a/to/coordinator/update", b"late" * 100)  # written during the rewrite
    k = 0
    while True:
        root, trace = tmp_path / f"cut{k}" / "disk", tmp_path / f"cut{k}" / "trace"
        root.mkdir(parents=True)
        path = root / "round-journal"
        j = RoundJournal(path, max_frame=1 << 20)
        j.begin(2, 1, ())
        for t, d in frames:
            j.append(t, d)
        powercut.install(root, trace)
        calls = 0
        wrapped = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace")}

        def counting(name):
            def call(*args):
                nonlocal calls
                if calls == k:
                    raise Cut(name)
                calls += 1
                return wrapped[name](*args)

            return call

        finished = False
        try:
            for name in wrapped:
                os.__dict__[name] = counting(name)
            mark = j.rewrite_mark()
            keep = [(a, b, "a") for a, b, t, d in j.frame_records(mark.upto) if (t, d) in needed]
            j.rewrite_write(mark, InFlight(3, 2, ()), keep)
            j.append(*late)
            j.rewrite_commit(mark)
            finished = True
        except Cut:
            pass
        finally:
            powercut.uninstall()
            j.close()
        powercut.restore(root, trace, rng)
        statefile.cleanup_temp_files(root)
        assert sorted(p.name for p in root.iterdir()) == ["round-journal"]
        again = RoundJournal(path, max_frame=1 << 20)
        inflight = again.recover()
        got = list(again.frames_of())
        again.close()
        if inflight == InFlight(2, 1, ()):
            assert got[: len(frames)] == frames and got[len(frames) :] in ([], [late])
        else:
            assert inflight == InFlight(3, 2, ()), inflight
            assert got in (needed, [*needed, late])
        if finished:
            assert inflight == InFlight(3, 2, ()) and got == [*needed, late]
            break
        k += 1
    assert k >= 4  # cut before: the new file's sync, the late frame's, the tail's sync, the rename


def test_the_asynchronous_coordinator_keeps_what_its_messenger_still_assembles(pki, tmp_path):
    """The asynchronous coordinator's part (AsyncMode, around a stand-in of its core): the
    transfers it passes as live are those pending in its messenger, queued or being added;
    while a journaled frame is in the messenger's hands, every unfinished one is kept.
    Pass: a rewrite at model 1 drops the update the checkpoint holds and keeps both
    unfinished transfers while a frame is in hand; the next drops the one no longer
    pending anywhere and keeps the one the messenger still assembles."""
    from types import SimpleNamespace

    from fedagent.coordinator.fedbuff import AsyncMode
    from fedagent.coordinator.streams import StreamFeed
    from fedagent.protocols.chunking import Reassembler
    from fedagent.protocols.streaming import StreamIntake

    async def run() -> None:
        a, c, e = Agent(pki, "a"), Agent(pki, "c"), Agent(pki, "e")
        taken = await a.stream(1, 0)
        assembling = (await c.stream(2, 0))[:1]
        over = (await e.stream(3, 0))[:1]
        durable = DurableJournal(tmp_path / "round-journal", max_frame=1 << 20, per_sender=1 << 30)
        durable.journal.begin(1, 0, ())
        for t, d in taken + assembling + over:
            durable.journal.write(t, d)
        durable.journal.sync()
        intake = StreamIntake(FEDERATION, max_transfer_bytes=1 << 20, max_pending_bytes=1 << 20, timeout=30.0)
        intake.feed("c", decode(assembling[0][1], WIRE, views=True).body, 0.0)
        messenger = SimpleNamespace(
            journaled_in_hand=1,
            intake=intake,
            reassembler=Reassembler(1 << 20, 1 << 20, 30.0),
            wire_limits=WIRE,
            model_limits=MODEL,
        )
        mode = SimpleNamespace(
            durability=durable,
            core=SimpleNamespace(messenger=messenger),
            streams=StreamFeed(asyncio.Queue()),
            machine=SimpleNamespace(inflight={}),
            config=SimpleNamespace(max_staleness=4),
            journal_bound=JournalBound(1),
            journal_rewrites=0,
        )
        mode._live_transfers = lambda: AsyncMode._live_transfers(mode)
        await AsyncMode._rewrite_journal(mode, 1, [["a", 1, 0]])
        assert list(durable.journal.frames_of()) == assembling + over
        messenger.journaled_in_hand = 0
        await AsyncMode._rewrite_journal(mode, 1, [["a", 1, 0]])
        assert list(durable.journal.frames_of()) == assembling
        assert mode.journal_rewrites == 2 and mode.journal_bound.left == durable.journal.size
        durable.journal.close()

    asyncio.run(run())
