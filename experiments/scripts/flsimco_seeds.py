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

``--reuse PATH`` takes the runs of an earlier ``results.json`` as they are and runs only
the (seed, strategy) pairs it lacks; ``--seeds``/``--first-seed`` stay the report's whole
seed range. A reused file must have been made with the same setting (refused otherwise),
and the first round of one reused run per strategy is recomputed and must match.
``results.json`` is rewritten after every run, so an interrupted invocation can be
continued with ``--reuse`` on its own output.

    .venv/bin/python experiments/scripts/flsimco_seeds.py --seeds 5 --jobs 2 --out results/flsimco/seeds
    .venv/bin/python experiments/scripts/flsimco_seeds.py --seeds 10 --reuse results/flsimco/seeds/results.json \
        --jobs 1 --out results/flsimco/seeds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from fedagent_experiments.flsimco import LABELS, STRATEGIES, Setup, _vehicle_options

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


def run(setup: Setup, strategy: str, stop_after: int | None = None) -> dict:
    """One strategy over the setup's rounds (``stop_after``: only the first rounds of
    that schedule, the step sizes still those of ``setup.rounds`` rounds)."""
    torch.set_num_threads(1)
    t0 = time.monotonic()
    base = load_task("flsimco", {"seed": setup.seed, "speed": 0.0})
    torch.manual_seed(setup.seed)
    model = base.build_model()
    weights = get_weights(model)
    heldout = [heldout_loss(model, base.queries)]
    tasks: dict[str, object] = {}
    dropped = aggregated = 0
    for r, vehicles in enumerate(rounds_of(setup)[:stop_after], start=1):
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


def setting(setup: Setup) -> dict:
    """What a run's numbers depend on besides its seed and strategy (recorded in
    results.json; a reused run must have been made with the same)."""
    d = asdict(setup)
    d.pop("seed")
    d.pop("round_timeout")  # the daemons' limit; nothing in process waits on it
    return d


class ReuseRefused(ValueError):
    pass


