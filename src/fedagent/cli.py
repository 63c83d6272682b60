"""The ``fedagent`` command line."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
from pathlib import Path

import click

from fedagent import __version__
from fedagent.errors import ConfigError, FedagentError

DEFAULT_AGENT_CONFIG = Path(os.environ.get("FEDAGENT_CONFIG", "/etc/fedagent/agent.toml"))


def _fail(exc: FedagentError) -> None:
    click.secho(f"error: {exc}", fg="red", err=True)
    sys.exit(exc.exit_code)


def _run_daemon(make) -> None:
    """Run a daemon's ``run()`` until SIGTERM/SIGINT, then let it shut down cleanly."""
    from fedagent.node.runtime import setup_logging

    setup_logging(os.environ.get("FEDAGENT_LOG_LEVEL", "INFO"))

    async def main() -> None:
        daemon = make()
        task = asyncio.current_task()
        assert task is not None  # main() runs as asyncio.run's task
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await daemon.run()
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(main())
    except (FedagentError, BaseExceptionGroup) as exc:
        found = _first_fedagent_error(exc)
        if found is None:
            raise
        _fail(found)


def _first_fedagent_error(exc: BaseException) -> FedagentError | None:
    """The error to report from a TaskGroup's (possibly nested) exception group."""
    if isinstance(exc, FedagentError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first_fedagent_error(sub)
            if found is not None:
                return found
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedagent")
def main() -> None:
    """fedagent: federated learning between edge machines over MQTT with mutual TLS."""


# -- daemons -----------------------------------------------------------------------------
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
        _fail(exc)
    _run_daemon(lambda: build_agent(cfg))


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
        _fail(exc)
    _run_daemon(lambda: build_coordinator(cfg))


# -- operator commands ---------------------------------------------------------------
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
        from fedagent import status as rendering
        from fedagent.node.control import request

        try:
            result = request(_socket_for(config_path, socket, is_coord), cmd)
        except FedagentError as exc:
            _fail(exc)
        if as_json:
            click.echo(json.dumps(result, sort_keys=True, default=str))
        else:
            getattr(rendering, render_name)(result)

    command.__doc__ = doc
    return main.command(name)(command)


status = _ask_daemon("status", "status", "Show what the local daemon is doing.", "render_status")
peers = _ask_daemon(
    "peers", "peers", "List the peers the local daemon knows: role, broker, online, last seen.", "render_peers"
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
    from fedagent import status as rendering
    from fedagent.node.control import request

    try:
        result = request(
            _socket_for(config_path, socket, False),
            "search",
            {"text": text, "k": k, "timeout": timeout},
            timeout=timeout + 60.0,
        )
    except FedagentError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, sort_keys=True, default=str))
    else:
        rendering.render_search(text, result)


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
        _fail(exc)


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
    from fedagent import config, pki
    from fedagent.node.control import request
    from fedagent.node.discovery import Discovery
    from fedagent.protocols.topics import check_name

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
        _fail(exc)


@main.command("export")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="config file of the daemon whose model to export (default: /etc/fedagent/agent.toml)",
)
@click.option("--coordinator", "is_coord", is_flag=True, help="export the coordinator's global model")
@click.option(
    "--checkpoint",
    "ckpt",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="read this checkpoint file instead of the daemon's",
)
@click.option(
    "--format", "fmt", type=click.Choice(["pt", "safetensors"]), default=None, help="default: from OUT's suffix"
)
def export_model(out: Path, config_path: Path | None, is_coord: bool, ckpt: Path | None, fmt: str | None) -> None:
    """Write the latest model to OUT as a PyTorch state_dict (*.pt, opened by
    torch.load(OUT, weights_only=True)) or as safetensors (*.safetensors)."""
    from fedagent import config
    from fedagent import export as exporting

    role = "coordinator" if is_coord else "agent"
    try:
        if ckpt is None:
            path = config_path or (Path("/etc/fedagent/coordinator.toml") if is_coord else DEFAULT_AGENT_CONFIG)
            ckpt = exporting.checkpoint_of(config.load(path, role), role)
        summary = exporting.export(ckpt, out, fmt)
    except FedagentError as exc:
        _fail(exc)
    click.echo(
        f"wrote {summary['path']}: {summary['tensors']} tensors, {summary['parameters']:,} parameters, "
        f"model version {summary['model_version']} ({summary['format']}, from {ckpt})"
    )


# -- certificates and broker --------------------------------------------------------
@main.group()
def ca() -> None:
    """Federation CA: create it, issue certificates, write the broker config."""


