"""Accuracy against wall time for every run of the ``tta`` bench section.

    python results/tta/plot.py RESULTS_JSON [OUT_DIR]

RESULTS_JSON is bench/run.py's results.json of a run with ``--only tta``; writes
accuracy_vs_time.png (time from the start of round 1) and runs.json (the runs, copied
out of the results) into OUT_DIR (default: this directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent
    rows = [r for r in results["rows"] if r["section"] == "tta"]
    runs = rows[0]["extra"]["runs"]
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        t0 = run["rounds"][0]["start"]
        pts = [(r["end"] - t0, r["accuracy"]) for r in run["rounds"] if r.get("accuracy") is not None]
        style = "-" if run["framework"].startswith("Flower") else "-o"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=3, label=run["framework"])
    target = runs[0]["target"]
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("seconds since the start of round 1")
    ax.set_ylabel("held-out accuracy of the global model")
    ax.set_ylim(0.5, 1.0)
    ax.set_title("1.08M-parameter CNN, digits, Dirichlet(0.5) over 10 nodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_time.png", dpi=120)


if __name__ == "__main__":
    main()
