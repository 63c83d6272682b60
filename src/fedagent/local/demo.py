"""``fedagent demo``: a whole federation on this machine, end to end.

A private Mosquitto (its own CA, certificates, ACL, a free loopback port), a
coordinator and N agents as separate processes that find the coordinator by mDNS on
loopback (:class:`fedagent.local.federation.Federation`), then one of three modes: FedAvg rounds
on the built-in digits task split non-IID, gossip without a coordinator, or Sync-Opt
(gFedNTM) on synthetic documents. At the end the federated result is compared with
local-only and centralized training.

Every mode goes through one runner, :func:`run`. Ctrl-C, SIGTERM (``timeout``, systemd,
CI) and SIGHUP (the terminal went away) all end a demo the same way: every process it
started is stopped and its work directory removed (unless ``--keep``), and the exit status
is 128 + the signal's number (130, 143, 129).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedagent.errors import FedagentError
from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED, Federation
from fedagent.protocols.dp import RANGE_MISS
from fedagent.protocols.serveropt import DEFAULT_MOMENTUM
from fedagent.stopsignals import deferring
from fedagent.storage import checkpoint, history

__all__ = [
    "Plan",
    "Watch",
    "run",
    "run_demo",
    "run_gossip_demo",
    "run_syncopt_demo",
    "train_reference",
    "train_reference_steps",
]

T = TypeVar("T")


# ---- the runner -----------------------------------------------------------------------
class Interrupted(BaseException):
    """A signal asked the demo to stop. A BaseException like KeyboardInterrupt, so no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# SIGINT is Python's KeyboardInterrupt already; these two otherwise end the process
# without running a single ``finally``.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def _signals(handler: Callable[[int, FrameType | None], Any] | int, *, interrupt_too: bool = False) -> Iterator[None]:
    """``handler`` for SIGTERM and SIGHUP (and SIGINT if asked) inside the block, the
    previous handlers after it. Only the main thread may set handlers; elsewhere (a
    test calling a demo from a thread) the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (*_STOP_SIGNALS, signal.SIGINT) if interrupt_too else _STOP_SIGNALS
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def _ctrl_c_deferring() -> Iterator[None]:
    """Ctrl-C's KeyboardInterrupt, held back while a child process is being started
    (see :mod:`fedagent.stopsignals`), if SIGINT has Python's default handler here."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, deferring(signal.default_int_handler))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class Watch:
    """One look at a running federation: progress so far, and whether it is over."""

    completed: int
    description: str
    finished: bool


@dataclass
class Plan(Generic[T]):
    """One demo mode, as the runner needs it.

    ``configure`` writes the mode's configs after the PKI and broker exist; ``watch``
    polls the daemons (None while they do not answer yet); ``collect`` reads what the
    evaluation needs while they still run; ``evaluate`` runs after they have stopped
    and returns the exit status."""

    title: str
    started: Callable[[Federation], str]
    total: int
    limit: float
    watch: Callable[[Federation], Watch | None]
    collect: Callable[[Federation], T]
    evaluate: Callable[[T], int]
    configure: Callable[[Federation], None] | None = None


