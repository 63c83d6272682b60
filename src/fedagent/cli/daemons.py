"""`fedagent agent` and `fedagent coordinator`: the two daemons systemd runs."""

from __future__ import annotations

from pathlib import Path

import click

from fedagent.cli.app import DEFAULT_AGENT_CONFIG, fail, main, run_daemon
from fedagent.errors import ConfigError, FedagentError


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    help="agent config file (TOML)",
)
def agent(config_path: Path) -> None:
    """Run the agent daemon (what systemd starts)."""
    from fedagent import config
    from fedagent.agent.daemon import build_agent

    try:
        cfg = config.load(config_path, "agent")
    except FedagentError as exc:
        fail(exc)
    run_daemon(lambda: build_agent(cfg))


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=Path("/etc/fedagent/coordinator.toml"),
    show_default=True,
    help="coordinator config file (TOML)",
)
def coordinator(config_path: Path) -> None:
    """Run the coordinator daemon."""
    from fedagent import config
    from fedagent.coordinator.daemon import build_coordinator

    try:
        cfg = config.load(config_path, "coordinator")
    except FedagentError as exc:
        fail(exc)
    run_daemon(lambda: build_coordinator(cfg))


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=Path("/etc/fedagent/aggregator.toml"),
    show_default=True,
    help="site aggregator config file (TOML): a coordinator's, with [tier] upstream",
)
def aggregator(config_path: Path) -> None:
    """Run a site aggregator: the coordinator of its site's agents, one participant of
    the upstream tier's rounds (docs/multisite.md)."""
    from fedagent import config
    from fedagent.coordinator.daemon import build_coordinator

    try:
        cfg = config.load(config_path, "coordinator")
        if not cfg.tier.upstream:
            raise ConfigError(f"{cfg.path}: a site aggregator needs [tier] upstream (the upstream tier's broker)")
    except FedagentError as exc:
        fail(exc)
    run_daemon(lambda: build_coordinator(cfg))
