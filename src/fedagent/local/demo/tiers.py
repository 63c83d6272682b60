"""``fedagent demo --sites N``: the FedAvg demo in two tiers, after the same agents flat.

Each site has its own Mosquitto, a site aggregator (``fedagent aggregator``) and its
agents; the hub has its broker and coordinator (:class:`~fedagent.local.tiers.
TieredFederation`). The same agents (same shards) first train flat, one coordinator for
all (:func:`~fedagent.local.demo.fedavg.run_demo`, with its local-only and centralized
references), then in tiers; the final test accuracies are compared in the table and the
report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedagent.errors import FedagentError
from fedagent.local.demo.fedavg import DISTRIBUTED_CLIP, FEDAVG, run_demo
from fedagent.local.demo.runner import Plan, Watch, elapsed, run, work_dir
from fedagent.local.federation import SEED
from fedagent.local.tiers import TieredFederation

#: How far (in test accuracy) the tiered model may be from the flat one before the demo
#: says so: the rounds are the same FedAvg, but each site's weight cap sees its own
#: agents, and the downlink's int8 steps round the two models differently.
SLACK = 0.03


def split(agents: int, sites: int) -> list[int]:
    """Agents per site, as even as can be (the first sites take the remainder)."""
    if sites < 1 or agents < sites:
        raise FedagentError(f"--sites {sites} needs at least one agent per site (--agents {agents})")
    return [agents // sites + (1 if i < agents % sites else 0) for i in range(sites)]


def run_sites_demo(
    *,
    sites: int,
    agents: int,
    rounds: int = 15,
    alpha: float = 0.3,
    keep: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
    secure: bool = False,
    dp_epsilon: float | None = None,
) -> int:
    """``secure``: secure aggregation in both tiers (each site's agents mask against their
    site, the site aggregators against each other at the hub); the flat run stays plain.
    ``dp_epsilon`` (with ``secure``): distributed DP across tiers, the hub's accountant
    calibrated to this ε (δ = 1e-5, a fixed clip): the agents add the noise, the sites
    none; the accuracy is then reported beside the flat run's, not held to it."""
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    sizes = split(agents, sites)
    console.print(
        f"[bold]tiers[/]: {agents} agents flat first, then the same agents over {sites} sites "
        f"({', '.join(map(str, sizes))} agents), each with its own broker and site aggregator"
    )
    flat: dict[str, Any] = {}
    code = run_demo(agents=agents, rounds=rounds, alpha=alpha, keep=keep, console=console, figures=flat)
    if code != 0:
        return code
    torch.set_num_threads(1)
    tiers_secure = {"secure_aggregation": True} if secure else {}
    private = secure and dp_epsilon is not None
    fed = TieredFederation(
        work_dir("fedagent-demo-sites-"),
        sites=sizes,
        rounds=rounds,
        alpha=alpha,
        hub_rounds={**tiers_secure, "min_updates": 2} if secure else None,
        site_rounds={**tiers_secure, "min_updates": 2} if secure else None,
        hub_privacy={"mode": "distributed", "target_epsilon": dp_epsilon, "clip_norm": DISTRIBUTED_CLIP}
        if private
        else None,
    )
    how = f"{FEDAVG}, secure aggregation in both tiers" if secure else FEDAVG
    if private:
        # (server momentum is off under DP: docs/privacy.md)
        how = f"FedAvg, secure aggregation in both tiers, distributed DP ε={dp_epsilon:g}"
    started = time.monotonic()

    def watch(fed: TieredFederation) -> Watch | None:
        s = fed.status("coordinator")
        if s is None:
            return None
        sites_ = ((s.get("tier") or {}).get("sites")) or {}
        up = sum(1 for v in sites_.values() if v["state"] != "offline")
        agents_ = sum(v["agents"] for v in sites_.values())
        m = s.get("metrics") or {}
        p = s.get("privacy") or {}
        desc = (
            f"round {s['round']} ({s['phase']}), {up}/{sites} sites with {agents_} agents"
            + (f", train loss {m['loss']:.3f}" if "loss" in m else "")
            + (f", ε {p['epsilon']:.2f}" if p else "")
        )
        return Watch(s["completed_rounds"], desc, s["phase"] == "done")

    def collect(fed: TieredFederation) -> tuple[dict[str, Any], dict[str, Any]]:
        weights, meta = fed.final_weights()
        hub = fed.status("coordinator") or {}
        meta = {**meta, "privacy": hub.get("privacy")}
        # what each site says of the noise: its agents' shares, none of its own
        meta["site_privacy"] = {s: ((fed.status(s) or {}).get("tier") or {}).get("privacy") for s in fed.site_ids}
        return weights, meta

    def evaluate(collected: tuple[dict[str, Any], dict[str, Any]]) -> int:
        weights, meta = collected
        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, weights)
        tiered = task.evaluate(model)["accuracy"]
        table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
        table.add_column("model")
        table.add_column("topology")
        table.add_column("accuracy", justify="right")
        table.add_row(f"federated ({FEDAVG})", f"flat: one coordinator, {agents} agents", f"{flat['accuracy']:.3f}")
        table.add_row(
            f"[bold]federated ({how})[/]",
            f"tiers: hub, {sites} site aggregators with {', '.join(map(str, sizes))} agents",
            f"[bold]{tiered:.3f}[/]",
        )
        console.print(table)
        gap = tiered - flat["accuracy"]
        p = meta.get("privacy") or {}
        if private:
            added = [v.get("noise_added") for v in meta["site_privacy"].values() if v]
            console.print(
                f"privacy: ε = {p.get('epsilon', float('nan')):.3f} spent at δ = {p.get('delta', 0):g}, accounted once at "
                f"the hub for {int(p.get('cohort', 0))} agents a round (noise ×{p.get('noise_multiplier', float('nan')):.3g}, "
                f"clip {p.get('clip_norm', float('nan')):.3g}); noise added by the site aggregators: "
                f"{', '.join(f'{a:g}' for a in added) or 'not reported'}"
            )
        dp_note = f", DP ε = {p.get('epsilon', 0.0):.3f}" if private else ""
        verdict_note = "differential privacy costs accuracy: not compared" if private else f"the demo accepts ±{SLACK}"
        if report_dir is not None:
            md = report_dir / "report.md"
            report_dir.mkdir(parents=True, exist_ok=True)
            with md.open("a") as f:
                f.write(
                    f"\n## Tiers: {sites} sites against flat\n\n| topology | accuracy |\n|---|---|\n"
                    f"| flat ({agents} agents) | {flat['accuracy']:.3f} |\n"
                    f"| {sites} sites ({', '.join(map(str, sizes))} agents){', secure' if secure else ''}"
                    f"{dp_note}"
                    f" | {tiered:.3f} |\n"
                    f"\n{meta.get('completed_rounds')} rounds each; tiered minus flat {gap:+.3f} "
                    f"({verdict_note}).\n"
                )
            console.print(f"report: [cyan]{md}[/]")
        if private:
            console.print(
                f"DP costs {-gap:+.3f} accuracy against the plain flat run (the noise hides a whole agent and is "
                f"averaged over {agents}); total {elapsed(started)}"
            )
            return 0
        ok = abs(gap) <= SLACK
        verdict = "[green]tiers within" if ok else "[red]tiers NOT within"
        console.print(f"{verdict} {SLACK} of flat[/] ({gap:+.3f}); total {elapsed(started)}")
        return 0 if ok else 1

    plan: Plan[tuple[dict[str, Any], dict[str, Any]]] = Plan(
        title=f"[bold]fedagent demo --sites {sites}[/]: federation [cyan]{fed.fed}[/], {rounds} {how} rounds",
        started=lambda fed: (
            f"hub broker and coordinator; per site a broker, a site aggregator and its agents "
            f"({', '.join(map(str, sizes))}); nothing bridged: the aggregators carry what crosses tiers"
        ),
        total=rounds,
        limit=900,
        watch=watch,
        collect=collect,
        evaluate=evaluate,
    )
    return run(fed, plan, keep=keep, console=console)