@ca.command("init")
@click.argument("federation")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=Path("pki"), show_default=True)
def ca_init(federation: str, directory: Path) -> None:
    """Create the CA of FEDERATION in DIR (ca.crt, ca.key)."""
    from fedagent import pki

    try:
        path = pki.create_ca(directory, federation)
    except FedagentError as exc:
        _fail(exc)
    click.echo(f"created CA {path} (keep {directory / 'ca.key'} offline after issuing)")


@ca.command("issue")
@click.argument("name")
@click.option("--role", type=click.Choice(["agent", "coordinator", "broker"]), required=True)
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
    from fedagent import pki

    try:
        cert, key = pki.issue(directory, out or directory, name, role, sans=sans, federation=federation, days=days)
    except FedagentError as exc:
        _fail(exc)
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
    from fedagent import broker

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
        _fail(exc)
    click.echo(f"wrote {conf}; run: mosquitto -c {conf}")


@main.command()
@click.argument("histories", nargs=-1, type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="collect every history.jsonl below this state directory",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("fedagent-report"), show_default=True)
@click.option("--title", default=None)
def report(histories: tuple[Path, ...], state_dir: Path | None, out: Path, title: str | None) -> None:
    """Write a markdown report with PNG plots from daemon histories."""
    from fedagent.report import find_histories, write_report

    paths = list(histories)
    if state_dir is not None:
        paths += find_histories(state_dir)
    if not paths:
        default = [Path("/var/lib/fedagent-coordinator"), Path("/var/lib/fedagent-agent")]
        paths = [p for d in default if d.exists() for p in find_histories(d)]
    try:
        if not paths:
            raise ConfigError("no history.jsonl found; pass HISTORY files or --state-dir DIR")
        md = write_report(paths, out, title=title)
    except FedagentError as exc:
        _fail(exc)
    click.echo(f"wrote {md} ({len(paths)} histories)")


# -- demo -------------------------------------------------------------------------------
@main.command()
@click.option(
    "--mode",
    type=click.Choice(["fedavg", "gossip", "syncopt"]),
    default="fedavg",
    show_default=True,
    help="fedavg: a coordinator runs rounds; gossip: no coordinator, agents merge each other's models; "
    "syncopt: gFedNTM, vocabulary consensus then one gradient per agent per step (ProdLDA)",
)
@click.option("--agents", type=int, default=None, help="number of agent processes [default: 3, gossip 5]")
@click.option("--rounds", default=15, show_default=True, help="FedAvg rounds")
@click.option("--steps", default=300, show_default=True, help="syncopt: Sync-Opt steps")
@click.option("--periods", default=100, show_default=True, help="gossip exchange periods per agent")
@click.option("--period-steps", default=10, show_default=True, help="gossip: local mini-batches per exchange")
@click.option(
    "--merge",
    type=click.Choice(["pushsum", "thesis", "average"]),
    default="pushsum",
    show_default=True,
    help="gossip merge rule (thesis = Alg. 3.1 as written; average = own and received models, equal weights)",
)
@click.option("--alpha", default=0.3, show_default=True, help="Dirichlet non-IID concentration")
@click.option(
    "--dp-epsilon",
    type=float,
    default=None,
    help="fedavg: also run with central differential privacy calibrated to this epsilon (delta 1e-5) and "
    "compare (needs the 'privacy' extra); with --secure-aggregation, distributed DP under secure aggregation",
)
@click.option(
    "--secure-aggregation",
    is_flag=True,
    help="fedavg: mask every update (SecAgg+) so the coordinator sees only their sum; runs plain FedAvg "
    "first and prints both accuracies and the masking overhead",
)
@click.option("--keep", is_flag=True, help="keep the work directory (logs, checkpoints)")
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=Path("demo-report"),
    show_default=True,
    help="where to write the run's report (markdown + PNG plots)",
)
def demo(
    mode: str,
    agents: int | None,
    rounds: int,
    steps: int,
    periods: int,
    period_steps: int,
    merge: str,
    alpha: float,
    dp_epsilon: float | None,
    secure_aggregation: bool,
    keep: bool,
    report_dir: Path,
) -> None:
    """A whole federation on this machine: broker, coordinator (FedAvg), agents, mDNS."""
    from fedagent.demo import run_demo, run_dp_demo, run_gossip_demo, run_syncopt_demo

    try:
        if secure_aggregation and mode != "fedavg":
            raise FedagentError(f"--secure-aggregation works with --mode fedavg, not {mode}")
        if dp_epsilon is not None and mode != "fedavg":
            raise FedagentError("--dp-epsilon runs the fedavg demo (central DP); drop --mode")
        if dp_epsilon is not None:
            if not (dp_epsilon > 0 and math.isfinite(dp_epsilon)):
                raise FedagentError("--dp-epsilon must be a positive number")
            code = run_dp_demo(
                epsilon=dp_epsilon,
                agents=agents or 3,
                rounds=rounds,
                alpha=alpha,
                keep=keep,
                secure=secure_aggregation,
            )
        elif mode == "syncopt":
            code = run_syncopt_demo(agents=agents or 5, steps=steps, keep=keep)
        elif mode == "gossip":
            code = run_gossip_demo(
                agents=agents or 5,
                periods=periods,
                period_steps=period_steps,
                alpha=alpha,
                merge=merge,
                keep=keep,
                report_dir=report_dir,
            )
        else:
            code = run_demo(
                agents=agents or 3,
                rounds=rounds,
                alpha=alpha,
                keep=keep,
                report_dir=report_dir,
                secure=secure_aggregation,
            )
    except FedagentError as exc:
        _fail(exc)
    sys.exit(code)


