"""In-process study of gossip Word2Vec's gap to centralized training, one factor at a time.

The same task code as the agents (:mod:`fedagent.tasks.word2vec`: the shards, the common
vocabulary, the pair streams, the hand-written SGD step) and a synchronous simulation of
the agents' exchange (:mod:`fedagent.protocols.gossip`, merge-then-update push-sum): every
period each of the N nodes trains ``period_steps`` batches, then at the boundary it folds
back mass that came home, sends its model with half its mass to a random peer, and merges
its own model with at most ``max_incoming`` of the models that reached it during the
period (the others go home to their sender). The last boundary merges without training.
No network, no processes: a configuration costs about what the centralized run costs.

Factors (``Variant``):

* ``merge``: ``pushsum`` (mass-weighted, the agents' default), ``plain`` (own and
  received models averaged with equal weights, nothing conserved), ``rows``
  (:func:`fedagent.protocols.gossip_rows.merge_rows`: push-sum with one mass per
  embedding row, initially the node's count of the word);
* ``lr_factor``: the gossip step is ``lr x lr_factor`` (the agents: x N);
* ``row_steps``: with ``rows``, scale each row's step by the word's federation count over
  the node's current row mass (clipped to ``[1, lr_factor]``) instead of ``lr_factor``;
* ``period_steps``: exchange frequency;
* ``local_counts``: subsampling and noise distribution from the node's own counts
  instead of the agreed federation-wide counts (the vocabulary factor);
* ``outer``: train at ``lr x lr_factor`` between boundaries, then send and merge the
  period's start + ``outer`` x the progress (``[gossip] outer_step`` in the agents).

Run: ``python -m fedagent_experiments.gossip_w2v_study OUT.json [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedagent.protocols.gossip_rows import merge_rows, row_step_scale
from fedagent.tasks import text_data as td
from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import load_task
from fedagent.tasks.word2vec import (
    PairStream,
    SkipGram,
    Word2VecTask,
    load_vectors,
    sgns_update,
    train_centralized,
)

TABLES = ("in_embed.weight", "out_embed.weight")


@dataclass(frozen=True)
class Variant:
    name: str
    split: str = "topic"
    period_steps: int = 10
    merge: str = "pushsum"  # pushsum | plain | rows | allreduce
    lr_factor: float = 10.0
    row_steps: bool = False
    local_counts: bool = False
    mass_steps: bool = False
    max_incoming: int = 2
    exchange: tuple[str, ...] = TABLES
    # Exchange-only periods after the training budget (no training: communication, not
    # training budget), so that the nodes' final models are closer to their consensus.
    mix_periods: int = 0
    # Scale node i's step by its share of the samples x N (n_i / mean n): with plain
    # averaging every token then moves the consensus equally, as in centralized training.
    share_steps: bool = False
    # Peers a node sends its model to at each boundary; with push-sum the node keeps
    # 1/(fanout+1) of its mass and each peer gets as much.
    fanout: int = 1
    # A message carries only the rows its sender changed since its previous boundary
    # (the others NaN here); a merge averages each row over the entries that carry it.
    changed_rows: bool = False
    # Outer step: between boundaries a node trains a working copy of its merged model at
    # the step lr x lr_factor; at the boundary it sends and merges merged + outer x (its
    # progress since the merge) instead of the working copy (local SGD's outer step).
    outer: float | None = None


@dataclass(frozen=True)
class Budget:
    agents: int = 10
    topics: int = 5
    dim: int = 32
    window: int = 5
    negative: int = 5
    min_count: int = 5
    batch_size: int = 1024
    lr: float = 0.025
    local_steps: int = 2760

    def options(self, split: str | None, seed: int) -> dict[str, Any]:
        o: dict[str, Any] = {
            "dim": self.dim,
            "window": self.window,
            "negative": self.negative,
            "min_count": self.min_count,
            "seed": seed,
        }
        if split is not None:
            o.update(split=split, shards=self.agents)
            if split == "topic":
                o["topics"] = self.topics
        return o


def rowwise_mean(tables: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Weighted mean of each row over the tables that carry it (a row absent from a
    message is NaN there). The first table (the node's own) carries every row."""
    num = np.zeros(tables[0].shape, dtype=np.float64)
    den = np.zeros((tables[0].shape[0], 1))
    for wj, a in zip(weights, tables):
        has = ~np.isnan(a[:, 0])
        num[has] += wj * a[has]
        den[has] += wj
    return (num / den).astype(np.float32)


