"""Is the decoder-reading gap of gFedNTM Fig. 2 at K' = 15, 40 a matter of topic slots?

A non-collaborative model has 50 topics for the K' + (50 - K')/5 true topics its node
generates from (42 at K' = 40, 22 at K' = 15); the federated model has 50 for all 50.
TSS takes, for every true topic, the best of the learnt ones, so spare slots (duplicates
of a topic, each a different draw) raise it. This retrains one setting's models exactly
as ``fedagent experiment gfedntm`` does (same seeds, same early stopping) with the slots
changed: the local models with as many topics as their node has (no spare slot), the
federated one with as many spare slots per true topic as a local model has by default
(50 * 50 / seen), and prints the decoder-reading TSS next to the K = 50 figures of
``results.json`` and to random topics with the same counts.

    .venv/bin/python experiments/scripts/gfedntm_slots.py --shared 40 --eta 0.01 --seed 0 [--json FILE]

``--union-vocabulary``: instead, only the local models without spare slots, each on the
union of all nodes' terms (the federated model's vocabulary) rather than its own node's,
to test whether the vocabulary is what keeps the local models ahead.

``--split``: instead, the tables' own models (K = 50 for every model, as in
``results.json``) with their decoder-reading TSS split by true topic: the shared ones,
each node's own private ones and the other nodes' private ones (which a local model
never sees); the totals must equal ``results.json``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from fedagent_experiments import gfedntm

from fedagent.tasks.ntm_data import TopicStructure
from fedagent.tasks.ntm_scores import similarity, topic_similarity_score


def decoder_per_topic(data, task, model) -> np.ndarray:
    theta = gfedntm.theta_on(task, model, data.val_bow, data.all_terms)
    beta = gfedntm.widen(task.decoder_topic_word(model, theta), task.terms, data.all_terms)
    return similarity(data.beta, beta).max(axis=1)


def random_tss(data, eta: float, count: int, seed: int, draws: int = 5) -> float:
    rng = np.random.default_rng(seed + 1)
    v = data.beta.shape[1]
    return float(
        np.mean([topic_similarity_score(data.beta, rng.dirichlet(np.full(v, eta), size=count)) for _ in range(draws)])
    )


def split(args, scale, data, structure, out: dict, saved: dict, t0: float) -> None:
    shared = np.arange(args.shared)
    nodes = []
    for n in range(scale.nodes):
        task = gfedntm.load_ntm("prodlda", {**data.opts, "shard": n})
        task.set_vocabulary(sorted(task.term_counts(), key=lambda t: int(t[4:])))
        model, _ = gfedntm.train_local_early_stopped(task, scale)
        pt = decoder_per_topic(data, task, model)
        own = structure.node_topics(n)[args.shared :]
        others = np.setdiff1d(np.arange(args.shared, scale.true_topics), own)
        nodes.append({"tss": float(pt.sum()), "shared": float(pt[shared].sum()), "own private": float(pt[own].sum())})
        nodes[-1]["other private"] = float(pt[others].sum())
        nodes[-1]["per_topic"] = pt.tolist()
    tasks, _ = gfedntm.joint_tasks(scale, data)
    model, stop = gfedntm.syncopt_early_stopped(tasks, scale)
    pt = decoder_per_topic(data, tasks[0], model)
    fed = {"tss": float(pt.sum()), "shared": float(pt[shared].sum()), "best_epoch": stop.best_epoch}
    for n in range(scale.nodes):
        own = structure.node_topics(n)[args.shared :]
        fed[f"private of node {n}"] = float(pt[own].sum())
    fed["per_topic"] = pt.tolist()
    out.update(local=nodes, federated=fed)
    for r in saved["results"]:
        if r["shared"] == args.shared and r["eta"] == args.eta and r["seed"] == args.seed:
            out["k50"] = {m: r["tss_decoder"][m] for m in ("non-collaborative", "federated")}
    out["random_per_topic"] = random_tss(data, args.eta, scale.n_topics, args.seed) / scale.true_topics
    out["seconds"] = time.monotonic() - t0
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", type=int, default=40)
    ap.add_argument("--eta", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=Path("results/gfedntm/results.json"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--union-vocabulary", action="store_true")
    ap.add_argument("--split", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    saved = json.loads(args.results.read_text())
    scale = replace(gfedntm.Scale(**saved["scale"]), seed=args.seed)
    data = gfedntm.setting_data(scale, args.shared, args.eta)
    structure = TopicStructure(scale.true_topics, args.shared, scale.nodes)
    seen = args.shared + structure.private
    k_fed = math.ceil(scale.n_topics * scale.true_topics / seen)
    shared = np.arange(args.shared)
    private = np.arange(args.shared, scale.true_topics)
    out: dict = {"shared": args.shared, "eta": args.eta, "seed": args.seed, "seen": seen, "k_fed": k_fed}

    if args.split:
        split(args, scale, data, structure, out, saved, t0)
        return
    union = gfedntm.joint_tasks(scale, data)[1] if args.union_vocabulary else None
    local = []
    for n in range(scale.nodes):
        task = gfedntm.load_ntm("prodlda", {**data.opts, "n_topics": seen, "shard": n})
        task.set_vocabulary(union or sorted(task.term_counts(), key=lambda t: int(t[4:])))
        model, stop = gfedntm.train_local_early_stopped(task, scale)
        local.append(decoder_per_topic(data, task, model))
    local_pt = np.mean(local, axis=0)
    out["local_no_spare"] = {
        "tss": float(local_pt.sum()),
        "shared": float(local_pt[shared].sum()),
        "private": float(local_pt[private].sum()),
    }
    if union is not None:
        out["vocabulary"] = "union"
        out["seconds"] = time.monotonic() - t0
        text = json.dumps(out, indent=1)
        print(text)
        if args.json:
            args.json.write_text(text)
        return

    tasks, _ = gfedntm.joint_tasks(scale, data, n_topics=k_fed)
    model, stop = gfedntm.syncopt_early_stopped(tasks, scale)
    fed_pt = decoder_per_topic(data, tasks[0], model)
    out["federated_spare"] = {
        "tss": float(fed_pt.sum()),
        "shared": float(fed_pt[shared].sum()),
        "private": float(fed_pt[private].sum()),
        "best_epoch": stop.best_epoch,
    }
    for r in saved["results"]:
        if r["shared"] == args.shared and r["eta"] == args.eta and r["seed"] == args.seed:
            out["k50"] = {
                "non-collaborative": r["tss_decoder"]["non-collaborative"],
                "federated": r["tss_decoder"]["federated"],
            }
            break
    out["random"] = {str(c): random_tss(data, args.eta, c, args.seed) for c in (seen, scale.n_topics, k_fed)}
    out["seconds"] = time.monotonic() - t0
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
