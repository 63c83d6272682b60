"""`fedagent demo`: a whole federation on this machine."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from fedagent.cli.app import fail, main
from fedagent.errors import FedagentError


@main.command()
@click.option(
    "--mode",
    type=click.Choice(["fedavg", "gossip", "syncopt", "async"]),
    default="fedavg",
    show_default=True,
    help="fedavg: a coordinator runs rounds; gossip: no coordinator, agents merge each other's models; "
    "syncopt: gFedNTM, vocabulary consensus then one gradient per agent per step (ProdLDA); "
    "async: buffered asynchronous FedAvg with a slow agent and one that keeps losing its link, "
    "after the same federation in rounds",
)
@click.option("--agents", type=int, default=None, help="number of agent processes [default: 3, gossip and async 5]")
@click.option(
    "--rounds",
    default=None,
    type=int,
    help="FedAvg rounds [default: 15; async: 10, then asynchronously for as long]",
)
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
@click.option(
    "--compare/--no-compare",
    default=True,
    show_default=True,
    help="async: run the same federation in FedAvg rounds first and compare; without, asynchronously alone "
    "for as long as the rounds would take at the least",
)
@click.option(
    "--sites",
    type=click.IntRange(min=1),
    default=None,
    help="fedavg: the same agents flat, then over this many sites, each with its own Mosquitto and a site "
    "aggregator between its agents and the hub; compares the final accuracies [default agents: 2 per site]; "
    "with --secure-aggregation, secure rounds in both tiers (and with --dp-epsilon, distributed DP across them)",
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
    rounds: int | None,
    steps: int,
    periods: int,
    period_steps: int,
    merge: str,
    alpha: float,
    dp_epsilon: float | None,
    secure_aggregation: bool,
    compare: bool,
    sites: int | None,
    keep: bool,
    report_dir: Path,
) -> None:
    """A whole federation on this machine: broker, coordinator (FedAvg), agents, mDNS."""
    from fedagent.local.demo import (
        run_async_demo,
        run_demo,
        run_dp_demo,
        run_gossip_demo,
        run_sites_demo,
        run_syncopt_demo,
    )

    try:
        if sites is not None and mode != "fedavg":
            raise FedagentError("--sites runs the fedavg demo in tiers; drop --mode")
        if sites is not None and dp_epsilon is not None and not secure_aggregation:
            raise FedagentError(
                "--sites with --dp-epsilon runs distributed DP across tiers, which needs --secure-aggregation "
                "(a site's sum carries only its agents' part of the noise)"
            )
        if secure_aggregation and mode != "fedavg":
            raise FedagentError(f"--secure-aggregation works with --mode fedavg, not {mode}")
        if dp_epsilon is not None and mode != "fedavg":
            raise FedagentError("--dp-epsilon runs the fedavg demo (central DP); drop --mode")
        if sites is not None:
            code = run_sites_demo(
                sites=sites,
                agents=agents or 2 * sites,
                rounds=rounds or 15,
                alpha=alpha,
                keep=keep,
                report_dir=report_dir,
                secure=secure_aggregation,
                dp_epsilon=dp_epsilon,
            )
        elif mode == "async":
            if (agents or 5) < 3:
                raise FedagentError("--mode async needs at least 3 agents (one slow, one cut off, one steady)")
            code = run_async_demo(agents=agents or 5, rounds=rounds or 10, alpha=alpha, keep=keep, compare=compare)
        elif dp_epsilon is not None:
            if not (dp_epsilon > 0 and math.isfinite(dp_epsilon)):
                raise FedagentError("--dp-epsilon must be a positive number")
            code = run_dp_demo(
                epsilon=dp_epsilon,
                agents=agents or 3,
                rounds=rounds or 15,
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
                rounds=rounds or 15,
                alpha=alpha,
                keep=keep,
                report_dir=report_dir,
                secure=secure_aggregation,
            )
    except FedagentError as exc:
        fail(exc)
    sys.exit(code)
