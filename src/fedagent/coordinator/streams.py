"""Streamed updates on their way from the messenger to a coordinator's machine.

The messenger hands over each chunk's events (an update's header, its parts, its end)
and acknowledges the chunk when the hand-over returns. The parts go through the
coordinator's one queue, so its machine sees them in order with presence changes and
timer wake-ups; each part is a chunk-sized view, folded and dropped when its turn comes.
Holding the hand-over while more than a budget of values waits keeps the backlog at the
broker (its Receive Maximum), which bounds this process's memory whatever agents send.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from fedagent.node.messaging import Messenger
from fedagent.protocols.streaming import StreamEvent, UpdatePart

#: Values of streamed parts that may wait to be folded, at most.
STREAM_BUDGET = 16 * 2**20


def stream_budget(model_bytes: int) -> int:
    """Values of streamed parts that may wait to be folded, for a model of ``model_bytes``."""
    return max(64 * 1024, min(STREAM_BUDGET, model_bytes // 4))


class StreamFeed:
    """Streamed events into ``queue``, with the values of parts waiting in it bounded."""

    def __init__(self, queue: asyncio.Queue[Any], budget: int = STREAM_BUDGET) -> None:
        self.queue = queue
        self.budget = budget  # until the model's size is known
        self.waiting = 0  # values of parts queued, not yet taken
        self.queued_transfers: Counter[tuple[str, str]] = Counter()  # (sender, tid) -> its events queued
        self._room = asyncio.Event()
        self._room.set()

    @property
    def queued(self) -> int:
        """Events queued, not yet taken."""
        return self.queued_transfers.total()

    def size_for(self, model_bytes: int) -> None:
        self.budget = stream_budget(model_bytes)

    async def put(self, events: Iterable[StreamEvent], seen: Callable[[StreamEvent], None] | None = None) -> None:
        """Queue ``events`` (``seen`` is told of each first); returns once the values
        waiting are within the budget again."""
        for ev in events:
            if isinstance(ev, UpdatePart):
                self.waiting += ev.nbytes
            if seen is not None:
                seen(ev)
            self.queued_transfers[(ev.sender, ev.tid)] += 1
            await self.queue.put(ev)
        while self.waiting > self.budget:
            self._room.clear()
            await self._room.wait()

    def taken(self, item: object) -> None:
        """The coordinator took ``item`` off its queue."""
        if isinstance(item, StreamEvent):
            key = (item.sender, item.tid)
            self.queued_transfers[key] -= 1
            if self.queued_transfers[key] <= 0:
                del self.queued_transfers[key]
        if isinstance(item, UpdatePart):
            self.waiting -= item.nbytes
            if self.waiting <= self.budget:
                self._room.set()

    async def expire_stalled(self, messenger: Messenger, every: float) -> None:
        """Every ``every`` seconds, streams that stalled past the messenger's timeout end
        as failed (refused, and their ends queued like any other)."""
        while True:
            await asyncio.sleep(every)
            events = messenger.intake.expire(time.monotonic())
            for ev in events:
                messenger.reject("stream", ev.sender, ev.reason)
            await self.put(list(events))
