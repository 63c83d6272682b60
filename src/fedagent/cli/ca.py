"""`fedagent ca`: the federation CA, certificates for every role, and the broker's configuration."""

from __future__ import annotations

from pathlib import Path

import click

from fedagent.cli.app import fail, main
from fedagent.errors import FedagentError


@main.group()
def ca() -> None:
    """Federation CA: create it, issue certificates, write the broker config."""


@ca.command("init")
@click.argument("federation")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=Path("pki"), show_default=True)
def ca_init(federation: str, directory: Path) -> None:
    """Create the CA of FEDERATION in DIR (ca.crt, ca.key)."""
    from fedagent.security import pki

    try:
        path = pki.create_ca(directory, federation)
    except FedagentError as exc:
        fail(exc)
    click.echo(f"created CA {path} (keep {directory / 'ca.key'} offline after issuing)")


@ca.command("issue")
@click.argument("name")
@click.option("--role", type=click.Choice(["agent", "coordinator", "broker", "aggregator"]), required=True)
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=Path("pki"),
    show_default=True,
    help="the CA directory",
)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="where to write (default: DIR)")
@click.option(
    "--san",
    "sans",
    multiple=True,
    help="broker: a DNS name or IP it is reached by, in addition to localhost and 127.0.0.1 (repeatable)",
)
@click.option(
    "--federation",
    default=None,
    help="agent/coordinator: the federation the certificate is for (default: the CA's own)",
)
@click.option("--days", default=825, show_default=True)
def ca_issue(
    name: str, role: str, directory: Path, out: Path | None, sans: tuple[str, ...], federation: str | None, days: int
) -> None:
    """Issue a certificate for NAME (its MQTT identity and client id)."""
    from fedagent.security import pki

    try:
        cert, key = pki.issue(directory, out or directory, name, role, sans=sans, federation=federation, days=days)
    except FedagentError as exc:
        fail(exc)
    click.echo(f"issued {cert} and {key}")


@ca.command("broker-config")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=Path("pki"),
    show_default=True,
    help="the CA directory (holds broker.crt/broker.key)",
)
@click.option("--federation", "federations", multiple=True, required=True)
@click.option("--coordinator", "coordinators", multiple=True, required=True, help="coordinator identities")
@click.option("--port", default=8883, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True)
@click.option("--broker-name", default="broker", show_default=True)
@click.option(
    "--trust-bridge",
    "trusted_bridges",
    multiple=True,
    help="central broker: a site bridge identity, which relays nodes' traffic up and the coordinators' messages down (repeatable)",
)
@click.option("--bridge-to", default=None, help="site broker: HOST:PORT of the central broker to bridge to")
@click.option("--bridge-name", default=None, help="site broker: the bridge's certificate name (CN)")
@click.option(
    "--max-queued-bytes",
    type=int,
    default=1024 * 2**20,
    show_default=True,
    help="bytes Mosquitto may queue for one client beyond its in-flight window (see docs/operators.md)",
)
@click.option(
    "--max-queued-messages",
    type=int,
    default=100_000,
    show_default=True,
    help="messages Mosquitto may queue for one client beyond its in-flight window",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("mosquitto"), show_default=True)
def ca_broker_config(
    directory: Path,
    federations,
    coordinators,
    port: int,
    bind: str,
    broker_name: str,
    trusted_bridges,
    bridge_to: str | None,
    bridge_name: str | None,
    max_queued_bytes: int,
    max_queued_messages: int,
    out: Path,
) -> None:
    """Write a Mosquitto config and ACL (mutual TLS, one subtree per identity)."""
    from fedagent import mosquitto as broker

    try:
        conf = broker.write_site_config(
            out,
            ca_dir=directory,
            broker_name=broker_name,
            federations=list(federations),
            coordinators=list(coordinators),
            port=port,
            bind=bind,
            trusted_bridges=list(trusted_bridges),
            bridge_to=bridge_to,
            bridge_name=bridge_name,
            max_queued_bytes=max_queued_bytes,
            max_queued_messages=max_queued_messages,
        )
    except FedagentError as exc:
        fail(exc)
    click.echo(f"wrote {conf}; run: mosquitto -c {conf}")
