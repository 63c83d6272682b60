"""``fedagent demo --mode gossip``: agents and no coordinator. Each trains a few
mini-batches, sends its model to a random peer and merges what it received; at the end
every agent's own model is compared with local-only and centralized training."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedagent.errors import FedagentError
from fedagent.local.demo.references import train_reference_steps
from fedagent.local.demo.runner import Plan, Watch, elapsed, need_agents, report_label, run, work_dir
from fedagent.local.federation import SEED, Federation
from fedagent.storage import checkpoint

# Gossip demo margin: every agent's own model ends within this much of centralized
# training on the union of the data with the same total number of mini-batches.
GOSSIP_MARGIN = 0.05
# Training 10 mini-batches of the tiny digits MLP takes milliseconds; a period of at
# least this long gives models time to travel, as a real model's training would.
PERIOD_SECONDS = 0.1
# The peak step size of the cosine schedule (gossip.lr_schedule): it decays to 0 at the
# last period, so the agents end in consensus.
GOSSIP_LR = 0.1


def run_gossip_demo(
    *,
    agents: int = 5,
    periods: int = 100,
    period_steps: int = 10,
    alpha: float = 0.3,
    keep: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
    merge: str = "pushsum",
) -> int:
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    need_agents(agents)
    torch.set_num_threads(1)
    fed = Federation(
        work_dir("fedagent-gossip-demo-"),
        agents=agents,
        rounds=1,
        alpha=alpha,
        mode="gossip",
        gossip={
            "periods": periods,
            "period_steps": period_steps,
            "merge": merge,
            "min_peers": agents - 1,
            "period_seconds": PERIOD_SECONDS,
            "lr": GOSSIP_LR,
        },
    )
    started = time.monotonic()
    statuses: dict[str, dict[str, Any] | None] = {}

    def watch(fed: Federation) -> Watch | None:
        statuses.update({aid: fed.status(aid) for aid in fed.agent_ids})
        live = [s for s in statuses.values() if s is not None and "gossip" in s]
        if not live:
            return None
        slowest = min(s["period"] for s in live)
        sent = sum(s["gossip"]["sent"] for s in live)
        dropped = sum(s["gossip"]["dropped"] for s in live)
        dis = [s["disagreement_rel"] for s in live if s.get("disagreement_rel") is not None]
        desc = f"slowest agent at period {slowest}, {len(live)}/{agents} gossiping, {sent} models sent, " + (
            f"{dropped} dropped" + (f", disagreement {max(dis):.1%}" if dis else "")
        )
        return Watch(slowest, desc, len(live) == agents and all(s["round_state"] == "finished" for s in live))

    def evaluate(_: None) -> int:
        console.print(
            f"all agents finished {periods} periods in {elapsed(started)}; evaluating each "
            "agent's own model against local-only and centralized training"
        )
        task = load_task("digits", {"seed": SEED})
        table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
        table.add_column("model")
        table.add_column("training data")
        table.add_column("accuracy", justify="right")
        steps = periods * period_steps
        gossip_acc: dict[str, float] = {}
        for aid in fed.agent_ids:
            loaded = checkpoint.load(fed.model_path(aid))
            if loaded is None:
                raise FedagentError(f"{aid} wrote no model checkpoint")
            model = task.build_model()
            set_weights(model, loaded[0])
            gossip_acc[aid] = task.evaluate(model)["accuracy"]
        local_acc: dict[str, float] = {}
        for i, aid in enumerate(fed.agent_ids):
            n = (statuses.get(aid) or {}).get("num_samples", "?")
            table.add_row(
                f"[bold]gossip: {aid}'s own model[/]",
                f"{agents} agents, never pooled",
                f"[bold]{gossip_acc[aid]:.3f}[/]",
            )
            local_acc[aid] = train_reference_steps(
                {"shard": i, "shards": agents, "alpha": alpha, "seed": SEED}, steps, GOSSIP_LR, cosine=True
            )
            table.add_row(f"local only: {aid}", f"its own shard ({n} images), {steps} steps", f"{local_acc[aid]:.3f}")
        central = train_reference_steps({"seed": SEED}, steps * agents, GOSSIP_LR, cosine=True)
        table.add_row("centralized", f"union of all shards, {steps * agents} steps", f"{central:.3f}")
        console.print(table)
        worst = min(gossip_acc.values())
        if report_dir is not None:
            from fedagent.local.report import write_gossip_report

            md = write_gossip_report(
                sorted((fed.work / "state").glob(f"*/agent/{fed.fed}/history.jsonl")),
                report_dir,
                title=f"fedagent gossip demo: {agents} agents, {periods} periods of "
                f"{period_steps} steps, digits (alpha={alpha}), merge={merge}",
                final=gossip_acc,
                local=local_acc,
                centralized=central,
                margin=GOSSIP_MARGIN,
            )
            console.print(f"{report_label()}: [cyan]{md}[/]")
        ok = central - worst <= GOSSIP_MARGIN
        verdict = (
            f"[green]every agent within {GOSSIP_MARGIN} of centralized[/]"
            if ok
            else f"[red]an agent is more than {GOSSIP_MARGIN} below centralized[/]"
        )
        console.print(
            f"{verdict}: worst agent {worst:.3f}, centralized {central:.3f} "
            f"(gap {central - worst:+.3f}); total {elapsed(started)}"
        )
        return 0 if ok else 1

    plan: Plan[None] = Plan(
        title=f"[bold]fedagent demo --mode gossip[/]: federation [cyan]{fed.fed}[/], {agents} agents and "
        f"[bold]no coordinator[/]; each trains {period_steps} mini-batches, sends its model to a random "
        f"peer and merges what it received ({merge}), {periods} times; UCI digits "
        f"(Dirichlet alpha={alpha})",
        started=lambda fed: (
            f"broker [green]{fed.broker_uri}[/] (mutual TLS, per-agent ACL); {fed.agent_ids[0]} "
            "is given the broker and advertises it, the others find it by mDNS on 127.0.0.1"
        ),
        total=periods,
        limit=600,
        watch=watch,
        collect=lambda fed: None,
        evaluate=evaluate,
    )
    return run(fed, plan, keep=keep, console=console)
