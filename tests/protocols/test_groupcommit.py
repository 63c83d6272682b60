"""Group commit for the round journal (fedagent.protocols.groupcommit): when a sync is due,
what is durable, and a trace of one round's intake with crashes at every step."""

from __future__ import annotations

import pytest

from fedagent.protocols.groupcommit import GroupCommit, GroupPolicy

FRAME = 540_000


def test_one_frame_waits_for_the_delay_then_one_sync_covers_everything_written():
    g = GroupCommit(GroupPolicy(max_frames=16, max_bytes=2**30, max_delay=0.1))
    assert not g.due(0.0) and g.deadline() is None
    assert g.write(FRAME, 0.0) == 1
    assert not g.due(0.05)
    assert g.deadline() == pytest.approx(0.1)
    g.write(FRAME, 0.06)
    assert g.due(0.1)
    upto = g.start()
    assert upto == 2 and g.durable == 0
    # written while the sync runs: waits for the next one, which cannot start meanwhile
    g.write(FRAME, 0.11)
    assert not g.due(1.0) and g.deadline() is None
    g.finished(upto)
    assert g.durable == 2 and g.waiting == 1
    assert g.deadline() == pytest.approx(0.21)  # the delay counts from frame 3's write
    assert not g.due(0.2) and g.due(0.22)
    g.finished(g.start())
    assert g.durable == 3 and g.waiting == 0 and not g.due(9.0)
    assert g.syncs == 2


@pytest.mark.parametrize("policy", [GroupPolicy(max_frames=4), GroupPolicy(max_bytes=3 * FRAME)])
def test_a_full_group_is_synced_without_waiting_for_the_delay(policy):
    g = GroupCommit(policy)
    for i in range(3):
        g.write(FRAME, 0.0)
        assert g.due(0.0) == (isinstance(policy.max_bytes, int) and policy.max_bytes == 3 * FRAME and i == 2)
    if not g.due(0.0):
        g.write(FRAME, 0.0)
        assert g.due(0.0)
    assert g.start() == g.written


def test_a_barrier_makes_the_sync_due_now_and_a_flush_covers_a_sync_in_flight():
    g = GroupCommit(GroupPolicy(max_delay=10.0))
    g.barrier()  # nothing written: nothing to do
    assert not g.due(0.0)
    g.write(100, 0.0)
    g.barrier()
    assert g.due(0.0)
    first = g.start()
    g.write(100, 0.0)
    g.write(100, 0.0)
    # a barrier that cannot wait: synced on the spot, covering the sync in flight too
    assert g.flushed() == 3 and g.durable == 3
    g.finished(first)  # the earlier sync ends later: nothing goes backwards
    assert g.durable == 3 and g.syncing is None and not g.due(100.0)


def test_settling_releases_every_frame_written_and_a_late_sync_changes_nothing():
    g = GroupCommit()
    for _ in range(5):
        g.write(FRAME, 0.0)
    upto = g.start()
    g.write(FRAME, 0.0)
    g.settle()  # the round's journal was replaced after its checkpoint
    assert g.durable == 6 and g.waiting == 0 and g.deadline() is None
    g.finished(upto)
    assert g.durable == 6
    g.write(FRAME, 1.0)  # the next round's first frame
    assert g.durable == 6 and g.waiting == 1


def test_policy_is_validated():
    for bad in ({"max_frames": 0}, {"max_bytes": 0}, {"max_delay": -1.0}, {"max_delay": float("nan")}):
        with pytest.raises(ValueError):
            GroupPolicy(**bad)


def intake_trace(policy: GroupPolicy, *, sync_s: float, crash_at: int | None = None) -> dict:
    """One round's intake as the coordinator sees it: 10 updates of 9 frames, one frame
    every 21 ms, an update's first frame a replay-guard barrier (a stream starts), each
    sync taking ``sync_s``. A model of the disk keeps what a sync made durable; the
    acknowledgements are the frames up to ``g.durable``, sent in order. ``crash_at``: the
    machine loses power after that many events (unsynced writes are gone)."""
    g = GroupCommit(policy)
    disk_durable = 0  # frames a completed fdatasync covers
    acked = 0
    events: list[tuple[float, str, int]] = []
    t = 0.0
    n = 0
    for _update in range(10):
        for k in range(9):
            n += 1
            events.append((t, "frame", n if k else -n))  # negative: the head (a barrier)
            t += 0.021
    events.sort()
    syncing_until: float | None = None
    syncing_upto = 0
    step = 0
    i = 0
    now = 0.0
    while i < len(events) or g.syncing is not None or g.waiting:
        # the next thing to happen: a frame arrives, the sync in flight ends, or a deadline
        candidates = []
        if i < len(events):
            candidates.append(events[i][0])
        if syncing_until is not None:
            candidates.append(syncing_until)
        if g.deadline() is not None:
            candidates.append(g.deadline())
        now = max(now, min(candidates))
        if syncing_until is not None and now >= syncing_until:
            disk_durable = max(disk_durable, syncing_upto)
            g.finished(syncing_upto)
            syncing_until = None
        elif i < len(events) and events[i][0] <= now:
            _, _, num = events[i]
            i += 1
            g.write(FRAME, now)
            if num < 0:  # the replay guard is about to be committed: flush first
                g.flushed()
                disk_durable = g.written
        if g.due(now):
            syncing_upto = g.start()
            syncing_until = now + sync_s
        # acknowledgements: in order, only what is durable
        assert g.durable >= acked
        acked = g.durable
        # the invariant: nothing acknowledged is lost if the power goes now
        assert acked <= disk_durable, f"frame {acked} acknowledged, only {disk_durable} on disk"
        step += 1
        if crash_at is not None and step >= crash_at:
            return {"acked": acked, "durable": disk_durable, "written": g.written, "syncs": g.syncs}
    return {"acked": acked, "durable": disk_durable, "written": g.written, "syncs": g.syncs, "end": now}


def test_a_round_of_frames_needs_far_fewer_syncs_and_every_frame_is_acknowledged():
    policy = GroupPolicy()
    out = intake_trace(policy, sync_s=0.004)
    assert out["acked"] == out["written"] == 90
    # one flush per update (its head) and a sync when the delay runs out in between: at
    # most two per update instead of nine
    assert out["syncs"] <= 20
    # acknowledged soon after the last frame: the delay bounds what the broker keeps
    assert out["end"] - 89 * 0.021 <= policy.max_delay + 0.004 + 1e-9
    one_each = intake_trace(GroupPolicy(max_frames=1), sync_s=0.004)
    assert one_each["syncs"] == 90 and one_each["acked"] == 90


@pytest.mark.parametrize("sync_s", [0.001, 0.03, 0.2])
def test_a_power_loss_at_any_step_loses_only_frames_never_acknowledged(sync_s):
    full = intake_trace(GroupPolicy(), sync_s=sync_s)
    assert full["acked"] == 90
    for crash_at in range(1, 200):
        out = intake_trace(GroupPolicy(), sync_s=sync_s, crash_at=crash_at)
        assert out["acked"] <= out["durable"] <= out["written"]


def test_a_flush_covers_only_the_frames_written_before_it_started():
    g = GroupCommit(GroupPolicy(max_delay=10.0))
    g.write(100, 0.0)
    g.write(100, 0.0)
    upto = g.written  # the flush starts here, in a worker thread
    g.write(100, 0.5)  # another task hands a frame on meanwhile
    assert g.flushed(upto) == 2
    assert g.durable == 2 and g.waiting == 1 and g.deadline() is not None
