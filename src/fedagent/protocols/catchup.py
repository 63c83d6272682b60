"""Catching up after an absence, as pure code: the current global model on request.

An agent's round starts (which carry the global model) are subscribed with QoS 0, so
the broker delivers them while the agent is connected and queues none of them while it
is away: a vehicle out of range for an hour would otherwise come back to every model
broadcast of that hour, held by the broker all the while. Instead, every time its
connection is made, the agent asks the coordinator once for the model it lacks
(:class:`ModelRequest` with the version it has) and the coordinator answers on the
agent's own inbox with the current :class:`~fedagent.protocols.messages.GlobalModel`,
signed and verified like any broadcast.

:class:`CatchUp` is the agent's side: one request per connection, sent once a
coordinator is known. :class:`ModelServer` is the coordinator's: it answers only an
agent that is behind, and at most once per ``min_interval`` seconds per agent unless the
model changed since its last answer, and even then not again within a tenth of that
interval: a member asking in a loop costs one model per interval, or one per second
while rounds are faster than that, never one per request. Its table is bounded (the
least recently answered agents are forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fedagent.protocols.messages import ModelRequest


class CatchUp:
    """The agent's side: ask once per connection, as soon as a coordinator is known."""

    def __init__(self) -> None:
        self.pending = False
        self.requests = 0

    def connected(self, coordinator_online: bool, have_version: int) -> ModelRequest | None:
        """A connection was made: whatever was broadcast meanwhile was not queued for us.
        The request to send now if a coordinator is known to be online, else None (it is
        sent when the coordinator's presence arrives)."""
        self.pending = True
        return self.coordinator_known(have_version) if coordinator_online else None

    def coordinator_known(self, have_version: int) -> ModelRequest | None:
        """A coordinator's (online) presence arrived: the request to send it, if one is due."""
        if not self.pending:
            return None
        self.pending = False
        self.requests += 1
        return ModelRequest(have_version)


@dataclass(frozen=True, slots=True)
class _Answered:
    version: int
    at: float


class ModelServer:
    """The coordinator's side: whether to answer a :class:`ModelRequest` with the model."""

    def __init__(self, min_interval: float = 10.0, max_agents: int = 100_000) -> None:
        if min_interval < 0 or max_agents < 1:
            raise ValueError("min_interval must be >= 0 and max_agents >= 1")
        self.min_interval = min_interval
        self.max_agents = max_agents
        self._answered: OrderedDict[str, _Answered] = OrderedDict()
        self.answered = 0
        self.refused: dict[str, int] = {"current": 0, "rate": 0}

    def answer(self, agent: str, have_version: int, current_version: int, now: float) -> bool:
        """True: send ``agent`` the current model (recorded as sent at ``now``)."""
        if have_version >= current_version:
            self.refused["current"] += 1
            return False
        last = self._answered.get(agent)
        if last is not None and (
            now - last.at < self.min_interval / 10
            or (last.version >= current_version and now - last.at < self.min_interval)
        ):
            self.refused["rate"] += 1
            return False
        self._answered[agent] = _Answered(current_version, now)
        self._answered.move_to_end(agent)
        while len(self._answered) > self.max_agents:
            self._answered.popitem(last=False)
        self.answered += 1
        return True
