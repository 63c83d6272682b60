"""Is server momentum 0.7 a good default beyond the benchmark CNN? Plain FedAvg against
FedAvgM (``[rounds] server_momentum``) on the FedAvg workloads fedagent ships.

Every federation below runs in one process through the coordinator's own round machine
(:class:`fedagent.protocols.rounds.RoundMachine`: selection, aggregation, robust
aggregators, the DP stage and the server momentum step are the daemons' code); only the
transport and the agent processes are left out. Each agent trains the built-in
``digits`` task as the agent daemon does (``task.fit`` with the round number as its seed,
2 local epochs, lr 0.05, batch 32: fedagent.local.federation's settings), and the global model is
scored on the held-out digits after every round. The seed is the task's ``seed`` option
(held-out split, Dirichlet split and initial weights) and the round machine's sampling
seed.

Workloads (``--workloads``):

* ``demo``         ``fedagent demo``: 3 agents, Dirichlet(0.3), 15 rounds, every agent
                   every round;
* ``partial``      10 agents, Dirichlet(0.3), 3 sampled per round ([rounds]
                   agents_per_round), 20 rounds: partial participation (the demo itself
                   has no absent-agent pattern, so this is the stand-in);
* ``median``       10 agents, Dirichlet(0.5), coordinate-wise median, 20 rounds;
* ``trimmed_mean`` 10 agents, Dirichlet(0.5), trimmed mean (β = 0.1), 20 rounds;
* ``alpha0.1``     10 agents, Dirichlet(0.1), 20 rounds: the non-IID extreme;
* ``dp-fixed``     the same at ε = 3 and 8 with a fixed clip norm (dp_digits
                   ``--fixed-clip``), to tell the noise from the adaptive clipping;
* ``dp``           the DP experiment (fedagent_experiments.dp_digits, its recorded
                   setting: 300 agents, 100 sampled per round, 80 rounds, adaptive
                   clipping) at ε = 3, 8 and without DP. Momentum only post-processes the
                   released aggregate, so ε is unchanged.

Settings (``--settings``): ``m=0`` (plain FedAvg), ``m=0.7``, ``m=0.5``, ...

    nice -n 10 .venv/bin/python bench/studies/tta/momentum_default_study.py [--seeds 0 1 2 3 4] \
        [--workloads demo partial median trimmed_mean alpha0.1 dp] [--settings m=0 m=0.7 m=0.5]

Writes results/tta/momentum_default_study.json (every run's accuracy per round; runs
already there are skipped), prints the table of results/tta/report.md and, with
``--plot``, draws results/tta/momentum_default.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))

from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR  # noqa: E402
from fedagent.protocols.aggregation import Strategy  # noqa: E402
from fedagent.protocols.messages import TrainConfig  # noqa: E402
from fedagent.protocols.rounds import (  # noqa: E402
    AgentOnline,
    Finished,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)


@dataclass(frozen=True)
class Workload:
    agents: int
    alpha: float
    rounds: int
    target: float  # rounds to this held-out accuracy are counted
    per_round: int = 0
    strategy: Strategy = field(default_factory=Strategy)


WORKLOADS: dict[str, Workload] = {
    "demo": Workload(agents=3, alpha=0.3, rounds=15, target=0.95),
    "partial": Workload(agents=10, alpha=0.3, rounds=20, target=0.85, per_round=3),
    "median": Workload(agents=10, alpha=0.5, rounds=20, target=0.93, strategy=Strategy(name="median")),
    "trimmed_mean": Workload(
        agents=10, alpha=0.5, rounds=20, target=0.93, strategy=Strategy(name="trimmed_mean", trim=0.1)
    ),
    "alpha0.1": Workload(agents=10, alpha=0.1, rounds=20, target=0.93),
}
DP_EPSILONS = (3.0, 8.0, math.inf)
DP_TARGET = 0.90


def target_of(key: str) -> float:
    return DP_TARGET if key.startswith("dp") else WORKLOADS[key].target


def beta_of(setting: str) -> float:
    kind, _, val = setting.partition("=")
    if kind != "m":
        raise SystemExit(f"{setting}: settings are m=BETA")
    return float(val)


def run_digits(name: str, seed: int, beta: float) -> dict[str, Any]:
    import torch

    from fedagent.tasks import digits
    from fedagent.tasks.base import get_weights, set_weights

    w = WORKLOADS[name]
    tasks = [digits.make({"shard": i, "shards": w.agents, "alpha": w.alpha, "seed": seed}) for i in range(w.agents)]
    model = tasks[0].build_model()
    cfg = RoundConfig(
        rounds=w.rounds,
        min_agents=w.agents,
        expected_agents=w.agents,
        agents_per_round=w.per_round,
        min_updates=w.per_round or w.agents,
        train=TrainConfig(epochs=LOCAL_EPOCHS, lr=LR, batch_size=BATCH),
        seed=seed,
        strategy=w.strategy,
        server_momentum=beta,
    )
    machine = RoundMachine(cfg, get_weights(model), rng=np.random.default_rng(10_000 + seed))
    ids = [f"agent-{i + 1}" for i in range(w.agents)]
    out: list[Any] = []
    for aid, task in zip(ids, tasks, strict=True):
        out += machine.handle(AgentOnline(aid, task.num_samples()), 0.0)
    accs: list[float] = []
    now = 1.0
    while not any(isinstance(c, Finished) for c in out):
        starts = [c for c in out if isinstance(c, StartRound)]
        if not starts:
            raise RuntimeError(f"{name}: the round machine stopped without finishing: {out}")
        start = starts[-1]
        out = []
        for aid in start.selected:
            task = tasks[ids.index(aid)]
            set_weights(model, start.weights)
            metrics = task.fit(
                model, epochs=start.train.epochs, lr=start.train.lr, batch_size=start.train.batch_size, seed=start.round
            )
            upd = UpdateReceived(aid, start.round, start.model_version, task.num_samples(), get_weights(model), metrics)
            out += machine.handle(upd, now)
        now += 1.0
        if not any(isinstance(c, RoundAggregated) for c in out):
            raise RuntimeError(f"{name}: round {start.round} did not aggregate: {out}")
        set_weights(model, machine.weights)
        accs.append(tasks[0].evaluate(model)["accuracy"])
    torch.manual_seed(0)
    return {"accuracy": accs, "target": w.target}


def run_dp(epsilon: float, seed: int, beta: float, *, adaptive: bool = True) -> dict[str, Any]:
    from fedagent_experiments import dp_digits

    r = dp_digits.run_one(replace(dp_digits.Setup(), server_momentum=beta, adaptive=adaptive), epsilon, seed)
    return {
        "accuracy": [r["accuracy"]],
        "target": DP_TARGET,
        "epsilon_spent": r["epsilon_spent"],
        "noise_multiplier": r["noise_multiplier"],
        "final_clip_norm": r["final_clip_norm"],
    }


def jobs(workloads: list[str]) -> list[str]:
    """Workload keys: the digits workloads by name, the DP one per ε (``dp:eps=8``)."""
    keys = []
    for w in workloads:
        if w == "dp":
            keys += [f"dp:eps={e:g}" for e in DP_EPSILONS]
        elif w == "dp-fixed":
            keys += [f"dp-fixed:eps={e:g}" for e in DP_EPSILONS if math.isfinite(e)]
        else:
            keys.append(w)
    return keys


def run(key: str, seed: int, beta: float) -> dict[str, Any]:
    if key.startswith(("dp:eps=", "dp-fixed:eps=")):
        return run_dp(float(key.split("=")[1]), seed, beta, adaptive=key.startswith("dp:"))
    return run_digits(key, seed, beta)


def summary(rs: list[dict[str, Any]]) -> tuple[str, str]:
    """Rounds to the target (per seed, mean) and final accuracy (mean, min-max)."""
    fa = [r["accuracy"][-1] for r in rs]
    return (
        ", ".join(str(r["rounds_to_target"]) for r in rs),
        f"{statistics.mean(fa):.4f} ({min(fa):.4f}-{max(fa):.4f})",
    )


def table(results: list[dict[str, Any]], keys: list[str], settings: list[str]) -> None:
    print(
        "| workload | setting | seeds | rounds to target, per seed | mean rounds | final accuracy, mean (min-max) "
        "| Δ final vs m=0 |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    for key in keys:
        base = None
        for s in settings:
            rs = sorted((r for r in results if r["workload"] == key and r["setting"] == s), key=lambda r: r["seed"])
            if not rs:
                continue
            if s == "m=0":
                base = {r["seed"]: r["accuracy"][-1] for r in rs}
            dp_row = key.startswith("dp")
            target = target_of(key)
            for r in rs:  # from the recorded curve, so a target can change without a rerun
                r["rounds_to_target"] = next((i + 1 for i, a in enumerate(r["accuracy"]) if a >= target), None)
                r["target"] = target
            per_seed, final = summary(rs)
            n = [r["rounds_to_target"] or (len(r["accuracy"]) + 1) for r in rs]
            delta = ""
            if base is not None:
                d = [r["accuracy"][-1] - base[r["seed"]] for r in rs if r["seed"] in base]
                delta = f"{statistics.mean(d):+.4f} ({min(d):+.4f} to {max(d):+.4f})" if d else ""
            print(
                f"| {key} (target {rs[0]['target']:.2f}) | {s} | {', '.join(str(r['seed']) for r in rs)} |"
                f" {'-' if dp_row else per_seed} | {'-' if dp_row else f'{statistics.mean(n):.1f}'} | {final} | {delta} |"
            )


def plot(results: list[dict[str, Any]], keys: list[str], settings: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [k for k in keys if not k.startswith("dp")]
    dps = [k for k in keys if k.startswith("dp")]
    panels = len(curves) + (1 if dps else 0)
    cols = min(3, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[panels:]:
        ax.axis("off")
    colors = {s: f"C{i}" for i, s in enumerate(settings)}
    for ax, key in zip(axes, curves, strict=False):
        for s in settings:
            rs = [r for r in results if r["workload"] == key and r["setting"] == s]
            if not rs:
                continue
            a = np.array([r["accuracy"] for r in rs])
            x = np.arange(1, a.shape[1] + 1)
            ax.plot(x, a.mean(0), color=colors[s], label=s)
            ax.fill_between(x, a.min(0), a.max(0), color=colors[s], alpha=0.15)
        ax.axhline(rs[0]["target"], color="gray", linestyle=":", linewidth=1)
        ax.set_ylim(0.5, 1.0)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("held-out accuracy")
    axes[0].set_title(f"{curves[0]} (mean, min-max over seeds)", fontsize=10)
    axes[0].legend(loc="lower right")
    if dps:
        ax = axes[panels - 1]
        width = 0.8 / len(settings)
        for i, s in enumerate(settings):
            ms, lo, hi = [], [], []
            for key in dps:
                fa = [r["accuracy"][-1] for r in results if r["workload"] == key and r["setting"] == s]
                m = statistics.mean(fa) if fa else math.nan
                ms.append(m)
                lo.append(m - min(fa) if fa else 0)
                hi.append(max(fa) - m if fa else 0)
            ax.bar(np.arange(len(dps)) + i * width, ms, width, yerr=[lo, hi], color=colors[s], label=s, capsize=2)
        labels = [k.replace("dp:", "").replace("dp-fixed:", "fixed C, ") for k in dps]
        ax.set_xticks(np.arange(len(dps)) + width * (len(settings) - 1) / 2, labels, fontsize=7, rotation=20)
        ax.set_ylim(0.0, 1.12)
        ax.set_title("dp_digits, final accuracy (adaptive / fixed C)", fontsize=10)
        ax.legend(loc="upper center", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--workloads", nargs="+", default=[*WORKLOADS, "dp"])
    ap.add_argument("--settings", nargs="+", default=["m=0", "m=0.7"])
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "tta" / "momentum_default_study.json")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--plot", type=Path, nargs="?", const=ROOT / "results" / "tta" / "momentum_default.png")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    keys = jobs(args.workloads)
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    if not args.table_only:
        for key in keys:
            for setting in args.settings:
                for seed in args.seeds:
                    if any(r["seed"] == seed and r["setting"] == setting and r["workload"] == key for r in results):
                        continue
                    t0, c0 = time.perf_counter(), time.process_time()
                    r = run(key, seed, beta_of(setting))
                    reached = next((i + 1 for i, a in enumerate(r["accuracy"]) if a >= r["target"]), None)
                    r.update(
                        workload=key,
                        setting=setting,
                        seed=seed,
                        rounds_to_target=reached,
                        wall_s=time.perf_counter() - t0,
                        cpu_s=time.process_time() - c0,
                    )
                    results.append(r)
                    args.json.write_text(json.dumps(results, indent=1))
                    print(
                        key, setting, seed, reached, f"{r['accuracy'][-1]:.4f}", f"{r['cpu_s']:.1f} CPU-s", flush=True
                    )
    all_settings = list(dict.fromkeys([*args.settings, *(r["setting"] for r in results)]))
    all_settings.sort(key=beta_of)
    all_keys = list(dict.fromkeys([*keys, *(r["workload"] for r in results)]))
    table(results, all_keys, all_settings)
    if args.plot:
        plot(results, all_keys, all_settings, args.plot)


if __name__ == "__main__":
    main()
