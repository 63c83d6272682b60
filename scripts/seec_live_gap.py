"""Why the SEEC experiment's live mapping row differs from its in-process mapping row.

Repeats the in-process mapping (default scale: the 105 Wikipedia articles over 3 sites,
own models, mappers on the 200 newsgroups posts, sim_10 against the centralized model)
with the two things the agents do differently, one at a time:

* the query: the indexed document vector (``vec``, what the in-process rows use), or the
  article's text vectorised by ``embed_text`` as the agent does (``text-cut``: the first
  10,000 characters, the control socket's limit; ``text-full``: the whole article);
* the site's own model: trained with the experiment's cosine-decayed lr, or with one
  constant lr as an agent of a mapped federation trains it.

    nice -n 10 .venv/bin/python scripts/seec_live_gap.py      # ~4 min on 2 busy cores
"""

from __future__ import annotations

import numpy as np
import torch

from fedagent.agent.search import MAX_QUERY_CHARS
from fedagent.experiments import seec as X
from fedagent.tasks import text_data as td
from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import load_task
from fedagent.tasks.seec import map_vectors, train_mapper


def main() -> None:
    torch.set_num_threads(1)
    sc = X.SCALES["default"]
    central_task = load_task("doc2vec", X.options(sc))
    tokens = central_task.tokens
    n, k = len(tokens), sc.k
    central, _ = X.train(central_task, sc, seed=sc.seed)
    central_vec, _ = central_task.infer_vectors(central, tokens, seed=101)
    nn_central = X.neighbours(central_vec, k)
    index = {tuple(t): i for i, t in enumerate(tokens)}
    public = [td.tokenize(p.text) for p in td.newsgroups()]
    for constant_lr in (False, True):
        sites = []
        for i in range(sc.sites):
            task = load_task("doc2vec", X.options(sc, shard=i, shards=sc.sites))
            own = td.merge_term_counts([task.term_counts()], min_count=sc.min_count)
            task.set_vocabulary([t for t, _ in own], [c for _, c in own])
            if constant_lr:
                torch.manual_seed(sc.seed + 10 + i)
                model = task.build_model()
                task.fit(model, epochs=sc.epochs, lr=sc.lr, batch_size=sc.batch_size, seed=sc.seed + 10 + i)
            else:
                model, _ = X.train(task, sc, seed=sc.seed + 10 + i)
            queries = {
                "vec": task.infer_vectors(model, task.tokens, seed=404 + i)[0],
                "text-cut": np.stack(
                    [task.embed_text(model, X.query_text(list(t), MAX_QUERY_CHARS)[0]) for t in task.tokens]
                ),
                "text-full": np.stack([task.embed_text(model, " ".join(t)) for t in task.tokens]),
            }
            sites.append(
                {
                    "vec": queries["vec"],
                    "queries": queries,
                    "rows": [index[tuple(t)] for t in task.tokens],
                    "pub": task.infer_vectors(model, public, seed=505 + i)[0],
                }
            )
        mappers = {
            (i, j): train_mapper(
                sites[i]["pub"], sites[j]["pub"], lr=sc.mapper_lr, epochs=sc.mapper_epochs, seed=i * 10 + j
            )
            for i in range(sc.sites)
            for j in range(sc.sites)
            if i != j
        }
        for how in ("vec", "text-cut", "text-full"):
            result: list[list[int]] = [[] for _ in range(n)]
            for i, si in enumerate(sites):
                for local_row, row in enumerate(si["rows"]):
                    q = si["queries"][how][local_row]
                    hits: list[tuple[float, int]] = []
                    for j, sj in enumerate(sites):
                        v = q if i == j else map_vectors(mappers[i, j], q[None, :])[0]
                        sims = tm.normalize_rows(sj["vec"]) @ (v / (np.linalg.norm(v) or 1.0))
                        hits += [(float(s), sj["rows"][r]) for r, s in enumerate(sims) if sj["rows"][r] != row]
                    hits.sort(key=lambda h: (-h[0], h[1]))
                    result[row] = [r for _, r in hits[:k]]
            sim = X.overlaps(nn_central, result, k).mean() / k
            print(
                f"own models {'constant lr' if constant_lr else 'cosine lr  '}  query {how:9s}  sim_{k} {sim:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
