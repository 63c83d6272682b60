"""The doc2vec-settings grid of the study: one markdown table (printed) and grid.png, from
ceiling-grid.jsonl (references and ceilings, seed 0) and dim-joint.jsonl (joint learning
with the experiment's setting, seeds 0-2).

Run: ``.venv/bin/python experiments/studies/seec/grid.py``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parents[3] / "results" / "seec" / "study"
BASE = {"epochs": 10, "dim": 50, "negative": 5, "sample": 0.001}
KEYS = ("epochs", "dim", "negative", "sample", "infer")


def rows(name: str) -> list[dict]:
    path = HERE / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def setting(r: dict) -> tuple:
    return tuple(r[k] for k in KEYS)


def label(key: tuple) -> str:
    changed = [f"{k} {v:g}" for k, v in zip(KEYS[:-1], key[:-1]) if BASE[k] != v]
    return (", ".join(changed) or "current (d 50)") + f"; infer {key[-1]}"


refs: dict[tuple, dict] = {}
cpu: dict[tuple, float] = {}
for r in rows("ceiling-grid.jsonl") + rows("dim-joint.jsonl"):
    # the row that also measured the second model, where there is one
    key = (setting(r), r["seed"])
    # CPU of the references: the row that measured them (a joint row's cpu_infer_s is its own)
    if not r.get("joint"):
        cpu.setdefault(key, r["cpu_train_2_central_s"] + r["cpu_infer_s"])
    if key not in refs or ("reseed_knn_section" in r and "reseed_knn_section" not in refs[key]):
        refs[key] = r
joints: dict[tuple, dict] = {}
for r in rows("dim-joint.jsonl"):
    if r.get("joint"):
        joints[(setting(r), r["seed"])] = r["joint"][0]


def fmt(x: object, spec: str) -> str:
    return "-" if x is None else format(x, spec)


print(
    "| setting (seed 0) | reinfer | reseed (ceiling) | kNN section | hubness (max in) "
    "| 2nd model: kNN section, hubness | joint (R 10, step 2) | joint / ceiling | CPU s (2 models + 3 inferences) |"
)
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def group(k: tuple) -> int:
    """The current setting first, then one knob at a time: epochs, sample, negative, dim."""
    changed = [i for i, name in enumerate(KEYS[:-1]) if BASE[name] != k[i]]
    return {(): 0, (0,): 1, (3,): 2, (2,): 3, (1,): 4}.get(tuple(changed), 5)


order = sorted({k for k, s in refs if s == 0}, key=lambda k: (group(k), k[1], k[0], -k[3], k[2], k[4]))
for key in order:
    r, j = refs[(key, 0)], joints.get((key, 0))
    second = f"{r['reseed_knn_section']:.3f}, {r['reseed_hubness']}" if "reseed_knn_section" in r else "-"
    print(
        f"| {label(key)} | {r['reinfer']:.3f} | {r['reseed']:.3f} | {r['knn_section']:.3f} "
        f"| {r['hubness']} ({r['max_in']}) | {second} | {fmt(j and j['sim'], '.3f')} "
        f"| {fmt(j and j['sim'] / r['reseed'], '.2f')} | {fmt(cpu.get((key, 0)), '.0f')} |"
    )

print()
print(
    "| d (R 10, step 2) | seed | reseed (ceiling) | joint | joint / ceiling | kNN section: central, 2nd, joint "
    "| hubness: central, 2nd, joint |"
)
print("|---|---:|---:|---:|---:|---|---|")
summary: dict[int, list[tuple[float, float]]] = {}
for (key, seed), j in sorted(joints.items(), key=lambda kv: (kv[0][0][1], kv[0][1])):
    r = refs[(key, seed)]
    summary.setdefault(key[1], []).append((r["reseed"], j["sim"]))
    second = (r.get("reseed_knn_section"), r.get("reseed_hubness"))
    print(
        f"| {key[1]} | {seed} | {r['reseed']:.3f} | {j['sim']:.3f} | {j['sim'] / r['reseed']:.3f} "
        f"| {r['knn_section']:.3f}, {fmt(second[0], '.3f')}, {j['knn_section']:.3f} "
        f"| {r['hubness']}, {fmt(second[1], 'd')}, {j['hubness']} |"
    )
for d, pairs in sorted(summary.items()):
    if len(pairs) > 1:
        c, s = [p[0] for p in pairs], [p[1] for p in pairs]
        print(
            f"\nd {d}: ceiling {statistics.fmean(c):.3f} ± {statistics.stdev(c):.3f}, "
            f"joint {statistics.fmean(s):.3f} ± {statistics.stdev(s):.3f} over {len(pairs)} seeds"
        )

fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
names = [label(k) for k in order]
y = range(len(order))
a.barh(y, [refs[(k, 0)]["reseed"] for k in order], color="C0", alpha=0.6, label="reseed (ceiling)")
a.scatter([refs[(k, 0)]["reinfer"] for k in order], y, color="C2", marker="|", s=120, label="reinfer")
js = [(i, joints[(k, 0)]["sim"]) for i, k in enumerate(order) if (k, 0) in joints]
a.scatter([v for _, v in js], [i for i, _ in js], color="C3", marker="D", s=25, label="joint (R 10, step 2)")
a.axvline(0.8, color="k", ls="--", lw=1, label="goal 0.8")
a.set_yticks(list(y), names, fontsize=8)
a.invert_yaxis()
a.set_xlim(0.6, 0.95)
a.set_xlabel("sim_10 against the centralized model (seed 0)")
a.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4)
b.scatter([refs[(k, 0)]["knn_section"] for k in order], y, color="C0", label="kNN section accuracy")
b.set_yticks(list(y), [""] * len(order))
b.invert_yaxis()
b.set_xlabel("kNN section accuracy (10 neighbours, centralized model)")
b2 = b.twiny()
b2.scatter([refs[(k, 0)]["hubness"] for k in order], y, color="C1", marker="x", label="hubness")
b2.set_xlabel("distinct documents in all top 10s (of 1,083)", color="C1")
fig.tight_layout()
fig.savefig(HERE / "grid.png", dpi=110)
print(f"\n{HERE / 'grid.png'}")
