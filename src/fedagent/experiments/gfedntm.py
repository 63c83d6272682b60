"""``fedagent experiment gfedntm``: gFedNTM's Fig. 2 (shared/seeds/000, Sec. 4.1) and a run
on real text.

Synthetic corpus (``--corpus synthetic``)
-----------------------------------------
For every setting the generator (:mod:`fedagent.tasks.ntm_data`) builds N nodes whose
documents mix K' shared and (K - K')/N private true topics. Three ProdLDA models are
trained and scored against the truth:

* **non-collaborative**: every node alone on its own documents and its own vocabulary
  (its topic-word matrix is widened to the full vocabulary with zeros for the terms it
  never saw, then renormalised); scores are the mean over the nodes;
* **centralized**: one model on the pooled documents of all nodes (the paper's
  Scenario 2), shuffled across nodes, the same batch size;
* **federated**: Sync-Opt (Algorithm 1): each step every node's mini-batch gradient,
  their sample-weighted mean, one Adam step. By default this runs in this process
  (:func:`fedagent.tasks.ntm.federated_step`), which is exactly what the coordinator and
  agents compute over the network (the exactness test checks that); pass another
  :data:`FederatedTrainer` to :func:`run_synthetic` to train through real daemons.

Each node trains for the same number of passes over its own documents in all three
(``epochs``). Scores (:mod:`fedagent.tasks.ntm_scores`) on the validation documents of
all nodes together: the doc-similarity score (per-document scale: the sum over all
ordered pairs divided by the number of documents, as the authors' evaluation code
reports it; smaller is better) and TSS (at most K; larger is better), plus TSS of
random topics drawn from the same Dirichlet(eta) as a floor.

Setting A varies K' in {5, 10, 15, 40} at eta = 0.01; setting B fixes K' = 10 and varies
eta in {0.01, 0.02, 0.03, 0.04, 0.08, 1}.

Real text (``--corpus newsgroups``)
-----------------------------------
gensim's 20-newsgroups sample, one newsgroup per agent; vocabulary consensus (the union
of the agents' vocabularies), a federated model and one local model per agent; the
report lists the top words of the federated topics next to each agent's local topics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from fedagent.tasks import ntm_data
from fedagent.tasks.base import load_task
from fedagent.tasks.ntm import NodeCorpus, NtmTask, ProdLDA, federated_step
from fedagent.tasks.ntm_scores import doc_similarity_score, topic_similarity_score

K_PRIME = (5, 10, 15, 40)
ETAS = (0.01, 0.02, 0.03, 0.04, 0.08, 1.0)

# A trainer of the federated model: given the agents' tasks (already on the common
# vocabulary) and the number of Sync-Opt steps, return the trained model. The default
# runs Sync-Opt in this process; a run through the real coordinator and agents plugs in
# here and returns a model holding the coordinator's final weights.
FederatedTrainer = Callable[[Sequence[NtmTask], int], nn.Module]


@dataclass(frozen=True)
class Scale:
    nodes: int = 5
    vocab_size: int = 500
    true_topics: int = 50
    n_topics: int = 50
    docs: int = 1000             # training documents per node
    val_docs: int = 200          # validation documents per node
    epochs: int = 20             # passes of every node over its own documents
    batch_size: int = 64
    seed: int = 0

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"corpus": "synthetic", "shards": self.nodes, "vocab_size": self.vocab_size,
                "true_topics": self.true_topics, "n_topics": self.n_topics, "docs": self.docs,
                "val_docs": self.val_docs, "batch_size": self.batch_size, "seed": self.seed,
                "data_seed": self.seed, **extra}


SCALES = {
    "default": Scale(),
    "paper": Scale(vocab_size=5000, docs=10000, val_docs=1000, epochs=100),
    "tiny": Scale(vocab_size=120, true_topics=10, n_topics=10, docs=64, val_docs=16, epochs=2, batch_size=16),
}


@dataclass
class SettingResult:
    group: str                   # "A" (K' varies) or "B" (eta varies)
    shared: int
    eta: float
    tss: dict[str, float] = field(default_factory=dict)
    doc_sim: dict[str, float] = field(default_factory=dict)
    tss_nodes: list[float] = field(default_factory=list)
    seconds: float = 0.0


# ---- training ------------------------------------------------------------------------
def train_local(task: NtmTask, epochs: int) -> ProdLDA:
    model = task.build_model()
    task.fit(model, epochs=epochs)
    return model


def in_process_syncopt(tasks: Sequence[NtmTask], steps: int) -> nn.Module:
    """The default :data:`FederatedTrainer`: Algorithm 1 with the nodes in this process."""
    model = tasks[0].build_model()
    opt = tasks[0].make_optimizer(model.parameters())
    for step in range(steps):
        federated_step(model, opt, tasks, step)
    return model


def common_vocabulary(tasks: Sequence[NtmTask]) -> list[str]:
    """Stand-in for the coordinator's vocabulary consensus: the union of the nodes' terms,
    most frequent first (ties by name)."""
    totals: dict[str, int] = {}
    for t in tasks:
        for term, c in t.term_counts().items():
            totals[term] = totals.get(term, 0) + c
    return sorted(totals, key=lambda term: (-totals[term], term))


def pooled_task(tasks: Sequence[NtmTask], terms: list[str]) -> NtmTask:
    """One task holding every node's documents (the centralized scenario)."""
    for t in tasks:
        t.set_vocabulary(terms)
    first = tasks[0]
    ctx = None
    if first.combined:
        ctx = (np.concatenate([t.corpus.train_context for t in tasks]),
               np.concatenate([t.corpus.val_context for t in tasks]))
    corpus = NodeCorpus(list(terms), sp.vstack([t.train for t in tasks]).tocsr(),
                        sp.vstack([t.val for t in tasks]).tocsr(),
                        None if ctx is None else ctx[0], None if ctx is None else ctx[1])
    return NtmTask(corpus, combined=first.combined, shard=len(tasks), seed=first.seed, n_topics=first.n_topics,
                   batch_size=first.batch_size, hidden=first.hidden, dropout=first.dropout, lr=first.lr,
                   prior_alpha=first.prior_alpha)


