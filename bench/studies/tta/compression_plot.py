"""int8 against none, round by round: the held-out accuracy of every round's global model
for each seed, on the time-to-accuracy workload (compression_seeds.json, real daemons)
the same CNN in process with int8 updates and with int8 both ways (compression_inproc_tta_*.json),
and on the demo's task (compression_demo_*.json, bench/compression.py in process).

    .venv/bin/python bench/studies/tta/compression_plot.py   # writes results/tta/compression_int8.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parents[3] / "results" / "tta"


def tta_runs() -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = {"none": {}, "int8": {}}
    for r in json.loads((HERE / "compression_seeds.json").read_text()):
        if "task" not in r and not r.get("run") and r["compression"] in out:
            out[r["compression"]][r["seed"]] = r["accuracy"][:20]
    return out


def demo_runs(name: str) -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = {}
    for row in json.loads((HERE / name).read_text()):
        out[row["mode"]] = {r["seed"]: r["accuracy_by_round"] for r in row["runs"]}
    return out


def inproc_tta() -> dict[str, dict[int, list[float]]]:
    out = {}
    for mode, name in (("none", "none"), ("int8", "int8"), ("int8_downlink", "int8 both ways")):
        row = json.loads((HERE / f"compression_inproc_tta_{mode}.json").read_text())[0]
        out[name] = {r["seed"]: r["accuracy_by_round"] for r in row["runs"]}
    return out


def main() -> None:
    panels = [
        ("time-to-accuracy CNN, 10 agents (daemons)", tta_runs(), 0.95),
        ("time-to-accuracy CNN, 10 agents (in process)", inproc_tta(), 0.95),
        ("demo task, 3 agents (in process)", demo_runs("compression_demo_3agents.json"), None),
        ("demo task, 10 agents (in process)", demo_runs("compression_demo_10agents.json"), None),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(20, 7), sharex="col", gridspec_kw={"height_ratios": [3, 1.4]})
    for col, (title, runs, target) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for i, seed in enumerate(sorted(runs["none"])):
            a, b = runs["none"][seed], runs["int8"][seed]
            x = range(1, len(a) + 1)
            c = f"C{i}"
            top.plot(x, a, color=c, lw=1.5, label=f"seed {seed}: none")
            top.plot(x, b, color=c, lw=1.5, ls="--", label=f"seed {seed}: int8")
            bottom.plot(x, [100 * (q - p) for p, q in zip(a, b)], color=c, marker="o", ms=3, lw=1)
            if "int8 both ways" in runs:
                both = runs["int8 both ways"][seed]
                top.plot(x, both, color=c, lw=1, ls=":")
                bottom.plot(x, [100 * (q - p) for p, q in zip(a, both)], color=c, marker="x", ms=3, lw=0.6, ls=":")
        if target:
            top.axhline(target, color="grey", lw=0.8, ls=":")
        top.set_title(title)
        top.set_ylim(0.8, 1.0)
        top.set_ylabel("held-out accuracy")
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set_ylabel("int8 − none (points)")
        bottom.set_xlabel("round")
    axes[0][0].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle(
        "Update compression int8 against none, same seeds (dashed: int8 updates; dotted: int8 updates and broadcast)"
    )
    fig.tight_layout()
    fig.savefig(HERE / "compression_int8.png", dpi=110)


if __name__ == "__main__":
    main()