# -- experiments ------------------------------------------------------------------------
def _exit_on_stop_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@main.group()
def experiment() -> None:
    """Paper experiments, each writing a report (markdown + PNG plots).

    flsimco trains every strategy through a real coordinator and agent processes over
    Mosquitto; gfedntm trains Fig. 2's many models in process or in --jobs workers (Sync-Opt computed in
    process, which the exactness test shows equals the network path) and runs one
    setting again through a real coordinator and agents over Mosquitto."""
    # SIGTERM and SIGHUP would otherwise end the process without running a single
    # ``finally``: the daemons an experiment started (each in a session of its own) would
    # be left running and its work directory left behind. As an exception they unwind
    # the experiment, and the exit status is 128 + the signal's number (Ctrl-C too, which
    # click would report as 1). A signal ignored by whoever started us (nohup, a
    # background job) stays ignored.
    from fedagent.stopsignals import deferring

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, deferring(_exit_on_stop_signal))


@experiment.command("flsimco")
@click.option("--rounds", default=10, show_default=True, help="RSU rounds per strategy")
@click.option("--coverage", default=4, show_default=True, help="vehicles in range of the RSU per round")
@click.option("--stay", default=2, show_default=True, help="rounds each vehicle stays in range")
@click.option("--alpha", default=1.0, show_default=True, help="Dirichlet label skew over the shards (0 = IID)")
@click.option("--threshold", default=100.0, show_default=True, help="km/h above which baseline 2 drops a model")
@click.option("--local-epochs", default=2, show_default=True)
@click.option(
    "--speed",
    "speed",
    nargs=4,
    type=float,
    default=(90.0, 20.0, 50.0, 130.0),
    show_default=True,
    metavar="MU SIGMA V_MIN V_MAX",
    help="eq. 1: truncated Gaussian of vehicle speeds (km/h)",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    type=click.Choice(["blur", "fedavg", "drop_above"]),
    help="run only these (default: all three)",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("flsimco-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the work directory (logs, checkpoints, histories)")
def experiment_flsimco(
    rounds: int,
    coverage: int,
    stay: int,
    alpha: float,
    threshold: float,
    local_epochs: int,
    speed: tuple[float, float, float, float],
    seed: int,
    strategies: tuple[str, ...],
    out: Path,
    keep: bool,
) -> None:
    """FLSimCo: vehicles join and leave an RSU; blur-weighted (eq. 11) vs FedAvg vs dropping fast vehicles."""
    try:
        from fedagent.experiments.flsimco import STRATEGIES, Setup, run_experiment

        if rounds < 1 or coverage < 1 or stay < 1:
            raise ConfigError("--rounds, --coverage and --stay must be at least 1")
        mu, sigma, v_min, v_max = speed
        if not (sigma > 0 and 0 <= v_min < v_max):
            raise ConfigError("--speed: need SIGMA > 0 and 0 <= V_MIN < V_MAX")
        setup = Setup(
            rounds=rounds,
            coverage=coverage,
            stay=stay,
            alpha=alpha,
            threshold=threshold,
            local_epochs=local_epochs,
            seed=seed,
            mobility={"mu": mu, "sigma": sigma, "v_min": v_min, "v_max": v_max},
        )
        run_experiment(out, setup, strategies or STRATEGIES, keep=keep)
    except FedagentError as exc:
        _fail(exc)


@experiment.command("gossip-w2v")
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "tiny"]),
    default="default",
    show_default=True,
    help="default: 10 agents, 3 seeds, paced, ~6 min a configuration, ~2 h in all; tiny: 3 agents, a smoke test",
)
@click.option("--local-steps", type=int, default=None, help="batches per agent (centralized gets agents x this)")
@click.option("--dim", type=int, default=None, help="embedding size")
@click.option("--seeds", type=str, default=None, help="comma-separated seeds of every gossip configuration (1,2,3)")
@click.option(
    "--central-seeds", type=str, default=None, help="comma-separated seeds of the centralized runs (at least two)"
)
@click.option(
    "--config",
    "configs",
    multiple=True,
    help="run only these configurations (topic-frequent, random-frequent, imbalanced-frequent, "
    "half-frequent, topic-infrequent, random-infrequent, imbalanced-infrequent, local)",
)
@click.option(
    "--merge",
    type=click.Choice(["pushsum", "average"]),
    default=None,
    help="the agents' merge in every configuration but thesis-literal (default: the scale's)",
)
@click.option(
    "--outer-step",
    type=float,
    default=None,
    help="the agents' [gossip] outer_step B: step lr x N / B between exchanges, adopt start + B x the progress "
    "(default 1: lr x N)",
)
@click.option(
    "--period-seconds",
    type=float,
    default=None,
    help="the agents' [gossip] period_seconds in the frequent configurations (infrequent ones: x5, the same "
    "time per batch): every period lasts at least this long, which keeps agents of unequal speed in step "
    "(default scale: 1.2; 0: unpaced)",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("gossip-w2v-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the work directories (logs, checkpoints, histories)")
@click.option("--report-only", is_flag=True, help="run nothing new: rebuild the report from OUT/runs/")
def experiment_gossip_w2v(
    scale_name: str,
    local_steps: int | None,
    dim: int | None,
    seeds: str | None,
    central_seeds: str | None,
    configs: tuple[str, ...],
    merge: str | None,
    outer_step: float | None,
    period_seconds: float | None,
    out: Path,
    keep: bool,
    report_only: bool,
) -> None:
    """Gossip Word2Vec (the thesis): 10 gossip agents, topic/random/imbalanced splits, frequent/infrequent/half
    exchange and local-only, against centralized training with the same number of batches."""
    from dataclasses import replace

    try:
        from fedagent.experiments import gossip_w2v

        scale = gossip_w2v.SCALES[scale_name]
        for name, value in (("local_steps", local_steps), ("dim", dim)):
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        scale = replace(
            scale,
            local_steps=scale.local_steps if local_steps is None else local_steps,
            dim=scale.dim if dim is None else dim,
            merge=scale.merge if merge is None else merge,
            outer_step=scale.outer_step if outer_step is None else outer_step,
            period_seconds=scale.period_seconds if period_seconds is None else period_seconds,
        )
        if not (math.isfinite(scale.outer_step) and scale.outer_step > 0):
            raise ConfigError(f"--outer-step must be a positive number, not {scale.outer_step}")
        if not (math.isfinite(scale.period_seconds) and 0 <= scale.period_seconds <= 3600):
            raise ConfigError(f"--period-seconds must be 0..3600 seconds, not {scale.period_seconds}")
        for name, text in (("seeds", seeds), ("central_seeds", central_seeds)):
            if text is None:
                continue
            try:
                values = tuple(int(x) for x in text.split(","))
            except ValueError:
                raise ConfigError(
                    f"--{name.replace('_', '-')}: expected comma-separated integers, not {text!r}"
                ) from None
            if len(set(values)) != len(values) or (name == "central_seeds" and len(values) < 2):
                raise ConfigError(f"--{name.replace('_', '-')}: distinct seeds, at least two centralized ones")
            scale = replace(scale, seeds=values) if name == "seeds" else replace(scale, central_seeds=values)
        known = {c.name for c in gossip_w2v.configurations(scale)}
        if set(configs) - known:
            raise ConfigError(f"unknown configurations {sorted(set(configs) - known)}; known: {sorted(known)}")
        gossip_w2v.run_experiment(out, scale, configs, keep=keep, report_only=report_only)
    except FedagentError as exc:
        _fail(exc)


@experiment.command("gfedntm")
@click.option(
    "--corpus",
    type=click.Choice(["all", "synthetic", "newsgroups"]),
    default="all",
    show_default=True,
    help="synthetic: Fig. 2 (Sec. 4.1); newsgroups: gensim's sample, one newsgroup per agent; all: both, in one report",
)
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "paper", "tiny"]),
    default="default",
    show_default=True,
    help="synthetic sizes (default: under an hour on 2 busy cores; paper: Sec. 4.1's)",
)
@click.option(
    "--jobs",
    type=int,
    default=1,
    show_default=True,
    help="synthetic: settings trained in this many worker processes at once",
)
@click.option(
    "--daemons/--no-daemons",
    default=True,
    show_default=True,
    help="synthetic: also train K'=10, eta=0.01 through a coordinator and agent processes over Mosquitto",
)
@click.option(
    "--daemons-only",
    is_flag=True,
    help="synthetic: only the run through the daemons (seeds --seed .. --seed + --seeds - 1, default one), "
    "merged into the report already in --out (its in-process tables are kept)",
)
@click.option(
    "--float64",
    is_flag=True,
    help="with --daemons-only: every model in float64 and the coordinator in float64 mode",
)
@click.option(
    "--epochs",
    type=int,
    default=None,
    help="passes of every node over its documents (synthetic: at most this many, with early stopping)",
)
@click.option("--seeds", type=int, default=None, help="synthetic: seeds per setting (mean and spread reported)")
@click.option(
    "--patience",
    type=int,
    default=None,
    help="synthetic: early-stopping patience in epochs (0: exactly --epochs passes, no split)",
)
@click.option("--docs", type=int, default=None, help="synthetic: training documents per node")
@click.option("--vocab-size", type=int, default=None, help="synthetic: V")
@click.option("--k-prime", "k_primes", multiple=True, type=int, help="synthetic: shared topics (default 5 10 15 40)")
@click.option(
    "--eta",
    "etas",
    multiple=True,
    type=float,
    help="synthetic: topic priors for setting B (default 0.01 0.02 0.03 0.04 0.08 1)",
)
@click.option(
    "--model",
    type=click.Choice(["prodlda", "combinedtm"]),
    default="combinedtm",
    show_default=True,
    help="newsgroups: the topic model (combinedtm uses the offline SBERT model)",
)
@click.option("--n-topics", type=int, default=10, show_default=True, help="newsgroups: K")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("gfedntm-report"), show_default=True)
def experiment_gfedntm(
    corpus: str,
    scale_name: str,
    epochs: int | None,
    seeds: int | None,
    patience: int | None,
    docs: int | None,
    vocab_size: int | None,
    jobs: int,
    daemons: bool,
    daemons_only: bool,
    float64: bool,
    k_primes: tuple[int, ...],
    etas: tuple[float, ...],
    model: str,
    n_topics: int,
    seed: int,
    out: Path,
) -> None:
    """gFedNTM: centralized vs federated (Sync-Opt) vs non-collaborative topic models (Fig. 2)."""
    from dataclasses import replace

    try:
        from fedagent.experiments import gfedntm

        news = gfedntm.NewsScale(model=model, n_topics=n_topics, seed=seed)
        if corpus == "newsgroups":
            if epochs is not None:
                news = replace(news, epochs=epochs)
            gfedntm.run_newsgroups(out, news)
            return
        scale = replace(gfedntm.SCALES[scale_name], seed=seed)
        for name, value in (("epochs", epochs), ("docs", docs), ("vocab_size", vocab_size)):
            if value is not None:
                if value < 1:
                    raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
                scale = replace(scale, **{name: value})
        if seeds is not None:
            if seeds < 1:
                raise ConfigError("--seeds must be at least 1")
            scale = replace(scale, seeds=seeds)
        if patience is not None:
            if patience < 0:
                raise ConfigError("--patience must be at least 0")
            scale = replace(scale, patience=patience)
        k_primes = k_primes or gfedntm.K_PRIME
        setting = (10, 0.01) if 10 in k_primes else (k_primes[0], 0.01)
        if float64 and not daemons_only:
            raise ConfigError("--float64 goes with --daemons-only (the in-process tables are float32)")
        if daemons_only:
            if corpus != "synthetic":
                raise ConfigError("--daemons-only goes with --corpus synthetic")
            gfedntm.run_daemons_only(
                out,
                scale if seeds is not None else replace(scale, seeds=1),
                setting,
                [seed + i for i in range(seeds or 1)],
                "float64" if float64 else "float32",
            )
            return
        if jobs < 1:
            raise ConfigError("--jobs must be at least 1")
        gfedntm.run_synthetic(
            out, scale, k_primes, etas or gfedntm.ETAS, daemons=setting if daemons else None, jobs=jobs
        )
        if corpus == "all":
            gfedntm.run_newsgroups(out, news)
            gfedntm.report_from_json(out)  # the report now quotes the newsgroups run too
    except FedagentError as exc:
        _fail(exc)


