"""What the learnt topic slots of gFedNTM's models are used for at K' = 40 (decoder reading).

At K' = 40 the federated model with K = 50 topics is behind a node's own model with K = 42
(one slot per true topic it sees) on the 40 shared true topics, although it sees five times
their data. This retrains the setting's models exactly as ``fedagent experiment gfedntm``
does (same seeds, same early stopping, the protocol of results/gfedntm/report.md), keeps
each model's decoder topics (cached as .npz under ``--cache``, so a second run only
re-analyses) and classifies every learnt topic and every shared true topic:

- junk (H1): the topic's best similarity to any true topic is at the level of random
  topics (at most the 99th percentile of the same figure for Dirichlet(eta) draws);
- node mixture (H2): closer to a mixture (the mean of one node's two private topics, of
  one node's 42 topics, or of all 50 weighted as in the union) than to any single true
  topic;
- merged (H3): a shared true topic whose best learnt topic is also the best learnt topic
  of another shared true topic;
- split (H4): a shared true topic that is the best true match of 2+ non-junk learnt topics;
- one-to-one otherwise.

Then it splits the shared-topic deficit of the federated model against the local models
(the mean over the five nodes) by the federated model's class of each true topic, and
reports the federated models' best epochs (H5) and variants (patience 10, other
initialisations, the pooled centralized model, K = 60; local K = 50). For the
``--trajectory-seeds`` it also trains the federated K = 50 and the local K = 42 models 100
epochs without early stopping and scores the decoder reading after every epoch (with a
plot next to ``--out``). A "## Reading it" section already in ``--out`` is kept.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 .venv/bin/python experiments/scripts/gfedntm_slotuse.py \\
        --seeds 0 1 2 --trajectory-seeds 0 1 2 --trajectory-nodes 5 --trajectory-central-epochs 60 \\
        --out results/gfedntm/k40-slot-use.md
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from fedagent_experiments import gfedntm

from fedagent.local.report import pyplot
from fedagent.tasks.ntm import federated_step
from fedagent.tasks.ntm_data import TopicStructure
from fedagent.tasks.ntm_scores import similarity

# name -> (kind, options): kind "fed" (Sync-Opt), "local" (each node alone), "central"
# (pooled corpus); options: n_topics, patience, init (an init/batch-order seed offset).
MODELS: dict[str, tuple[str, dict]] = {
    "fed50": ("fed", {}),
    "local42": ("local", {"n_topics": 42}),
    "fed50-p10": ("fed", {"patience": 10}),
    "fed50-init1": ("fed", {"init": 1000}),
    "fed50-init2": ("fed", {"init": 2000}),
    "central50": ("central", {}),
    "fed60": ("fed", {"n_topics": 60}),
    "local50": ("local", {}),
}


def decoder_topics(data, task, model) -> np.ndarray:
    theta = gfedntm.theta_on(task, model, data.val_bow, data.all_terms)
    return gfedntm.widen(task.decoder_topic_word(model, theta), task.terms, data.all_terms)


def train(name: str, scale, data, shared: int) -> dict:
    kind, o = MODELS[name]
    sc = replace(scale, patience=o.get("patience", scale.patience))
    extra: dict = {}
    if "n_topics" in o:
        extra["n_topics"] = o["n_topics"]
    if "init" in o:
        extra["seed"] = scale.seed + o["init"]  # same documents (data_seed), other init
    t0 = time.monotonic()
    if kind == "local":
        topics, epochs = [], []
        for n in range(scale.nodes):
            task = gfedntm.load_ntm("prodlda", {**data.opts, **extra, "shard": n})
            task.set_vocabulary(sorted(task.term_counts(), key=lambda t: int(t[4:])))
            model, stop = gfedntm.train_local_early_stopped(task, sc)
            topics.append(decoder_topics(data, task, model))
            epochs.append((stop.best_epoch, stop.epochs))
        return {"topics": np.stack(topics), "epochs": np.array(epochs), "seconds": time.monotonic() - t0}
    tasks, terms = gfedntm.joint_tasks(scale, data, **extra)
    if kind == "fed":
        model, stop = gfedntm.syncopt_early_stopped(tasks, sc)
        task = tasks[0]
    else:
        task = gfedntm.pooled_task(tasks, terms)
        model, stop = gfedntm.train_local_early_stopped(task, sc)
    return {
        "topics": decoder_topics(data, task, model)[None],
        "epochs": np.array([(stop.best_epoch, stop.epochs)]),
        "seconds": time.monotonic() - t0,
    }


def trajectory(scale, data, refs: Refs, epochs: int, nodes: int, central_epochs: int = 0) -> dict:
    """The decoder-reading shared-topic TSS after every epoch of the federated model (K = 50)
    and of the first ``nodes`` local models (K = 42), trained ``epochs`` epochs without early
    stopping; the validation loss each would stop on; the same seeds and steps as above, so
    the figures at a model's best epoch are those of the early-stopped model."""
    sh = refs.shared

    def record(hist: dict, task, model, loss: float) -> None:
        c = classify(decoder_topics(data, task, model), refs)
        hist["val_loss"].append(loss)
        hist["shared"].append(float(c["per_topic"][:sh].sum()))
        hist["best_mass"].append(float(np.mean(c["best_mass"])))

    def follow(task, n_epochs: int) -> dict:
        """One model trained alone on ``task`` for ``n_epochs`` epochs, recorded after each."""
        model = task.build_model()
        opt = task.make_optimizer(model.parameters())
        step = gfedntm.local_step(model, opt, task)
        hist: dict = {"val_loss": [], "shared": [], "best_mass": []}
        for e in range(n_epochs):
            for i in range(e * task.num_batches(), (e + 1) * task.num_batches()):
                step(i)
            record(hist, task, model, task.evaluate(model)["val_loss"])
        return hist

    out: dict = {}
    tasks, terms = gfedntm.joint_tasks(scale, data)
    model = tasks[0].build_model()
    opt = tasks[0].make_optimizer(model.parameters())
    spe = min(t.num_batches() for t in tasks)
    hist: dict = {"val_loss": [], "shared": [], "best_mass": []}
    for e in range(epochs):
        for i in range(e * spe, (e + 1) * spe):
            federated_step(model, opt, tasks, i)
        record(hist, tasks[0], model, gfedntm.federated_validation_loss(model, tasks))
        print(f"  fed50 epoch {e + 1}: val {hist['val_loss'][-1]:.3f} shared {hist['shared'][-1]:.3f}", flush=True)
    out["fed50"] = hist
    if central_epochs:
        hist = follow(gfedntm.pooled_task(tasks, terms), central_epochs)
        print(f"  central50: shared by epoch {np.round(hist['shared'], 2).tolist()}", flush=True)
        out["central50"] = hist
    for n in range(nodes):
        task = gfedntm.load_ntm("prodlda", {**data.opts, "n_topics": 42, "shard": n})
        task.set_vocabulary(sorted(task.term_counts(), key=lambda t: int(t[4:])))
        hist = follow(task, epochs)
        print(f"  local42 node {n}: shared by epoch {np.round(hist['shared'], 2).tolist()}", flush=True)
        out[f"local42 node {n}"] = hist
    return out


