"""FLSimCo over several seeds, in one process per (seed, strategy): the same schedule of
vehicles, mobility, blur, SimCo training and aggregation as ``fedagent experiment
flsimco``, without the daemons (the real path takes ~27 minutes per seed on 2 shared
cores; the aggregation is the coordinator's own ``StrategyAggregator``).

Per round r: the ``coverage`` vehicles in range (the experiment's schedule: the first
ones stay 1..``stay`` rounds, every later one ``stay`` rounds, a leaving vehicle replaced
by the next) each train the global model for ``local_epochs`` epochs at the cosine step
of round r with seed r (what the coordinator sends), then the strategy aggregates them;
the global model's held-out SimCo loss (7 clean batches, fixed augmentations) is
recorded. The seed sets everything: the digits split, the Dirichlet shards, the speeds,
the model's initial weights. Writes ``results.json``, ``report.md`` and ``loss.png``
(mean and 95 % band over the seeds, t interval) to ``--out``.

    .venv/bin/python scripts/flsimco_seeds.py --seeds 5 --jobs 2 --out results/flsimco/seeds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from fedagent.experiments.flsimco import LABELS, STRATEGIES, Setup, _vehicle_options
from fedagent.protocols.aggregation import Strategy, StrategyAggregator
from fedagent.tasks.base import get_weights, load_task, set_weights
from fedagent.tasks.flsimco import heldout_loss

# two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def rounds_of(setup: Setup) -> list[list[dict]]:
    """The vehicles in range in each round (the daemon run's schedule, every join on time)."""
    queue = list(setup.schedule())
    active = [dict(v, left=v["stay"]) for v in queue[: setup.coverage]]
    queue = queue[setup.coverage :]
    out = []
    for _ in range(setup.rounds):
        out.append([dict(v) for v in active])
        for v in active:
            v["left"] -= 1
        active = [v for v in active if v["left"] > 0]
        while len(active) < setup.coverage and queue:
            v = queue.pop(0)
            active.append(dict(v, left=v["stay"]))
    return out


def run(setup: Setup, strategy: str) -> dict:
    torch.set_num_threads(1)
    t0 = time.monotonic()
    base = load_task("flsimco", {"seed": setup.seed, "speed": 0.0})
    torch.manual_seed(setup.seed)
    model = base.build_model()
    weights = get_weights(model)
    heldout = [heldout_loss(model, base.queries)]
    tasks: dict[str, object] = {}
    dropped = aggregated = 0
    for r, vehicles in enumerate(rounds_of(setup), start=1):
        lr = setup.lr * 0.5 * (1.0 + math.cos(math.pi * (r - 1) / setup.rounds))
        strat = (
            Strategy(strategy, key="speed", threshold=setup.threshold)
            if strategy == "drop_above"
            else Strategy(strategy)
        )
        agg = StrategyAggregator(strat, weights)
        for v in vehicles:
            task = tasks.get(v["id"]) or tasks.setdefault(v["id"], load_task("flsimco", _vehicle_options(setup, v)))
            local = task.build_model()
            set_weights(local, weights)
            metrics = task.fit(local, epochs=setup.local_epochs, lr=lr, batch_size=setup.batch_size, seed=r)
            if agg.add(v["id"], get_weights(local), task.num_samples(), metrics):
                aggregated += 1
            else:
                dropped += 1
        if agg.count:
            weights = agg.result()
        set_weights(model, weights)
        heldout.append(heldout_loss(model, base.queries))
    return {
        "seed": setup.seed,
        "strategy": strategy,
        "heldout": heldout,
        "aggregated": aggregated,
        "dropped": dropped,
        "fast_visits": sum(v["speed"] > setup.threshold for rnd in rounds_of(setup) for v in rnd),
        "seconds": time.monotonic() - t0,
    }


def band(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    return m, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def second_half(curve: list[float]) -> float:
    rounds = curve[1:]  # curve[0] is the untrained model
    return statistics.fmean(rounds[len(rounds) // 2 :])


def var_change(curve: list[float]) -> float:
    d = np.diff(np.asarray(curve[1:]))
    return float(np.var(d))


def verdicts(res: dict[str, dict[int, dict]], seeds: list[int]) -> list[str]:
    """Each of the paper's orderings, paired by seed: the per-seed differences, their mean
    and 95 % interval; it holds when the whole interval is on the paper's side."""
    lines = []

    def paired(name: str, diffs: list[float], better: str) -> None:
        m, h = band(diffs)
        wins = sum(d < 0 for d in diffs)
        holds = m + h < 0
        verdict = "**holds**" if holds else ("**not shown**" if m < 0 else "**does not hold**")
        lines.append(
            f"- {name}: difference {m:+.4f} ± {h:.4f} (95 % interval over {len(diffs)} seeds; "
            f"negative = {better}); {wins} of {len(diffs)} seeds on the paper's side: {verdict}"
        )

    b, f, d = (res[s] for s in STRATEGIES)
    paired(
        "blur-weighted lower than FedAvg (held-out, 2nd-half mean)",
        [second_half(b[s]["heldout"]) - second_half(f[s]["heldout"]) for s in seeds],
        "blur-weighted lower",
    )
    paired(
        "blur-weighted lower than FedAvg (held-out, final)",
        [b[s]["heldout"][-1] - f[s]["heldout"][-1] for s in seeds],
        "blur-weighted lower",
    )
    paired(
        "blur-weighted steadier than FedAvg (variance of the round-to-round change)",
        [var_change(b[s]["heldout"]) - var_change(f[s]["heldout"]) for s in seeds],
        "blur-weighted steadier",
    )
    paired(
        "dropping blurred models worse than FedAvg (2nd-half mean)",
        [second_half(f[s]["heldout"]) - second_half(d[s]["heldout"]) for s in seeds],
        "dropping worse",
    )
    paired(
        "dropping blurred models worse than blur-weighted (2nd-half mean)",
        [second_half(b[s]["heldout"]) - second_half(d[s]["heldout"]) for s in seeds],
        "dropping worse",
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/flsimco/seeds"))
    args = ap.parse_args()
    t0 = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    todo = [(replace(Setup(), seed=s, rounds=args.rounds), strat) for s in seeds for strat in STRATEGIES]
    res: dict[str, dict[int, dict]] = {s: {} for s in STRATEGIES}
    with ProcessPoolExecutor(args.jobs) as pool:
        for out in pool.map(run, *zip(*todo)):
            res[out["strategy"]][out["seed"]] = out
            print(
                f"seed {out['seed']} {out['strategy']}: final {out['heldout'][-1]:.4f} ({out['seconds']:.0f} s)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    wall = time.monotonic() - t0
    (args.out / "results.json").write_text(
        json.dumps({"seeds": seeds, "rounds": args.rounds, "wall_s": wall, "runs": res}, indent=1)
    )
    write_report(args.out, res, seeds, args.rounds, wall, args)


def write_report(out: Path, res: dict, seeds: list[int], rounds: int, wall: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = []
    for i, s in enumerate(STRATEGIES):
        curves = np.array([res[s][seed]["heldout"] for seed in seeds])
        m = curves.mean(0)
        h = np.array([band(list(curves[:, r]))[1] for r in range(curves.shape[1])])
        x = np.arange(curves.shape[1])
        ax.plot(x, m, color=f"C{i}", label=LABELS[s])
        ax.fill_between(x, m - h, m + h, color=f"C{i}", alpha=0.2)
        fm, fh = band(list(curves[:, -1]))
        sm, sh = band([second_half(list(c)) for c in curves])
        vm, vh = band([var_change(list(c)) for c in curves])
        drops = sum(res[s][seed]["dropped"] for seed in seeds)
        rows.append(f"| {LABELS[s]} | {fm:.4f} ± {fh:.4f} | {sm:.4f} ± {sh:.4f} | {vm:.5f} ± {vh:.5f} | {drops} |")
    ax.set_xlabel("round (0 = initial model)")
    ax.set_ylabel("held-out SimCo loss")
    ax.set_title(f"FLSimCo, mean and 95 % band over {len(seeds)} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    seconds = [r["seconds"] for s in STRATEGIES for r in res[s].values()]
    per_round = ["| round | " + " | ".join(LABELS[s] for s in STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
    for r in range(rounds + 1):
        cells = []
        for s in STRATEGIES:
            m, h = band([res[s][seed]["heldout"][r] for seed in seeds])
            cells.append(f"{m:.4f} ± {h:.4f}")
        per_round.append(f"| {r} | " + " | ".join(cells) + " |")
    text = [
        "# FLSimCo over seeds: held-out loss, mean and 95 % band",
        "",
        f"Command: `.venv/bin/python scripts/flsimco_seeds.py --seeds {len(seeds)} --first-seed {seeds[0]} "
        f"--rounds {rounds} --jobs {args.jobs} --out {out}`; seeds {', '.join(map(str, seeds))}; "
        f"{wall / 60:.1f} min wall time on 2 cores shared with other jobs ({min(seconds):.0f}-{max(seconds):.0f} s per run).",
        "",
        f"The set-up of `fedagent experiment flsimco` ({rounds} rounds, 4 vehicles in range per round, each staying "
        "2 rounds, 10 Dirichlet α = 1 shards of the digits, SimCo on the small ResNet, 2 local epochs, SGD lr 0.05 "
        "with cosine decay, speeds from eq. 1, blur from eq. 2, baseline 2 drops vehicles above 100 km/h) run in "
        "process: the same vehicle schedule, training and `StrategyAggregator` as the daemons, every vehicle on time. "
        "Each seed changes the data split, the shards, the speeds and the initial model. ± is the half-width of the "
        "95 % Student t interval over the seeds.",
        "",
        "| strategy | held-out loss, final | held-out, 2nd-half mean | var of round-to-round change | models dropped |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "## The paper's orderings",
        "",
        "Paired by seed (the three strategies of a seed share the vehicles, data and initial model):",
        "",
        *verdicts(res, seeds),
        "",
        "![held-out loss](loss.png)",
        "",
        "## Per round",
        "",
        *per_round,
        "",
    ]
    (out / "report.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