@experiment.command("dp-digits")
@click.option("--rounds", default=80, show_default=True, help="DP-FedAvg rounds per run")
@click.option("--seeds", default=3, show_default=True, help="seeds per epsilon")
@click.option("--fixed-clip", is_flag=True, help="a fixed clip norm instead of adaptive clipping")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/dp_digits"), show_default=True)
def experiment_dp_digits(rounds: int, seeds: int, fixed_clip: bool, out: Path) -> None:
    """Accuracy against epsilon (1, 3, 8, no DP) of DP-FedAvg on digits, simulated in-process."""
    try:
        from fedagent.experiments.dp_digits import Setup, run_experiment

        md = run_experiment(out, Setup(rounds=rounds, seeds=tuple(range(seeds)), adaptive=not fixed_clip))
    except FedagentError as exc:
        _fail(exc)
    click.echo(f"report: {md}")


@experiment.command("seec")
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "paper", "tiny"]),
    default="default",
    show_default=True,
    help="default: all documents, 10 epochs and a second centralized model (the ceiling; "
    "~30 min on 2 heavily shared cores); paper: 40 epochs, 40 inference passes; tiny: a smoke run",
)
@click.option("--sites", type=int, default=None, help="agents / edge sites [default: 3]")
@click.option(
    "--epochs",
    type=int,
    default=None,
    help="passes over the data (joint learning: --rounds-per-epoch FedAvg rounds each)",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("seec-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the federation's work directory (logs, checkpoints)")
@click.option(
    "--corpus",
    type=click.Choice(["wiki", "manpages"]),
    default="wiki",
    show_default=True,
    help="private data: gensim's Wikipedia articles (105) or the Linux manual pages (1,083)",
)
@click.option("--limit", type=int, default=None, help="use only the corpus's first N documents (0: all)")
@click.option("--dim", type=int, default=None, help="doc2vec vector size d [default: 100 on the man pages, 50 on wiki]")
@click.option(
    "--rounds-per-epoch",
    type=int,
    default=None,
    help="joint learning: FedAvg rounds per pass over the data (a round is that fraction of a local epoch) "
    "[default: 10 on the man pages, 1 on wiki]",
)
@click.option(
    "--server-lr",
    type=float,
    default=None,
    help="joint learning: the coordinator's server step [default: 2 on the man pages, 1 on wiki]",
)
def experiment_seec(
    scale_name: str,
    sites: int | None,
    epochs: int | None,
    seed: int,
    out: Path,
    keep: bool,
    corpus: str,
    limit: int | None,
    dim: int | None,
    rounds_per_epoch: int | None,
    server_lr: float | None,
) -> None:
    """SEEC: joint doc2vec learning (daemons) and vector-space mapping vs centralized (sim_10)."""
    from dataclasses import replace

    try:
        from fedagent.experiments import seec

        scale = replace(seec.SCALES[scale_name], seed=seed)
        for name, value in (("sites", sites), ("epochs", epochs)):
            if value is not None and value < (2 if name == "sites" else 1):
                raise ConfigError(f"--{name} is too small")
        scale = replace(
            scale,
            sites=scale.sites if sites is None else sites,
            epochs=scale.epochs if epochs is None else epochs,
            corpus=corpus,
            limit=scale.limit if limit is None else limit,
        )
        joint = seec.JOINT_SETTINGS.get(corpus, (scale.rounds_per_epoch, scale.server_lr))
        scale = replace(
            scale,
            dim=seec.CORPUS_DIM.get(corpus, scale.dim) if dim is None else dim,
            rounds_per_epoch=joint[0] if rounds_per_epoch is None else rounds_per_epoch,
            server_lr=joint[1] if server_lr is None else server_lr,
        )
        if scale.limit < 0:
            raise ConfigError("--limit must be at least 0")
        if not 1 <= scale.dim <= 1000:
            raise ConfigError("--dim must be in [1, 1000]")
        if scale.rounds_per_epoch < 1 or not 0 < scale.server_lr <= 100:
            raise ConfigError("--rounds-per-epoch must be at least 1 and --server-lr in (0, 100]")
        seec.run_experiment(out, scale, keep=keep)
    except FedagentError as exc:
        _fail(exc)


if __name__ == "__main__":
    main()