def reusable(path: Path, setup: Setup, seeds: list[int]) -> tuple[dict, dict[tuple[int, str], dict]]:
    """The runs of ``path`` for ``seeds`` that this setting may take as they are, by
    (seed, strategy), and the file's own record; :class:`ReuseRefused` with the reason
    when the file was made with another setting."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReuseRefused(f"cannot read {path}: {e}") from e
    if old.get("rounds") != setup.rounds:
        raise ReuseRefused(f"{path} has runs of {old.get('rounds')} rounds, this report {setup.rounds}")
    want = setting(setup)
    if "setting" in old:
        diff = {k: (old["setting"].get(k), v) for k, v in want.items() if old["setting"].get(k) != v}
        if diff:
            raise ReuseRefused(f"{path} was made with another setting (file, now): {diff}")
    # Files written before the setting was recorded: their runs must still fit this
    # schedule (the rounds, the visits above the threshold, the models per round).
    found: dict[tuple[int, str], dict] = {}
    for strategy, by_seed in old.get("runs", {}).items():
        if strategy not in STRATEGIES:
            raise ReuseRefused(f"{path} has runs of an unknown strategy {strategy!r}")
        for key, out in by_seed.items():
            seed = int(key)
            if seed not in seeds:
                continue
            s = replace(setup, seed=seed)
            sched = rounds_of(s)
            fast = sum(v["speed"] > s.threshold for rnd in sched for v in rnd)
            problems = []
            if out.get("seed") != seed or out.get("strategy") != strategy:
                problems.append("its record names another seed or strategy")
            if len(out.get("heldout", [])) != setup.rounds + 1:
                problems.append(f"{len(out.get('heldout', []))} held-out losses, not {setup.rounds + 1}")
            if out.get("fast_visits") != fast:
                problems.append(f"{out.get('fast_visits')} visits above the threshold, this schedule has {fast}")
            if out.get("aggregated", 0) + out.get("dropped", 0) != sum(map(len, sched)):
                problems.append("another number of models per round")
            if problems:
                raise ReuseRefused(f"{path}: seed {seed} {strategy}: " + "; ".join(problems))
            found[(seed, strategy)] = out
    return old, found


def check_reproduced(setup: Setup, found: dict[tuple[int, str], dict], tolerance: float = 1e-6) -> list[str]:
    """Recompute the first round of the lowest reused seed of each strategy; the held-out
    losses must match the reused ones (the code still makes the runs it would reuse)."""
    lines = []
    for strategy in STRATEGIES:
        seeds = sorted(seed for seed, st in found if st == strategy)
        if not seeds:
            continue
        old = found[(seeds[0], strategy)]["heldout"][:2]
        new = run(replace(setup, seed=seeds[0]), strategy, stop_after=1)["heldout"]
        gap = max(abs(a - b) for a, b in zip(old, new, strict=True))
        if not gap <= tolerance:
            raise ReuseRefused(
                f"seed {seeds[0]} {strategy}: round 1 recomputed gives held-out {new}, the reused run has {old} "
                f"(difference {gap:.3g} > {tolerance:g}): the code no longer makes the runs it would reuse"
            )
        lines.append(f"seed {seeds[0]} {strategy}: round 1 reproduced (largest difference {gap:.3g})")
    return lines


def band(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def second_half(curve: list[float]) -> float:
    rounds = curve[1:]  # curve[0] is the untrained model
    return statistics.fmean(rounds[len(rounds) // 2 :])


def var_change(curve: list[float]) -> float:
    d = np.diff(np.asarray(curve[1:]))
    return float(np.var(d))


def t95(df: int) -> float:
    """Two-sided 95 % Student t quantile (beyond the table: Cornish-Fisher's expansion
    around the normal quantile to 1/df², within 0.003 of the exact value from df 11)."""
    if df in T95:
        return T95[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def seeds_to_show(mean: float, sd: float, cap: int = 1000) -> int | None:
    """How many seeds would put the whole 95 % interval on the side of ``mean`` if the mean
    difference and its spread stayed as measured (None beyond ``cap``)."""
    if mean == 0 or not math.isfinite(sd):
        return None
    for n in range(2, cap + 1):
        if t95(n - 1) * sd / math.sqrt(n) < abs(mean):
            return n
    return None


def verdict(diffs: list[float], ref: float, ref_name: str, better: str) -> str:
    """The ordering's verdict (negative differences are on the paper's side) and what the
    interval says: how large an effect either way the seeds leave room for."""
    m, h = band(diffs)
    lo, hi = m - h, m + h
    interval = f"[{lo:+.4f}, {hi:+.4f}]"
    pct = abs(lo) / abs(ref) * 100 if ref else math.nan
    if hi < 0:
        return f"**holds**: the whole interval {interval} is on the paper's side"
    if lo > 0:
        return f"**the opposite holds**: the whole interval {interval} is on the other side"
    room = (
        f"the interval {interval} includes 0: {better} by at most {abs(lo):.4f} ({pct:.0f} % of {ref_name}'s "
        f"{ref:.4f}), or the other way by at most {hi:.4f}"
    )
    if m >= 0:
        return f"**does not hold**: the mean difference is on the other side; {room}"
    n = seeds_to_show(m, statistics.stdev(diffs))
    more = (
        f"if the mean difference and its spread stayed as measured, about {n} seeds would show it"
        if n
        else "no number of seeds up to 1,000 would show a mean difference this small at this spread"
    )
    return f"**not shown**: {room}; {more}"


def verdicts(res: dict[str, dict[int, dict]], seeds: list[int]) -> list[str]:
    """Each of the paper's orderings, paired by seed: the per-seed differences, their mean
    and 95 % interval; it holds when the whole interval is on the paper's side."""
    lines = []

    def paired(name: str, diffs: list[float], better: str, ref: list[float], ref_name: str) -> None:
        m, h = band(diffs)
        wins = sum(d < 0 for d in diffs)
        lines.append(
            f"- {name}: difference {m:+.4f} ± {h:.4f} (95 % interval over {len(diffs)} seeds; "
            f"negative = {better}); {wins} of {len(diffs)} seeds on the paper's side: "
            f"{verdict(diffs, statistics.fmean(ref), ref_name, better)}."
        )

    b, f, d = (res[s] for s in STRATEGIES)
    half = {name: [second_half(runs[s]["heldout"]) for s in seeds] for name, runs in (("b", b), ("f", f), ("d", d))}
    paired(
        "blur-weighted lower than FedAvg (held-out, 2nd-half mean)",
        [x - y for x, y in zip(half["b"], half["f"], strict=True)],
        "blur-weighted lower",
        half["f"],
        "FedAvg",
    )
    paired(
        "blur-weighted lower than FedAvg (held-out, final)",
        [b[s]["heldout"][-1] - f[s]["heldout"][-1] for s in seeds],
        "blur-weighted lower",
        [f[s]["heldout"][-1] for s in seeds],
        "FedAvg",
    )
    paired(
        "blur-weighted steadier than FedAvg (variance of the round-to-round change)",
        [var_change(b[s]["heldout"]) - var_change(f[s]["heldout"]) for s in seeds],
        "blur-weighted steadier",
        [var_change(f[s]["heldout"]) for s in seeds],
        "FedAvg",
    )
    paired(
        "dropping blurred models worse than FedAvg (2nd-half mean)",
        [x - y for x, y in zip(half["f"], half["d"], strict=True)],
        "dropping worse",
        half["f"],
        "FedAvg",
    )
    paired(
        "dropping blurred models worse than blur-weighted (2nd-half mean)",
        [x - y for x, y in zip(half["b"], half["d"], strict=True)],
        "dropping worse",
        half["b"],
        "blur-weighted",
    )
    return lines


