"""``fedagent coordinator``: one daemon core with the federation's mode plugged in.

The config's ``mode`` picks the round logic; everything else (connection, presence,
control socket, metrics, shutdown) is the core's (:mod:`fedagent.coordinator.core`).
A gossip federation has no coordinator.
"""

from __future__ import annotations

from collections.abc import Callable

from fedagent.config import NodeConfig
from fedagent.coordinator import fedavg, fedbuff, site, syncopt
from fedagent.coordinator.core import CoordinatorCore, Mode
from fedagent.errors import ConfigError

#: mode name -> (the mode's adapter, the transport's Receive Maximum for it or None)
MODES: dict[str, tuple[Callable[[CoordinatorCore], Mode], Callable[[NodeConfig], int] | None]] = {
    "fedavg": (fedavg.FedAvgMode, fedavg.receive_maximum),
    "syncopt": (syncopt.SyncOptMode, None),
    "async": (fedbuff.AsyncMode, fedavg.receive_maximum),
}


def build_coordinator(cfg: NodeConfig) -> CoordinatorCore:
    """The coordinator daemon for ``cfg``; run it with ``await daemon.run()``."""
    if cfg.tier.upstream:
        # A site aggregator: the coordinator of its site's agents, one participant upstream.
        return CoordinatorCore(cfg, site.SiteMode, receive_maximum=fedavg.receive_maximum(cfg))
    try:
        make_mode, receive_maximum = MODES[cfg.mode]
    except KeyError:
        raise ConfigError(
            f"{cfg.path}: mode {cfg.mode!r} has no coordinator (choose one of {', '.join(MODES)}; "
            "a gossip federation runs without one)"
        ) from None
    return CoordinatorCore(cfg, make_mode, receive_maximum=receive_maximum(cfg) if receive_maximum else None)