@dataclass
class Refs:
    beta: np.ndarray  # 50 x V true topics
    shared: int
    pairs: np.ndarray  # nodes x V: the mean of each node's private topics
    profiles: np.ndarray  # nodes x V: the mean of each node's own topics
    union: np.ndarray  # V: the union's word profile (shared topics in every node)
    support: np.ndarray  # 50 x V bool: the fewest words holding 90 % of each true topic
    junk: float  # best similarity of the union's word profile to a true topic
    random99: float  # 99th percentile of the best similarity of one Dirichlet(eta) topic


def references(data, structure: TopicStructure, eta: float, seed: int, draws: int = 4000) -> Refs:
    beta = data.beta
    own = [structure.node_topics(n) for n in range(structure.nodes)]
    w = np.ones(len(beta))
    w[: structure.shared] = structure.nodes
    union = w @ beta / w.sum()
    support = np.zeros(beta.shape, bool)
    for t, row in enumerate(beta):
        order = np.argsort(-row, kind="stable")
        support[t, order[: np.searchsorted(np.cumsum(row[order]), 0.9) + 1]] = True
    rnd = np.random.default_rng(seed + 7).dirichlet(np.full(beta.shape[1], eta), size=draws)
    return Refs(
        beta,
        structure.shared,
        np.array([beta[o[structure.shared :]].mean(0) for o in own]),
        np.array([beta[o].mean(0) for o in own]),
        union,
        support,
        float(similarity(beta, union[None]).max()),
        float(np.quantile(similarity(beta, rnd).max(0), 0.99)),
    )