def per_seed(res: dict[str, dict[int, dict]], seeds: list[int]) -> list[str]:
    """One row a seed: its untrained loss, the visits above the threshold and each
    strategy's 2nd-half mean (the measure most of the orderings use)."""
    b = res[STRATEGIES[0]]
    rows = [
        "| seed | untrained | visits > threshold | " + " | ".join(LABELS[s] for s in STRATEGIES) + " |",
        "|---|---|---|" + "---|" * len(STRATEGIES),
    ]
    for s in seeds:
        cells = " | ".join(f"{second_half(res[st][s]['heldout']):.4f}" for st in STRATEGIES)
        rows.append(f"| {s} | {b[s]['heldout'][0]:.4f} | {b[s]['fast_visits']} | {cells} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5, help="how many seeds the report covers")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/flsimco/seeds"))
    ap.add_argument(
        "--reuse", type=Path, help="an earlier results.json: its runs are taken as they are, only missing ones run"
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="write report.md and loss.png again from --out's results.json (no runs; the command it records)",
    )
    args = ap.parse_args()
    if args.report_only:
        report_again(args.out)
        return
    t0 = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    setup = replace(Setup(), rounds=args.rounds)
    res: dict[str, dict[int, dict]] = {s: {} for s in STRATEGIES}
    reused: list[tuple[int, str]] = []
    earlier_wall = 0.0
    if args.reuse:
        try:
            old, found = reusable(args.reuse, setup, seeds)
            for line in check_reproduced(setup, found):
                print(line, flush=True)
        except ReuseRefused as e:
            sys.exit(f"--reuse refused: {e}")
        for (seed, strategy), out in sorted(found.items()):
            res[strategy][seed] = out
        reused = sorted(found)
        earlier_wall = float(old.get("wall_s", 0.0)) + float(old.get("earlier_wall_s", 0.0))
        print(f"reused {len(reused)} runs from {args.reuse}", flush=True)
    todo = [(seed, strat) for seed in seeds for strat in STRATEGIES if seed not in res[strat]]
    args.out.mkdir(parents=True, exist_ok=True)

    def save(wall: float) -> None:
        record = {
            "seeds": seeds,
            "rounds": args.rounds,
            "setting": setting(setup),
            "wall_s": wall,
            "jobs": args.jobs,
            "ran": len(todo),
            "reused": [list(k) for k in reused],
            "reused_from": str(args.reuse) if args.reuse else None,
            "earlier_wall_s": earlier_wall,
            "runs": res,
        }
        tmp = args.out / "results.json.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(args.out / "results.json")

    print(f"{len(todo)} runs to make", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, replace(setup, seed=seed), strat) for seed, strat in todo]
        for done, fut in enumerate(as_completed(futures), start=1):
            out = fut.result()
            res[out["strategy"]][out["seed"]] = out
            save(time.monotonic() - t0)
            print(
                f"[{done}/{len(todo)}, {(time.monotonic() - t0) / 60:.1f} min] seed {out['seed']} {out['strategy']}: "
                f"final {out['heldout'][-1]:.4f} ({out['seconds']:.0f} s)",
                flush=True,
            )
    wall = time.monotonic() - t0
    save(wall)
    write_report(args.out, res, seeds, args.rounds, wall, args, tuple(reused), earlier_wall)


