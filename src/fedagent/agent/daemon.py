"""``fedagent agent``: the daemon every site or vehicle runs.

This module only puts the parts together: the :class:`~fedagent.agent.core.Agent` core,
the session class of the configured mode (:mod:`fedagent.agent.modes`) and the services
(search). The modes and services import the core, never this module.
"""

from __future__ import annotations

from pathlib import Path

from fedagent import config as config_mod
from fedagent.agent.core import Agent, ServiceSpec
from fedagent.agent.modes import session_class
from fedagent.agent.search import SEARCH
from fedagent.config import NodeConfig

SERVICES: tuple[ServiceSpec, ...] = (SEARCH,)


def build_agent(cfg: NodeConfig) -> Agent:
    """The agent daemon of ``cfg``: its mode's sessions, with every service registered."""
    return Agent(cfg, session_class(cfg.mode), SERVICES)


def load_agent_config(path: Path) -> NodeConfig:
    return config_mod.load(path, "agent")