def classify(topics: np.ndarray, refs: Refs) -> dict:
    """Slot and true-topic classes of one model (topics: K x V)."""
    sh = refs.shared
    s = similarity(refs.beta, topics)  # 50 x K
    best_sim, best_true = s.max(0), s.argmax(0)
    junk = best_sim <= refs.junk
    pair = similarity(refs.pairs, topics).max(0)
    profile = similarity(refs.profiles, topics).max(0)
    union = similarity(refs.union[None], topics)[0]
    # H2: closer to a node's private pair than to any single topic, or to a node's own
    # profile than to any single topic and to the union's profile (every learnt topic
    # is diffuse, so the union's profile alone beats a single topic for most of them)
    mixture = ~junk & ((pair > best_sim) | ((profile > best_sim) & (profile > union)))
    shared = np.arange(sh)
    best_slot = s.argmax(1)  # per true topic
    per_topic = s.max(1)
    used = ~junk & ~mixture
    assigned = np.array([np.sum((best_true == t) & used) for t in range(len(refs.beta))])
    cls = []
    for t in shared:
        if any(u != t and best_slot[u] == best_slot[t] for u in shared):
            cls.append("merged")
        elif assigned[t] >= 2:
            cls.append("split")
        elif best_true[best_slot[t]] == t and used[best_slot[t]]:
            cls.append("one-to-one")
        else:
            cls.append("other")
    slot = []
    for k in range(topics.shape[0]):
        if junk[k]:
            slot.append("junk")
        elif mixture[k]:
            slot.append("mixture")
        elif best_true[k] >= sh:
            slot.append("private")
        elif best_slot[best_true[k]] == k:
            slot.append("shared, best of 2+" if np.sum(best_slot[shared] == k) >= 2 else "shared, best of 1")
        else:
            slot.append("shared, extra copy")
    mass = topics @ refs.support.T.astype(float)  # K x 50: each slot's mass on each topic's words
    top = np.sort(mass, axis=1)[:, ::-1]
    return {
        "per_topic": per_topic,
        "topic_class": np.array(cls),
        "slot_class": np.array(slot),
        "below_random99": int(np.sum(best_sim <= refs.random99)),
        # the best slot's mass on each shared topic's words
        "best_mass": mass[best_slot[shared], shared],
        "slot_top1": top[:, 0],
        "slot_top2": top[:, 1],
        "shared_mass": topics[:, refs.support[:sh].any(0)].sum(1),
        "second": np.sort(s[shared], axis=1)[:, -2],
    }


