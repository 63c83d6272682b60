"""In-process study of SEEC's joint-learning gap on the man pages, one factor at a time.

``sim_10`` of joint learning is measured against *one* centralized model, which is itself
only one draw of a noisy training run. This study puts the gap next to its ceiling:

* ``reseed``: a second centralized model (another training seed, another inference seed)
  against the first: what run-to-run noise alone leaves of the top 10;
* ``reinfer``: the first centralized model inferred a second time with another seed: what
  the noise of inference alone leaves;
* ``joint``: FedAvg over the sites as the daemons run it (each site trains one local
  epoch from the round's global head, its document vectors kept across rounds, its
  subsampling and noise words from its own counts of the agreed vocabulary; the heads
  averaged weighted by tokens; the step decaying along a half cosine over the rounds),
  simulated synchronously in this process.

Factors: passes over the data (``epochs``: rounds of one local epoch when federated),
inference passes (``infer``), ``min_count``, the doc2vec settings ``dim``, ``negative``
and ``sample``. Every configuration is a JSON line in the output file as soon as it is
measured.

Agreement can be bought by degrading the model: if every top 10 collapsed onto a few hub
documents, any two models would agree. So each reference (and each joint model) also gets
two measures that do not depend on agreement (:func:`quality`): ``knn_section``, how often
the man page's section (1-8, from its name) is the majority of its 10 nearest neighbours'
sections, and ``hubness``, the number of distinct documents in all the top 10s together
(with ``max_in``, how many top 10s the most frequent one is in).

Run: ``python -m fedagent_experiments.seec_study OUT.jsonl --epochs 10 20 40 --infer 10 40``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedagent.tasks import text_data as td
from fedagent.tasks.doc2vec import DocHead
from fedagent_experiments.seec import (
    Scale,
    cosine_lr,
    joint_local_steps,
    load_doc2vec,
    neighbours,
    overlaps,
    train,
)


def sim(a: list[list[int]], b: list[list[int]], k: int) -> float:
    return float(overlaps(a, b, k).mean() / k)


def section(title: str) -> str:
    """A man page's section from its title: ``open(2)`` -> "2", ``open_how(2type)`` -> "2"
    ("" when the title has none)."""
    m = re.search(r"\((\d)[^()]*\)\s*$", title)
    return m.group(1) if m else ""


def quality(top: list[list[int]], labels: list[str], k: int) -> dict[str, float | int]:
    """Measures of one model's top k that do not depend on agreement with another model:
    ``knn_section``, the share of documents whose label is the majority label of their k
    nearest neighbours (a tie goes to the label of the nearest of the tied ones);
    ``hubness``, the number of distinct documents in all top k lists; ``max_in``, the
    number of lists the most frequent document is in."""
    right = 0
    seen: Counter[int] = Counter()
    for i, row in enumerate(top):
        row = row[:k]
        seen.update(row)
        votes = Counter(labels[j] for j in row)
        if votes:
            best = max(votes.values())
            winner = next(labels[j] for j in row if votes[labels[j]] == best)
            right += winner == labels[i]
    return {
        "knn_section": right / max(len(top), 1),
        "hubness": len(seen),
        "max_in": max(seen.values(), default=0),
    }


def train_joint(
    scale: Scale,
    server_lr: float = 1.0,
    global_counts: bool = False,
    local_epochs: int = 1,
    rounds_per_epoch: int = 1,
    weights: str = "tokens",
    schedule: str = "rounds",
    server_momentum: float = 0.0,
) -> tuple[Any, DocHead]:
    """FedAvg of the doc2vec head over ``scale.sites`` shards, ``local_epochs`` per round and
    ``scale.epochs / local_epochs`` rounds (the agents' ``_fit``: the round number is the
    local seed). ``server_lr``: the global head moves by that times the mean update (1:
    plain FedAvg). ``global_counts``: the sites subsample and draw noise words by the
    federation's counts instead of their own. ``rounds_per_epoch`` > 1 (with one local
    epoch): a round is that fraction of a site's epoch (its steps), so the same passes
    take ``rounds_per_epoch`` times more rounds. ``weights``: "tokens" (FedAvg) or "equal".
    ``schedule``: the cosine step over the rounds ("rounds", the coordinator's) or over
    the epochs, constant within one ("epochs", the centralized model's).
    ``server_momentum`` β: the coordinator's FedAvgM (``[rounds] server_momentum``):
    v = β·v + (mean − global), global += server_lr · v."""
    shards = [load_doc2vec(scale, shard=i, shards=scale.sites) for i in range(scale.sites)]
    merged = td.merge_term_counts([t.term_counts() for t in shards], min_count=scale.min_count)
    terms = [t for t, _ in merged]
    for t in shards:
        # an agent's counts: its own + 1 (fedagent.tasks.doc2vec), or the federation's
        t.set_vocabulary(terms, [c for _, c in merged] if global_counts else None)
    w = np.array([t.num_samples() if weights == "tokens" else 1 for t in shards], dtype=np.float64)
    w /= w.sum()
    torch.manual_seed(scale.seed)
    glob = shards[0].build_model()
    models = [t.build_model() for t in shards]
    if rounds_per_epoch > 1:
        local_epochs = 1
    rounds = max(1, scale.epochs // local_epochs) * rounds_per_epoch
    # a fraction of an epoch: the sites' mean epoch split (what the experiment sets as
    # the daemons' [rounds] local_steps)
    steps = joint_local_steps(shards, replace(scale, rounds_per_epoch=rounds_per_epoch))
    velocity = torch.zeros_like(glob.out_embed.weight.data)
    for r in range(1, rounds + 1):
        if schedule == "epochs":
            lr = cosine_lr(scale.lr, (r - 1) // rounds_per_epoch + 1, rounds // rounds_per_epoch)
        else:
            lr = cosine_lr(scale.lr, r, rounds)
        acc = torch.zeros_like(glob.out_embed.weight.data)
        for wi, t, m in zip(w, shards, models):
            m.out_embed.weight.data.copy_(glob.out_embed.weight.data)
            if rounds_per_epoch > 1:
                t.fit_steps(m, steps=steps, lr=lr, batch_size=scale.batch_size, seed=r)
            else:
                t.fit(m, epochs=local_epochs, lr=lr, batch_size=scale.batch_size, seed=r)
            acc += float(wi) * m.out_embed.weight.data
        if server_momentum > 0:
            velocity.mul_(server_momentum).add_(acc - glob.out_embed.weight.data)
            glob.out_embed.weight.data.add_(server_lr * velocity)
        else:
            glob.out_embed.weight.data.add_(server_lr * (acc - glob.out_embed.weight.data))
    central_vocab = load_doc2vec(scale)
    central_vocab.set_vocabulary(terms, [c for _, c in merged])
    return central_vocab, glob


def scale_key(scale: Scale) -> dict[str, Any]:
    """The settings that tell one study configuration from another, as a JSON row's fields."""
    return {
        "epochs": scale.epochs,
        "min_count": scale.min_count,
        "dim": scale.dim,
        "negative": scale.negative,
        "sample": scale.sample,
        "seed": scale.seed,
    }


def baseline(
    scale: Scale, central_task: Any, infers: list[int], cache: Path | None
) -> list[tuple[dict[str, Any], list[list[int]]]]:
    """For each number of inference passes in ``infers``: the centralized model's top k of
    every document (the reference), the reinfer and reseed ceilings, and the reference's
    :func:`quality`. The two centralized models are trained once for all ``infers``;
    everything is read back from ``cache`` where an earlier run left it (it depends on
    nothing a joint variant changes)."""

    def key(infer: int) -> str:
        return (
            f"e{scale.epochs}-i{infer}-m{scale.min_count}-s{scale.seed}-l{scale.limit}"
            f"-d{scale.dim}-n{scale.negative}-x{scale.sample:g}.json"
        )

    out: dict[int, tuple[dict[str, Any], list[list[int]]]] = {}
    for infer in infers:
        if cache is not None and (cache / key(infer)).exists():
            saved = json.loads((cache / key(infer)).read_text())
            print(json.dumps(saved["row"]), flush=True)
            out[infer] = saved["row"], saved["ref"]
    todo = [i for i in infers if i not in out]
    if todo:
        docs, k = central_task.tokens, scale.k
        labels = [section(t) for t in central_task.titles]
        t0 = time.process_time()
        central, _ = train(central_task, scale, seed=scale.seed)
        other_task = load_doc2vec(replace(scale, seed=scale.seed + 1))
        other, _ = train(other_task, scale, seed=scale.seed + 1)
        cpu_train = time.process_time() - t0
        for infer in todo:
            t0 = time.process_time()
            ref = neighbours(central_task.infer_vectors(central, docs, epochs=infer, seed=101)[0], k)
            row: dict[str, Any] = {**scale_key(scale), "infer": infer}
            again = central_task.infer_vectors(central, docs, epochs=infer, seed=202)[0]
            row["reinfer"] = sim(ref, neighbours(again, k), k)
            other_top = neighbours(other_task.infer_vectors(other, docs, epochs=infer, seed=202)[0], k)
            row["reseed"] = sim(ref, other_top, k)
            row.update(quality(ref, labels, k))
            # the same measures on the second model: how much they move between two runs
            row.update({f"reseed_{name}": v for name, v in quality(other_top, labels, k).items()})
            row["cpu_train_2_central_s"] = round(cpu_train, 1)
            row["cpu_infer_s"] = round(time.process_time() - t0, 1)
            print(json.dumps(row), flush=True)
            ref = [[int(j) for j in r] for r in ref]
            if cache is not None:
                cache.mkdir(parents=True, exist_ok=True)
                (cache / key(infer)).write_text(json.dumps({"row": row, "ref": ref}))
            out[infer] = row, ref
    return [out[i] for i in infers]


def study_mapping(args: argparse.Namespace) -> None:
    """Vector-space mapping (Algorithm 2) as the experiment runs it in process, for every
    public corpus and mapper setting asked for: ``sim_10`` of the mapped and the unmapped
    global search against the centralized model."""
    from fedagent.tasks.seec import public_vectors, train_mapper, train_own_model
    from fedagent_experiments.seec import Site, global_search, site_seed

    for scale in scales(args):
        scale = replace(scale, infer_epochs=args.infer[0])
        central_task = load_doc2vec(scale)
        docs = central_task.tokens
        n, k = len(docs), scale.k
        if args.cache is not None:
            # the reference the joint study measured (and cached) for these settings
            ref = baseline(scale, central_task, [scale.infer_epochs], args.cache)[0][1]
        else:
            central, _ = train(central_task, scale, seed=scale.seed)
            ref = neighbours(central_task.infer_vectors(central, docs, seed=101)[0], k)
        index = {tuple(t): i for i, t in enumerate(docs)}
        sites: list[Site] = []
        models = []
        for i in range(scale.sites):
            task = load_doc2vec(scale, shard=i, shards=scale.sites)
            own = td.merge_term_counts([task.term_counts()], min_count=scale.min_count)
            task.set_vocabulary([t for t, _ in own], [c for _, c in own])
            model = train_own_model(
                task, epochs=scale.epochs, lr=scale.lr, batch_size=scale.batch_size, seed=site_seed(scale, i)
            )
            models.append(model)
            rows = [index[tuple(t)] for t in task.tokens]
            sites.append(
                {"task": task, "vec": task.embed_documents(model), "pub": np.zeros(0), "rows": rows, "vocab": len(own)}
            )
        base = {**scale_key(scale), "infer": scale.infer_epochs}
        unmapped = sim(ref, global_search(sites, None, n, k), k)
        print(json.dumps({**base, "unmapped": unmapped}), flush=True)
        for corpus in args.public:
            name, _, count = corpus.partition(":")
            _, public = td.public_corpus(name, int(count))
            for i, si in enumerate(sites):
                si["pub"] = public_vectors(si["task"], models[i], public, site_seed(scale, i))
            for setting in args.mapper:
                lr_s, _, ep_s = setting.partition(":")
                t0 = time.process_time()
                mappers = {
                    (i, j): train_mapper(
                        sites[i]["pub"], sites[j]["pub"], lr=float(lr_s), epochs=int(ep_s), seed=site_seed(scale, i)
                    )
                    for i in range(scale.sites)
                    for j in range(scale.sites)
                    if i != j
                }
                row = {
                    **base,
                    "public": corpus,
                    "mapper_lr": float(lr_s),
                    "mapper_epochs": int(ep_s),
                    "mapped": sim(ref, global_search(sites, mappers, n, k), k),
                    "unmapped": unmapped,
                    "cpu_mappers_s": round(time.process_time() - t0, 1),
                }
                print(json.dumps(row), flush=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


def scales(args: argparse.Namespace) -> list[Scale]:
    """One :class:`Scale` of the man-page experiment per combination of the settings asked
    for (seed outermost, so one seed's configurations come together)."""
    return [
        Scale(
            corpus="manpages",
            epochs=e,
            min_count=m,
            dim=d,
            negative=n,
            sample=x,
            seed=s,
            limit=args.limit,
        )
        for s in args.seed
        for m in args.min_count
        for e in args.epochs
        for d in args.dim
        for n in args.negative
        for x in args.sample
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--epochs", type=int, nargs="+", default=[10])
    p.add_argument("--infer", type=int, nargs="+", default=[10])
    p.add_argument("--min-count", type=int, nargs="+", default=[2])
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--dim", type=int, nargs="+", default=[Scale.dim], help="doc2vec: vector size d")
    p.add_argument("--negative", type=int, nargs="+", default=[Scale.negative], help="doc2vec: noise words a pair")
    p.add_argument(
        "--sample", type=float, nargs="+", default=[Scale.sample], help="doc2vec: subsampling threshold (0: none)"
    )
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--no-joint", action="store_true")
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="keep the centralized reference and ceilings of each seed here and reuse them",
    )
    p.add_argument("--server-lr", type=float, nargs="+", default=[1.0], help="joint variants: server step")
    p.add_argument(
        "--server-momentum", type=float, nargs="+", default=[0.0], help="joint variants: server momentum (FedAvgM)"
    )
    p.add_argument("--local-epochs", type=int, nargs="+", default=[1], help="joint variants: local epochs a round")
    p.add_argument(
        "--rounds-per-epoch",
        type=int,
        nargs="+",
        default=[1],
        help="joint variants: rounds a site epoch (a round is 1/R epoch)",
    )
    p.add_argument("--weights", nargs="+", default=["tokens"], choices=["tokens", "equal"], help="joint variants")
    p.add_argument("--schedule", nargs="+", default=["rounds"], choices=["rounds", "epochs"], help="joint variants")
    p.add_argument(
        "--counts",
        choices=["own", "federation", "both"],
        default="federation",
        help="joint variants: the sites' subsampling and noise words by their own counts (the FedAvg agents "
        "before they took the vocabulary's counts), the federation's (now), or both",
    )
    p.add_argument("--mapping", action="store_true", help="study the mapping instead of joint learning")
    p.add_argument("--public", nargs="+", default=["newsgroups:200"], help="public corpora NAME:DOCS")
    p.add_argument("--mapper", nargs="+", default=["0.001:150"], help="mapper settings LR:EPOCHS")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.mapping:
        study_mapping(args)
        return
    for scale in scales(args):
        central_task = load_doc2vec(scale)
        docs = central_task.tokens
        k = scale.k
        variants = [
            {
                "server_lr": slr,
                "local_epochs": le,
                "global_counts": gc,
                "rounds_per_epoch": rpe,
                "weights": wt,
                "schedule": sc,
                **({"server_momentum": sm} if sm else {}),
            }
            for slr in args.server_lr
            for sm in args.server_momentum
            for le in args.local_epochs
            for gc in {"own": [False], "federation": [True], "both": [False, True]}[args.counts]
            for rpe in args.rounds_per_epoch
            for wt in args.weights
            for sc in args.schedule
        ]
        base_rows = baseline(scale, central_task, args.infer, args.cache)
        labels = [section(t) for t in central_task.titles]
        # One line per joint variant and inference setting, written as soon as it is measured.
        for v in [] if args.no_joint else variants:
            t0 = time.process_time()
            jt, jm = train_joint(scale, **v)
            cpu = time.process_time() - t0
            for row, ref in base_rows:
                t0 = time.process_time()
                top = neighbours(jt.infer_vectors(jm, docs, epochs=row["infer"], seed=303)[0], k)
                joint = {**v, "sim": sim(ref, top, k), **quality(top, labels, k), "cpu_s": round(cpu, 1)}
                out = {**row, "joint": [joint]}
                out["cpu_infer_s"] = round(time.process_time() - t0, 1)
                print(json.dumps(out), flush=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(out) + "\n")
        if args.no_joint:
            with args.out.open("a") as f:
                for row, _ in base_rows:
                    f.write(json.dumps({**row, "joint": []}) + "\n")


if __name__ == "__main__":
    main()
