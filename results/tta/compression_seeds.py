"""Does int8 update compression cost rounds to 95 %? fedagent's tta federation (bench/tta.py)
with ``[transfer] compression = "none"`` and ``"int8"``, for three seeds of the digits
task (each seed its own held-out quarter, Dirichlet split and initial weights), 20 rounds
each (more if 95 % is not reached by then, up to 30).

    nice -n 10 .venv/bin/python results/tta/compression_seeds.py --out runs/tta-seeds [--seeds 0 1 2]

Writes results/tta/compression_seeds.json (every run's accuracy per round) and prints the
table docs/benchmarks.md quotes. Only the rounds and accuracies matter here, not times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.tta import run_fedagent  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=["none", "int8"])
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "tta" / "compression_seeds.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    for seed in args.seeds:
        for comp in args.settings:
            if any(r["seed"] == seed and r["compression"] == comp for r in results):
                continue
            run = run_fedagent(args.out.resolve(), print, compression=comp, seed=seed, rounds=30, min_rounds=20)
            reached = run.reached()
            results.append(
                {
                    "seed": seed,
                    "compression": comp,
                    "rounds_to_target": reached["round"] if reached else None,
                    "accuracy": [r["accuracy"] for r in run.rounds],
                    "final_accuracy": run.final_accuracy,
                }
            )
            args.json.write_text(json.dumps(results, indent=1))
            print(seed, comp, results[-1]["rounds_to_target"], results[-1]["final_accuracy"], flush=True)
    print("| seed | compression | rounds to 95 % | accuracy after 20 rounds |")
    print("|---:|---|---:|---:|")
    for r in sorted(results, key=lambda r: (r["seed"], r["compression"])):
        print(f"| {r['seed']} | {r['compression']} | {r['rounds_to_target']} | {r['final_accuracy']:.4f} |")


if __name__ == "__main__":
    main()