def _work_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def run(fed: Federation, plan: Plan[T], *, keep: bool = False, console: Console | None = None) -> int:
    """Start ``fed``, watch it until ``plan`` says it is over, evaluate, tidy up.

    Whatever ends the run (the end, an error, Ctrl-C, SIGTERM, SIGHUP) every process the
    federation started is stopped, and its work directory is removed unless ``keep``."""
    console = console or Console()
    work = fed.work
    started = time.monotonic()
    stopped_by = ""
    try:
        with _signals(deferring(_raise_interrupted)), _ctrl_c_deferring():
            try:
                console.print(f"{plan.title}; work dir {work}")
                with console.status("creating a CA and certificates, starting a private Mosquitto ..."):
                    fed.prepare()
                    if plan.configure is not None:
                        plan.configure(fed)
                console.print(plan.started(fed))
                fed.start_all()
                _follow(fed, plan, started, console)
                collected = plan.collect(fed)
                fed.close()
                return plan.evaluate(collected)
            except KeyboardInterrupt:
                stopped_by = "interrupted"
                console.print("[yellow]interrupted; stopping every process the demo started[/]")
                return 128 + signal.SIGINT
            except Interrupted as exc:
                stopped_by = f"received {exc}"
                console.print(f"[yellow]received {exc}; stopping every process the demo started[/]")
                return 128 + exc.signum
    finally:
        # A second signal must not cut the clean-up short (SIGKILL still can).
        with _signals(signal.SIG_IGN, interrupt_too=True):
            fed.close()
            if keep:
                console.print(f"kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
            if stopped_by:
                console.print(
                    f"[yellow]demo stopped ({stopped_by}): every process it started has exited"
                    + ("" if keep else f", {work} removed")
                    + "[/]"
                )


def _follow(fed: Federation, plan: Plan[Any], started: float, console: Console) -> None:
    """Progress bar until ``plan.watch`` reports the end; a daemon that dies or a run
    past ``plan.limit`` seconds is an error."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    running = False
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("waiting for agents", total=plan.total)
        while True:
            fed.check_alive()
            w = plan.watch(fed)
            if w is not None:
                if not running:
                    running = True
                    progress.console.print(
                        f"federation running: {len(fed.procs)} daemons started, answering on their sockets"
                    )
                progress.update(bar, completed=w.completed, description=w.description)
                if w.finished:
                    return
            if time.monotonic() - started > plan.limit:
                raise FedagentError(
                    f"the federation did not finish in {plan.limit / 60:.0f} minutes; logs in {fed.work / 'logs'}"
                )
            time.sleep(0.25)


def _elapsed(started: float) -> str:
    return f"{time.monotonic() - started:.1f}s"


def _need_agents(agents: int) -> None:
    if agents < 2:
        raise FedagentError("the demo needs at least 2 agents")


def train_reference(options: dict[str, Any], epochs: int) -> float:
    """Accuracy of a model trained with plain local SGD on the data ``options`` selects."""
    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    for e in range(epochs):
        task.fit(model, epochs=1, lr=LR, batch_size=BATCH, seed=e + 1)
    return task.evaluate(model)["accuracy"]


def train_reference_steps(options: dict[str, Any], steps: int, lr: float = LR, cosine: bool = False) -> float:
    """Accuracy after ``steps`` plain local SGD mini-batches (gossip's local-only and
    centralized baselines), with the gossip agents' cosine step-size decay if asked."""

    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    done, chunk = 0, 10
    while done < steps:
        n = min(chunk, steps - done)
        lr_t = lr * 0.5 * (1.0 + math.cos(math.pi * done / steps)) if cosine else lr
        task.fit_steps(model, steps=n, lr=lr_t, batch_size=BATCH, seed=done + 1)
        done += n
    return task.evaluate(model)["accuracy"]


# Gossip demo margin: every agent's own model ends within this much of centralized
# training on the union of the data with the same total number of mini-batches.
GOSSIP_MARGIN = 0.05
# Training 10 mini-batches of the tiny digits MLP takes milliseconds; a period of at
# least this long gives models time to travel, as a real model's training would.
PERIOD_SECONDS = 0.1
# The peak step size of the cosine schedule (gossip.lr_schedule): it decays to 0 at the
# last period, so the agents end in consensus.
GOSSIP_LR = 0.1


# ---- FedAvg -----------------------------------------------------------------------------
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
    _need_agents(agents)
    plain: dict[str, Any] = {}
    mine: dict[str, Any] = figures if figures is not None else {}
    if secure:
        console.print("[bold]secure aggregation[/]: the same federation runs twice, plain FedAvg first")
        code = run_demo(agents=agents, rounds=rounds, alpha=alpha, keep=keep, console=console, figures=plain)
        if code != 0:
            return code
    torch.set_num_threads(1)
    fed = Federation(
        _work_dir("fedagent-demo-"),
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
            f"federation finished {meta['completed_rounds']} rounds in {_elapsed(started)}; "
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
            console.print(f"{_report_label()}: [cyan]{md}[/]")
        ok = all(federated >= a for a in locals_)
        verdict = (
            "[green]federated >= every local-only model[/]"
            if ok
            else "[red]federated model is below a local-only model[/]"
        )
        console.print(f"{verdict}; gap to centralized {central - federated:+.3f}; total {_elapsed(started)}")
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
    _need_agents(agents)
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
            _work_dir("fedagent-demo-"),
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
        f"Total {_elapsed(started)}."
    )
    return 0


def round_costs(fed: Federation, into: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds and coordinator bytes (in + out) per aggregated round, from the
    coordinator's history (read while the federation's files exist)."""
    path = fed.work / "state" / "coordinator" / fed.coordinator_id / fed.fed / "history.jsonl"
    rounds = [ev for ev in history.read_records(path) if ev.get("event") == "round" and "seconds" in ev]
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


# ---- gossip -----------------------------------------------------------------------------
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
    _need_agents(agents)
    torch.set_num_threads(1)
    fed = Federation(
        _work_dir("fedagent-gossip-demo-"),
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
            f"all agents finished {periods} periods in {_elapsed(started)}; evaluating each "
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
            console.print(f"{_report_label()}: [cyan]{md}[/]")
        ok = central - worst <= GOSSIP_MARGIN
        verdict = (
            f"[green]every agent within {GOSSIP_MARGIN} of centralized[/]"
            if ok
            else f"[red]an agent is more than {GOSSIP_MARGIN} below centralized[/]"
        )
        console.print(
            f"{verdict}: worst agent {worst:.3f}, centralized {central:.3f} "
            f"(gap {central - worst:+.3f}); total {_elapsed(started)}"
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


# ---- Sync-Opt (gFedNTM) -----------------------------------------------------------------
# ProdLDA on the paper's synthetic generator (Sec. 4.1), at a size that trains in about a
# minute on 2 cores: 500 terms, 5 true topics shared by every agent and private ones
# (with the default 5 agents, one each: 10 true topics). See syncopt_options.
SYNCOPT_OPTIONS: dict[str, Any] = {
    "corpus": "synthetic",
    "vocab_size": 500,
    "true_topics": 10,
    "shared_topics": 5,
    "eta": 0.05,
    "docs": 400,
    "val_docs": 50,
    "doc_length": [50, 100],
    "data_seed": 0,
    "seed": 0,
    "n_topics": 10,
    "batch_size": 32,
}


def syncopt_options(agents: int) -> dict[str, Any]:
    """The demo's corpus for this many agents: every agent gets the same number of private
    topics (the generator needs the private ones to split evenly), 5 // agents of them but at
    least one; the model has as many topics as the corpus."""
    shared = SYNCOPT_OPTIONS["shared_topics"]
    true_topics = shared + agents * max(1, (SYNCOPT_OPTIONS["true_topics"] - shared) // agents)
    return {**SYNCOPT_OPTIONS, "true_topics": true_topics, "n_topics": true_topics}


def run_syncopt_demo(*, agents: int = 5, steps: int = 300, keep: bool = False, console: Console | None = None) -> int:
    """Vocabulary consensus and Sync-Opt steps over the network, then the same steps
    centralized in this process: the two models must agree and find the true topics."""
    import numpy as np
    import torch

    from fedagent.tasks import ntm, ntm_data, ntm_scores
    from fedagent.tasks.base import get_weights, load_task, set_weights

    console = console or Console()
    _need_agents(agents)
    torch.set_num_threads(1)
    fed = Federation(_work_dir("fedagent-syncopt-demo-"), agents=agents, rounds=1, alpha=0.0)
    started = time.monotonic()
    o = syncopt_options(agents)

    def options(i: int) -> dict[str, Any]:
        return {**o, "shard": i, "shards": agents}

    def configure(fed: Federation) -> None:
        syncopt = {
            "steps": steps,
            "expected_agents": agents,
            "min_agents": agents,
            "step_timeout": 60.0,
            "on_fault": "continue",
            "checkpoint_every": 50,
        }
        fed.prepare_syncopt("prodlda", options, options(0), syncopt)

    last: dict[str, Any] = {}

    def watch(fed: Federation) -> Watch | None:
        s = fed.status("coordinator")
        if s is None:
            return None
        last.update(s)
        if s["phase"] == "vocabulary":
            desc = f"vocabulary: {len(s.get('vocabulary_offers') or [])}/{agents} offers"
        else:
            loss = s.get("last_loss")
            desc = f"{s['phase']}: step {s['step']}, vocabulary {s.get('vocabulary_size')} terms" + (
                f", loss {loss:.2f}" if loss is not None else ""
            )
        return Watch(s["steps_done"], desc, s["phase"] in ("done", "aborted"))

    def collect(fed: Federation) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        if last.get("phase") != "done":
            raise FedagentError(f"Sync-Opt aborted; logs in {fed.work / 'logs'}")
        weights, meta = fed.final_weights()
        weights = {k: v for k, v in weights.items() if not k.startswith("optim/")}
        vocab = (fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "vocabulary.json").read_text()
        return weights, meta, json.loads(vocab)["terms"]

    def ntm_task(i: int) -> ntm.NtmTask:
        task = load_task("prodlda", options(i))
        if not isinstance(task, ntm.NtmTask):
            raise FedagentError(f"prodlda is not a topic-model task ({type(task).__name__})")
        return task

    def evaluate(collected: tuple[dict[str, Any], dict[str, Any], list[str]]) -> int:
        weights, meta, terms = collected
        console.print(
            f"federation finished {meta['model_version']} steps in {_elapsed(started)} "
            f"(exact: {meta['exact']}); training the same steps centralized in this process ..."
        )
        tasks = [ntm_task(i) for i in range(agents)]
        for t in tasks:
            t.set_vocabulary(terms)
        central = tasks[0].build_model()
        opt = tasks[0].make_optimizer(central.parameters())
        for step in range(steps):
            ntm.centralized_step(central, opt, tasks, step)
        federated = tasks[0].build_model()
        set_weights(federated, weights)
        cw = get_weights(central)
        diff = max(float(np.max(np.abs(weights[k].astype(np.float64) - cw[k]))) for k in cw)
        # The true topics on the agreed vocabulary (terms nobody used are dropped).
        all_terms = ntm_data.synthetic_terms(o["vocab_size"])
        col = {t: j for j, t in enumerate(all_terms)}
        beta = ntm_data.true_topics(o["vocab_size"], o["true_topics"], o["eta"], o["data_seed"])[
            :, [col[t] for t in terms]
        ]
        beta = beta / beta.sum(axis=1, keepdims=True)
        tss_fed = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(federated))
        tss_central = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(central))
        table = Table(title="federated ProdLDA topics (top 8 words)", title_justify="left")
        table.add_column("topic", justify="right")
        table.add_column("words")
        for k, words in enumerate(tasks[0].topics(federated, 8)):
            table.add_row(str(k), " ".join(words))
        console.print(table)
        res = Table(title="federated vs centralized", title_justify="left")
        res.add_column("measure")
        res.add_column("value", justify="right")
        res.add_row("max |w_federated - w_centralized|", f"{diff:.2e}")
        res.add_row(f"TSS federated (max {o['true_topics']})", f"{tss_fed:.3f}")
        res.add_row("TSS centralized", f"{tss_central:.3f}")
        console.print(res)
        ok = diff <= 1e-3 and abs(tss_fed - tss_central) <= 0.01
        console.print(
            (
                "[green]federated training matches centralized training[/]"
                if ok
                else "[red]federated training differs from centralized training[/]"
            )
            + f"; total {_elapsed(started)}"
        )
        return 0 if ok else 1

    plan = Plan(
        title=f"[bold]fedagent demo --mode syncopt[/] (gFedNTM): federation [cyan]{fed.fed}[/], {agents} "
        f"agents with {o['docs']} synthetic documents each ({o['vocab_size']} terms, "
        f"{o['true_topics']} true topics, {o['shared_topics']} shared); ProdLDA with {o['n_topics']} "
        f"topics, {steps} Sync-Opt steps of {o['batch_size']} documents per agent",
        started=lambda fed: (
            f"broker [green]{fed.broker_uri}[/] (mutual TLS, per-agent ACL); agents find the "
            "coordinator by mDNS, send it their vocabularies (terms and counts, never a document), then one "
            "gradient per step"
        ),
        total=steps,
        limit=900,
        watch=watch,
        collect=collect,
        evaluate=evaluate,
        configure=configure,
    )
    return run(fed, plan, keep=keep, console=console)


def _report_label() -> str:
    from fedagent.local.report import plots_available

    return "report with plots" if plots_available() else "report (no plots: install the 'report' extra)"
