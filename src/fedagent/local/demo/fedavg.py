"""``fedagent demo`` (the default mode): FedAvg rounds on the built-in digits task split
non-IID, compared at the end with local-only and centralized training; with
``--secure-aggregation`` and ``--dp-epsilon``, the same federation plain and private side
by side (accuracy, seconds and bytes per round, epsilon spent)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedagent.local.demo.references import train_reference
from fedagent.local.demo.runner import Plan, Watch, elapsed, need_agents, report_label, run, work_dir
from fedagent.local.federation import LOCAL_EPOCHS, SEED, Federation
from fedagent.protocols.dp import RANGE_MISS
from fedagent.protocols.serveropt import DEFAULT_MOMENTUM

#: What the demo's coordinator runs with its defaults (private rounds: no momentum).
FEDAVG = f"FedAvg, server momentum {DEFAULT_MOMENTUM:g}"


def run_demo(
    *,
    agents: int = 3,
    rounds: int = 15,
    alpha: float = 0.3,
    keep: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
    secure: bool = False,
    figures: dict[str, Any] | None = None,
) -> int:
    """FedAvg on digits. ``secure``: with secure aggregation, after a plain run of the
    same federation, and both side by side (accuracy, seconds and bytes per round).
    ``figures`` receives this run's accuracy and per-round cost."""
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    need_agents(agents)
    plain: dict[str, Any] = {}
    mine: dict[str, Any] = figures if figures is not None else {}
    if secure:
        console.print("[bold]secure aggregation[/]: the same federation runs twice, plain FedAvg first")
        code = run_demo(agents=agents, rounds=rounds, alpha=alpha, keep=keep, console=console, figures=plain)
        if code != 0:
            return code
    torch.set_num_threads(1)
    fed = Federation(
        work_dir("fedagent-demo-"),
        agents=agents,
        rounds=rounds,
        alpha=alpha,
        rounds_options={"secure_aggregation": True} if secure else None,
    )
    started = time.monotonic()
    title = f"{FEDAVG}, secure aggregation" if secure else FEDAVG

    def watch(fed: Federation) -> Watch | None:
        s = fed.status("coordinator")
        if s is None:
            return None
        m = s.get("metrics") or {}
        online = sum(1 for p in (s.get("peers") or {}).values() if p.get("online"))
        desc = f"round {s['round']} ({s['phase']}), {online}/{agents} agents online" + (
            f", train loss {m['loss']:.3f}" if "loss" in m else ""
        )
        return Watch(s["completed_rounds"], desc, s["phase"] == "done")

    def collect(fed: Federation) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any], dict[str, Any]]:
        agent_status = {aid: fed.status(aid) for aid in fed.agent_ids}
        weights, meta = fed.final_weights()
        round_costs(fed, mine)
        return agent_status, weights, meta

    def evaluate(collected: tuple[dict[str, dict[str, Any] | None], dict[str, Any], dict[str, Any]]) -> int:
        agent_status, weights, meta = collected
        console.print(
            f"federation finished {meta['completed_rounds']} rounds in {elapsed(started)}; "
            "evaluating against local-only and centralized training"
        )
        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, weights)
        federated = task.evaluate(model)["accuracy"]
        mine["accuracy"] = federated
        epochs = rounds * LOCAL_EPOCHS
        table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
        table.add_column("model")
        table.add_column("training data")
        table.add_column("accuracy", justify="right")
        if plain:
            table.add_row(f"federated ({FEDAVG})", f"{agents} agents, never pooled", f"{plain['accuracy']:.3f}")
        table.add_row(f"[bold]federated ({title})[/]", f"{agents} agents, never pooled", f"[bold]{federated:.3f}[/]")
        locals_ = []
        for i, aid in enumerate(fed.agent_ids):
            n = (agent_status.get(aid) or {}).get("num_samples", "?")
            acc = train_reference({"shard": i, "shards": agents, "alpha": alpha, "seed": SEED}, epochs)
            locals_.append(acc)
            table.add_row(f"local only: {aid}", f"its own shard ({n} images)", f"{acc:.3f}")
        central = train_reference({"seed": SEED}, epochs)
        table.add_row("centralized", "union of all shards", f"{central:.3f}")
        console.print(table)
        if plain:
            console.print(masking_overhead(plain, mine))
        if report_dir is not None:
            from fedagent.local.report import find_histories, write_report

            md = write_report(
                find_histories(fed.work / "state"),
                report_dir,
                title=f"fedagent demo: {agents} agents, {rounds} rounds, digits (alpha={alpha})",
            )
            with md.open("a") as f:
                f.write(
                    "\n## Final test accuracy\n\n| model | accuracy |\n|---|---|\n"
                    f"| federated ({title}) | {federated:.3f} |\n"
                    + "".join(f"| local only: {aid} | {acc:.3f} |\n" for aid, acc in zip(fed.agent_ids, locals_))
                    + f"| centralized | {central:.3f} |\n"
                )
            console.print(f"{report_label()}: [cyan]{md}[/]")
        ok = all(federated >= a for a in locals_)
        verdict = (
            "[green]federated >= every local-only model[/]"
            if ok
            else "[red]federated model is below a local-only model[/]"
        )
        console.print(f"{verdict}; gap to centralized {central - federated:+.3f}; total {elapsed(started)}")
        return 0 if ok else 1

    plan = Plan(
        title=f"[bold]fedagent demo[/]: federation [cyan]{fed.fed}[/], {agents} agents, {rounds} {title} "
        f"rounds on UCI digits (Dirichlet alpha={alpha})",
        started=lambda fed: (
            f"broker [green]{fed.broker_uri}[/] (mutual TLS, per-agent ACL); starting the "
            f"coordinator and {agents} agents; agents find the coordinator by mDNS on 127.0.0.1"
        ),
        total=rounds,
        limit=600,
        watch=watch,
        collect=collect,
        evaluate=evaluate,
    )
    return run(fed, plan, keep=keep, console=console)