def widen(topic_word: np.ndarray, terms: list[str], all_terms: list[str]) -> np.ndarray:
    """A topic-word matrix over ``terms`` laid out over ``all_terms`` (zeros for the terms
    the model never had), rows renormalised."""
    index = {t: j for j, t in enumerate(all_terms)}
    out = np.zeros((topic_word.shape[0], len(all_terms)))
    out[:, [index[t] for t in terms]] = topic_word
    return out / out.sum(1, keepdims=True)


def theta_on(task: NtmTask, model: nn.Module, bow: sp.csr_matrix, terms: list[str]) -> np.ndarray:
    """Proportions that ``model`` (trained on ``task.terms``) infers for documents given as
    counts over ``terms``."""
    index = {t: j for j, t in enumerate(task.terms)}
    src = [i for i, t in enumerate(terms) if t in index]
    remap = sp.csr_matrix((np.ones(len(src), dtype=np.float32), (src, [index[terms[i]] for i in src])),
                          shape=(len(terms), len(task.terms)))
    corpus = NodeCorpus(list(task.terms), task.train[: task.batch_size], (bow @ remap).tocsr())
    probe = NtmTask(corpus, shard=task.shard, seed=task.seed, n_topics=task.n_topics, batch_size=task.batch_size)
    return probe.infer_theta(model, "val")