def report_again(out: Path) -> None:
    """The report of ``out/results.json`` as the invocation that wrote it would have
    written it (its seeds, rounds, jobs, reuse and wall times)."""
    rec = json.loads((out / "results.json").read_text())
    res = {s: {int(seed): r for seed, r in rec["runs"][s].items()} for s in STRATEGIES}
    reuse = Path(rec["reused_from"]) if rec.get("reused_from") else None
    made_by = argparse.Namespace(jobs=rec.get("jobs", "?"), reuse=reuse)
    reused = tuple((int(seed), s) for seed, s in rec.get("reused", []))
    write_report(out, res, rec["seeds"], rec["rounds"], rec["wall_s"], made_by, reused, rec.get("earlier_wall_s", 0.0))


def seed_ranges(seeds: list[int]) -> str:
    """``0-4, 7`` for [0, 1, 2, 3, 4, 7]."""
    parts: list[str] = []
    for s in sorted(set(seeds)):
        if parts and parts[-1][1] == s - 1:
            parts[-1] = (parts[-1][0], s)
        else:
            parts.append((s, s))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def wall_line(res: dict, wall: float, reused: list[tuple[int, str]], reuse: Path | None, earlier_wall: float) -> str:
    """Where the runs came from and what they took."""
    made = [r["seconds"] for s in STRATEGIES for seed, r in res[s].items() if (int(seed), s) not in set(reused)]
    old = [r["seconds"] for s in STRATEGIES for seed, r in res[s].items() if (int(seed), s) in set(reused)]
    line = f"{len(made)} runs made here in {wall / 60:.1f} min wall time on 2 cores shared with other jobs"
    if made:
        line += f" ({min(made):.0f}-{max(made):.0f} s per run)"
    if reused:
        whole = ", all three strategies" if len(reused) == len(STRATEGIES) * len({seed for seed, _ in reused}) else ""
        line += (
            f"; {len(reused)} runs (seeds {seed_ranges([seed for seed, _ in reused])}{whole}) "
            f"reused as they are from `{reuse}`, made earlier in {earlier_wall / 60:.1f} min "
            f"({min(old):.0f}-{max(old):.0f} s per run)"
        )
    return line + "."


def write_report(
    out: Path,
    res: dict,
    seeds: list[int],
    rounds: int,
    wall: float,
    args,
    reused: tuple[tuple[int, str], ...] = (),
    earlier_wall: float = 0.0,
) -> None:
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
        f"Command: `.venv/bin/python experiments/scripts/flsimco_seeds.py --seeds {len(seeds)} --first-seed {seeds[0]} "
        f"--rounds {rounds} --jobs {args.jobs}{f' --reuse {args.reuse}' if args.reuse else ''} --out {out}`; "
        f"seeds {seed_ranges(seeds)}; {wall_line(res, wall, list(reused), args.reuse, earlier_wall)}",
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
        "## Per seed",
        "",
        f"Held-out loss, 2nd-half mean (rounds {rounds // 2 + 1}-{rounds} of {rounds}), and the untrained model's held-out loss: the held-out "
        "batches come from the seed's own split, so the level moves with the seed for all three strategies alike; "
        "the orderings above compare strategies within a seed.",
        "",
        *per_seed(res, seeds),
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