DISTRIBUTED_CLIP = 1.0  # the demo's fixed clip norm under distributed DP


def run_dp_demo(
    *,
    epsilon: float,
    agents: int = 3,
    rounds: int = 15,
    alpha: float = 0.3,
    keep: bool = False,
    console: Console | None = None,
    secure: bool = False,
) -> int:
    """The FedAvg demo twice, plain and with central DP-FedAvg calibrated to ``epsilon``
    (δ = 1e-5, adaptive clipping), and their accuracies side by side with ε spent.
    ``secure``: the private run uses secure aggregation with distributed DP instead (each
    agent clips to a fixed bound and adds its share of the noise before masking), and the
    masking overhead per round is printed too."""
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    need_agents(agents)
    torch.set_num_threads(1)
    started = time.monotonic()
    results: dict[str, Any] = {}

    def plan_for(fed: Federation, label: str) -> Plan[Any]:
        def watch(fed: Federation) -> Watch | None:
            s = fed.status("coordinator")
            if s is None:
                return None
            p = s.get("privacy") or {}
            desc = f"{label}: round {s['round']} ({s['phase']})" + (f", ε {p['epsilon']:.2f}" if p else "")
            return Watch(s["completed_rounds"], desc, s["phase"] == "done")

        def collect(fed: Federation) -> tuple[dict[str, Any], dict[str, Any]]:
            status = fed.status("coordinator") or {}
            status["costs"] = round_costs(fed, {})
            status["cut"] = sum(int((fed.status(a) or {}).get("dp_quantisation_cut") or 0) for a in fed.agent_ids)
            return status, fed.final_weights()[0]

        def evaluate(collected: tuple[dict[str, Any], dict[str, Any]]) -> int:
            status, weights = collected
            task = load_task("digits", {"seed": SEED})
            model = task.build_model()
            set_weights(model, weights)
            results[label] = (task.evaluate(model)["accuracy"], status)
            return 0

        return Plan(
            title=f"[bold]fedagent demo[/] ({label}): federation [cyan]{fed.fed}[/], {agents} agents, "
            f"up to {rounds} FedAvg rounds on UCI digits",
            started=lambda fed: f"broker [green]{fed.broker_uri}[/]; starting the coordinator and {agents} agents",
            total=rounds,
            limit=600,
            watch=watch,
            collect=collect,
            evaluate=evaluate,
        )

    if secure:
        # Distributed DP: a fixed clip (the coordinator sees no single update to adapt it
        # to), each agent adding z·C/√n before masking. The demo's first updates have norms
        # of 1.8 to 6, so every one is clipped: the ratio of signal to noise is then the
        # same for any C.
        privacy = {"mode": "distributed", "target_epsilon": epsilon, "clip_norm": DISTRIBUTED_CLIP}
        label = f"secure + DP ε={epsilon:g}"
    else:
        privacy = {"mode": "central", "target_epsilon": epsilon, "clip_norm": 1.0, "adaptive_clip": True}
        label = f"DP ε={epsilon:g}"
    runs: tuple[tuple[str, dict[str, Any] | None], ...] = (("plain", None), (label, privacy))
    for name, dp_options in runs:
        fed = Federation(
            work_dir("fedagent-demo-"),
            agents=agents,
            rounds=rounds,
            alpha=alpha,
            privacy=dp_options,
            rounds_options={"secure_aggregation": True} if secure and dp_options else None,
        )
        code = run(fed, plan_for(fed, name), keep=keep, console=console)
        if code:
            return code
    (plain, plain_status), (private, status) = results["plain"], results[label]
    p = status.get("privacy") or {}
    table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
    table.add_column("model")
    table.add_column("rounds", justify="right")
    table.add_column("privacy")
    table.add_column("accuracy", justify="right")
    table.add_row(f"federated ({FEDAVG})", str(rounds), "none", f"{plain:.3f}")
    table.add_row(
        "[bold]federated, secure aggregation + distributed DP[/]" if secure else "[bold]federated, central DP[/]",
        str(status.get("completed_rounds", "?")),
        f"ε = {p.get('epsilon', float('nan')):.3f} spent at δ = {p.get('delta', 0):g} "
        f"(noise ×{p.get('noise_multiplier', float('nan')):.3g}, clip {p.get('clip_norm', float('nan')):.3g})",
        f"[bold]{private:.3f}[/]",
    )
    console.print(table)
    if secure:
        costs = status.get("costs") or {}
        console.print(masking_overhead(plain_status.get("costs") or {}, costs))
        if "range" in costs:
            cut = int(status.get("cut") or 0)
            console.print(
                f"quantisation range ±{costs['range']:.3g} per coordinate (clip + the noise share's tail, "
                f"missed with probability below {RANGE_MISS:g} a round): {cut} noised value(s) cut"
            )
    console.print(
        f"DP costs {plain - private:+.3f} accuracy here. The guarantee covers each agent's whole data set, so the "
        f"noise on the average shrinks only with the number of agents: with {agents} agents it swamps the updates. "
        "`fedagent experiment dp-digits` measures the same mechanism with 300 simulated agents. "
        f"Total {elapsed(started)}."
    )
    return 0


