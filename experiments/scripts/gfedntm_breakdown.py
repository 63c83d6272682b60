"""Where the TSS of a gFedNTM Fig. 2 setting comes from: the per-true-topic similarity to
the closest learnt topic, split into shared topics, the node's own private topics and
the other nodes' private topics. Retrains the setting's models exactly as
``fedagent experiment gfedntm`` does (same seeds, same early stopping), checks the TSS
totals against ``results.json`` of that run, and prints a markdown table.

    .venv/bin/python experiments/scripts/gfedntm_breakdown.py --shared 40 --eta 0.01 --seed 0 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from fedagent_experiments import gfedntm

from fedagent.tasks.base import load_task
from fedagent.tasks.ntm_data import TopicStructure
from fedagent.tasks.ntm_scores import similarity


def per_topic(beta_true: np.ndarray, beta_model: np.ndarray) -> np.ndarray:
    return similarity(beta_true, beta_model).max(axis=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", type=int, default=40)
    ap.add_argument("--eta", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=Path("results/gfedntm/results.json"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scale = replace(gfedntm.Scale(**json.loads(args.results.read_text())["scale"]), seed=args.seed)
    data = gfedntm.setting_data(scale, args.shared, args.eta)
    structure = TopicStructure(scale.true_topics, args.shared, scale.nodes)
    shared = np.arange(args.shared)
    rows: dict[str, dict[str, float]] = {}
    readings = {
        "softmax(beta)": lambda task, model, theta: task.topic_word(model),
        "decoder": lambda task, model, theta: task.decoder_topic_word(model, theta),
    }

    def scores(task, model) -> dict[str, np.ndarray]:
        theta = gfedntm.theta_on(task, model, data.val_bow, data.all_terms)
        return {
            name: per_topic(data.beta, gfedntm.widen(f(task, model, theta), task.terms, data.all_terms))
            for name, f in readings.items()
        }

    # non-collaborative: per node, own private topics vs the others'
    local: dict[str, list[dict[str, float]]] = {name: [] for name in readings}
    for n in range(scale.nodes):
        task = load_task("prodlda", {**data.opts, "shard": n})
        task.set_vocabulary(sorted(task.term_counts(), key=lambda t: int(t[4:])))
        model, _ = gfedntm.train_local_early_stopped(task, scale)
        own = np.setdiff1d(structure.node_topics(n), shared)
        others = np.setdiff1d(np.arange(scale.true_topics), structure.node_topics(n))
        for name, sims in scores(task, model).items():
            local[name].append(
                {
                    "total": sims.sum(),
                    "shared": sims[shared].sum(),
                    "own private": sims[own].sum(),
                    "others' private": sims[others].sum(),
                }
            )
    tasks, terms = gfedntm.joint_tasks(scale, data)
    fed, _ = gfedntm.syncopt_early_stopped(tasks, scale)
    pooled = gfedntm.pooled_task(tasks, terms)
    central, _ = gfedntm.train_local_early_stopped(pooled, scale)
    private = np.arange(args.shared, scale.true_topics)
    for name in readings:
        rows[f"non-collaborative ({name})"] = {k: float(np.mean([d[k] for d in local[name]])) for k in local[name][0]}
    for kind, task, model in (("federated", tasks[0], fed), ("centralized", pooled, central)):
        for name, sims in scores(task, model).items():
            rows[f"{kind} ({name})"] = {
                "total": sims.sum(),
                "shared": sims[shared].sum(),
                "own private": float("nan"),
                "others' private": float("nan"),
                "private": sims[private].sum(),
            }
    ref = next(
        r
        for r in json.loads(args.results.read_text())["results"]
        if r["shared"] == args.shared and r["eta"] == args.eta and r["seed"] == args.seed
    )
    n_own = structure.private
    lines = [
        f"### K' = {args.shared}, eta = {args.eta}, seed {args.seed}",
        "",
        f"Sum over true topics of the similarity to the closest learnt topic ({args.shared} shared; "
        f"{n_own} private per node, {scale.true_topics - args.shared} in all); the totals are the TSS "
        "of the report (checked below).",
        "",
        "| model (reading) | TSS total | shared | private: all | own private | others' private | total in results.json |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        kind, name = label.split(" (", 1)
        name = name[:-1]
        logged = (ref["tss"] if name == "softmax(beta)" else ref["tss_decoder"])[kind]
        others = r["others' private"]
        allp = r.get("private", r["own private"] + others)
        lines.append(
            f"| {label} | {r['total']:.3f} | {r['shared']:.3f} | {allp:.3f} | "
            f"{r['own private']:.3f} | {others:.3f} | {logged:.3f} |"
        )
        if abs(r["total"] - logged) > 1e-6:
            lines.append(f"| (differs from the report by {r['total'] - logged:+.2e}) | | | | | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
