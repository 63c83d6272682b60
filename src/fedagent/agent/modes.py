"""Which session class runs a federation of each mode (``mode`` in the agent's config)."""

from __future__ import annotations

from fedagent.agent.core import SessionClass
from fedagent.agent.fedavg import FedAvgSession
from fedagent.agent.fedbuff import AsyncSession
from fedagent.agent.gossip import GossipSession
from fedagent.agent.syncopt import SyncOptSession
from fedagent.errors import ConfigError

MODES: dict[str, SessionClass] = {
    "fedavg": FedAvgSession,
    "syncopt": SyncOptSession,
    "gossip": GossipSession,
    "async": AsyncSession,
}


def session_class(mode: str) -> SessionClass:
    try:
        return MODES[mode]
    except KeyError:
        raise ConfigError(f"unknown mode {mode!r}: use one of {sorted(MODES)}") from None
