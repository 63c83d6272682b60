"""``fedagent experiment gossip-w2v``: the gossip-learning thesis's Word2Vec experiments
(shared/seeds/003, Ch. 4-5) through real gossip agents.

Every configuration starts 10 agent processes (``mode = "gossip"``, no coordinator) on a
private Mosquitto with mutual TLS; they find each other by mDNS on loopback, agree on
one vocabulary with the coordinator-free consensus (:mod:`fedagent.protocols.
gossip_vocab`: term counts travel, never text), then train skip-gram with negative
sampling (:mod:`fedagent.tasks.word2vec`) on their own share of the Wikipedia dump
shipped with gensim and exchange models with merge-then-update push-sum gossip, at
most two incoming models per period (:mod:`fedagent.protocols.gossip`).

Configurations (the thesis's Sec. 4.2):

* data split ``topic`` (topics derived from the text: TF-IDF + k-means over the
  articles into 5 topics, each topic's articles divided between two agents, as the
  thesis had 5 topics over 10 nodes), ``random`` (balanced), ``imbalanced`` (target
  sizes evenly spaced from 1 to 4);
* exchange every ``frequent`` local batches or every ``infrequent`` ones;
* ``half``: the topic split, exchanging only the input vectors (``in_embed``, the
  thesis's M_2);
* ``local``: the topic split, a common vocabulary, no exchange at all;
* **centralized**: one model on all articles with the same total number of batches
  (agents × local steps) of the same size, the same step size and the same linear
  decay (word2vec's alpha schedule; the agents use ``lr_schedule = "linear"`` across
  their periods and within each period).

Metrics of every agent's final model: Spearman's rho on wordsim353 and simlex999, the
thesis's neighbour overlap ``w2v_sim`` (its 23 evaluation words, 8 neighbours each,
at most 184) against the centralized model, and the thesis-style ``w2v_sim`` against an
independent reference (gensim's skip-gram trained on the same articles for 20 epochs
at d = 100, standing in for the thesis's Google News vectors). The quality loss of a
configuration is ``(central - config) / central`` of the mean over its agents. A second
centralized run with another seed measures how much two equally good models differ
(the noise floor of every comparison).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from fedagent.errors import FedagentError
from fedagent.extras import require, require_installed
from fedagent.local.federation import Federation
from fedagent.local.report import pyplot
from fedagent.storage import checkpoint, history
from fedagent.tasks import text_data as td
from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import load_task
from fedagent.tasks.word2vec import PairStream, Word2VecTask, load_vectors, save_vectors, train_centralized
from fedagent_experiments import EXTRAS, NEEDS
from fedagent_experiments.gossip_w2v_results import SCALES, SIX, Config, Result, Scale, configurations

require_installed(NEEDS, EXTRAS, "the gossip-w2v experiment")


# ---- metrics ---------------------------------------------------------------------------
def score(vectors: tm.WordVectors, central: tm.WordVectors, reference: tm.WordVectors | None) -> dict[str, float]:
    out = {}
    for name, pairs in (("wordsim353", td.wordsim353()), ("simlex999", td.simlex999())):
        out[name] = tm.similarity_benchmark(pairs, vectors).rho
    out["overlap_central"] = float(tm.neighbour_overlap(vectors, central).total)
    out["w2v_sim"] = float(tm.neighbour_overlap(vectors, reference).total) if reference is not None else float("nan")
    return out


class Judge:
    """Scores a model against K centralized models (K >= 2).

    ``overlap_consensus``: the neighbour measure against the centralized seeds' consensus
    (each word's 8 nearest by cosine similarity averaged over the models), leave-one-out:
    the i-th centralized model is scored against the consensus of the other K - 1, any
    other model against each of those K consensus sets in turn (mean), so both meet
    references of the same size. ``overlap_central``: the thesis's count against each
    centralized model (mean; for a centralized model, the other ones)."""

    def __init__(self, centrals: list[tm.WordVectors], reference: tm.WordVectors | None) -> None:
        if len(centrals) < 2:
            raise FedagentError("the noise floor needs at least two centralized seeds")
        self.centrals, self.reference = centrals, reference
        self.loo = [
            tm.consensus_neighbours([c for j, c in enumerate(centrals) if j != i]) for i in range(len(centrals))
        ]

    def __call__(self, vectors: tm.WordVectors, central_index: int | None = None) -> dict[str, float]:
        out = score(vectors, self.centrals[0], self.reference)
        idx = range(len(self.centrals)) if central_index is None else [central_index]
        others = [c for j, c in enumerate(self.centrals) if j != central_index]
        out["overlap_central"] = float(np.mean([tm.neighbour_overlap(vectors, c).total for c in others]))
        out["overlap_consensus"] = float(np.mean([tm.overlap_with_neighbours(vectors, self.loo[i]) for i in idx]))
        return out


def gensim_reference(task: Word2VecTask, scale: Scale, path: Path) -> tm.WordVectors:
    if path.exists():
        return load_vectors(path)
    Word2Vec = require("gensim.models", "text", "the gensim reference model").Word2Vec
    g = Word2Vec(
        [list(a.tokens) for a in task.documents],
        vector_size=100,
        window=scale.window,
        negative=scale.negative,
        sample=1e-3,
        min_count=scale.min_count,
        sg=1,
        alpha=0.025,
        min_alpha=0.0001,
        workers=1,
        epochs=scale.gensim_epochs,
        seed=1,
    )
    vec = tm.WordVectors(list(g.wv.index_to_key), g.wv.vectors)
    save_vectors(path, vec)
    return vec


def gensim_same_settings(task: Word2VecTask, scale: Scale, epochs: float) -> dict[str, float]:
    """gensim's skip-gram at our centralized model's settings (d, window, negatives,
    subsampling, min_count, start step, linear decay, the nearest whole number of
    epochs): is our torch SGNS as good as the reference implementation?"""
    Word2Vec = require("gensim.models", "text", "the gensim reference model").Word2Vec
    t0 = time.monotonic()
    g = Word2Vec(
        [list(a.tokens) for a in task.documents],
        vector_size=scale.dim,
        window=scale.window,
        negative=scale.negative,
        sample=1e-3,
        min_count=scale.min_count,
        sg=1,
        alpha=scale.lr,
        min_alpha=scale.lr * 1e-4,
        workers=1,
        epochs=max(1, round(epochs)),
        seed=1,
    )
    vec = tm.WordVectors(list(g.wv.index_to_key), g.wv.vectors)
    out = {
        n: tm.similarity_benchmark(p, vec).rho
        for n, p in (("wordsim353", td.wordsim353()), ("simlex999", td.simlex999()))
    }
    return {**out, "epochs": float(max(1, round(epochs))), "seconds": time.monotonic() - t0}


CENTRAL_INIT = 1_000_003


def fresh_stream(task: Word2VecTask, seed: int) -> None:
    """Restart the task's pair stream at a new epoch drawn with ``seed``: every centralized
    run is then reproducible from its seed alone, whatever ran before it."""
    task.stream = PairStream(task.stream.make_epoch, seed)


def centralized(task: Word2VecTask, scale: Scale, seed: int) -> tuple[tm.WordVectors, float]:
    torch.manual_seed(seed)
    fresh_stream(task, seed)
    model = task.build_model()
    # The initial model changes with the seed too, from a range the gossip runs (whose
    # initial model is drawn with the run's seed) never use: no gossip run starts from a
    # centralized run's initial model.
    model.reset(torch.Generator().manual_seed(CENTRAL_INIT + seed))
    t0 = time.monotonic()
    train_centralized(
        task, model, steps=scale.agents * scale.local_steps, lr=scale.lr, batch_size=scale.batch_size, seed=seed
    )
    return task.word_vectors(model), time.monotonic() - t0


def learning_curve(
    task: Word2VecTask, scale: Scale, central: tm.WordVectors, reference: tm.WordVectors
) -> list[dict[str, float]]:
    """Centralized quality against the total number of batches: one run per budget (each
    with its own linear decay to 0, as a run of that length would have), so the chosen
    budget can be seen to sit where the curve has flattened."""
    rows = []
    total = scale.agents * scale.local_steps
    for fraction in scale.curve:
        steps = max(1, round(fraction * total))
        if steps == total:
            vectors = central  # the same run (seed 1, same budget) as the reference
        else:
            torch.manual_seed(1)
            fresh_stream(task, 1)
            model = task.build_model()
            train_centralized(task, model, steps=steps, lr=scale.lr, batch_size=scale.batch_size, seed=1)
            vectors = task.word_vectors(model)
        rows.append(
            {
                "fraction": fraction,
                "batches": steps,
                "epochs": steps * scale.batch_size / task.pairs_per_epoch(),
                **score(vectors, central, reference),
            }
        )
    return rows


# ---- one gossip configuration through the daemons ----------------------------------------
def agent_gossip(cfg: Config, scale: Scale) -> dict[str, Any]:
    """Every agent's ``[gossip]`` table in configuration ``cfg``."""
    periods = 1 if cfg.local else max(1, scale.local_steps // cfg.period_steps)
    eval_every = periods if cfg.local else max(1, min(scale.eval_frequent, periods // 6 or 1))
    outer = scale.outer_step if cfg.lr_factor is None and not cfg.local else 1.0
    factor = scale.gossip_lr_factor / outer if cfg.lr_factor is None else cfg.lr_factor
    lr = scale.lr if cfg.local else scale.lr * factor
    gossip = {
        "periods": periods,
        "period_steps": cfg.period_steps,
        "lr": lr,
        "lr_schedule": "linear",
        "batch_size": scale.batch_size,
        "seed": scale.seed,
        "min_peers": scale.agents - 1,
        "send_timeout": 60.0,
        "eval_every": eval_every,
        "vocab_agents": scale.agents,
        "vocab_min_count": scale.min_count,
        "vocab_timeout": 600.0,
        "merge": scale.merge if cfg.merge is None else cfg.merge,
    }
    if outer != 1.0:
        gossip["outer_step"] = outer
    if scale.period_seconds > 0 and not cfg.local:
        gossip["period_seconds"] = scale.period_seconds * cfg.period_steps / scale.frequent
    if cfg.exchange:
        gossip["exchange"] = list(cfg.exchange)
    return gossip


def run_config(
    cfg: Config, scale: Scale, work: Path, central_npz: Path, console: Console, timeout: float = 1800.0
) -> tuple[Result, list[tm.WordVectors], list[str]]:
    gossip = agent_gossip(cfg, scale)
    periods = gossip["periods"]
    options = {**scale.task_options(cfg.split), "reference": str(central_npz)}
    fed = Federation(
        work,
        agents=scale.agents,
        rounds=1,
        alpha=0.0,
        mode="gossip",
        task="word2vec",
        task_options=options,
        gossip=gossip,
    )
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        fed.prepare()
        fed.start_all()
        ids = list(fed.agent_ids)
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            fed.check_alive()
            st = {a: fed.status(a) for a in ids}
            states = [s.get("round_state", "?") if s else "starting" for s in st.values()]
            if any(x == "vocabulary failed" for x in states):
                raise FedagentError(
                    f"{cfg.name}: vocabulary consensus failed: {[s['vocabulary'] for s in st.values() if s]}"
                )
            if all(x == "finished" for x in states):
                break
            line = (
                f"{cfg.name}: "
                + ", ".join(f"{x}" for x in sorted(set(states)))
                + f"; periods {min((s or {}).get('period', 0) for s in st.values())}/{periods}"
            )
            if line != last:
                console.log(line)
                last = line
            if time.monotonic() > deadline:
                raise FedagentError(f"{cfg.name}: not finished after {timeout:.0f} s")
            time.sleep(2.0)
        seconds = time.monotonic() - t0
        done = {a: s for a, s in st.items() if s is not None}  # all of them: every agent reported "finished"
        vocabs = {s["vocabulary"]["digest"] for s in done.values()}
        if len(vocabs) != 1:
            raise FedagentError(f"{cfg.name}: agents ended on different vocabularies {vocabs}")
        terms = json.loads((work / "state" / ids[0] / "agent" / fed.fed / "vocabulary.json").read_text())["terms"]
        vectors = []
        for a in ids:
            loaded = checkpoint.load(fed.model_path(a))
            if loaded is None or not loaded[1].get("final"):
                raise FedagentError(f"{cfg.name}: {a} wrote no final model")
            vectors.append(tm.WordVectors(terms, loaded[0]["in_embed.weight"]))
        curves = {}
        for a in ids:
            path = work / "state" / a / "agent" / fed.fed / "history.jsonl"
            rows = history.read_records(path)
            curves[a] = [
                {"period": r["period"], "time": r["time"], **r["metrics"]}
                for r in rows
                if r.get("event") == "gossip_eval"
            ]
        res = Result(
            cfg.name,
            cfg.split,
            cfg.period_steps,
            0 if cfg.local else periods,
            seconds,
            seed=scale.seed,
            curves=curves,
            bytes_out=sum(int(s.get("bytes_out", 0)) for s in done.values()),
            lag={a: float(s["lag_mean"]) for a, s in done.items() if isinstance(s.get("lag_mean"), (int, float))},
        )
        return res, vectors, ids
    finally:
        fed.close()


# ---- the experiment --------------------------------------------------------------------------
def run_experiment(
    out: Path,
    scale: Scale,
    only: tuple[str, ...] = (),
    keep: bool = False,
    console: Console | None = None,
    report_only: bool = False,
) -> dict[str, Any]:
    """Run every configuration (or ``only`` these) at every seed, reusing what ``out/runs/``
    holds; with ``report_only`` run nothing new and rebuild the report from ``out/runs/``."""
    console = console or Console()
    torch.set_num_threads(1)
    out = out.resolve()  # the agents' configs name their directories absolutely
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    t_start = time.monotonic()
    console.log(f"scale: {asdict(scale)}")
    task = load_task(
        "word2vec", {k: v for k, v in scale.task_options("random").items() if k not in ("split", "shards")}
    )
    assert isinstance(task, Word2VecTask)
    console.log(
        f"corpus: {len(task.documents)} articles, {task.num_samples()} tokens in the vocabulary of "
        f"{len(task.vocab)} terms; {task.pairs_per_epoch() / 1e6:.2f} M pairs per epoch"
    )
    # The independent reference (gensim, ~0.5 min) first: the learning curve is scored on it.
    ref_path = out / "gensim_reference.npz"
    reference = gensim_reference(task, scale, ref_path)
    ref_scores = {
        n: tm.similarity_benchmark(p, reference).rho
        for n, p in (("wordsim353", td.wordsim353()), ("simlex999", td.simlex999()))
    }
    console.log(f"gensim reference ({scale.gensim_epochs} epochs, d 100): {ref_scores}")
    meta_path = out / "central.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    total_batches = scale.agents * scale.local_steps
    epochs = total_batches * scale.batch_size / task.pairs_per_epoch()
    central_key = json.loads(json.dumps(_central_key(scale)))  # tuples as lists, as read back
    paths = [out / f"central_seed{s}.npz" for s in scale.central_seeds]
    if meta.get("scale") == central_key and all(p.exists() for p in paths) and "curve" in meta:
        # A previous run at this scale (interrupted later) trained them already.
        centrals, central_s = [load_vectors(p) for p in paths], meta["seconds"]
        same, curve = meta["gensim_same"], meta["curve"]
        console.log("centralized models of a previous run at this scale reused")
    else:
        centrals, times = [], []
        for seed, path in zip(scale.central_seeds, paths):
            vec, secs = centralized(task, scale, seed=seed)
            save_vectors(path, vec)
            centrals.append(vec)
            times.append(secs)
        central_s = float(np.mean(times))
        same = gensim_same_settings(task, scale, epochs)
        console.log("centralized learning curve")
        curve = learning_curve(task, scale, centrals[0], reference)
        meta_path.write_text(
            json.dumps({"scale": central_key, "seconds": central_s, "gensim_same": same, "curve": curve})
        )
    for row in curve:
        console.log(
            f"  {row['batches']} batches ({row['epochs']:.1f} epochs): wordsim353 {row['wordsim353']:.3f}, "
            f"simlex999 {row['simlex999']:.3f}, w2v_sim {row['w2v_sim']:.0f}, "
            f"overlap with the budget's model {row['overlap_central']:.0f}"
        )
    judge = Judge(centrals, reference)
    central_scores = [judge(c, central_index=i) for i, c in enumerate(centrals)]
    console.log(f"gensim at the centralized settings: {same}")
    console.log(
        f"centralized: {total_batches} batches of {scale.batch_size} ({epochs:.1f} epochs) in "
        f"{central_s:.0f} s per seed: {central_scores}"
    )

    configs = [c for c in configurations(scale) if not only or c.name in only]
    results: dict[str, list[Result]] = {}
    split_info: dict[str, Any] = {}
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    key = json.dumps(_run_key(scale), sort_keys=True, default=list)

    def report() -> dict[str, Any]:
        return write_report(
            out,
            scale,
            task,
            ref_scores,
            central_scores,
            central_s,
            epochs,
            results,
            split_info,
            time.monotonic() - t_start,
            same,
            curve,
        )

    for seed in scale.seeds:  # every configuration at one seed before the next seed
        for cfg in configs:
            if not cfg.every_seed and seed != scale.seeds[0]:
                continue
            saved = runs / f"{cfg.name}-seed{seed}.json"
            if saved.exists() and json.loads(saved.read_text()).get("key") == key:
                res = Result(**json.loads(saved.read_text())["result"])
                console.log(f"{cfg.name} seed {seed}: reused from {saved.name}")
            elif report_only:
                continue
            else:
                console.rule(f"{cfg.name}, seed {seed}")
                run_scale = replace(scale, seed=seed)
                res, vectors, ids = run_config(cfg, run_scale, work / f"{cfg.name}-seed{seed}", paths[0], console)
                for a, v in zip(ids, vectors):
                    res.per_agent[a] = judge(v)
                saved.write_text(json.dumps({"key": key, "result": asdict(res)}, default=float))
                if not keep:
                    shutil.rmtree(work / f"{cfg.name}-seed{seed}", ignore_errors=True)
            results.setdefault(cfg.name, []).append(res)
            if cfg.split not in split_info:
                split_info[cfg.split] = describe_split(cfg.split, replace(scale, seed=scale.seeds[0]))
            console.log(
                f"{cfg.name} seed {seed}: {res.seconds:.0f} s, wordsim353 {res.mean('wordsim353'):.3f}, "
                f"overlap with the centralized consensus {res.mean('overlap_consensus'):.1f}, "
                f"w2v_sim {res.mean('w2v_sim'):.1f}"
                + (
                    f", merged models {np.mean(list(res.lag.values())):.0f} local steps behind "
                    f"(agents {min(res.lag.values()):.0f} to {max(res.lag.values()):.0f})"
                    if res.lag
                    else ""
                )
            )
            report()  # after every run: an interrupted experiment keeps what it measured
    summary = report()
    print_table(console, summary)
    return summary


def _run_key(scale: Scale) -> dict[str, Any]:
    """What a saved run in ``OUT/runs/`` depends on (``outer_step`` only when it is
    not 1 and ``period_seconds`` only when it is set, so that runs saved before they
    existed are still reused)."""
    key = asdict(scale) | {"seed": None}
    if key["outer_step"] == 1.0:
        del key["outer_step"]
    if not key["period_seconds"]:
        del key["period_seconds"]
    return key


def _central_key(scale: Scale) -> dict[str, Any]:
    """What the centralized models depend on (not the gossip settings, not the run seeds)."""
    skip = (
        "gossip_lr_factor",
        "merge",
        "outer_step",
        "period_seconds",
        "frequent",
        "infrequent",
        "eval_frequent",
        "seed",
        "seeds",
    )
    return {k: v for k, v in asdict(scale).items() if k not in skip}


def describe_split(split: str, scale: Scale) -> dict[str, Any]:
    articles = td.wiki_articles()
    s = td.split_articles(
        [a.tokens for a in articles],
        scale.agents,
        split,
        seed=scale.seed,
        topics=scale.topics if split == "topic" else None,
    )
    sizes = s.sizes([len(a.tokens) for a in articles])
    info: dict[str, Any] = {"tokens": sizes, "ratio": max(sizes) / max(1, min(sizes))}
    if s.topic_terms:
        info["topics"] = [list(t[:4]) for t in s.topic_terms]
        info["topic_of_agent"] = list(s.topic_of_shard or ())
        info["titles"] = [[articles[i].title for i in sh][:4] for sh in s.shards]
    return info


def loss_pct(central: float, value: float) -> float:
    return 100.0 * (central - value) / central if central else float("nan")


METRICS = ("wordsim353", "simlex999", "overlap_consensus", "overlap_central", "w2v_sim")


def _std(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")


def write_report(
    out: Path,
    scale: Scale,
    task: Word2VecTask,
    ref_scores: dict[str, float],
    central: list[dict[str, float]],
    central_s: float,
    epochs: float,
    results: dict[str, list[Result]],
    split_info: dict[str, Any],
    elapsed: float,
    gensim_same: dict[str, float] | None = None,
    curve: list[dict[str, float]] | None = None,
) -> dict[str, Any]:
    cmean = {k: float(np.mean([c[k] for c in central])) for k in METRICS}
    cstd = {k: _std([c[k] for c in central]) for k in METRICS}
    # The noise floor: how far one centralized seed lies from the mean of the seeds.
    cfloor = {k: float(np.mean([abs(loss_pct(cmean[k], c[k])) for c in central])) for k in METRICS}
    rows = []
    for name, runs in results.items():
        seed_means = {k: [r.mean(k) for r in runs] for k in METRICS}
        row: dict[str, Any] = {
            "config": name,
            "seeds": [r.seed for r in runs],
            "exchanges": runs[0].exchanges,
            "period_steps": runs[0].period_steps,
            "seconds": float(np.mean([r.seconds for r in runs])),
            "MB_sent": float(np.mean([r.bytes_out for r in runs])) / 1e6,
        }
        for k in METRICS:
            row[k] = float(np.mean(seed_means[k]))
            row[k + "_std"] = _std(seed_means[k])
            row[k + "_agents"] = (min(r.spread(k)[0] for r in runs), max(r.spread(k)[1] for r in runs))
            row[f"loss_{k}_pct"] = loss_pct(cmean[k], row[k])
            row[f"loss_{k}_per_seed"] = [loss_pct(cmean[k], v) for v in seed_means[k]]
        rows.append(row)
    six = [r for r in rows if r["config"] in SIX]
    average: dict[str, Any] = {"configs": len(six)}
    for k in METRICS:
        average[k] = float(np.mean([r[f"loss_{k}_pct"] for r in six])) if six else float("nan")
        # the six-configuration average per seed (seeds every one of them ran)
        common = set.intersection(*(set(r["seeds"]) for r in six)) if six else set()
        per_seed = [
            float(np.mean([r[f"loss_{k}_per_seed"][r["seeds"].index(sd)] for r in six])) for sd in sorted(common)
        ]
        average[k + "_per_seed"] = per_seed
        average[k + "_std"] = _std(per_seed)
    summary = {
        "scale": asdict(scale),
        "gensim": ref_scores,
        "central": central,
        "central_mean": cmean,
        "central_std": cstd,
        "noise_floor_pct": cfloor,
        "central_seconds": central_s,
        "epochs": epochs,
        "rows": rows,
        "average_six": average,
        "splits": split_info,
        "elapsed_s": elapsed,
        # the runs' own wall time, also right in a report rebuilt with --report-only
        "runs_s": float(sum(r.seconds for rs in results.values() for r in rs)),
        "vocabulary": len(task.vocab),
        "gensim_same": gensim_same or {},
        "curve": curve or [],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=float))
    plots(out, results, rows, cmean, cstd)
    curve_plot(out, curve or [], summary)
    study, status = out / "study.md", out / "status.md"
    (out / "report.md").write_text(
        markdown(summary, study.read_text() if study.exists() else "", status.read_text() if status.exists() else "")
    )
    return summary


def plots(
    out: Path,
    results: dict[str, list[Result]],
    rows: list[dict[str, Any]],
    cmean: dict[str, float],
    cstd: dict[str, float],
) -> None:
    plt = pyplot()
    if not results:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in results.items():
        r = runs[0]  # the first seed's curves
        if r.exchanges == 0:
            continue
        by_period: dict[float, list[dict[str, float]]] = {}
        t0 = min(p["time"] for c in r.curves.values() for p in c) if any(r.curves.values()) else 0
        for c in r.curves.values():
            for p in c:
                by_period.setdefault(p["period"], []).append(p)
        xs = sorted(by_period)
        if not xs:
            continue
        frac = [x / max(xs) for x in xs]
        axes[0].plot(frac, [np.mean([p.get("w2v_sim", np.nan) for p in by_period[x]]) for x in xs], label=name)
        axes[1].plot(
            [np.mean([p["time"] for p in by_period[x]]) - t0 for x in xs],
            [np.mean([p.get("wordsim353_rho", np.nan) for p in by_period[x]]) for x in xs],
            label=name,
        )
    axes[0].axhline(184, ls=":", c="grey")
    axes[0].set(
        xlabel="fraction of exchanges done",
        ylabel="neighbour overlap with centralized seed 1 (max 184)",
        title="overlap, mean over agents (first seed)",
    )
    axes[1].axhline(cmean["wordsim353"], ls="--", c="k", label="centralized (mean of seeds)")
    axes[1].set(
        xlabel="seconds since the first evaluation",
        ylabel="wordsim353 Spearman",
        title="wordsim353, mean over agents (first seed)",
    )
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "quality_over_exchanges.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [r["config"] for r in rows]
    for ax, key, title in (
        (axes[0], "wordsim353", "wordsim353 Spearman"),
        (axes[1], "overlap_consensus", "overlap with the centralized consensus (max 184)"),
        (axes[2], "w2v_sim", "w2v_sim vs gensim reference (max 184)"),
    ):
        means = [r[key] for r in rows]
        err = [0.0 if np.isnan(r[key + "_std"]) else r[key + "_std"] for r in rows]
        ax.bar(range(len(names)), means, yerr=err, capsize=3, color="tab:blue", alpha=0.8)
        ax.axhline(cmean[key], ls="--", c="k", label="centralized, mean of seeds")
        if not np.isnan(cstd[key]):
            ax.axhspan(cmean[key] - cstd[key], cmean[key] + cstd[key], color="grey", alpha=0.2, label="± 1 sd")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title + "\n(mean over seeds, bar: sd over seeds)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "per_config.png", dpi=100)
    plt.close(fig)


def curve_plot(out: Path, curve: list[dict[str, float]], summary: dict[str, Any]) -> None:
    plt = pyplot()
    if not curve:
        return
    budget = summary["scale"]["agents"] * summary["scale"]["local_steps"]
    xs = [r["batches"] for r in curve]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("wordsim353", "simlex999"):
        axes[0].plot(xs, [r[key] for r in curve], "o-", label=key)
    axes[0].set(
        xlabel="total batches (each run decays its step to 0 at its own end)",
        ylabel="Spearman",
        title="centralized: word similarity",
    )
    axes[1].plot(xs, [r["w2v_sim"] for r in curve], "o-", label="w2v_sim vs gensim reference")
    axes[1].plot(xs, [r["overlap_central"] for r in curve], "s--", label="overlap with the budget's model")
    axes[1].set(xlabel="total batches", ylabel="shared neighbours (max 184)", title="centralized: neighbour overlap")
    for ax in axes:
        ax.axvline(budget, ls=":", c="k", label="budget of every run")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # minor labels overlap
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=100)
    plt.close(fig)


def _gossip_step(sc: dict[str, Any]) -> str:
    b = float(sc.get("outer_step", 1.0))
    paced = float(sc.get("period_seconds", 0.0))
    pace = (
        f"; every period lasts at least {paced:g} s per {sc['frequent']} batches (`period_seconds`)"
        if paced > 0
        else ""
    )
    if b == 1.0:
        return f"{sc['lr']} x {sc['gossip_lr_factor']:g}{pace}"
    return (
        f"{sc['lr']} x {sc['gossip_lr_factor'] / b:g} between exchanges, then the period's start + {b:g} x the "
        f"progress (`outer_step = {b:g}`; thesis-literal without){pace}"
    )


def markdown(s: dict[str, Any], study: str = "", status: str = "") -> str:
    """The report; ``status`` (the directory's ``status.md``: what ran, what did not) goes
    under the title, ``study`` (its ``study.md``) after the results."""
    sc, g, cm, cs, fl = s["scale"], s["gensim"], s["central_mean"], s["central_std"], s["noise_floor_pct"]
    av = s["average_six"]
    seeds = ", ".join(str(x) for x in sc["seeds"])
    lines = [
        "# Gossip Word2Vec (the gossip-learning thesis, Ch. 4-5) through real agents",
        "",
        *([status.strip(), ""] if status.strip() else []),
        "Produced by `fedagent experiment gossip-w2v`; see `fedagent_experiments.gossip_w2v` for the method.",
        "",
        "## Scale",
        "",
        f"{sc['agents']} agent processes per configuration (torch 1 thread each), one private Mosquitto with "
        f"mutual TLS, mDNS on loopback, no coordinator. Corpus: the {s.get('vocabulary')}-term common vocabulary "
        f"(merged count >= {sc['min_count']}, agreed over the network by every run's agents) of the 105 articles "
        f"of gensim's Wikipedia dump. Skip-gram with negative sampling, d = {sc['dim']}, window {sc['window']}, "
        f"{sc['negative']} negatives, batches of {sc['batch_size']} pairs, {sc['local_steps']} local batches per "
        f"agent ({sc['agents'] * sc['local_steps']} in all = {s['epochs']:.1f} epochs of the whole corpus, the "
        f"budget of every centralized run too; the thesis: 5,000,000 batches of 2048, d 200), step {sc['lr']} per "
        f"pair decaying linearly to 0 (gossip agents: {_gossip_step(sc)}; local-only agents "
        f"{sc['lr']}). Merge: `{sc.get('merge', 'pushsum')}` (thesis-literal: `thesis`). Frequent exchange every {sc['frequent']} local batches "
        f"({sc['local_steps'] // sc['frequent']} exchanges), infrequent every {sc['infrequent']} "
        f"({sc['local_steps'] // sc['infrequent']} exchanges). Seeds of every gossip configuration: {seeds} "
        f"(the seed changes the split, the initial model and the data order); centralized seeds: "
        f"{', '.join(str(x) for x in sc['central_seeds'])}. Wall time of the gossip runs: "
        f"{s.get('runs_s', s['elapsed_s']) / 60:.1f} min in all (their sum; the centralized runs and the "
        "scoring come on top), on 2 shared cores.",
        "",
        "## References and the noise floor",
        "",
        "| model | wordsim353 | simlex999 | overlap with the other seeds' consensus (max 184) "
        "| overlap with each other seed | w2v_sim vs gensim ref |",
        "|---|---|---|---|---|---|",
    ]
    for seed, c in zip(sc["central_seeds"], s["central"]):
        lines.append(
            f"| centralized, seed {seed} | {c['wordsim353']:.3f} | {c['simlex999']:.3f} | "
            f"{c['overlap_consensus']:.0f} | {c['overlap_central']:.1f} | {c['w2v_sim']:.0f} |"
        )
    lines += [
        f"| **centralized, mean ± sd (the reference)** | {cm['wordsim353']:.3f} ± {cs['wordsim353']:.3f} "
        f"| {cm['simlex999']:.3f} ± {cs['simlex999']:.3f} | {cm['overlap_consensus']:.1f} ± "
        f"{cs['overlap_consensus']:.1f} | {cm['overlap_central']:.1f} ± {cs['overlap_central']:.1f} "
        f"| {cm['w2v_sim']:.1f} ± {cs['w2v_sim']:.1f} |",
        f"| gensim skip-gram, {sc['gensim_epochs']} epochs, d 100 (the independent reference for w2v_sim) "
        f"| {g['wordsim353']:.3f} | {g['simlex999']:.3f} | | | 184 (itself) |",
    ]
    gs = s.get("gensim_same") or {}
    if gs:
        lines.append(
            f"| gensim skip-gram at the centralized settings (d {sc['dim']}, {gs['epochs']:.0f} epochs, "
            f"start step {sc['lr']}, linear decay) | {gs['wordsim353']:.3f} | {gs['simlex999']:.3f} | | | |"
        )
    lines += [
        "",
        f"**Noise floor** (mean distance of one centralized seed from the mean of the seeds, in % of the mean): "
        f"wordsim353 {fl['wordsim353']:.1f} %, simlex999 {fl['simlex999']:.1f} %, overlap with the consensus "
        f"{fl['overlap_consensus']:.1f} %, w2v_sim vs gensim {fl['w2v_sim']:.1f} %. "
        f"Two equally good centralized models share only {cm['overlap_central']:.0f} of 184 neighbours: "
        f"the neighbour measure against *one* centralized model (the thesis's) is mostly noise on this corpus. "
        f"The overlap loss below is therefore taken against the centralized seeds' consensus (each word's 8 "
        f"nearest by cosine similarity averaged over the other seeds, leave-one-out, so a centralized seed and "
        f"a gossip model meet references of the same size): a gossip model that agrees with the consensus as "
        f"well as a centralized seed does has 0 % loss.",
        "",
        "## Centralized learning curve (first seed; one run per budget, each decaying to 0 at its end)",
        "",
        "| total batches | epochs | wordsim353 | simlex999 | w2v_sim vs gensim ref | overlap with the budget's model |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['batches']} | {r['epochs']:.1f} | {r['wordsim353']:.3f} | {r['simlex999']:.3f} | {r['w2v_sim']:.0f} "
            f"| {r['overlap_central']:.0f} |"
            for r in s.get("curve", [])
        ],
        "",
        "![learning curve](learning_curve.png)",
        "",
        "## Results (mean over seeds of the mean over the agents' final models; ± sd over seeds)",
        "",
        "Loss in % of the centralized mean (negative = better than centralized).",
        "",
        "| configuration | seeds | exchanges | wordsim353 | loss % | simlex999 | loss % | overlap with "
        "consensus | loss % | overlap with each centralized seed | w2v_sim vs gensim | loss % | MB sent | s per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pm(r: dict[str, Any], k: str, f: str) -> str:
        return f"{r[k]:{f}}" + ("" if np.isnan(r[k + "_std"]) else f" ± {r[k + '_std']:{f}}")

    for r in s["rows"]:
        lines.append(
            f"| {r['config']} | {len(r['seeds'])} | {r['exchanges']} | {pm(r, 'wordsim353', '.3f')} | "
            f"{r['loss_wordsim353_pct']:.1f} | {pm(r, 'simlex999', '.3f')} | {r['loss_simlex999_pct']:.1f} | "
            f"{pm(r, 'overlap_consensus', '.1f')} | {r['loss_overlap_consensus_pct']:.1f} | "
            f"{pm(r, 'overlap_central', '.1f')} | {pm(r, 'w2v_sim', '.1f')} | {r['loss_w2v_sim_pct']:.1f} | "
            f"{r['MB_sent']:.0f} | {r['seconds']:.0f} |"
        )
    if av["configs"]:

        def avg(k: str) -> str:
            sd = av[k + "_std"]
            return f"{av[k]:.1f} %" + ("" if np.isnan(sd) else f" (sd over seeds {sd:.1f})")

        lines += [
            "",
            f"**Average quality loss over the {av['configs']} full-exchange configurations** (the thesis averaged "
            f"its comparable ones: 6.904 %): wordsim353 {avg('wordsim353')}, neighbour overlap with the "
            f"centralized consensus {avg('overlap_consensus')}, simlex999 {avg('simlex999')}, w2v_sim vs the "
            f"gensim reference {avg('w2v_sim')}, overlap with each centralized seed {avg('overlap_central')}.",
        ]
    lines += [
        "",
        "`w2v_sim` is the thesis's eq. 3.5 (shared nearest neighbours of its 23 evaluation words, 8 each), "
        "against gensim's model as the thesis used Google News vectors.",
        "",
    ]
    if study:
        lines += [study.strip(), ""]
    lines += ["## Splits (first seed)", ""]
    for name, info in s["splits"].items():
        lines.append(f"* `{name}`: tokens per agent {info['tokens']} (largest/smallest {info['ratio']:.2f})")
        if "topics" in info:
            lines.append(
                "  topics (k-means on TF-IDF of the articles; top terms): "
                + "; ".join(f"{i}: {', '.join(t)}" for i, t in enumerate(info["topics"]))
                + f"; topic of each agent {info['topic_of_agent']}"
            )
    lines += [
        "",
        "## Plots",
        "",
        "![quality over exchanges](quality_over_exchanges.png)",
        "",
        "![per configuration](per_config.png)",
        "",
    ]
    return "\n".join(lines)


def print_table(console: Console, s: dict[str, Any]) -> None:
    t = Table(title="gossip Word2Vec: quality loss against the centralized mean")
    for col in ("configuration", "seeds", "wordsim353", "loss %", "overlap/consensus", "loss %", "w2v_sim", "loss %"):
        t.add_column(col)
    for r in s["rows"]:
        t.add_row(
            r["config"],
            str(len(r["seeds"])),
            f"{r['wordsim353']:.3f}",
            f"{r['loss_wordsim353_pct']:.1f}",
            f"{r['overlap_consensus']:.1f}",
            f"{r['loss_overlap_consensus_pct']:.1f}",
            f"{r['w2v_sim']:.0f}",
            f"{r['loss_w2v_sim_pct']:.1f}",
        )
    console.print(t)


__all__ = ["SCALES", "SIX", "Config", "Judge", "Scale", "configurations", "replace", "run_experiment"]
