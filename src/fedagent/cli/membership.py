"""`fedagent join` and `fedagent leave`: a federation recorded in the config and told to the running agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from fedagent.cli.app import DEFAULT_AGENT_CONFIG, fail, main
from fedagent.errors import ConfigError, FedagentError


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    help="agent config file to clear membership in",
)
def leave(config_path: Path) -> None:
    """Leave the current federation: the agent goes offline there and forgets it."""
    from fedagent import config
    from fedagent.node.control import request

    try:
        cfg = config.load(config_path, "agent")
        if not cfg.federation:
            raise ConfigError(f"{cfg.path} records no federation; nothing to leave")
        config.update_membership(cfg.path, "", "")
        click.echo(f"cleared membership of {cfg.federation} in {cfg.path}")
        try:
            request(cfg.control_socket, "leave")
        except FedagentError as exc:
            click.secho(f"no running agent was told ({exc})", fg="yellow")
            return
        click.echo(f"the running agent {cfg.id} left {cfg.federation}")
    except FedagentError as exc:
        fail(exc)


@main.command()
@click.argument("federation")
@click.option("--broker", default="", help="mqtts://HOST:PORT (default: find it by mDNS)")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    help="agent config file to record membership in",
)
@click.option(
    "--interface",
    "interfaces",
    multiple=True,
    help="this machine's address to run mDNS on (repeatable); recorded as [discovery] interfaces",
)
@click.option("--timeout", default=10.0, show_default=True, help="seconds to look for the federation")
def join(federation: str, broker: str, config_path: Path, interfaces: tuple[str, ...], timeout: float) -> None:
    """Join FEDERATION: find its broker, record it, and tell the running agent."""
    from fedagent import config
    from fedagent.node.control import request
    from fedagent.node.discovery import Discovery
    from fedagent.protocols.topics import check_name
    from fedagent.security import pki

    try:
        check_name(federation, "federation")
        cfg = config.load(config_path, "agent")
        if broker and not broker.startswith("mqtts://"):
            raise ConfigError(f"--broker must look like mqtts://HOST:PORT, not {broker!r}")
        chosen = config.check_interfaces(list(interfaces), "--interface") if interfaces else None
        pki.check_member_of(cfg.tls.cert, cfg.tls.ca, federation)
        if not broker:
            ifaces = chosen or cfg.interfaces

            async def find() -> str:
                async with Discovery(ifaces) as disc:
                    return (await disc.find(federation, ("coordinator", "broker"), timeout)).broker_uri

            click.echo(f"looking for federation {federation} on mDNS ({', '.join(ifaces)}) ...")
            broker = asyncio.run(find())
            click.echo(f"found broker {broker}")
        config.update_membership(cfg.path, federation, broker, chosen)
        recorded = f" and mDNS interfaces {', '.join(chosen)}" if chosen else ""
        click.echo(f"recorded membership of {federation}{recorded} in {cfg.path}")
        args: dict[str, object] = {"federation": federation, "broker": broker}
        if chosen:
            args["interfaces"] = list(chosen)
        try:
            request(cfg.control_socket, "join", args)
        except FedagentError:
            # Also the case while an agent is starting (importing torch takes seconds):
            # it reads the file again once its control socket is up, so it joins too.
            click.secho(
                f"no running agent answered at {cfg.control_socket}. The membership is recorded:\n"
                f"an agent still starting, or started later, joins {federation} from {cfg.path}.\n"
                f"To start one: fedagent agent --config {cfg.path}  (or: systemctl start fedagent-agent)",
                fg="yellow",
            )
            return
        click.echo(f"the running agent {cfg.id} is joining {federation}")
    except FedagentError as exc:
        fail(exc)
