"""Agent and coordinator configuration: TOML files, validated into frozen dataclasses.

Each setting is declared once (:mod:`.settings`: name, type, default, bounds or choices,
help, and where it goes in a pure machine's configuration); the loader (:mod:`.loader`),
the configuration reference (docs/configuration.md, written by
``scripts/config_reference.py`` from :mod:`.reference`) and the machines' configurations
(:mod:`.machines`, :func:`~.declare.build`) read the declaration. Relative paths in a
config file are relative to the file's directory (:mod:`.paths`). Every problem raises
:class:`~fedagent.errors.ConfigError` naming the file, the table and the key.
"""

from __future__ import annotations

from fedagent.config.fedbuff import buffer_config
from fedagent.config.loader import load, render, update_membership
from fedagent.config.machines import round_config
from fedagent.config.paths import TaskOptions, resolve_path
from fedagent.config.settings import (
    DEFAULT_INTERFACES,
    MODES,
    TABLES,
    AsyncSettings,
    GossipSettings,
    NodeConfig,
    PrivacySettings,
    RoundsConfig,
    SearchSettings,
    SyncOptSettings,
    TlsConfig,
    check_interfaces,
    consensus_config,
    default_socket_path,
    vocab_config,
)

__all__ = [
    "DEFAULT_INTERFACES",
    "MODES",
    "TABLES",
    "AsyncSettings",
    "GossipSettings",
    "NodeConfig",
    "PrivacySettings",
    "RoundsConfig",
    "SearchSettings",
    "SyncOptSettings",
    "TaskOptions",
    "TlsConfig",
    "buffer_config",
    "check_interfaces",
    "consensus_config",
    "default_socket_path",
    "load",
    "render",
    "resolve_path",
    "round_config",
    "update_membership",
    "vocab_config",
]
