"""Does int8 update compression cost accuracy? fedagent's tta federation (bench/tta.py)
with ``[transfer] compression = "none"`` and ``"int8"``, for five seeds of the digits
task (each seed its own held-out quarter, Dirichlet split and initial weights), 20 rounds
each (more if the target is not reached by then, up to 30).

    nice -n 10 .venv/bin/python bench/studies/tta/compression_seeds.py --out runs/tta-seeds [--seeds 0 1 2 3 4]
    nice -n 10 .venv/bin/python bench/studies/tta/compression_seeds.py --out runs/tta-seeds --task digits --target 0.9

The first is the time-to-accuracy workload (the benchmark's 1.1M-parameter CNN); the
second the demo's own task (``[task] name = "digits"``, its small CNN, FedAvg defaults).
Writes results/tta/compression_seeds.json (every run's accuracy per round; ``task`` says
which workload, absent for the benchmark's) and prints the table docs/benchmarks.md
quotes. Only the rounds and accuracies matter here, not times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.tta import run_fedagent  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--settings", nargs="+", default=["none", "int8"])
    ap.add_argument("--task", default="bench.tta_task:make", help='"digits": the demo\'s task')
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument(
        "--run", type=int, default=0, help="1, 2, ...: run the settings again (run-to-run noise of the same seed)"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "tta" / "compression_seeds.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    task = None if args.task == "bench.tta_task:make" else args.task
    for seed in args.seeds:
        for comp in args.settings:
            if any(
                r["seed"] == seed and r["compression"] == comp and r.get("task") == task and r.get("run", 0) == args.run
                for r in results
            ):
                continue
            run = run_fedagent(
                args.out.resolve(),
                print,
                compression=comp,
                seed=seed,
                rounds=30,
                min_rounds=20,
                target=args.target,
                task=args.task,
            )
            reached = run.reached()
            results.append(
                {
                    **({"task": task, "target": args.target} if task else {}),
                    **({"run": args.run} if args.run else {}),
                    "seed": seed,
                    "compression": comp,
                    "rounds_to_target": reached["round"] if reached else None,
                    "accuracy": [r["accuracy"] for r in run.rounds],
                    "final_accuracy": run.final_accuracy,
                }
            )
            args.json.write_text(json.dumps(results, indent=1))
            print(seed, comp, results[-1]["rounds_to_target"], results[-1]["final_accuracy"], flush=True)
    mine = [r for r in results if r.get("task") == task]
    print(f"| seed | run | compression | rounds to {args.target:.0%} | accuracy after 20 rounds |")
    print("|---:|---:|---|---:|---:|")
    for r in sorted(mine, key=lambda r: (r["seed"], r.get("run", 0), r["compression"])):
        print(
            f"| {r['seed']} | {r.get('run', 0)} | {r['compression']} | {r['rounds_to_target']} "
            f"| {r['final_accuracy']:.4f} |"
        )


if __name__ == "__main__":
    main()