SLOT_CLASSES = ["shared, best of 1", "shared, best of 2+", "shared, extra copy", "private", "mixture", "junk"]
TOPIC_CLASSES = ["one-to-one", "split", "merged", "other"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=int, default=40)
    ap.add_argument("--eta", type=float, default=0.01)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--results", type=Path, default=Path("results/gfedntm/results.json"))
    ap.add_argument("--cache", type=Path, default=Path("runs/gfedntm-slot-use"))
    ap.add_argument("--train-only", action="store_true", help="train and cache, write no report")
    ap.add_argument(
        "--trajectory-seeds",
        type=int,
        nargs="*",
        default=[0],
        help="seeds whose fed50 and local42 models are also followed epoch by epoch (no early stopping)",
    )
    ap.add_argument("--trajectory-epochs", type=int, default=100)
    ap.add_argument("--trajectory-nodes", type=int, default=2)
    ap.add_argument(
        "--trajectory-central-epochs",
        type=int,
        default=0,
        help="also follow the pooled centralized model (K = 50) this many epochs (5x the steps of one)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.monotonic()
    saved = json.loads(args.results.read_text())
    args.cache.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict[str, dict]] = {}
    for seed in args.seeds:
        scale = replace(gfedntm.Scale(**saved["scale"]), seed=seed)
        data = gfedntm.setting_data(scale, args.shared, args.eta)
        structure = TopicStructure(scale.true_topics, args.shared, scale.nodes)
        runs[seed] = {"_refs": references(data, structure, args.eta, seed)}
        for name in args.models:
            path = args.cache / f"{args.shared}-{args.eta}-{seed}-{name}.npz"
            if path.exists():
                with np.load(path) as z:
                    run = {k: z[k] for k in z.files}
                print(f"seed {seed} {name}: cached ({path})", flush=True)
            else:
                print(f"seed {seed} {name}: training ...", flush=True)
                run = train(name, scale, data, args.shared)
                np.savez_compressed(path, **run)
                print(f"seed {seed} {name}: {float(run['seconds']):.0f} s, epochs {run['epochs'].tolist()}", flush=True)
            runs[seed][name] = run
        if seed in args.trajectory_seeds:
            path = args.cache / (
                f"{args.shared}-{args.eta}-{seed}-trajectory-{args.trajectory_epochs}-{args.trajectory_nodes}.json"
            )
            if not path.exists():
                print(f"seed {seed} trajectory: training ...", flush=True)
                t0 = time.monotonic()
                traj = trajectory(scale, data, runs[seed]["_refs"], args.trajectory_epochs, args.trajectory_nodes)
                traj["seconds"] = time.monotonic() - t0
                path.write_text(json.dumps(traj))
            runs[seed]["_trajectory"] = json.loads(path.read_text())
            if args.trajectory_central_epochs:
                path = (
                    args.cache
                    / f"{args.shared}-{args.eta}-{seed}-trajectory-central-{args.trajectory_central_epochs}.json"
                )
                if not path.exists():
                    print(f"seed {seed} centralized trajectory: training ...", flush=True)
                    t0 = time.monotonic()
                    traj = trajectory(scale, data, runs[seed]["_refs"], 0, 0, args.trajectory_central_epochs)
                    traj["central seconds"] = time.monotonic() - t0
                    path.write_text(json.dumps(traj))
                traj = json.loads(path.read_text())
                runs[seed]["_trajectory"]["central50"] = traj["central50"]
                runs[seed]["_trajectory"]["seconds"] += traj["central seconds"]
    if args.train_only:
        return
    text = report(args, runs, saved, time.monotonic() - t_start)
    if args.out and args.out.exists():
        # keep the hand-written "Reading it" section of an earlier run, before the tables
        old = args.out.read_text()
        if "\n## Reading it\n" in old:
            reading = "## Reading it\n" + old.split("\n## Reading it\n", 1)[1].split("\n## ", 1)[0].rstrip() + "\n\n"
            head, rest = text.split("\n## ", 1)
            text = head + "\n" + reading + "## " + rest
    print(text)
    if args.out:
        args.out.write_text(text)


def analyse(run: dict, refs: Refs) -> list[dict]:
    return [classify(t, refs) for t in run["topics"]]


