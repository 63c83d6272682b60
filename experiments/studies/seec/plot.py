"""Draws study.png from the JSON lines next to it: joint learning and its ceilings per
setting (seed 0), and the mapping rows per public corpus over seeds.

Run: ``.venv/bin/python experiments/studies/seec/plot.py``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parents[3] / "results" / "seec" / "study"


def rows(name: str) -> list[dict]:
    path = HERE / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def joint_sim(r: dict) -> float:
    j = r["joint"]
    return j if isinstance(j, float) else j[0]["sim"]


fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
settings = [r for r in rows("joint.jsonl") if r["seed"] == 0]
labels = [f"{r['epochs']} ep / {r['infer']} inf" for r in settings]
x = range(len(settings))
w = 0.27
a.bar([i - w for i in x], [r["reinfer"] for r in settings], w, label="same model, other inference seed")
a.bar(list(x), [r["reseed"] for r in settings], w, label="second centralized model (ceiling)")
a.bar([i + w for i in x], [joint_sim(r) for r in settings], w, label="joint learning (FedAvg)")
a.axhline(0.8, color="k", ls="--", lw=1, label="goal 0.8")
a.set_xticks(list(x), labels)
a.set_ylabel("sim_10 against the centralized model")
a.set_ylim(0.5, 1.12)
a.set_title("joint learning vs its ceilings (seed 0)")
a.legend(fontsize=7, ncol=2, loc="upper center")

maps = rows("mapping.jsonl") + rows("seeds-mapping.jsonl")
groups: dict[str, list[float]] = {}
for r in maps:
    if "public" in r and r.get("mapper_epochs") == 150:
        groups.setdefault(r["public"], []).append(r["mapped"])
unmapped = sorted({(r["seed"], r["unmapped"]) for r in maps})
groups["no mapping"] = [u for _, u in unmapped]
names = list(groups)
for i, n in enumerate(names):
    vals = groups[n]
    b.bar(i, sum(vals) / len(vals), color="C1" if "freebsd" in n else "C7")
    b.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
b.axhline(0.45, color="k", ls="--", lw=1, label="goal 0.45")
b.set_xticks(range(len(names)), names)
b.set_ylabel("sim_10 of the mapped search")
b.set_title("mapping by public corpus (10 epochs, seeds 0-2; dots = seeds)")
b.legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "study.png", dpi=110)
