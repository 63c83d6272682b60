"""Faults of the state directory: kill -9 in the middle of checkpoint writes and
a full disk, against the real checkpoint code and the real coordinator daemon."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fedfixtures import COORDINATOR, FEDERATION
from netfed import wait_for

from fedagent.coordinator.durability import DurableJournal
from fedagent.errors import EXIT_IOERR, AckWithheld, StateWriteError
from fedagent.local.federation import Federation
from fedagent.node.messaging import REPLAY_FILE, Messenger
from fedagent.protocols import topics
from fedagent.protocols.codec import decode
from fedagent.protocols.messages import Heartbeat, Update
from fedagent.protocols.rounds import RoundAggregated, RoundConfig, RoundMachine, UpdateReceived
from fedagent.security import replaylog
from fedagent.security.signing import Identity
from fedagent.storage import checkpoint, statefile
from fedagent.storage.statefile import TEMP_PREFIX, atomic_write, cleanup_temp_files

# A process that has imported everything once and forks a fresh checkpoint writer on
# request, so each kill costs a fork instead of an interpreter start.
ZYGOTE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import numpy as np
    from fedagent.storage import checkpoint
    path = Path(sys.argv[1])
    for line in sys.stdin:
        start = int(line)
        pid = os.fork()
        if pid == 0:
            i = start
            while True:
                w = {"layer.weight": np.full((128, 128), i, np.float32), "layer.bias": np.full(128, i, np.float32)}
                checkpoint.save(path, w, {"i": i, "round": i})
                i += 1
        print(pid, flush=True)
        os.waitpid(pid, 0)
""")