def report(args, runs: dict, saved: dict, seconds: float) -> str:
    sh = args.shared
    lines = [
        f"# gFedNTM, K' = {sh}: what the learnt topic slots are used for (decoder reading)",
        "",
        "Written by",
        "",
        "```sh",
        "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 .venv/bin/python experiments/scripts/gfedntm_slotuse.py "
        f"--shared {sh} --eta {args.eta} --seeds {' '.join(map(str, args.seeds))} "
        f"--trajectory-seeds {' '.join(map(str, args.trajectory_seeds))} --trajectory-nodes {args.trajectory_nodes} "
        + (f"--trajectory-central-epochs {args.trajectory_central_epochs} " if args.trajectory_central_epochs else "")
        + f"--out {args.out}",
        "```",
        "",
        "(see the script's docstring for the classes). Protocol of report.md: N = 5, V = 500, 3000 documents "
        "per node, 75:25 early stopping with patience 5, at most 100 epochs; the same seeds, so `fed50` and "
        "`local42` are the models of slots/report.md and k40-breakdown.md (checked below). "
        "Models: "
        "`fedK` Sync-Opt with K topics, `localK` each node alone (figures are means over the 5 nodes), "
        "`central50` one model on the pooled corpus, `-p10` patience 10, `-initN` another initialisation "
        "and batch order on the same documents.",
        "",
    ]
    ref_rows = {
        r["seed"]: r for r in saved["results"] if r["shared"] == sh and r["eta"] == args.eta and r["seed"] in runs
    }
    train_s = {s: {m: float(r["seconds"]) for m, r in v.items() if not m.startswith("_")} for s, v in runs.items()}
    lines += [
        "Training wall time (2 shared cores, `nice -n 10`, one process): "
        + "; ".join(f"seed {s}: " + ", ".join(f"{m} {t:.0f} s" for m, t in v.items()) for s, v in train_s.items()),
        f"(models cached by an earlier run show the time they took then); this run {seconds:.0f} s.",
        "",
    ]
    summary: dict[int, dict[str, dict]] = {}
    for seed, models in runs.items():
        refs: Refs = models["_refs"]
        summary[seed] = {}
        lines += [
            f"## Seed {seed}",
            "",
            f"Junk threshold: {refs.junk:.3f}, the best similarity to a true topic of the union's word profile "
            "(a learnt topic that is no closer to any true topic has learnt no more than the corpus's word "
            f"frequencies). For comparison, one Dirichlet({args.eta}) topic's best similarity has 99th percentile "
            f"{refs.random99:.3f} (most learnt topics are below it: they are diffuse, see the mass columns).",
            "",
            "Learnt topics (slots) by class (local: mean over the nodes, TSS range over the nodes):",
            "",
            "| model | K | best epoch / run | shared TSS | private TSS | "
            + " | ".join(SLOT_CLASSES)
            + " | below Dirichlet 99th |",
            "|---|---|---|---|---|" + "---|" * (len(SLOT_CLASSES) + 1),
        ]
        table_b = [
            "",
            "Shared true topics by class, and how concentrated the learnt topics are (mass = a learnt topic's "
            "probability on the words that hold 90 % of a true topic, about 10 words each):",
            "",
            "| model | "
            + " | ".join(TOPIC_CLASSES)
            + " | similarity per shared topic | its best slot's mass on it | second-best slot's similarity "
            "| slot's top topic mass | slot's 2nd / top | slot's mass on shared words |",
            "|---|" + "---|" * (len(TOPIC_CLASSES) + 6),
        ]
        for name, run in models.items():
            if name.startswith("_"):
                continue
            cls = analyse(run, refs)
            summary[seed][name] = {"cls": cls, "epochs": run["epochs"]}
            shared_tss = [c["per_topic"][:sh].sum() for c in cls]
            priv_tss = [c["per_topic"][sh:].sum() for c in cls]
            slot_counts = [np.mean([np.sum(c["slot_class"] == k) for c in cls]) for k in SLOT_CLASSES]
            topic_counts = [np.mean([np.sum(c["topic_class"] == k) for c in cls]) for k in TOPIC_CLASSES]
            ep = run["epochs"].mean(0)
            spread = f" ({min(shared_tss):.2f}-{max(shared_tss):.2f})" if len(cls) > 1 else ""
            lines.append(
                f"| {name} | {run['topics'].shape[1]} | {ep[0]:.1f} / {ep[1]:.1f} | {np.mean(shared_tss):.3f}{spread} | "
                f"{np.mean(priv_tss):.3f} | "
                + " | ".join(f"{x:g}" for x in slot_counts)
                + f" | {np.mean([c['below_random99'] for c in cls]):g} |"
            )

            def m(key: str, cls: list = cls) -> float:
                return float(np.mean([np.mean(c[key]) for c in cls]))

            ratio = float(np.mean([np.mean(c["slot_top2"] / c["slot_top1"]) for c in cls]))
            table_b.append(
                f"| {name} | "
                + " | ".join(f"{x:g}" for x in topic_counts)
                + f" | {np.mean(shared_tss) / sh:.3f} | {m('best_mass'):.3f} | {m('second'):.3f} | "
                f"{m('slot_top1'):.3f} | {ratio:.2f} | {m('shared_mass'):.3f} |"
            )
        lines += table_b
        checks = []
        if seed in ref_rows and "fed50" in summary[seed]:
            tot = summary[seed]["fed50"]["cls"][0]["per_topic"].sum()
            checks.append(f"fed50 total {tot:.4f} vs results.json {ref_rows[seed]['tss_decoder']['federated']:.4f}")
        if seed in ref_rows and "local50" in summary[seed]:
            tot = np.mean([c["per_topic"].sum() for c in summary[seed]["local50"]["cls"]])
            checks.append(
                f"local50 total {tot:.4f} vs results.json {ref_rows[seed]['tss_decoder']['non-collaborative']:.4f}"
            )
        slots_json = args.results.parent / "slots" / f"slots-{sh}-{seed}.json"
        if slots_json.exists() and "local42" in summary[seed]:
            sj = json.loads(slots_json.read_text())
            tot = np.mean([c["per_topic"].sum() for c in summary[seed]["local42"]["cls"]])
            checks.append(f"local42 total {tot:.4f} vs slots/{slots_json.name} {sj['local_no_spare']['tss']:.4f}")
        if checks:
            lines += ["", "Reproduction check: " + "; ".join(checks) + ".", ""]
        if "fed50" in summary[seed] and "local42" in summary[seed]:
            lines += deficit(summary[seed], sh)
    lines += overview(summary, sh)
    for seed, models in runs.items():
        if "_trajectory" in models:
            lines += trajectory_section(args, seed, models["_trajectory"], summary[seed])
    return "\n".join(lines) + "\n"