def round_costs(fed: Federation, into: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds and coordinator bytes (in + out) per aggregated round, from the
    coordinator's history (read while the federation's files exist)."""
    path = fed.work / "state" / "coordinator" / fed.coordinator_id / fed.fed / "history.jsonl"
    rounds = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "round" and "seconds" in ev:
            rounds.append(ev)
    if rounds:
        into["round_seconds"] = sum(r["seconds"] for r in rounds) / len(rounds)
        last = rounds[-1]
        into["round_bytes"] = (last.get("bytes_in", 0) + last.get("bytes_out", 0)) / len(rounds)
        bounds = [r["secure"]["error_bound"] for r in rounds if "secure" in r]
        if bounds:
            into["error_bound"] = max(bounds)
        ranges = [r["secure"]["range"] for r in rounds if "range" in r.get("secure", {})]
        if ranges:
            into["range"] = max(ranges)
    return into


def masking_overhead(plain: dict[str, Any], secure: dict[str, Any]) -> str:
    if "round_seconds" not in plain or "round_seconds" not in secure:
        return "masking overhead: no round figures"
    t = secure["round_seconds"] / max(plain["round_seconds"], 1e-9)
    b = secure["round_bytes"] / max(plain["round_bytes"], 1.0)
    line = (
        f"masking overhead per round: {secure['round_seconds']:.2f}s vs {plain['round_seconds']:.2f}s "
        f"({t:.2f}x), {secure['round_bytes'] / 1e6:.2f} MB vs {plain['round_bytes'] / 1e6:.2f} MB "
        f"through the coordinator ({b:.2f}x)"
    )
    if "error_bound" in secure:
        line += f"; quantisation error per coordinate at most {secure['error_bound']:.2g}"
    return line
