"""Accuracy against wall time, and a summary table, for runs of the ``tta`` bench section.

    python bench/studies/tta/plot.py RESULTS_JSON [--out DIR]
    python bench/studies/tta/plot.py RUN_JSON... [--out DIR]

RESULTS_JSON is bench/run.py's results.json of a run with ``--only tta`` (the runs are
in its first row's ``extra``); a RUN_JSON holds one run or a list of runs as bench/tta.py
saves them. Writes accuracy_vs_time.png and runs.json into DIR (default: this
directory) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(paths: list[Path]) -> list[dict]:
    runs: list[dict] = []
    for p in paths:
        doc = json.loads(p.read_text())
        if isinstance(doc, dict) and "rows" in doc:
            doc = next(r for r in doc["rows"] if r["section"] == "tta")["extra"]["runs"]
        runs += doc if isinstance(doc, list) else [doc]
    return runs


def summary(run: dict) -> dict:
    rounds = run["rounds"]
    t0 = rounds[0]["start"]
    hit = next((r for r in rounds if r.get("accuracy") is not None and r["accuracy"] >= run["target"]), None)
    upto = rounds[: rounds.index(hit) + 1] if hit else rounds
    return {
        "framework": run["framework"],
        "rounds": hit["round"] if hit else None,
        "tta": hit["end"] - t0 if hit else None,
        "total": hit["end"] - run["launched"] if hit else None,
        # the rounds' own spans (start to aggregated model), without what lies between
        # them (Flower: its evaluation phase)
        "train_phases": sum(r["end"] - r["start"] for r in upto),
        # from one round's start to the next one's, rounds 2 to the target round
        "period": statistics.median(b["start"] - a["start"] for a, b in zip(upto[1:], rounds[2 : len(upto) + 1]))
        if len(upto) > 2 and len(rounds) > 2
        else float("nan"),
        "mb": run["bytes_to_target"] / 1e6,
        "node_mb": run.get("agent_bytes_to_target", 0) / 1e6,
        # after round 20 (the fedagent runs' final round), or the last round run
        "final": [r["accuracy"] for r in rounds[:20] if r.get("accuracy") is not None][-1],
        "rounds_run": len(rounds),
        "cpu": run.get("cpu", {}),
    }


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[3] / "results" / "tta")
    a = ap.parse_args()
    runs = load(a.inputs)
    (a.out / "runs.json").write_text(json.dumps(runs, indent=1))
    print(
        "| run | rounds to target | time to target | incl. start-up | median round, start to start (rounds 2 on) | bytes to target (node links) | accuracy after round 20 or the last (rounds run) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, run in enumerate(runs, 1):
        s = summary(run)
        print(
            f"| {i}. {s['framework']} | {s['rounds'] or '–'} | {_s(s['tta'])} | {_s(s['total'])} | {s['period']:.2f} s "
            f"| {s['mb']:.0f} MB ({s['node_mb']:.0f} MB) | {s['final']:.4f} ({s['rounds_run']}) |"
        )
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs, 1):
        t0 = run["rounds"][0]["start"]
        pts = [(r["end"] - t0, r["accuracy"]) for r in run["rounds"] if r.get("accuracy") is not None]
        style = "-s" if run["framework"].startswith("Flower") else "-o"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=3, label=f"{i}. {run['framework']}")
    target = runs[0]["target"]
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("seconds since the start of round 1 (end of each round)")
    ax.set_ylabel("held-out accuracy of the global model")
    ax.set_ylim(0.5, 1.0)
    ax.set_title("1.08M-parameter CNN, digits, Dirichlet(0.5) over 10 nodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out / "accuracy_vs_time.png", dpi=120)


if __name__ == "__main__":
    main()