def deficit(models: dict, sh: int) -> list[str]:
    fed = models["fed50"]["cls"][0]
    loc = models["local42"]["cls"]
    f = fed["per_topic"][:sh]
    loc_pt = np.mean([c["per_topic"][:sh] for c in loc], axis=0)
    loc_mass = np.mean([c["best_mass"] for c in loc], axis=0)
    lines = [
        "",
        f"Shared-topic deficit fed50 − local42: {f.sum() - loc_pt.sum():+.3f} "
        f"({f.sum():.3f} against {loc_pt.sum():.3f}), split by the federated model's class of each true topic "
        "(local: per true topic, the mean over the nodes):",
        "",
        "| class (fed50) | topics | fed50 per topic | local42 per topic | fed − local (sum) "
        "| fed50 best slot's mass | local42 best slot's mass |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in TOPIC_CLASSES:
        m = fed["topic_class"] == c
        if not m.any():
            continue
        lines.append(
            f"| {c} | {m.sum()} | {f[m].mean():.3f} | {loc_pt[m].mean():.3f} | {(f[m] - loc_pt[m]).sum():+.3f} "
            f"| {fed['best_mass'][m].mean():.3f} | {loc_mass[m].mean():.3f} |"
        )
    # how much of the deficit the concentration accounts for: a line through the per-topic
    # (best slot's mass, similarity) points of both models
    x = np.concatenate([fed["best_mass"]] + [c["best_mass"] for c in loc])
    y = np.concatenate([f] + [c["per_topic"][:sh] for c in loc])
    b, a = np.polyfit(x, y, 1)
    r = float(np.corrcoef(x, y)[0, 1])
    pred = b * (fed["best_mass"].sum() - loc_mass.sum())
    lines += [
        "",
        f"Per shared true topic, the similarity follows the best slot's mass on the topic's words: "
        f"similarity = {a:.3f} + {b:.3f} × mass (r = {r:.2f}, fed50 and local42 topics pooled). The fed50 "
        f"model's best slots hold {fed['best_mass'].mean():.3f} of their topic's words against "
        f"{loc_mass.mean():.3f}; by the line that is {pred:+.3f} of the {f.sum() - loc_pt.sum():+.3f}.",
        "",
    ]
    return lines


def trajectory_section(args, seed: int, traj: dict, summary: dict) -> list[str]:
    curves = {k: v for k, v in traj.items() if k != "seconds"}
    n_ep = len(curves["fed50"]["shared"])
    marks = [e for e in (1, 5, 10, 15, 20, 30, 40, 50, 75, 100) if e <= n_ep]
    lines = [
        f"## Seed {seed}: the decoder reading epoch by epoch",
        "",
        f"The same models trained {n_ep} epochs without early stopping ({traj['seconds']:.0f} s); shared-topic "
        "TSS of the decoder's topics after each epoch (in brackets: the best slot's mass on its shared topic, "
        "mean over the 40). `kept`: the epoch that early stopping with patience 5 keeps (the models above); "
        "`peak`: the best epoch on this reading.",
        "",
        "| model | " + " | ".join(f"ep {e}" for e in marks) + " | kept (epoch) | peak (epoch) | kept − peak |",
        "|---|" + "---|" * (len(marks) + 3),
    ]
    stops = {"fed50": int(summary["fed50"]["epochs"][0][0])} if "fed50" in summary else {}
    if "local42" in summary:
        for n, row in enumerate(summary["local42"]["epochs"]):
            stops[f"local42 node {n}"] = int(row[0])
    if "central50" in summary and "central50" in curves:
        kept = int(summary["central50"]["epochs"][0][0])
        if kept <= len(curves["central50"]["shared"]):
            stops["central50"] = kept
    local = [name for name in curves if name.startswith("local42")]
    rows = dict(curves)
    if len(local) > 1:
        rows["local42, mean over nodes"] = {
            key: np.mean([curves[n][key] for n in local], axis=0).tolist() for key in ("shared", "best_mass")
        }
    for name, h in rows.items():
        cells = [
            f"{h['shared'][e - 1]:.2f} ({h['best_mass'][e - 1]:.3f})" if e <= len(h["shared"]) else "" for e in marks
        ]
        top = int(np.argmax(h["shared"]))
        if name in stops:
            kept = stops[name]
            kept_cell = f"{h['shared'][kept - 1]:.2f} ({kept})"
            diff = f"{h['shared'][kept - 1] - h['shared'][top]:+.2f}"
        elif name.startswith("local42, mean") and all(n in stops for n in local):
            vals = [curves[n]["shared"][stops[n] - 1] for n in local]
            peaks = [max(curves[n]["shared"]) for n in local]
            kept_cell = f"{np.mean(vals):.2f} (each node's)"
            diff = f"{np.mean(vals) - np.mean(peaks):+.2f} (each node's peak: {np.mean(peaks):.2f})"
        else:
            kept_cell, diff = "", ""
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {kept_cell} | {h['shared'][top]:.2f} ({top + 1}) | {diff} |"
        )
    if args.out:
        plt = pyplot()
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, h in curves.items():
            x = np.arange(1, len(h["shared"]) + 1)
            style = {"lw": 2, "color": "k"} if name == "fed50" else {"lw": 0.8}
            if name == "central50":
                style = {"lw": 1.5, "color": "k", "ls": "--"}
            (line,) = ax[0].plot(x, h["shared"], label=name, **style)
            ax[1].plot(x, h["val_loss"], label=name, **style)
            if name in stops:
                ax[0].plot([stops[name]], [h["shared"][stops[name] - 1]], "o", ms=4, color=line.get_color())
        ax[0].set(xlabel="epoch", ylabel="shared-topic TSS (decoder)", title=f"K'={args.shared}, seed {seed}")
        ax[1].set(xlabel="epoch", ylabel="validation loss (mean neg. ELBO per document)")
        ax[0].legend(fontsize=7)
        fig.tight_layout()
        png = args.out.with_name(f"{args.out.stem}-trajectory-{seed}.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        lines += ["", f"![shared-topic TSS and validation loss by epoch]({png.name})"]
    return lines + [""]


def overview(summary: dict, sh: int) -> list[str]:
    names = [n for n in MODELS if all(n in v for v in summary.values())]
    lines = [
        "## Over the seeds",
        "",
        "Shared-topic TSS (40 shared true topics) and counts (mean over seeds; local: over nodes too):",
        "",
        "| model | shared TSS per seed | mean | slots: junk | mixture | private | extra copies | topics merged "
        "| split | best slot's mass on its shared topic | slot's top topic mass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        per_seed = [np.mean([c["per_topic"][:sh].sum() for c in v[n]["cls"]]) for v in summary.values()]

        def count(kind: str, key: str, n: str = n) -> float:
            return float(np.mean([np.mean([np.sum(c[kind] == key) for c in v[n]["cls"]]) for v in summary.values()]))

        def mean(key: str, n: str = n) -> float:
            return float(np.mean([np.mean([np.mean(c[key]) for c in v[n]["cls"]]) for v in summary.values()]))

        lines.append(
            f"| {n} | {' / '.join(f'{x:.2f}' for x in per_seed)} | {np.mean(per_seed):.3f} | "
            f"{count('slot_class', 'junk'):.3g} | {count('slot_class', 'mixture'):.3g} | "
            f"{count('slot_class', 'private'):.3g} | {count('slot_class', 'shared, extra copy'):.3g} | "
            f"{count('topic_class', 'merged'):.3g} | {count('topic_class', 'split'):.3g} | "
            f"{mean('best_mass'):.3f} | {mean('slot_top1'):.3f} |"
        )
    lines.append("")
    return lines


if __name__ == "__main__":
    main()