# ---- one synthetic setting -------------------------------------------------------------
def run_setting(scale: Scale, shared: int, eta: float, group: str,
                trainer: FederatedTrainer = in_process_syncopt, progress=None) -> SettingResult:
    t0 = time.monotonic()
    res = SettingResult(group=group, shared=shared, eta=eta)
    opts = scale.options(shared_topics=shared, eta=eta)
    all_terms = ntm_data.synthetic_terms(scale.vocab_size)
    beta = ntm_data.true_topics(scale.vocab_size, scale.true_topics, eta, scale.seed)
    gen = ntm_data.synthetic_options(opts)
    nodes = [ntm_data.synthetic_node(n, scale.nodes, **gen) for n in range(scale.nodes)]
    val_bow = sp.vstack([n.val for n in nodes]).tocsr()
    val_theta = np.concatenate([n.val_theta for n in nodes])

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    # non-collaborative: each node on its own vocabulary
    tss_nodes, ds_nodes = [], []
    for n in range(scale.nodes):
        say(f"K'={shared} eta={eta}: node {n} alone")
        task = load_task("prodlda", {**opts, "shard": n})
        local_terms = sorted(task.term_counts(), key=lambda t: int(t[4:]))
        task.set_vocabulary(local_terms)
        model = train_local(task, scale.epochs)
        tw = widen(task.topic_word(model), task.terms, all_terms)
        tss_nodes.append(topic_similarity_score(beta, tw))
        ds_nodes.append(doc_similarity_score(theta_on(task, model, val_bow, all_terms), val_theta, per_document=True))
    res.tss_nodes = tss_nodes
    res.tss["non-collaborative"] = float(np.mean(tss_nodes))
    res.doc_sim["non-collaborative"] = float(np.mean(ds_nodes))

    # federated: Sync-Opt over the nodes on the common vocabulary
    say(f"K'={shared} eta={eta}: federated")
    tasks = [load_task("prodlda", {**opts, "shard": n}) for n in range(scale.nodes)]
    for t in tasks:
        t.set_vocabulary(all_terms)
    steps = scale.epochs * min(t.num_batches() for t in tasks)
    model = trainer(tasks, steps)
    res.tss["federated"] = topic_similarity_score(beta, widen(tasks[0].topic_word(model), tasks[0].terms, all_terms))
    res.doc_sim["federated"] = doc_similarity_score(theta_on(tasks[0], model, val_bow, all_terms), val_theta,
                                                    per_document=True)

    # centralized: the pooled corpus, ordinary mini-batches
    say(f"K'={shared} eta={eta}: centralized")
    pooled = pooled_task(tasks, all_terms)
    model = train_local(pooled, scale.epochs)
    res.tss["centralized"] = topic_similarity_score(beta, pooled.topic_word(model))
    res.doc_sim["centralized"] = doc_similarity_score(theta_on(pooled, model, val_bow, all_terms), val_theta,
                                                      per_document=True)

    rng = np.random.default_rng(scale.seed + 1)
    res.tss["random topics"] = topic_similarity_score(
        beta, rng.dirichlet(np.full(scale.vocab_size, eta), size=scale.n_topics))
    res.seconds = time.monotonic() - t0
    return res


def run_synthetic(out: Path, scale: Scale, k_primes: Sequence[int] = K_PRIME, etas: Sequence[float] = ETAS,
                  trainer: FederatedTrainer = in_process_syncopt, console=None) -> Path:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    torch.set_num_threads(1)
    plan = [("A", k, 0.01) for k in k_primes] + [("B", 10, e) for e in etas]
    console.print(f"[bold]gFedNTM Fig. 2[/]: {len(plan)} settings, scale {asdict(scale)}")
    results: list[SettingResult] = []
    t0 = time.monotonic()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bar:
        job = bar.add_task("settings", total=len(plan))
        for group, k, eta in plan:
            cached = next((r for r in results if r.shared == k and r.eta == eta), None)
            if cached is not None:      # K'=10, eta=0.01 is in both A and B
                results.append(replace(cached, group=group))
            else:
                results.append(run_setting(scale, k, eta, group, trainer,
                                           progress=lambda m: bar.update(job, description=m)))
            bar.advance(job)
            out.mkdir(parents=True, exist_ok=True)      # partial results survive a crash
            (out / "partial.json").write_text(json.dumps([asdict(r) for r in results]))
    report = write_synthetic_report(out, scale, results, time.monotonic() - t0)
    (out / "partial.json").unlink(missing_ok=True)
    console.print(report.read_text().split("\n## Plots")[0])
    console.print(f"report: [green]{report}[/]")
    return report


# ---- report ----------------------------------------------------------------------------
MODELS = ("centralized", "federated", "non-collaborative")