def kill_during_checkpoint_writes(tmp_path: Path, kills: int) -> dict[str, int]:
    target = tmp_path / "state" / "global.ckpt"
    target.parent.mkdir(parents=True)
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    rng = secrets.SystemRandom()
    seen = {"new": 0, "old": 0, "missing": 0, "temp_left": 0}
    last = -1
    try:
        for _ in range(kills):
            zygote.stdin.write(f"{last + 1}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.03))  # a random moment in the write loop, not synchronisation
            os.kill(pid, signal.SIGKILL)
            # The zygote reaps the child before it reads the next line; a load now sees
            # exactly what the dead writer left.
            loaded = checkpoint.load(target)  # raises on a torn or unreadable file
            if loaded is None:
                seen["missing"] += 1
                assert last == -1, "a checkpoint that existed disappeared"
            else:
                weights, meta = loaded
                i = meta["i"]
                assert set(weights) == {"layer.weight", "layer.bias"}
                assert weights["layer.weight"].shape == (128, 128)
                assert np.all(weights["layer.weight"] == i) and np.all(weights["layer.bias"] == i)
                assert i >= last, "a checkpoint went back to an older version"
                seen["new" if i > last else "old"] += 1
                last = i
            seen["temp_left"] += cleanup_temp_files(target.parent)
            assert [p.name for p in target.parent.iterdir()] in ([], ["global.ckpt"])
    finally:
        zygote.stdin.close()
        zygote.wait(10)
    return seen


def test_kill_9_during_checkpoint_writes_200_times(tmp_path):
    """Kill -9 during checkpoint writes (CI size): 200 kill -9 at random moments of a loop of
    ``checkpoint.save``. Pass: 0 unreadable checkpoints; every load gives one whole
    version (all tensors equal to the version number), never an older one. (Takes
    12-14 s here; its time is printed, not asserted: a busy CI machine is slower.)"""
    started = time.monotonic()
    seen = kill_during_checkpoint_writes(tmp_path, 200)
    took = time.monotonic() - started
    print(f"checkpoint kills: 200 kills in {took:.1f}s: {seen}")
    assert seen["new"] + seen["old"] + seen["missing"] == 200
    # The kills landed inside writes (temp files left) and between them (new versions):
    # the test exercised the window it is about.
    assert seen["temp_left"] > 0 and seen["new"] > 0


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_1000_times(tmp_path):
    """Kill -9 during checkpoint writes at full size: 1000 kill -9. Pass: 0 unreadable checkpoints."""
    seen = kill_during_checkpoint_writes(tmp_path, 1000)
    print(f"checkpoint kills: 1000 kills: {seen}")
    assert seen["new"] + seen["old"] + seen["missing"] == 1000 and seen["temp_left"] > 0


def test_atomic_write_orders_fsync_rename_dir_fsync(tmp_path, monkeypatch):
    """The mechanism the kill -9 tests rely on: data fsynced before the rename, the directory after it
    (Pillai et al.: without the directory fsync the rename itself may be lost)."""
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(a, b):
        calls.append("replace")
        real_replace(a, b)

    monkeypatch.setattr(statefile.os, "fsync", fsync)
    monkeypatch.setattr(statefile.os, "replace", replace)
    atomic_write(tmp_path / "x", b"data")
    assert calls == ["fsync-file", "replace", "fsync-dir"]


# -- disk full -----------------------------------------------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


class SmallDisk:
    """A tmpfs of a few hundred KiB mounted over ``path`` for the test, then unmounted."""

    def __init__(self, path: Path, size_kib: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
        self.filler = path / "filler"

    def fill(self) -> int:
        """Take every free byte; returns how many were written."""
        n = 0
        with open(self.filler, "ab", buffering=0) as f:
            chunk = b"\0" * 4096
            try:
                while True:
                    n += f.write(chunk)
            except OSError:
                pass
            try:
                while True:
                    n += f.write(b"\0")
            except OSError:
                pass
        return n

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@needs_root
def test_failed_writes_on_a_full_disk_leave_old_state_intact(tmp_path):
    """A full disk, library level. Pass: a clear StateWriteError (exit code 74),
    the old checkpoint still loads, no temp file and no half history line is left."""
    disk = SmallDisk(tmp_path / "state", 256)
    try:
        ckpt = disk.path / "global.ckpt"
        w = {"w": np.ones((64, 64), np.float32)}
        checkpoint.save(ckpt, w, {"round": 1})
        statefile.append_line(disk.path / "history.jsonl", b'{"round": 1}\n')
        disk.fill()
        with pytest.raises(StateWriteError, match="No space left on device; the previous version is intact") as exc:
            checkpoint.save(ckpt, {"w": np.full((64, 64), 2, np.float32)}, {"round": 2})
        assert exc.value.exit_code == EXIT_IOERR == 74
        with pytest.raises(StateWriteError, match="earlier records are intact"):
            statefile.append_line(disk.path / "history.jsonl", b'{"round": 2, "pad": "' + b"x" * 8192 + b'"}\n')
        weights, meta = checkpoint.load(ckpt)
        assert meta == {"round": 1} and np.all(weights["w"] == 1)
        assert (disk.path / "history.jsonl").read_bytes() == b'{"round": 1}\n'
        assert not [p for p in disk.path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    finally:
        disk.close()


class _Wire:
    """A transport that keeps what is published (the frames the broker would hold)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, **_kw) -> None:
        self.frames.append((topic, bytes(payload)))


def _identity(pki, name: str) -> Identity:
    tls = pki.issue(name, "coordinator" if name == COORDINATOR else "agent")
    return Identity.load(tls.cert, tls.key, tls.ca)


def _coordinator(pki, state: Path) -> tuple[Messenger, DurableJournal]:
    """A coordinator's receive path on ``state``: its messenger (the replay guard's
    journal in ``state``) with the round journal's hooks, as the FedAvg mode sets them."""
    m = Messenger(
        federation=FEDERATION,
        node_id=COORDINATOR,
        transport=_Wire(),
        identity=_identity(pki, COORDINATOR),
        state_dir=state,
    )
    durable = DurableJournal(state / "round-journal", max_frame=1 << 20, per_sender=1 << 30, replay=m.replay_journal)
    m.journal = durable.frame
    m.before_replay_commit = durable.flush
    return m, durable


def _refused_then_redelivered(
    pki, state: Path, lose: Callable[[DurableJournal], None], space_back: Callable[[], None] = lambda: None
) -> None:
    """An agent's heartbeat and update reach a coordinator's receive path (its messenger,
    round journal and replay guard's journal in ``state``); ``lose`` makes the update's
    journal record fail. Then the coordinator restarts (after ``space_back``): its replay
    guard from its file, the round journal read back, and the broker delivers the update
    again."""

    async def run() -> None:
        wire = _Wire()
        agent = Messenger(federation=FEDERATION, node_id="agent-a", transport=wire, identity=_identity(pki, "agent-a"))
        await agent.send(topics.direct(FEDERATION, "agent-a", COORDINATOR, "heartbeat"), Heartbeat(5.0))
        weights = {"w": np.arange(32768, dtype=np.float32)}  # a 128 KiB record
        await agent.send(topics.direct(FEDERATION, "agent-a", COORDINATOR, "update"), Update(3, 2, 10, {}, weights))
        (beat_topic, beat), (update_topic, update) = wire.frames
        seq = decode(update).seq
        got: list[Update] = []

        def saved(m: Messenger) -> set[int]:
            """The agent's numbers in the replay guard's file."""
            records, _good, _torn = replaylog.parse((state / REPLAY_FILE).read_bytes(), m.verifier.replay)
            return {n for r in records for n in r["n"].get("agent-a", ())}

        async def deliver(inc) -> None:
            if isinstance(inc.message, Update):
                got.append(inc.message)

        m, durable = _coordinator(pki, state)
        await durable.begin(3, 2, ("agent-a",))
        assert await m.receive(beat_topic, beat, deliver) is None
        lose(durable)
        gate = await m.receive(update_topic, update, deliver)
        assert gate is not None and len(got) == 1  # handed on to the round all the same
        with pytest.raises(AckWithheld):
            await asyncio.wait_for(gate, 30)  # so never acknowledged: the broker keeps it
        m.replay_journal.commit()  # the guard's next save (if the messenger's has not come yet)
        assert saved(m) and seq not in saved(m)  # its append went through, without the update's number
        durable.close()
        durable.journal.close()
        m.replay_journal.close()  # the exit (74 at the next write)
        space_back()

        got.clear()
        m, durable = _coordinator(pki, state)  # restarted, with space again
        assert durable.recover(3, 2, resumable=True, checkpoint_round=2) is not None
        for t, p in durable.journal.frames_of():
            await m.receive(t, p, deliver, journaled=True)
        assert got == []  # the round journal does not have the update
        gate = await m.receive(update_topic, update, deliver)  # the broker's redelivery
        assert m.rejected["replay"] == 0, m.recent_rejections
        assert len(got) == 1 and got[0].round == 3
        await m._persist_replay()  # the guard's commit after the round journal's flush ...
        assert seq in saved(m)  # ... has the number: the update's record is durable
        assert gate is not None
        await asyncio.wait_for(gate, 30)  # journaled and durable: acknowledged
        durable.close()
        durable.journal.close()
        m.replay_journal.close()

        got.clear()
        m, durable = _coordinator(pki, state)  # and once it is in the round journal, taken once only
        assert durable.recover(3, 2, resumable=True, checkpoint_round=2) is not None
        for t, p in durable.journal.frames_of():
            await m.receive(t, p, deliver, journaled=True)
        assert await m.receive(update_topic, update, deliver) is None
        assert len(got) == 1 and m.rejected["replay"] == 1
        durable.journal.close()
        m.replay_journal.close()

    asyncio.run(run())


@needs_root
def test_an_update_a_full_disk_kept_out_of_the_round_journal_is_taken_after_the_restart(pki, tmp_path):
    """A full disk refuses an update's round journal record (128 KiB) but takes the
    replay guard's next append (a few bytes, in the last page of its file), the case
    that lost updates. Pass: the update is handed on and not acknowledged; the restarted
    coordinator takes the broker's redelivery of it (its number was never saved), then
    refuses it once its round journal has it."""
    disk = SmallDisk(tmp_path / "state", 512)
    try:
        _refused_then_redelivered(pki, disk.path, lambda _durable: disk.fill(), disk.free)
    finally:
        disk.close()


def test_an_update_whose_record_sync_failed_is_taken_after_a_power_cut(pki, tmp_path):
    """The round journal's sync fails for an update (an I/O error) and the power is then
    cut: its record, written but not synced, is gone. Pass: the replay guard never saved
    the update's number (its flush before the guard's append failed), so the restarted
    coordinator takes the broker's redelivery."""
    state = tmp_path / "state"
    state.mkdir()

    def lose(durable: DurableJournal) -> None:
        journal = durable.journal
        real_sync = journal.sync

        def sync(generation: int | None = None) -> bool:
            durable_size = journal._durable
            try:
                raise StateWriteError(f"cannot sync {journal.path}: Input/output error")
            finally:
                # The power cut, early: what was never synced is not on the disk.
                os.truncate(journal.path, durable_size)
                journal.sync = real_sync  # type: ignore[method-assign]

        journal.sync = sync  # type: ignore[method-assign]

    _refused_then_redelivered(pki, state, lose)


def _withheld_then_redelivered_here(
    pki, state: Path, lose: Callable[[DurableJournal], None], space_back: Callable[[], None], *, records: int
) -> None:
    """Two agents' updates for a round; ``lose`` makes agent-a's journal record fail, so
    its acknowledgement is withheld. Then, without a restart (the connection to the broker
    comes back), the broker delivers it again to the same messenger (after
    ``space_back``), and a third time once it was taken. The round journal is left with
    ``records`` copies of it; a coordinator restarted from it aggregates it once."""

    def machine() -> RoundMachine:
        cfg = RoundConfig(rounds=10, min_agents=2, min_updates=2, round_timeout=600)
        rounds = RoundMachine(
            cfg, {"w": np.zeros(32768, np.float32)}, model_version=2, completed_rounds=2, last_round=3
        )
        rounds.resume(3, ("agent-a", "agent-b"), now=0.0)
        return rounds

    async def run() -> None:
        wire = _Wire()
        for name, value in (("agent-a", 1.0), ("agent-b", 3.0)):
            agent = Messenger(federation=FEDERATION, node_id=name, transport=wire, identity=_identity(pki, name))
            weights = {"w": np.full(32768, value, np.float32)}  # a 128 KiB record
            await agent.send(topics.direct(FEDERATION, name, COORDINATOR, "update"), Update(3, 2, 10, {}, weights))
        (a_topic, a_frame), (b_topic, b_frame) = wire.frames
        rounds = machine()
        out: list = []

        async def deliver(inc) -> None:
            u = inc.message
            out.extend(
                rounds.handle(
                    UpdateReceived(inc.sender, u.round, u.base_version, u.num_samples, u.weights, u.metrics), 1.0
                )
            )

        m, durable = _coordinator(pki, state)
        await durable.begin(3, 2, ("agent-a", "agent-b"))
        lose(durable)
        gate = await m.receive(a_topic, a_frame, deliver)
        assert gate is not None
        with pytest.raises(AckWithheld):
            await asyncio.wait_for(gate, 30)  # never acknowledged: the broker keeps it
        await asyncio.sleep(0)  # (the gate's callbacks)
        space_back()
        written = durable.journal.frames
        again = await m.receive(a_topic, a_frame, deliver)  # redelivered after the reconnection
        assert m.rejected["replay"] == 0, m.recent_rejections  # taken ...
        assert durable.journal.frames == written + 1  # ... journaled once ...
        assert again is not None
        await asyncio.wait_for(again, 30)  # ... durable, so acknowledged
        assert await m.receive(a_topic, a_frame, deliver) is None  # taken, so a replay now
        assert m.rejected["replay"] == 1
        last = await m.receive(b_topic, b_frame, deliver)
        assert last is not None
        await asyncio.wait_for(last, 30)
        aggregated = [c for c in out if isinstance(c, RoundAggregated)]
        assert len(aggregated) == 1 and aggregated[0].participants == ("agent-a", "agent-b")
        np.testing.assert_allclose(aggregated[0].weights["w"], 2.0)  # ... and aggregated once
        await m.persist_replay()
        durable.close()
        durable.journal.close()
        m.replay_journal.close()

        m, durable = _coordinator(pki, state)  # the journal alone aggregates each update once
        assert durable.recover(3, 2, resumable=True, checkpoint_round=2) is not None
        frames = list(durable.journal.frames_of())
        assert [p for _t, p in frames].count(a_frame) == records
        rounds = machine()
        out.clear()
        for t, p in frames:
            await m.receive(t, p, deliver, journaled=True)
        aggregated = [c for c in out if isinstance(c, RoundAggregated)]
        assert len(aggregated) == 1
        np.testing.assert_allclose(aggregated[0].weights["w"], 2.0)
        assert await m.receive(a_topic, a_frame, deliver) is None and m.rejected["replay"] == 1
        durable.journal.close()
        m.replay_journal.close()

    asyncio.run(run())


@needs_root
def test_an_update_a_full_disk_kept_out_of_the_round_journal_is_taken_when_the_broker_sends_it_again(pki, tmp_path):
    """A full disk refuses an update's round journal record; the coordinator goes on (the
    disk frees up before its next write of its own) and the broker, reconnected, delivers
    the update again. Pass: the same process takes it (its number left the replay guard
    with its withheld acknowledgement), journals it once and aggregates it once; a further
    copy is refused as a replay."""
    disk = SmallDisk(tmp_path / "state", 512)
    try:
        _withheld_then_redelivered_here(pki, disk.path, lambda _durable: disk.fill(), disk.free, records=1)
    finally:
        disk.close()


def test_an_update_whose_record_sync_failed_is_taken_when_the_broker_sends_it_again(pki, tmp_path):
    """The round journal's sync fails once (an I/O error) for an update, whose
    acknowledgement is then withheld; the broker, reconnected, delivers it again. Pass:
    the same process takes it, journals it once more (the first record was written, and
    its sync failed: it may or may not be on the disk, so the journal keeps both) and
    aggregates it once, then and from the journal after a restart."""
    state = tmp_path / "state"
    state.mkdir()

    def lose(durable: DurableJournal) -> None:
        journal = durable.journal
        real_sync = journal.sync

        def sync(generation: int | None = None) -> bool:
            journal.sync = real_sync  # type: ignore[method-assign]
            raise StateWriteError(f"cannot sync {journal.path}: Input/output error")

        journal.sync = sync  # type: ignore[method-assign]

    _withheld_then_redelivered_here(pki, state, lose, lambda: None, records=2)


def test_a_copy_delivered_while_its_frame_waits_for_a_failing_sync_is_not_acknowledged(pki, tmp_path):
    """The connection to the broker drops and comes back while an update's journal
    record is being synced; the broker delivers the update again meanwhile, and the sync
    then fails. Pass: the copy, refused while the first is in hand, is not acknowledged
    before the first is, and not at all once the first's acknowledgement is withheld
    (the broker would forget the update); the next delivery is taken and acknowledged."""
    import threading

    state = tmp_path / "state"
    state.mkdir()

    async def run() -> None:
        wire = _Wire()
        agent = Messenger(federation=FEDERATION, node_id="agent-a", transport=wire, identity=_identity(pki, "agent-a"))
        await agent.send(
            topics.direct(FEDERATION, "agent-a", COORDINATOR, "update"),
            Update(3, 2, 10, {}, {"w": np.ones(64, np.float32)}),
        )
        ((topic, frame),) = wire.frames
        m, durable = _coordinator(pki, state)
        await durable.begin(3, 2, ("agent-a",))
        journal = durable.journal
        real_sync = journal.sync
        syncing, fail = threading.Event(), threading.Event()

        def sync(generation: int | None = None) -> bool:
            syncing.set()
            fail.wait(30)
            journal.sync = real_sync  # type: ignore[method-assign]
            raise StateWriteError(f"cannot sync {journal.path}: Input/output error")

        journal.sync = sync  # type: ignore[method-assign]

        async def deliver(_inc) -> None:
            pass

        first = await m.receive(topic, frame, deliver)
        assert first is not None
        assert await asyncio.to_thread(syncing.wait, 30)
        copy = await m.receive(topic, frame, deliver)  # after the reconnection, the sync still running
        assert m.rejected["replay"] == 1
        assert copy is not None and not copy.done()  # its acknowledgement waits for the first's
        fail.set()
        for gate in (first, copy):
            with pytest.raises(AckWithheld):
                await asyncio.wait_for(gate, 30)
        await asyncio.sleep(0)  # (the gates' callbacks)
        again = await m.receive(topic, frame, deliver)  # after the next reconnection: taken
        assert m.rejected["replay"] == 1 and again is not None
        await asyncio.wait_for(again, 30)
        assert await m.receive(topic, frame, deliver) is None and m.rejected["replay"] == 2
        durable.close()
        journal.close()
        m.replay_journal.close()

    asyncio.run(run())


@pytest.mark.slow
@needs_root
def test_coordinator_on_a_full_disk_exits_74_and_resumes_when_space_returns(tmp_path):
    """A full disk with the real daemon: the coordinator's state directory fills up
    mid-federation. Pass: it exits with 74 (EX_IOERR) and a message naming the file and
    the cause; its checkpoint and history are intact (no corruption); started again on
    the still-full disk it fails the same way at once (no hang, no damage: systemd's
    start limit bounds the restarts); once space is freed it resumes and finishes with
    contiguous model versions, no round aggregated twice."""
    rounds = 4
    fed = Federation(tmp_path, agents=2, rounds=rounds, alpha=0.5, round_timeout=30)
    disk = SmallDisk(tmp_path / "state" / "coordinator", 512)
    try:
        fed.prepare()
        fed.start_all()
        coord = fed.procs[0]
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 1, 90, "a first round", fed)
        disk.fill()
        code = coord.popen.wait(60)
        fed.procs.remove(coord)
        out = coord.log.read_text()
        assert code == EXIT_IOERR, out[-2000:]
        assert "No space left on device" in out
        # the file being written when the disk filled: the checkpoint, the history or the
        # server momentum's velocity
        intact = (
            "previous version is intact",
            "earlier records are intact",
            "previous velocity and checkpoint are intact",
        )
        assert any(m in out for m in intact), out[-2000:]
        state = disk.path / "coordinator" / fed.fed
        weights, meta = checkpoint.load(state / "global.ckpt")
        records = [json.loads(line) for line in (state / "history.jsonl").read_text().splitlines()]
        done_before = [r["model_version"] for r in records if r["event"] == "round"]
        assert done_before == list(range(1, len(done_before) + 1)) and done_before
        assert meta["model_version"] in (done_before[-1], done_before[-1] + 1)
        assert not [p for p in state.iterdir() if p.name.startswith(TEMP_PREFIX)]
        # Still full: a restart fails the same way, quickly, and damages nothing.
        again = fed.spawn("coordinator")
        assert again.popen.wait(90) == EXIT_IOERR
        fed.procs.remove(again)
        assert checkpoint.load(state / "global.ckpt")[1] == meta
        disk.free()
        fed.spawn("coordinator")
        done = wait_for(
            lambda: (lambda s: s if s and s["phase"] == "done" else None)(fed.status("coordinator")),
            150,
            "the federation to finish after space returned",
            fed,
        )
        assert done["completed_rounds"] == rounds
        records = [json.loads(line) for line in (state / "history.jsonl").read_text().splitlines()]
        rounds_rec = [r for r in records if r["event"] == "round"]
        assert [r["model_version"] for r in rounds_rec] == list(range(1, rounds + 1))
        assert len({r["round"] for r in rounds_rec}) == rounds
        print(f"disk full: exited 74 after {len(done_before)} rounds; resumed and finished {rounds}")
    finally:
        fed.close()
        disk.close()


def test_units_bound_restarts_and_keep_roles_apart():
    """A full disk's "bounded restarts" in the units: Restart=on-failure retries exit 74 (freeing
    space is enough to resume) but the start limit can actually trigger: StartLimitBurst
    starts, RestartSec apart, fit inside StartLimitIntervalSec. Each role has its own
    state directory and certificate (the coordinator unit used the agent's)."""
    units = Path(__file__).resolve().parents[2] / "systemd"
    for role in ("agent", "coordinator"):
        text = (units / f"fedagent-{role}.service").read_text()
        keys: dict[str, list[str]] = {}
        for line in text.splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                keys.setdefault(k.strip(), []).append(v.strip())
        assert keys["Restart"] == ["on-failure"]
        assert "74" not in " ".join(keys["RestartPreventExitStatus"]).split()
        burst, interval = int(keys["StartLimitBurst"][0]), int(keys["StartLimitIntervalSec"][0])
        restart_sec = int(keys["RestartSec"][0])
        assert burst * restart_sec < interval, "the start limit could never trigger"
        assert keys["StateDirectory"] == [f"fedagent-{role}"] and keys["RuntimeDirectory"] == [f"fedagent-{role}"]
        assert f"node.crt:/etc/fedagent/tls/{role}.crt" in keys["LoadCredential"]
