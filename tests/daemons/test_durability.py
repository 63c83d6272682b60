"""The coordinator's durable intake (fedagent.coordinator.durability): an update frame of
the round in flight is journaled, and its acknowledgement waits for the sync that makes
it durable; everything else is acknowledged when handled."""

from __future__ import annotations

import asyncio
import json

from fedagent.coordinator.durability import DurableJournal, reconcile_history
from fedagent.node.runtime import History
from fedagent.protocols.codec import Envelope
from fedagent.protocols.groupcommit import GroupPolicy
from fedagent.protocols.messages import Update
from fedagent.storage.roundjournal import InFlight, RoundJournal

FED = "lab"
TOPIC = f"fedagent/v1/{FED}/node/agent-1/to/coordinator/update"


def env(kind: str = Update.kind, *, sender: str = "agent-1", round_: int = 3) -> Envelope:
    return Envelope(kind, FED, sender, round_, 1, 0.0, {})


def durable(tmp_path, **policy) -> DurableJournal:
    return DurableJournal(tmp_path / "round-journal", max_frame=1 << 20, per_sender=1000, policy=GroupPolicy(**policy))


def test_a_frame_is_acknowledged_once_durable_and_a_restart_finds_it(tmp_path, arun):
    async def main() -> None:
        d = durable(tmp_path, max_delay=10.0)
        await d.begin(3, 2, ("agent-1", "agent-2"))
        gate = await d.frame(TOPIC, b"x" * 100, env())
        assert gate is not None and not gate.done()  # written, not yet synced
        await d.flush()  # the barrier the replay guard asks for
        assert gate.done()
        d.close()

    arun(main())
    again = RoundJournal(tmp_path / "round-journal", max_frame=1 << 20)
    assert again.recover() == InFlight(3, 2, ("agent-1", "agent-2"))
    assert list(again.frames_of()) == [(TOPIC, b"x" * 100)]


def test_the_delay_runs_out_and_one_sync_releases_every_frame_written(tmp_path, arun):
    async def main() -> None:
        d = durable(tmp_path, max_delay=0.5)
        await d.begin(3, 2, ("agent-1", "agent-2"))
        d.count_round()
        gates = [await d.frame(TOPIC, bytes([i]) * 10, env(sender=f"agent-{1 + i % 2}")) for i in range(4)]
        assert all(g is not None for g in gates)
        await asyncio.wait_for(asyncio.gather(*gates), 5)
        assert d.group.durable == 4
        assert d.round_syncs() == {"journal": 1, "replay": 0, "frames": 4}  # the round's disk cost
        d.close()

    arun(main())


def test_what_is_not_an_update_of_the_round_in_flight_is_not_journaled(tmp_path, arun):
    async def main() -> None:
        d = durable(tmp_path, max_delay=10.0)
        assert await d.frame(TOPIC, b"x", env()) is None  # no round in flight
        await d.begin(3, 2, ("agent-1",))
        assert await d.frame(TOPIC, b"x", env("heartbeat")) is None
        assert await d.frame(TOPIC, b"x", env(round_=2)) is None  # stale
        assert await d.frame(TOPIC, b"x", env(sender="agent-9")) is None  # not selected
        assert await d.frame(TOPIC, b"x" * 1001, env()) is None  # more than an update's worth
        assert d.journal.frames == 0
        d.close()

    arun(main())


def test_the_round_ending_settles_the_frames_waiting_for_a_sync(tmp_path, arun):
    async def main() -> None:
        d = durable(tmp_path, max_delay=10.0)
        await d.begin(3, 2, ("agent-1",))
        gate = await d.frame(TOPIC, b"x" * 10, env())
        assert gate is not None and not gate.done()
        await d.end()  # the round is in the checkpoint: its frames need no sync
        assert gate.done() and d.journal.round is None
        d.close()

    arun(main())


def test_a_round_is_ended_only_while_the_journal_is_still_its_own(tmp_path, arun):
    async def main() -> None:
        d = durable(tmp_path, max_delay=10.0)
        await d.begin(3, 2, ("agent-1",))
        await d.begin(4, 2, ("agent-1",))  # the next round began before round 3's result went up
        await d.end_round(3)
        assert d.journal.round == InFlight(4, 2, ("agent-1",))
        await d.end_round(4)
        assert d.journal.round is None
        await d.end_round(4)  # nothing left: nothing done
        d.close()

    arun(main())


def test_a_restart_takes_up_only_the_round_the_checkpoint_started(tmp_path, arun):
    def restarted_with(round_: int, version: int, *, resumable: bool = True) -> InFlight | None:
        async def main() -> None:
            d = durable(tmp_path, max_delay=10.0)
            await d.begin(3, 2, ("agent-1",))
            await d.frame(TOPIC, b"x", env())
            await d.flush()
            d.close()

        arun(main())
        again = durable(tmp_path)
        return again.recover(round_, version, resumable=resumable, checkpoint_round=round_ - 1)

    assert restarted_with(3, 2) == InFlight(3, 2, ("agent-1",))
    # Aggregated before the crash (the checkpoint is newer), or a round the machine cannot
    # take up (a secure one): the journal is past, and ended.
    for round_, version, resumable in ((4, 3, True), (3, 2, False)):
        assert restarted_with(round_, version, resumable=resumable) is None
        assert RoundJournal(tmp_path / "round-journal", max_frame=1 << 20).recover() is None


def test_a_round_line_a_crash_left_out_is_restored_from_the_checkpoint_once(tmp_path):
    history = History(tmp_path / "history.jsonl")
    history.append({"event": "round", "round": 1, "model_version": 1})
    meta = {"model_version": 2, "round": 2, "participants": ["agent-1"], "metrics": {"loss": 0.5}}
    reconcile_history(history, meta)  # the process stopped between checkpoint and history
    reconcile_history(history, meta)  # the next restart finds the line there
    lines = [json.loads(line) for line in history.path.read_text().splitlines()]
    assert [(r["model_version"], r.get("recovered")) for r in lines] == [(1, None), (2, True)]
    assert lines[1]["participants"] == ["agent-1"] and lines[1]["metrics"] == {"loss": 0.5}
