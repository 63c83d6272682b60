"""Commands that ask a running daemon over its control socket: status, peers, search."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fedagent.cli.app import DEFAULT_AGENT_CONFIG, fail, main
from fedagent.errors import FedagentError


def _socket_for(config_path: Path | None, socket: Path | None, is_coord: bool) -> Path:
    """The control socket to ask: explicit, from a config's runtime_dir, or the default."""
    from fedagent import config
    from fedagent.config import default_socket_path

    if socket is not None:
        return socket
    if config_path is None and not is_coord and DEFAULT_AGENT_CONFIG.exists():
        config_path = DEFAULT_AGENT_CONFIG
    if config_path is None:
        return default_socket_path("coordinator" if is_coord else "agent")
    cfg = config.load(config_path, "agent")
    agent_sock = cfg.control_socket
    coord_sock = agent_sock.with_name("coordinator.sock")
    if is_coord or (not agent_sock.exists() and coord_sock.exists()):
        return coord_sock
    return agent_sock


def _ask_daemon(name: str, cmd: str, doc: str, render_name: str):
    """A read-only command that asks the local daemon ``cmd`` and prints the reply."""

    @click.option(
        "--config",
        "config_path",
        type=click.Path(path_type=Path),
        default=None,
        help="config file of the daemon to ask (default: /etc/fedagent/agent.toml)",
    )
    @click.option("--socket", type=click.Path(path_type=Path), default=None, help="control socket path")
    @click.option("--coordinator", "is_coord", is_flag=True, help="ask the coordinator daemon")
    @click.option("--json", "as_json", is_flag=True, help="print one JSON object")
    def command(config_path: Path | None, socket: Path | None, is_coord: bool, as_json: bool) -> None:
        import fedagent.cli.render as rendering
        from fedagent.node.control import request

        try:
            result = request(_socket_for(config_path, socket, is_coord), cmd)
        except FedagentError as exc:
            fail(exc)
        if as_json:
            click.echo(json.dumps(result, sort_keys=True, default=str))
        else:
            getattr(rendering, render_name)(result)

    command.__doc__ = doc
    return main.command(name)(command)


status = _ask_daemon("status", "status", "Show what the local daemon is doing.", "render_status")
peers = _ask_daemon(
    "peers",
    "peers",
    "List the peers the local daemon knows: role, broker, online, last seen. On a hub, its sites with their "
    "agents and state; on a site aggregator, its upstream and its agents: as a tree.",
    "render_peers",
)


@main.command()
@click.argument("text")
@click.option("--k", "k", default=10, show_default=True, help="how many documents to list")
@click.option("--timeout", default=5.0, show_default=True, help="seconds to wait for the peers' answers")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="config file of the agent to ask (default: /etc/fedagent/agent.toml)",
)
@click.option("--socket", type=click.Path(path_type=Path), default=None, help="control socket path")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def search(text: str, k: int, timeout: float, config_path: Path | None, socket: Path | None, as_json: bool) -> None:
    """Semantic search across the federation (SEEC): the running agent vectorises TEXT
    with the shared model, sends only the vector to its peers and merges their top-k."""
    import fedagent.cli.render as rendering
    from fedagent.node.control import request

    try:
        result = request(
            _socket_for(config_path, socket, False),
            "search",
            {"text": text, "k": k, "timeout": timeout},
            timeout=timeout + 60.0,
        )
    except FedagentError as exc:
        fail(exc)
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, default=str))
    else:
        rendering.render_search(text, result)