# ---- one simulated federation --------------------------------------------------------------
def train_node(
    task: Word2VecTask,
    model: SkipGram,
    steps: int,
    lr0: float,
    lr1: float,
    batch: int,
    gen: torch.Generator,
    scale_in: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    touched: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    w_in, w_out = model.in_embed.weight.data, model.out_embed.weight.data
    for s in range(steps):
        lr = lr0 + (lr1 - lr0) * s / steps
        centers, contexts = task.stream.next(batch)
        noise = task.noise.index_select(
            0, torch.randint(len(task.noise), (len(centers) * task.negative,), generator=gen)
        ).view(len(centers), task.negative)
        if touched is not None:  # the rows this step changes (input: centres; output: targets)
            touched[0][centers] = True
            touched[1][contexts] = True
            touched[1][noise.reshape(-1)] = True
        if scale_in is None:
            sgns_update(w_in, w_out, centers, contexts, noise, lr)
        else:
            assert scale_out is not None
            sgns_update(w_in, w_out, centers, contexts, noise, lr, row_scale=(scale_in, scale_out))


def simulate(v: Variant, b: Budget, seed: int, stats: dict[str, float] | None = None) -> list[dict[str, np.ndarray]]:
    """The nodes' final tables. ``stats`` (if given) receives the traffic per node: models
    sent, their bytes as dense float32 tables, and the bytes had each send carried only
    the rows the sender changed since its previous boundary (row index + values)."""
    n = b.agents
    tasks = []
    for i in range(n):
        t = load_task("word2vec", {**b.options(v.split, seed), "shard": i})
        assert isinstance(t, Word2VecTask)
        if v.local_counts:
            t.set_vocabulary(t.vocab.terms)  # local counts (+1) for subsampling and noise
        t.stream = PairStream(t.stream.make_epoch, seed * 7919 + i)
        tasks.append(t)
    rng = np.random.default_rng(seed)
    base = tasks[0].build_model()
    models = []
    for _ in range(n):
        m = SkipGram(len(tasks[0].vocab), b.dim)
        m.load_state_dict(base.state_dict())
        models.append(m)
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(n)]
    n_rows = len(tasks[0].vocab)
    touched = [(torch.zeros(n_rows, dtype=torch.bool), torch.zeros(n_rows, dtype=torch.bool)) for _ in range(n)]
    sent_models = [0] * n
    sent_rows = [0] * n  # rows of both tables over all sends
    global_counts = tasks[0].vocab.counts
    local = []
    for t in tasks:
        c = np.zeros(len(t.vocab))
        for e in t.encoded:
            np.add.at(c, e, 1.0)
        local.append(c)
    rows = v.merge == "rows"
    samples = [float(t.num_samples()) for t in tasks]
    # masses: scalar per node, or one per row per table
    mass: list[Any] = [{k: lc + 1.0 for k in TABLES} if rows else samples[i] for i, lc in enumerate(local)]
    train_periods = max(1, b.local_steps // v.period_steps)
    periods = train_periods + v.mix_periods
    lr = b.lr * v.lr_factor
    mean_samples = float(np.mean(samples))
    inbox: list[list[Any]] = [[] for _ in range(n)]
    home: list[list[tuple[dict[str, np.ndarray], Any]]] = [[] for _ in range(n)]

    def values(i: int) -> dict[str, np.ndarray]:
        return {k: models[i].state_dict()[k].numpy() for k in TABLES}

    def set_values(i: int, vals: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            models[i].in_embed.weight.copy_(torch.from_numpy(np.ascontiguousarray(vals["in_embed.weight"])))
            models[i].out_embed.weight.copy_(torch.from_numpy(np.ascontiguousarray(vals["out_embed.weight"])))

    def train_period(i: int, lr0: float, lr1: float, si: torch.Tensor | None, so: torch.Tensor | None) -> None:
        anchor = {k: a.copy() for k, a in values(i).items()} if v.outer is not None else None
        train_node(tasks[i], models[i], v.period_steps, lr0, lr1, b.batch_size, gens[i], si, so, touched[i])
        if anchor is not None:  # the merged model + outer x the progress since it
            assert v.outer is not None
            set_values(i, {k: outer_step(anchor[k], a, v.outer) for k, a in values(i).items()})

    def merge(i: int, entries: list[tuple[dict[str, np.ndarray], Any]]) -> None:
        if len(entries) < 2:
            return
        if rows:
            merged, masses = {}, {}
            for k in TABLES:
                merged[k], masses[k] = merge_rows([(e[0][k], e[1][k]) for e in entries])
            set_values(i, merged)
            mass[i] = masses
            return
        if v.merge == "plain":
            w = np.ones(len(entries))
        else:
            w = np.array([e[1] for e in entries], dtype=np.float64)
        tot = w.sum()
        if v.changed_rows:  # row by row over the entries that carry the row (own: all)
            set_values(i, {k: rowwise_mean([e[0][k] for e in entries], w) for k in TABLES})
        else:
            set_values(i, {k: sum(wj * e[0][k] for wj, e in zip(w, entries)) / tot for k in TABLES})
        if v.merge == "pushsum":
            mass[i] = float(tot)

    if v.merge == "allreduce":
        # Not gossip: every node gets the mean of all models at every boundary (parallel
        # SGD with model averaging), the best any merge could do with these steps.
        for p in range(train_periods):
            lr0, lr1 = lr * (1 - p / train_periods), lr * (1 - (p + 1) / train_periods)
            for i in range(n):
                train_period(i, lr0, lr1, None, None)
            avg = {k: np.mean([values(i)[k] for i in range(n)], axis=0) for k in TABLES}
            for i in range(n):
                set_values(i, avg)
                # counted as one model up per node and exchange (the mean coming back not counted)
                sent_models[i] += 1
                sent_rows[i] += int(touched[i][0].sum()) + int(touched[i][1].sum())
                touched[i][0].zero_()
                touched[i][1].zero_()
        _traffic(stats, b, sent_models, sent_rows)
        return [values(i) for i in range(n)]
    for p in range(periods):
        lr0, lr1 = lr * (1 - p / train_periods), lr * (1 - (p + 1) / train_periods)
        for i in range(n):
            if p >= train_periods:
                break
            si = so = None
            if rows and v.row_steps:
                tot = global_counts + n
                si = torch.from_numpy(row_step_scale(tot, mass[i]["in_embed.weight"], 1.0, v.lr_factor))
                so = torch.from_numpy(row_step_scale(tot, mass[i]["out_embed.weight"], 1.0, v.lr_factor))
                lr0_i, lr1_i = lr0 / v.lr_factor, lr1 / v.lr_factor
            elif v.mass_steps and v.merge == "pushsum":
                # stochastic gradient push: the step scaled by the node's share of the mass
                f = float(np.clip(samples[i] / mass[i], 0.25, 4.0))
                lr0_i, lr1_i = lr0 * f, lr1 * f
            elif v.share_steps:
                f = samples[i] / mean_samples
                lr0_i, lr1_i = lr0 * f, lr1 * f
            else:
                lr0_i, lr1_i = lr0, lr1
            train_period(i, lr0_i, lr1_i, si, so)
        last = p == periods - 1
        sends: list[tuple[int, int, dict[str, np.ndarray], Any]] = []
        new_inbox: list[list[Any]] = [[] for _ in range(n)]
        for i in range(n):
            own = values(i)
            own = {k: a.copy() for k, a in own.items()}
            if v.merge != "plain" and home[i]:
                merge(i, [(own, mass[i])] + home[i])
                own = {k: a.copy() for k, a in values(i).items()}
            home[i] = []
            arrivals = inbox[i]
            order = rng.permutation(len(arrivals))
            kept = [arrivals[j] for j in order[: v.max_incoming]]
            for j in order[v.max_incoming :]:
                src = arrivals[j][2]
                home[src].append(arrivals[j][:2])
            if not last:
                others = [j for j in range(n) if j != i]
                if v.fanout == 1:
                    peers = [int(rng.choice(others))]
                else:
                    peers = [int(j) for j in rng.choice(others, size=v.fanout, replace=False)]
                parts = len(peers) + 1
                if v.merge == "plain":
                    sm: Any = 1.0
                elif rows:
                    sm = {k: m / parts for k, m in mass[i].items()}
                    mass[i] = {k: m / parts for k, m in mass[i].items()}
                else:
                    sm = mass[i] / parts
                    mass[i] = mass[i] / parts
                changed = int(touched[i][0].sum()) + int(touched[i][1].sum())
                msg = own
                if v.changed_rows:
                    msg = {k: a.copy() for k, a in own.items()}
                    for k, mask in zip(TABLES, touched[i]):
                        msg[k][~mask.numpy()] = np.nan
                for peer in peers:
                    sends.append((i, peer, msg, sm))
                    sent_models[i] += 1
                    sent_rows[i] += changed
            touched[i][0].zero_()
            touched[i][1].zero_()
            merge(i, [(own, mass[i])] + [(e[0], e[1]) for e in kept])
        for src, dst, vals, sm in sends:
            new_inbox[dst].append((vals, sm, src))
        inbox = new_inbox
    _traffic(stats, b, sent_models, sent_rows)
    return [values(i) for i in range(n)]


def outer_step(anchor: np.ndarray, trained: np.ndarray, scale: float) -> np.ndarray:
    """``anchor + scale x (trained - anchor)``: the progress since the anchor, scaled
    (rows the training did not touch stay the anchor's). The agents' rule is
    :func:`fedagent.protocols.gossip.outer_step` (float64 arithmetic); this float32 form
    produced the study's rows."""
    return anchor + np.float32(scale) * (trained - anchor)


def model_bytes(b: Budget, terms: int) -> int:
    """Bytes of the two float32 tables (what a gossip message carries, before framing)."""
    return 2 * terms * b.dim * 4


def _traffic(stats: dict[str, float] | None, b: Budget, models: list[int], rows: list[int]) -> None:
    if stats is None:
        return
    stats["models_per_node"] = float(np.mean(models))
    stats["row_sends_per_node"] = float(np.mean(rows))
    stats["touched_bytes_per_node"] = float(np.mean(rows)) * (b.dim * 4 + 4)


# ---- scoring --------------------------------------------------------------------------------
def consensus_neighbours(refs: list[tm.WordVectors], words: list[str], k: int) -> dict[str, set[str]]:
    """The ``k`` nearest words of each word by cosine similarity averaged over ``refs``."""
    common = [t for t in refs[0].terms if all(t in r for r in refs)]
    mats = [tm.normalize_rows(r.restrict(common).vectors.astype(np.float64)) for r in refs]
    index = {t: i for i, t in enumerate(common)}
    out = {}
    for w in words:
        if w not in index:
            continue
        i = index[w]
        sims = np.mean([m @ m[i] for m in mats], axis=0)
        sims[i] = -np.inf
        out[w] = {common[j] for j in np.argsort(-sims, kind="stable")[:k]}
    return out


def overlap_with(vec: tm.WordVectors, ref: dict[str, set[str]], k: int) -> int:
    total = 0
    for w, nbrs in ref.items():
        if w in vec:
            total += len(set(tm.neighbours_of(vec, w, k)) & nbrs)
    return total


def scores(vec: tm.WordVectors, centrals: list[tm.WordVectors]) -> dict[str, float]:
    words = list(tm.THESIS_EVAL_WORDS)
    out = {"wordsim353": tm.similarity_benchmark(td.wordsim353(), vec).rho}
    out["overlap_each"] = float(np.mean([tm.neighbour_overlap(vec, c).total for c in centrals]))
    out["overlap_consensus"] = float(overlap_with(vec, consensus_neighbours(centrals, words, 8), 8))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seeds", type=int, nargs="*", default=[1])
    ap.add_argument("--central-seeds", type=int, nargs="*", default=[1, 2, 3])
    ap.add_argument("--cache", type=Path, default=Path("study-central"))
    ap.add_argument("--local-steps", type=int, default=Budget.local_steps, help="batches per node (centralized: x N)")
    ap.add_argument(
        "--central-from", type=Path, default=None, help="use the experiment's central_seed*.npz in this directory"
    )
    ap.add_argument("--score-only", action="store_true", help="score the cached simulations only")
    ap.add_argument(
        "--train-central", action="store_true", help="train missing centralized models (else wait for them)"
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    b = Budget(local_steps=a.local_steps)
    a.cache.mkdir(parents=True, exist_ok=True)
    task = load_task("word2vec", b.options(None, 0))
    assert isinstance(task, Word2VecTask)

    def load_centrals() -> list[tm.WordVectors]:
        out = []
        if a.central_from is not None:
            # the experiment's centralized models (initial models from their own seed range)
            for s in a.central_seeds:
                path = a.central_from / f"central_seed{s}.npz"
                while not path.exists():
                    time.sleep(10)
                vec = load_vectors(path)
                if list(vec.terms) != list(task.vocab.terms):
                    raise SystemExit(f"{path}: another vocabulary than this study's")
                out.append(vec)
            return out
        for s in a.central_seeds:
            path = a.cache / f"central{s}-{b.local_steps}.npy"
            if not path.exists() and a.train_central:
                torch.manual_seed(s)
                task.stream = PairStream(task.stream.make_epoch, s)
                m = task.build_model()
                m.reset(torch.Generator().manual_seed(s))
                train_centralized(task, m, steps=b.agents * b.local_steps, lr=b.lr, batch_size=b.batch_size, seed=s)
                np.save(a.cache / f"tmp{s}.npy", m.in_embed.weight.detach().numpy())
                (a.cache / f"tmp{s}.npy").rename(path)
            while not path.exists():
                time.sleep(10)
            out.append(tm.WordVectors(task.vocab.terms, np.load(path)))
        return out

    if a.only == []:
        load_centrals()
        return 0
    results: dict[str, Any] = json.loads(a.out.read_text()) if a.out.exists() else {}
    # Every simulation's final input vectors are kept in the cache as soon as it ends, so
    # that a study cut off (or one waiting for the centralized models) loses nothing;
    # ``--score-only`` scores what the cache holds without simulating.
    pending = []
    for v in VARIANTS:
        if a.only is not None and v.name not in a.only:
            continue
        for seed in a.seeds:
            key = f"{v.name}/seed{seed}"
            if key in results:
                continue
            path = a.cache / f"sim-{b.local_steps}-{key.replace('/', '_')}.npz"
            if not path.exists():
                if a.score_only:
                    continue
                t0 = time.process_time()
                stats: dict[str, float] = {}
                finals = simulate(v, b, seed, stats)
                cpu = time.process_time() - t0
                arrays = {f"node{i}": f["in_embed.weight"] for i, f in enumerate(finals)}
                extra = {f"stat_{k}": np.array(x) for k, x in stats.items()}
                np.savez(path.with_suffix(".tmp.npz"), cpu=np.array(cpu), **extra, **arrays)  # type: ignore[arg-type]
                path.with_suffix(".tmp.npz").rename(path)
                print(key, "simulated", f"{cpu:.0f} CPU s", flush=True)
            pending.append((key, v, path))
    centrals = load_centrals()
    central_rows = []
    words = list(tm.THESIS_EVAL_WORDS)
    loo = [consensus_neighbours([o for j, o in enumerate(centrals) if j != i], words, 8) for i in range(len(centrals))]
    for i, c in enumerate(centrals):
        others = [o for j, o in enumerate(centrals) if j != i]
        r = {"wordsim353": tm.similarity_benchmark(td.wordsim353(), c).rho}
        r["overlap_each"] = float(np.mean([tm.neighbour_overlap(c, o).total for o in others]))
        r["overlap_consensus"] = float(overlap_with(c, loo[i], 8))
        central_rows.append(r)
    print("central", central_rows, flush=True)
    results["central"] = central_rows
    for key, v, path in pending:
        saved = np.load(path)
        nodes = sorted((k for k in saved.files if k.startswith("node")), key=lambda k: int(k[4:]))
        per = []
        for k in nodes:
            vec = tm.WordVectors(task.vocab.terms, saved[k])
            # a gossip model is scored against the consensus of all centralized seeds but
            # one, each in turn (the leave-one-out references of the centralized rows)
            sc = {"wordsim353": tm.similarity_benchmark(td.wordsim353(), vec).rho}
            sc["overlap_each"] = float(np.mean([tm.neighbour_overlap(vec, c).total for c in centrals]))
            sc["overlap_consensus"] = float(np.mean([overlap_with(vec, ref, 8) for ref in loo]))
            per.append(sc)
        row: dict[str, Any] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        row["cpu_s"] = float(saved["cpu"])
        for k in saved.files:
            if k.startswith("stat_"):
                row[k[5:]] = float(saved[k])
        row["model_bytes"] = float(model_bytes(b, len(task.vocab)))
        row["variant"] = asdict(v)
        results[key] = row
        print(key, row, flush=True)
    a.out.write_text(json.dumps(results, indent=1))
    return 0


# Mixing: fanout k (k peers per boundary, up to 2k models kept, as the default keeps 2 for
# one send) and exchange r times as often as the configuration (frequent 10 / r batches,
# infrequent 50 / r: the infrequent configurations stay 5x less frequent).
MIXING = [(f"fan{k}", k, 1) for k in (2, 3)] + [
    (f"{fan}rate{r}", k, r) for k, fan in ((1, ""), (2, "fan2-"), (3, "fan3-")) for r in (2, 5, 10)
]
# The same with messages of the rows changed since the sender's previous boundary.
CHANGED_ROWS = [(f"{fan}rows-rate{r}", k, r) for k, fan in ((1, ""), (2, "fan2-")) for r in (1, 5, 10)]
# The rows of study.md's mixing table, in order (the defaults and ceilings for comparison).
MIXING_TABLE = [
    "",
    "fan2",
    "rate5",
    "fan2-rate5",
    "fan2-rows-rate5",
    "plain",
    "plain-every2",
    "allreduce",
    "allreduce-rate5",
    "allreduce1",
]

FACTOR_NAMES = {
    "": "push-sum, step x N (the agents' default)",
    "plain": "plain averaging (no masses)",
    "rows": "per-row push-sum, per-row step total/own",
    "rows-x10": "per-row push-sum, step x N",
    "sgp": "push-sum, step x N x own samples / own mass",
    "x5": "push-sum, step x 5",
    "x20": "push-sum, step x 20",
    "local-counts": "subsampling and noise from local counts",
    "every2": "exchange every 2 batches",
    "every5": "exchange every 5 batches",
    "every20": "exchange every 20 batches",
    "mix20": "push-sum, 20 exchange-only periods after the budget",
    "plain-mix20": "plain averaging, 20 exchange-only periods after the budget",
    "plain-share": "plain averaging, step x N x own samples / mean samples",
    "plain-x5": "plain averaging, step x 5",
    "plain-every5": "plain averaging, exchange every 5 batches",
    "plain-every2": "plain averaging, exchange every 2 batches",
    "outer": "push-sum, base step, outer step x N at each exchange",
    "outer5": "push-sum, base step, outer step x 5 at each exchange",
    "outer20": "push-sum, base step, outer step x 20 at each exchange",
    "outer-rate5": "push-sum, base step, outer step x N, exchange 5x as often",
    "x5-outer2": "push-sum, step x 5, outer step x 2 at each exchange",
    "x2-outer5": "push-sum, step x 2, outer step x 5 at each exchange",
    "allreduce-outer": "not gossip: all models averaged at every exchange, base step, outer step x N",
    "allreduce": "not gossip: all models averaged at every exchange",
    "allreduce1": "not gossip: all models averaged after every batch",
    "allreduce-rate2": "not gossip: all models averaged, exchange 2x as often",
    "allreduce-rate5": "not gossip: all models averaged, exchange 5x as often",
    **{
        name: (f"fanout {k}, " if k > 1 else "")
        + (f"exchange {r}x as often" if r > 1 else f"up to {2 * k} kept, period as configured")
        for name, k, r in MIXING
    },
    **{
        name: (f"fanout {k}, " if k > 1 else "")
        + "changed rows only, "
        + (f"exchange {r}x as often" if r > 1 else "period as configured")
        for name, k, r in CHANGED_ROWS
    },
}


def summarize(paths: list[Path], out_dir: Path, local_steps: int) -> str:
    """The study's tables (markdown, returned and written to ``out_dir/study.md``) and
    plot: every configuration x variant as the mean over the seeds it ran (each seed's
    value listed), then each variant's average loss over the six configurations, for
    the variants that ran all six at the same seeds."""
    rows: dict[str, dict[str, Any]] = {}
    central: list[dict[str, float]] = []
    for p in paths:
        data = json.loads(p.read_text())
        central = data.get("central") or central
        rows.update({k: v for k, v in data.items() if k != "central"})
    if not central or not rows:
        return ""
    cws = float(np.mean([c["wordsim353"] for c in central]))
    cov = float(np.mean([c["overlap_consensus"] for c in central]))
    cfloor_ws = float(np.mean([abs(c["wordsim353"] - cws) for c in central])) / cws * 100
    cfloor_ov = float(np.mean([abs(c["overlap_consensus"] - cov) for c in central])) / cov * 100
    groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for key, r in rows.items():
        parts = key.split("/")
        groups.setdefault((parts[0], "/".join(parts[1:-1])), {})[int(parts[-1].removeprefix("seed"))] = r
    lines = [
        f"Budget: {local_steps} batches of 1024 per node ({10 * local_steps} in all), the same as every "
        f"centralized run. Centralized reference: the experiment's three centralized seeds (wordsim353 {cws:.3f}, "
        f"overlap with the other seeds' consensus {cov:.1f}; one seed's distance from their mean: "
        f"{cfloor_ws:.1f} % and {cfloor_ov:.1f} %). Loss in % of the centralized mean; a configuration's "
        "value is the mean over its 10 nodes' final models, then over seeds (each seed's value in brackets).",
        "",
        "| configuration | variant | seeds | wordsim353 | loss % | overlap with consensus | loss % | CPU s per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    items = []
    for (base, factor), by_seed in sorted(groups.items()):
        seeds = sorted(by_seed)
        ws = [by_seed[sd]["wordsim353"] for sd in seeds]
        ov = [by_seed[sd]["overlap_consensus"] for sd in seeds]
        lws, lov = 100 * (cws - float(np.mean(ws))) / cws, 100 * (cov - float(np.mean(ov))) / cov
        items.append((f"{base} {factor or 'default'}", lws, lov))
        each_ws = " / ".join(f"{v:.3f}" for v in ws)
        each_ov = " / ".join(f"{v:.1f}" for v in ov)
        lines.append(
            f"| {base} | {FACTOR_NAMES.get(factor, factor)} | {', '.join(map(str, seeds))} | {np.mean(ws):.3f} "
            f"({each_ws}) | {lws:.1f} | {np.mean(ov):.1f} ({each_ov}) | {lov:.1f} | "
            f"{np.mean([by_seed[sd]['cpu_s'] for sd in seeds]):.0f} |"
        )
    bases = {b for b, _ in groups}
    six = [f"{sp}-{how}" for how in ("frequent", "infrequent") for sp in ("topic", "random", "imbalanced")]
    avg_lines = []
    for factor in sorted({f for _, f in groups}):
        if not all((b, factor) in groups for b in six):
            continue
        common = sorted(set.intersection(*(set(groups[(b, factor)]) for b in six)))
        if not common:
            continue
        per_seed_ws = [
            float(np.mean([100 * (cws - groups[(b, factor)][sd]["wordsim353"]) / cws for b in six])) for sd in common
        ]
        per_seed_ov = [
            float(np.mean([100 * (cov - groups[(b, factor)][sd]["overlap_consensus"]) / cov for b in six]))
            for sd in common
        ]
        avg_lines.append(
            f"| {FACTOR_NAMES.get(factor, factor)} | {', '.join(map(str, common))} | {np.mean(per_seed_ws):.1f} "
            f"({' / '.join(f'{v:.1f}' for v in per_seed_ws)}) | {np.mean(per_seed_ov):.1f} "
            f"({' / '.join(f'{v:.1f}' for v in per_seed_ov)}) |"
        )
    if avg_lines and bases >= set(six):
        lines += [
            "",
            "Average loss over the six full-exchange configurations (seeds every one of them ran; per seed in "
            "brackets):",
            "",
            "| variant | seeds | wordsim353 loss % | overlap-with-consensus loss % |",
            "|---|---|---|---|",
            *avg_lines,
        ]
    lines += ["", "![study](study.png)", ""]
    from fedagent.local.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = np.arange(len(items))
    ax.bar(x - 0.2, [i[1] for i in items], 0.4, label="wordsim353 loss %")
    ax.bar(x + 0.2, [i[2] for i in items], 0.4, label="overlap-with-consensus loss %")
    ax.axhline(3, ls=":", c="k", label="3 % target")
    ax.axhline(0, c="grey", lw=0.5)
    ax.set_xticks(x, [i[0] for i in items], rotation=40, ha="right", fontsize=8)
    ax.set_title(f"in-process study, {local_steps} batches per node: loss against the centralized mean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "study.png", dpi=100)
    plt.close(fig)
    return "\n".join(lines)


def traffic_of(variant: dict[str, Any], local_steps: int) -> float:
    """Models a node sends over the run, from the variant alone (the rows before the
    traffic was recorded): one per peer at every boundary but the last; ``allreduce`` one
    per boundary (its mean coming back not counted)."""
    periods = max(1, local_steps // variant["period_steps"])
    if variant["merge"] == "allreduce":
        return float(periods)
    return float((periods + variant.get("mix_periods", 0) - 1) * variant.get("fanout", 1))


def _pct(values: list[float]) -> str:
    """Mean and each seed's value; a model whose tables overflowed (NaN scores) reads
    "diverged"."""

    def one(x: float) -> str:
        return "diverged" if np.isnan(x) else f"{x:.1f}"

    return f"{one(float(np.mean(values)))} ({' / '.join(one(x) for x in values)})"


def summarize_mixing(
    paths: list[Path],
    local_steps: int,
    factors: list[str],
    terms: int,
    plot: Path | None = None,
    configs: list[str] | None = None,
) -> str:
    """The mixing table: each configuration x factor (seeds, loss on both measures with
    each seed's loss, traffic per node against the model's size, CPU), then the average
    over the six configurations for the factors that ran all six at common seeds. With
    ``plot``, a figure of each row's losses against its traffic per node; with
    ``configs``, the rows of those configurations only."""
    rows: dict[str, dict[str, Any]] = {}
    central: list[dict[str, float]] = []
    for p in paths:
        data = json.loads(p.read_text())
        central = data.get("central") or central
        rows.update({k: v for k, v in data.items() if k != "central"})
    cws = float(np.mean([c["wordsim353"] for c in central]))
    cov = float(np.mean([c["overlap_consensus"] for c in central]))
    size = model_bytes(Budget(local_steps=local_steps), terms)
    mb = size / 1e6
    groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for key, r in rows.items():
        parts = key.split("/")
        factor = "/".join(parts[1:-1])
        if factor in factors:
            groups.setdefault((parts[0], factor), {})[int(parts[-1].removeprefix("seed"))] = r
    six = [f"{sp}-{how}" for how in ("frequent", "infrequent") for sp in ("topic", "random", "imbalanced")]
    points: list[tuple[str, str, float, float, float]] = []  # config, factor, MB, ws loss, overlap loss
    lines = [
        f"Model: two float32 tables of {terms} x 32 = {mb:.2f} MB (the centralized model's size). Traffic per "
        "node: models sent over the run x that size (dense), and what messages of only the rows the sender "
        "changed since its previous boundary would carry (row index + values; measured in the runs that "
        "recorded it). Loss in % of the centralized mean (each seed's loss in brackets).",
        "",
        "| configuration | variant | period | seeds | wordsim353 loss % | overlap loss % | models sent per node | "
        "MB per node (x model) | changed rows only, MB per node | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for factor in factors:
        for base in six if configs is None else [c for c in six if c in configs]:
            by_seed = groups.get((base, factor))
            if not by_seed:
                continue
            seeds = sorted(by_seed)
            lw = [100 * (cws - by_seed[sd]["wordsim353"]) / cws for sd in seeds]
            lo = [100 * (cov - by_seed[sd]["overlap_consensus"]) / cov for sd in seeds]
            var = by_seed[seeds[0]]["variant"]
            sent = by_seed[seeds[0]].get("models_per_node") or traffic_of(var, local_steps)
            touched = [by_seed[sd]["touched_bytes_per_node"] for sd in seeds if "touched_bytes_per_node" in by_seed[sd]]
            # a changed-rows variant sends no dense models: its traffic is the next column
            dense = "-" if var.get("changed_rows") else f"{sent * mb:.0f} (x {sent:.0f})"
            tb = f"{np.mean(touched) / 1e6:.0f} (x {np.mean(touched) / size:.0f})" if touched else ""
            sent_mb = np.mean(touched) / 1e6 if var.get("changed_rows") else sent * mb
            points.append((base, factor, float(sent_mb), float(np.mean(lw)), float(np.mean(lo))))
            lines.append(
                f"| {base} | {FACTOR_NAMES.get(factor, factor)} | {var['period_steps']} | "
                f"{', '.join(map(str, seeds))} | {_pct(lw)} | {_pct(lo)} | {sent:.0f} | "
                f"{dense} | {tb} | {np.mean([by_seed[sd]['cpu_s'] for sd in seeds]):.0f} |"
            )
    avg = []
    for factor in factors:
        if not all((b, factor) in groups for b in six):
            continue
        common = sorted(set.intersection(*(set(groups[(b, factor)]) for b in six)))
        if not common:
            continue
        pw = [float(np.mean([100 * (cws - groups[(b, factor)][sd]["wordsim353"]) / cws for b in six])) for sd in common]
        po = [
            float(np.mean([100 * (cov - groups[(b, factor)][sd]["overlap_consensus"]) / cov for b in six]))
            for sd in common
        ]
        sent = float(
            np.mean(
                [
                    groups[(b, factor)][common[0]].get("models_per_node")
                    or traffic_of(groups[(b, factor)][common[0]]["variant"], local_steps)
                    for b in six
                ]
            )
        )
        avg.append(
            f"| {FACTOR_NAMES.get(factor, factor)} | {', '.join(map(str, common))} | {np.mean(pw):.1f} "
            f"({' / '.join(f'{x:.1f}' for x in pw)}) | {np.mean(po):.1f} ({' / '.join(f'{x:.1f}' for x in po)}) | "
            f"{sent * mb:.0f} (x {sent:.0f}) |"
        )
    if avg:
        lines += [
            "",
            "Average over the six configurations (per seed in brackets):",
            "",
            "| variant | seeds | wordsim353 loss % | overlap loss % | MB per node, mean of the six (x model) |",
            "|---|---|---|---|---|",
            *avg,
        ]
    if plot is not None and points:
        from fedagent.local.report import pyplot

        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
        for ax, j, title in ((axes[0], 3, "wordsim353 loss %"), (axes[1], 4, "overlap-with-consensus loss %")):
            for base in sorted({p[0] for p in points}):
                pts = [p for p in points if p[0] == base]
                ax.scatter([p[2] for p in pts], [p[j] for p in pts], label=base, s=25)
                for pt in pts:
                    ax.annotate(
                        pt[1] or "default", (pt[2], pt[j]), fontsize=6, xytext=(3, 2), textcoords="offset points"
                    )
            ax.axhline(3, ls=":", c="k")
            ax.set_xscale("log")
            ax.tick_params(axis="x", which="minor", labelbottom=False)
            ax.set_xlabel(f"MB sent per node over the run (model: {mb:.2f} MB)")
            ax.set_title(title + " (mean over the seeds run)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
        plt.close(fig)
    return "\n".join(lines)


_BASE = [
    Variant(f"{split}-{how}", split, steps)
    for how, steps in (("frequent", 10), ("infrequent", 50))
    for split in ("topic", "random", "imbalanced")
]
VARIANTS: list[Variant] = [
    *_BASE,
    *[replace(v, name=v.name + "/plain", merge="plain") for v in _BASE],
    *[replace(v, name=v.name + "/rows", merge="rows", row_steps=True) for v in _BASE],
    *[replace(v, name=v.name + "/rows-x10", merge="rows") for v in _BASE],
    *[replace(v, name=v.name + "/sgp", mass_steps=True) for v in _BASE],
    *[replace(v, name=v.name + "/x5", lr_factor=5.0) for v in _BASE],
    *[replace(v, name=v.name + "/x20", lr_factor=20.0) for v in _BASE],
    *[replace(v, name=v.name + "/local-counts", local_counts=True) for v in _BASE],
    *[replace(v, name=v.name + f"/every{p}", period_steps=p) for v in _BASE for p in (2, 5, 20)],
    *[replace(v, name=v.name + "/mix20", mix_periods=20) for v in _BASE],
    *[replace(v, name=v.name + "/plain-mix20", merge="plain", mix_periods=20) for v in _BASE],
    *[replace(v, name=v.name + "/plain-share", merge="plain", share_steps=True) for v in _BASE],
    *[replace(v, name=v.name + "/plain-x5", merge="plain", lr_factor=5.0) for v in _BASE],
    *[replace(v, name=v.name + "/plain-every5", merge="plain", period_steps=5) for v in _BASE],
    *[replace(v, name=v.name + "/plain-every2", merge="plain", period_steps=2) for v in _BASE],
    *[replace(v, name=v.name + "/allreduce", merge="allreduce") for v in _BASE],
    *[replace(v, name=v.name + "/allreduce1", merge="allreduce", period_steps=1) for v in _BASE],
    *[replace(v, name=v.name + "/outer", lr_factor=1.0, outer=10.0) for v in _BASE],
    *[replace(v, name=v.name + "/outer5", lr_factor=1.0, outer=5.0) for v in _BASE],
    *[replace(v, name=v.name + "/outer20", lr_factor=1.0, outer=20.0) for v in _BASE],
    *[replace(v, name=v.name + "/allreduce-outer", merge="allreduce", lr_factor=1.0, outer=10.0) for v in _BASE],
    *[
        replace(v, name=v.name + "/outer-rate5", lr_factor=1.0, outer=10.0, period_steps=v.period_steps // 5)
        for v in _BASE
    ],
    # split between the two: step x a between exchanges, progress x b at the exchange (a b = N)
    *[
        replace(v, name=v.name + f"/x{a}-outer{b}", lr_factor=float(a), outer=float(b))
        for v in _BASE
        for a, b in ((5, 2), (2, 5))
    ],
]
VARIANTS += [
    replace(v, name=f"{v.name}/{name}", fanout=k, max_incoming=2 * k, period_steps=v.period_steps // r)
    for v in _BASE
    for name, k, r in MIXING
]
VARIANTS += [
    replace(
        v,
        name=f"{v.name}/{name}",
        fanout=k,
        max_incoming=2 * k,
        period_steps=v.period_steps // r,
        changed_rows=True,
    )
    for v in _BASE
    for name, k, r in CHANGED_ROWS
]
VARIANTS += [
    replace(v, name=f"{v.name}/allreduce-rate{r}", merge="allreduce", period_steps=v.period_steps // r)
    for v in _BASE
    for r in (2, 5)
]


if __name__ == "__main__":
    sys.exit(main())