def _table(results: list[SettingResult], group: str) -> list[str]:
    key = "K'" if group == "A" else "eta"
    lines = [f"| {key} | TSS centralized | TSS federated | TSS non-collab. | TSS random | "
             f"doc-sim centralized | doc-sim federated | doc-sim non-collab. | fed. TSS >= non-collab. |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.group != group:
            continue
        x = r.shared if group == "A" else r.eta
        ok = "yes" if r.tss["federated"] >= r.tss["non-collaborative"] else "**no**"
        lines.append(f"| {x} | {r.tss['centralized']:.2f} | {r.tss['federated']:.2f} | "
                     f"{r.tss['non-collaborative']:.2f} | {r.tss['random topics']:.2f} | "
                     f"{r.doc_sim['centralized']:.1f} | {r.doc_sim['federated']:.1f} | "
                     f"{r.doc_sim['non-collaborative']:.1f} | {ok} |")
    return lines


def _plots(out: Path, results: list[SettingResult]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    styles = {"centralized": "o-", "federated": "x--", "non-collaborative": "s-", "random topics": ":"}
    for row, group in enumerate(("A", "B")):
        rs = [r for r in results if r.group == group]
        if not rs:
            continue
        xs = [r.shared if group == "A" else r.eta for r in rs]
        for col, metric in enumerate(("doc_sim", "tss")):
            ax = axes[row][col]
            names = list(MODELS) + (["random topics"] if metric == "tss" else [])
            for name in names:
                ax.plot(xs, [getattr(r, metric)[name] for r in rs], styles[name], label=name)
            if group == "B":
                ax.set_xscale("log")
            ax.set_xlabel("shared topics K'" if group == "A" else "topic prior eta")
            ax.set_ylabel("doc-similarity score (lower is better)" if metric == "doc_sim"
                          else "topic similarity score (higher is better)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("gFedNTM Fig. 2: centralized, federated (Sync-Opt) and non-collaborative ProdLDA")
    fig.tight_layout()
    fig.savefig(out / "fig2.png", dpi=110)
    plt.close(fig)
    return ["![Fig. 2](fig2.png)"]


def _notes(results: list[SettingResult]) -> list[str]:
    """Observations the numbers force, stated with the report so no one over-reads it."""
    notes = []
    unique = {(r.shared, r.eta): r for r in results}      # K'=10, eta=0.01 is in A and in B
    results = list(unique.values())
    below = [r for r in results if max(r.tss[m] for m in MODELS) < r.tss["random topics"]]
    if below:
        where = ", ".join(f"K'={r.shared}/eta={r.eta}" for r in below)
        notes.append(f"- In {len(below)} of {len(results)} settings ({where}) every trained model's TSS is below "
                     "that of random Dirichlet(eta) topics: ProdLDA's topic-word rows softmax(beta) are still "
                     "dispersed at this number of steps, so TSS differences there are small and say little.")
    fed_docs = [r for r in results if r.doc_sim["federated"] <= r.doc_sim["non-collaborative"]]
    notes.append(f"- Doc-similarity: federated <= non-collaborative in {len(fed_docs)} of {len(results)} settings; "
                 "centralized (pooled corpus: one optimizer step per batch of documents, N times as many steps as "
                 "Sync-Opt, whose step takes one batch from each of the N nodes) is lowest in "
                 f"{sum(r.doc_sim['centralized'] <= min(r.doc_sim['federated'], r.doc_sim['non-collaborative']) for r in results)}.")
    return ["", *notes] if notes else []


def report_from_json(out: Path) -> Path:
    """Rewrite ``report.md`` and the plot from a run's ``results.json``."""
    data = json.loads((out / "results.json").read_text())
    results = [SettingResult(**r) for r in data["results"]]
    return write_synthetic_report(out, Scale(**data["scale"]), results, data["seconds"])


def write_synthetic_report(out: Path, scale: Scale, results: list[SettingResult], seconds: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    a = [r for r in results if r.group == "A"]
    held = all(r.tss["federated"] >= r.tss["non-collaborative"] for r in a)
    lines = [
        "# gFedNTM: collaborative vs non-collaborative topic models (Fig. 2)", "",
        f"Scale: N = {scale.nodes} nodes, V = {scale.vocab_size} terms, K = {scale.true_topics} true topics, "
        f"{scale.n_topics} learnt topics, {scale.docs} training + {scale.val_docs} validation documents per node "
        f"(lengths uniform in [150, 250], alpha = 50/K), {scale.epochs} passes of every node over its documents, "
        f"batch {scale.batch_size}, ProdLDA defaults (2 x 100 softplus, dropout 0.2, Adam 2e-3, beta1 0.99). "
        f"Wall time {seconds / 60:.1f} min.", "",
        "TSS: sum over the true topics of the similarity (1 - squared Hellinger) to the closest learnt topic, "
        f"at most {scale.true_topics}, higher is better. Doc-sim: sum over all pairs of validation documents "
        f"(all {scale.nodes} nodes) of |similarity(model) - similarity(truth)|, divided by the number of "
        "documents, lower is better. Non-collaborative: mean over the nodes' own models. Federated: Sync-Opt "
        "in process (per-node gradients, sample-weighted mean, one Adam step).", "",
        f"Done-criterion (federated TSS >= non-collaborative TSS for every K'): **{'met' if held else 'NOT met'}**.",
        *_notes(results), "", "## A: shared topics K' (eta = 0.01)", "", *_table(results, "A"), "",
        "## B: topic prior eta (K' = 10)", "", *_table(results, "B"), "",
        "Per-node TSS of the non-collaborative models:", "",
    ]
    for r in results:
        if r.group == "A" or r.eta != 0.01:
            lines.append(f"- K' = {r.shared}, eta = {r.eta}: " + ", ".join(f"{x:.2f}" for x in r.tss_nodes)
                         + f" ({r.seconds:.0f} s)")
    lines += ["", "## Plots", "", *_plots(out, results), ""]
    (out / "results.json").write_text(json.dumps({"scale": asdict(scale), "seconds": seconds,
                                                  "results": [asdict(r) for r in results]}, indent=1))
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


# ---- newsgroups ------------------------------------------------------------------------
@dataclass(frozen=True)
class NewsScale:
    model: str = "combinedtm"
    n_topics: int = 10
    epochs: int = 60
    batch_size: int = 16
    seed: int = 0
    n_words: int = 8


def run_newsgroups(out: Path, scale: NewsScale, trainer: FederatedTrainer = in_process_syncopt,
                   console=None) -> Path:
    from rich.console import Console

    console = console or Console()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    groups = sorted({g for g, _ in ntm_data.load_newsgroups()})
    shards = len(groups)
    opts = {"corpus": "newsgroups", "shards": shards, "n_topics": scale.n_topics, "batch_size": scale.batch_size,
            "seed": scale.seed}
    console.print(f"[bold]gFedNTM on 20-newsgroups[/]: {shards} agents ({', '.join(groups)}), {scale.model}")
    local_topics: list[list[list[str]]] = []
    for s in range(shards):
        task = load_task(scale.model, {**opts, "shard": s})
        model = train_local(task, scale.epochs)
        local_topics.append(task.topics(model, scale.n_words))
        console.print(f"  local model of agent {s} ({groups[s]}): {task.num_samples()} posts, "
                      f"{len(task.terms)} terms, {task.evaluate(model)}")
    tasks = [load_task(scale.model, {**opts, "shard": s}) for s in range(shards)]
    terms = common_vocabulary(tasks)
    for t in tasks:
        t.set_vocabulary(terms)
    steps = scale.epochs * min(t.num_batches() for t in tasks)
    model = trainer(tasks, steps)
    fed_topics = tasks[0].topics(model, scale.n_words)
    seconds = time.monotonic() - t0

    out.mkdir(parents=True, exist_ok=True)
    lines = ["# gFedNTM on real text: the 20-newsgroups sample, one newsgroup per agent", "",
             f"{scale.model}, K = {scale.n_topics}, {scale.epochs} passes, batch {scale.batch_size}; "
             f"common vocabulary {len(terms)} terms (union of the agents'); {steps} Sync-Opt steps; "
             f"wall time {seconds:.0f} s.", "",
             "| topic | federated | " + " | ".join(f"agent {s} ({g}) local" for s, g in enumerate(groups)) + " |",
             "|---|---|" + "---|" * shards]
    for k in range(scale.n_topics):
        cells = [" ".join(fed_topics[k])] + [" ".join(local_topics[s][k]) for s in range(shards)]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    (out / "newsgroups.json").write_text(json.dumps({"federated": fed_topics, "local": local_topics,
                                                     "groups": groups, "scale": asdict(scale)}, indent=1))
    path = out / "newsgroups.md"
    path.write_text("\n".join(lines))
    console.print("\n".join(lines))
    console.print(f"report: [green]{path}[/]")
    return path
