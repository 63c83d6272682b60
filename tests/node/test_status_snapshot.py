"""The coordinator's status snapshot: never ahead of the disk (taken between events
only), and not rebuilt after every event (a snapshot sorts the agent lists: per update,
a round of N updates would cost O(N²))."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fedagent.coordinator import core as core_module
from fedagent.coordinator.core import CoordinatorCore, LivenessCheck
from fedagent.protocols.evaluation import HeldOut


class CountingMode:
    """A mode whose snapshot says how many events it has handled, and counts its builds."""

    title = "coordinator"

    def __init__(self) -> None:
        self.handled = 0
        self.built = 0
        self.in_event = asyncio.Event()
        self.hold: asyncio.Event | None = None

    async def start(self, now: float) -> None:
        return None

    async def on_item(self, item: Any, now: float) -> None:
        self.handled += 1
        if self.hold is not None:
            self.in_event.set()
            await self.hold.wait()  # in the middle of an event: e.g. a checkpoint being written

    def snapshot(self) -> dict[str, Any]:
        self.built += 1
        return {"handled": self.handled}


def bare_core(mode: CountingMode) -> CoordinatorCore:
    """Only what the event loop and the snapshot need (no broker, no disk)."""
    core = CoordinatorCore.__new__(CoordinatorCore)
    core.queue = asyncio.Queue()
    core.journaled_queued = 0
    core.mode = mode  # type: ignore[assignment]
    core.held_out = HeldOut()
    core._settled = core._take_snapshot()
    core._snapshot_at = 0.0
    core._stale = False
    core._idle = False
    core._snapshot_wake = None
    core._readers = []
    core._check_liveness = lambda item, now: asyncio.sleep(0)  # type: ignore[method-assign]
    return core


@contextlib.asynccontextmanager
async def processing(mode: CountingMode) -> AsyncIterator[CoordinatorCore]:
    """A bare core whose event loop runs for the ``async with`` block."""
    core = bare_core(mode)
    task = asyncio.create_task(core._process())
    try:
        yield core
    finally:
        task.cancel()
        if core._snapshot_wake is not None:
            core._snapshot_wake.cancel()


async def settled_loop(core: CoordinatorCore) -> None:
    """Until the core's event loop has taken every queued item and waits for the next."""
    while not (core.queue.empty() and core._idle):
        await asyncio.sleep(0)


def test_a_burst_of_events_builds_the_snapshot_once_and_a_reader_between_events_sees_them_all(monkeypatch):
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 3600.0)  # no refresh by time during the test

    async def run() -> None:
        mode = CountingMode()
        async with processing(mode) as core:
            core._snapshot_at = asyncio.get_running_loop().time()  # (time.monotonic: the same clock)
            for _ in range(50):
                core.queue.put_nowait(object())
            await settled_loop(core)
            assert mode.handled == 50
            assert mode.built == 1  # the one at construction: none per event, none for the burst
            assert core.settled == {"handled": 50, "held_out": {}}  # read between events: built now
            assert mode.built == 2
            assert core.settled == {"handled": 50, "held_out": {}} and mode.built == 2  # nothing new: not again

    asyncio.run(run())


def test_a_reader_in_the_middle_of_an_event_gets_the_last_settled_snapshot(monkeypatch):
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 3600.0)

    async def run() -> None:
        mode = CountingMode()
        async with processing(mode) as core:
            core.queue.put_nowait(object())
            await settled_loop(core)
            before = core.settled
            assert before == {"handled": 1, "held_out": {}}
            mode.hold = asyncio.Event()
            core.queue.put_nowait(object())
            await mode.in_event.wait()
            # The mode counted the event, but its disk work is not done: not shown yet, and
            # neither is an evaluation taken meanwhile (its version would be newer than the
            # one the kept snapshot shows).
            core.held_out.add("agent-1", 2, 10, {"accuracy": 0.9})
            assert mode.handled == 2 and core.settled == before
            mode.hold.set()
            await settled_loop(core)
            assert core.settled["handled"] == 2 and core.settled["held_out"]["model_version"] == 2

    asyncio.run(run())


def test_while_events_keep_coming_the_kept_snapshot_is_refreshed_in_time(monkeypatch):
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 0.05)

    async def run() -> None:
        mode = CountingMode()
        async with processing(mode) as core:
            core.queue.put_nowait(LivenessCheck(0.0))  # (not the mode's: the core's own item)
            core.queue.put_nowait(object())
            await settled_loop(core)
            while core._stale:  # nobody reads: the timer refreshes it once the time is up
                await asyncio.sleep(0.01)
            assert core._settled == {"handled": 1, "held_out": {}} and not core._stale

    asyncio.run(run())


def test_a_status_reader_in_the_middle_of_an_event_gets_the_snapshot_taken_when_it_ends(monkeypatch):
    """What status shows is never older than the reader's request: a reader that comes
    while an event is handled waits for its end (not for the next timed refresh)."""
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 3600.0)

    async def run() -> None:
        mode = CountingMode()
        async with processing(mode) as core:
            core.queue.put_nowait(object())
            assert (await core.settled_for_reader(wait=30))["handled"] == 1
            mode.hold = asyncio.Event()
            core.queue.put_nowait(object())
            await mode.in_event.wait()
            reader = asyncio.create_task(core.settled_for_reader(wait=30))
            await asyncio.sleep(0)
            assert not reader.done()  # the event is not over
            mode.hold.set()
            shown = await asyncio.wait_for(reader, 30)
            assert shown["handled"] == 2 and mode.built == 3

    asyncio.run(run())
