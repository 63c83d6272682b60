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
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedagent.extras import require, require_installed
from fedagent.protocols.syncopt import PatienceStop, pooled_validation_loss
from fedagent.storage import history
from fedagent.tasks import ntm_data
from fedagent.tasks.base import get_weights, load_task, set_weights
from fedagent.tasks.ntm import NtmTask, ProdLDA, centralized_step, federated_step
from fedagent.tasks.ntm_data import NodeCorpus
from fedagent.tasks.ntm_scores import doc_similarity_score, topic_similarity_score
from fedagent_experiments import EXTRAS, NEEDS
from fedagent_experiments.gfedntm_report import MODELS, report_from_json, write_synthetic_report
from fedagent_experiments.gfedntm_results import SCALES, DaemonResult, Scale, SettingResult, load_daemons

require_installed(NEEDS, EXTRAS, "the gfedntm experiment")
if TYPE_CHECKING:
    import scipy.sparse as sp
else:
    sp = require("scipy.sparse", EXTRAS, "the gfedntm experiment")

K_PRIME = (5, 10, 15, 40)
ETAS = (0.01, 0.02, 0.03, 0.04, 0.08, 1.0)

# A trainer of the federated model: given the agents' tasks (already on the common
# vocabulary) and the number of Sync-Opt steps, return the trained model. The default
# runs Sync-Opt in this process; a run through the real coordinator and agents plugs in
# here and returns a model holding the coordinator's final weights.
FederatedTrainer = Callable[[Sequence[NtmTask], int], nn.Module]


# ---- training ------------------------------------------------------------------------
def train_local(task: NtmTask, epochs: int) -> ProdLDA:
    model = task.build_model()
    task.fit(model, epochs=epochs)
    return model


@dataclass(frozen=True)
class Stopped:
    """How an early-stopped training ended: the kept model is the one after ``best_epoch``
    passes (``steps`` optimizer steps); ``epochs`` passes were trained in all."""

    best_epoch: int
    epochs: int
    steps: int
    best_loss: float


def early_stopped(
    model: nn.Module,
    step: Callable[[int], object],
    validation_loss: Callable[[], float],
    steps_per_epoch: int,
    rule: PatienceStop,
) -> Stopped:
    """Train ``model`` epoch by epoch (``step(i)`` runs optimizer step i) until ``rule``
    stops it, measuring ``validation_loss()`` after every epoch; the model ends with the
    weights of its best epoch. The same loop serves the local, the pooled and the
    federated model: only ``step`` and ``validation_loss`` differ."""
    best = get_weights(model)
    while not rule.stopped:
        first = rule.epochs * steps_per_epoch
        for i in range(first, first + steps_per_epoch):
            step(i)
        if rule.observe(float(validation_loss())):
            best = get_weights(model)
    set_weights(model, best)
    return Stopped(
        best_epoch=rule.best_epoch + 1,
        epochs=rule.epochs,
        steps=(rule.best_epoch + 1) * steps_per_epoch,
        best_loss=rule.best,
    )


def local_step(model: nn.Module, opt: torch.optim.Optimizer, task: NtmTask) -> Callable[[int], float]:
    def step(i: int) -> float:
        opt.zero_grad()
        loss, _ = task.step_loss(model, i)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def train_local_early_stopped(task: NtmTask, scale: Scale) -> tuple[ProdLDA, Stopped]:
    """One model on one task's documents (a node alone, or the pooled corpus), stopped
    on the task's held-out documents."""
    model = task.build_model()
    opt = task.make_optimizer(model.parameters())
    stop = early_stopped(
        model,
        local_step(model, opt, task),
        lambda: task.evaluate(model)["val_loss"],
        task.num_batches(),
        PatienceStop(patience=scale.patience, max_epochs=scale.epochs),
    )
    return model, stop


def federated_validation_loss(model: nn.Module, tasks: Sequence[NtmTask]) -> float:
    """What the coordinator can know of the federated model's validation loss: each node
    evaluates the broadcast weights on its own held-out documents and sends back one
    scalar and a count; the coordinator takes their sample-weighted mean."""
    return pooled_validation_loss({str(t.shard): (t.evaluate(model)["val_loss"], t.val.shape[0]) for t in tasks})


def syncopt_early_stopped(
    tasks: Sequence[NtmTask], scale: Scale, losses: list[float] | None = None
) -> tuple[ProdLDA, Stopped]:
    """Algorithm 1 in this process with the paper's early stopping: one epoch = as many
    Sync-Opt steps as the smallest node has batches. ``losses`` (if given) receives the
    pooled validation loss of every epoch, as the coordinator's history records it."""
    model = tasks[0].build_model()
    opt = tasks[0].make_optimizer(model.parameters())

    def validation_loss() -> float:
        loss = federated_validation_loss(model, tasks)
        if losses is not None:
            losses.append(loss)
        return loss

    stop = early_stopped(
        model,
        lambda i: federated_step(model, opt, tasks, i),
        validation_loss,
        min(t.num_batches() for t in tasks),
        PatienceStop(patience=scale.patience, max_epochs=scale.epochs),
    )
    return model, stop


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
        ctx = (
            np.concatenate([t.corpus.train_context for t in tasks]),
            np.concatenate([t.corpus.val_context for t in tasks]),
        )
    corpus = NodeCorpus(
        list(terms),
        sp.vstack([t.train for t in tasks]).tocsr(),
        sp.vstack([t.val for t in tasks]).tocsr(),
        None if ctx is None else ctx[0],
        None if ctx is None else ctx[1],
    )
    return NtmTask(
        corpus,
        combined=first.combined,
        shard=len(tasks),
        seed=first.seed,
        n_topics=first.n_topics,
        batch_size=first.batch_size,
        hidden=first.hidden,
        dropout=first.dropout,
        lr=first.lr,
        prior_alpha=first.prior_alpha,
        dtype=first.dtype_name,
    )


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
    remap = sp.csr_matrix(
        (np.ones(len(src), dtype=np.float32), (src, [index[terms[i]] for i in src])),
        shape=(len(terms), len(task.terms)),
    )
    corpus = NodeCorpus(list(task.terms), task.train[: task.batch_size], (bow @ remap).tocsr())
    probe = NtmTask(corpus, shard=task.shard, seed=task.seed, n_topics=task.n_topics, batch_size=task.batch_size)
    return probe.infer_theta(model, "val")


# ---- one synthetic setting -------------------------------------------------------------
@dataclass
class SettingData:
    """The ground truth and the evaluation documents of one setting."""

    opts: dict[str, Any]
    all_terms: list[str]
    beta: np.ndarray
    val_bow: sp.csr_matrix
    val_theta: np.ndarray


def setting_data(scale: Scale, shared: int, eta: float) -> SettingData:
    opts = scale.options(shared_topics=shared, eta=eta)
    gen = ntm_data.synthetic_options(opts)
    nodes = [ntm_data.synthetic_node(n, scale.nodes, **gen) for n in range(scale.nodes)]
    return SettingData(
        opts,
        ntm_data.synthetic_terms(scale.vocab_size),
        ntm_data.true_topics(scale.vocab_size, scale.true_topics, eta, scale.seed),
        sp.vstack([n.val for n in nodes]).tocsr(),
        np.concatenate([n.val_theta for n in nodes]),
    )


def score_model(data: SettingData, task: NtmTask, model: nn.Module) -> tuple[float, float, float]:
    """(TSS of softmax(beta), TSS of the decoder's topics, doc-sim) of a model trained on
    ``task.terms``, on the validation documents of every node."""
    theta = theta_on(task, model, data.val_bow, data.all_terms)
    tss = topic_similarity_score(data.beta, widen(task.topic_word(model), task.terms, data.all_terms))
    tss_dec = topic_similarity_score(
        data.beta, widen(task.decoder_topic_word(model, theta), task.terms, data.all_terms)
    )
    return tss, tss_dec, doc_similarity_score(theta, data.val_theta, per_document=True)


def load_ntm(name: str, options: dict[str, Any]) -> NtmTask:
    """A topic-model task (``prodlda``, ``combinedtm``) built as a config would build it."""
    from fedagent.errors import ConfigError

    task = load_task(name, options)
    if not isinstance(task, NtmTask):
        raise ConfigError(f"task {name!r} is not a topic model")
    return task


def joint_tasks(scale: Scale, data: SettingData, **extra: Any) -> tuple[list[NtmTask], list[str]]:
    """The nodes' tasks on the common vocabulary, merged the way the coordinator merges
    (union, most frequent first, ties by term), so that in-process Sync-Opt, the
    centralized references and the run through the daemons index the same terms alike."""
    tasks = [load_ntm("prodlda", {**data.opts, **extra, "shard": n}) for n in range(scale.nodes)]
    terms = common_vocabulary(tasks)
    for t in tasks:
        t.set_vocabulary(terms)
    return tasks, terms


def run_setting(
    scale: Scale,
    shared: int,
    eta: float,
    group: str,
    trainer: FederatedTrainer = in_process_syncopt,
    progress=None,
    keep: dict | None = None,
) -> SettingResult:
    """One Fig. 2 setting with the seed ``scale.seed`` (corpus, true topics, model
    initialisation and batches all follow it).

    With ``scale.patience`` > 0 (the paper's protocol) every model is trained to
    convergence: each node's training documents are split 75:25 (``scale.holdout``),
    and training stops when the validation loss has not improved for ``patience``
    epochs (at most ``scale.epochs``), keeping the best epoch's model. The validation
    loss is the node's own for a local model, the pooled held-out set's for the pooled
    model, and the sample-weighted mean of the nodes' losses for the federated one.
    ``trainer`` is then unused (a daemon trainer cannot report per-epoch losses).

    With ``patience`` = 0, every model trains exactly ``epochs`` passes over its
    documents on the whole training set: non-collaborative and federated models the
    same number of steps, the pooled model N times as many; the federated model comes
    from ``trainer``.

    ``keep`` (if given) receives the federated model's weights, vocabulary and steps."""
    t0 = time.monotonic()
    res = SettingResult(group=group, shared=shared, eta=eta, seed=scale.seed)
    data = setting_data(scale, shared, eta)
    stopping = scale.patience > 0
    if stopping and trainer is not in_process_syncopt:
        raise ValueError("early stopping runs Sync-Opt in process; pass patience=0 to use another trainer")

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    def fixed(task: NtmTask) -> tuple[ProdLDA, Stopped]:
        model = train_local(task, scale.epochs)
        return model, Stopped(scale.epochs, scale.epochs, scale.epochs * task.num_batches(), math.nan)

    # non-collaborative: each node on its own vocabulary
    model: nn.Module
    tss_nodes, dec_nodes, ds_nodes, stops = [], [], [], []
    for n in range(scale.nodes):
        say(f"K'={shared} eta={eta} seed={scale.seed}: node {n} alone")
        task = load_ntm("prodlda", {**data.opts, "shard": n})
        local_terms = sorted(task.term_counts(), key=lambda t: int(t[4:]))
        task.set_vocabulary(local_terms)
        model, stop = train_local_early_stopped(task, scale) if stopping else fixed(task)
        stops.append(stop)
        tss, dec, ds = score_model(data, task, model)
        tss_nodes.append(tss)
        dec_nodes.append(dec)
        ds_nodes.append(ds)
    res.tss_nodes, res.tss_decoder_nodes = tss_nodes, dec_nodes
    res.tss["non-collaborative"] = float(np.mean(tss_nodes))
    res.tss_decoder["non-collaborative"] = float(np.mean(dec_nodes))
    res.doc_sim["non-collaborative"] = float(np.mean(ds_nodes))
    _record(res, "non-collaborative", stops)
    t1 = time.monotonic()
    res.phase_seconds["non-collaborative"] = t1 - t0

    # federated: Sync-Opt over the nodes on the common vocabulary
    say(f"K'={shared} eta={eta} seed={scale.seed}: federated")
    tasks, terms = joint_tasks(scale, data)
    losses: list[float] = []
    if stopping:
        model, stop = syncopt_early_stopped(tasks, scale, losses)
    else:
        steps = scale.epochs * min(t.num_batches() for t in tasks)
        model, stop = trainer(tasks, steps), Stopped(scale.epochs, scale.epochs, steps, math.nan)
    _record(res, "federated", [stop])
    res.tss["federated"], res.tss_decoder["federated"], res.doc_sim["federated"] = score_model(data, tasks[0], model)
    if keep is not None:
        keep.update(weights=get_weights(model), terms=terms, steps=stop.steps, stop=stop, val_losses=losses)
    t2 = time.monotonic()
    res.phase_seconds["federated"] = t2 - t1

    # centralized: the pooled corpus, ordinary mini-batches
    say(f"K'={shared} eta={eta} seed={scale.seed}: centralized")
    pooled = pooled_task(tasks, terms)
    model, stop = train_local_early_stopped(pooled, scale) if stopping else fixed(pooled)
    _record(res, "centralized", [stop])
    res.tss["centralized"], res.tss_decoder["centralized"], res.doc_sim["centralized"] = score_model(
        data, pooled, model
    )
    res.phase_seconds["centralized"] = time.monotonic() - t2

    rng = np.random.default_rng(scale.seed + 1)
    random_topics = rng.dirichlet(np.full(scale.vocab_size, eta), size=scale.n_topics)
    res.tss["random topics"] = res.tss_decoder["random topics"] = topic_similarity_score(data.beta, random_topics)
    res.seconds = time.monotonic() - t0
    return res


def _record(res: SettingResult, kind: str, stops: Sequence[Stopped]) -> None:
    res.steps[kind] = float(np.mean([s.steps for s in stops]))
    res.best_epoch[kind] = float(np.mean([s.best_epoch for s in stops]))
    res.epochs_run[kind] = float(np.mean([s.epochs for s in stops]))


# ---- one setting through the real daemons ----------------------------------------------
def syncopt_through_daemons(
    options: dict[str, Any],
    agents: int,
    steps: int,
    console=None,
    timeout: float = 3600.0,
    syncopt: dict[str, Any] | None = None,
) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """Run at most ``steps`` Sync-Opt steps of ProdLDA on ``options`` (one shard per
    agent) through a private Mosquitto with mutual TLS, a coordinator process and
    ``agents`` agent processes that find it by mDNS (:class:`fedagent.local.federation.Federation`);
    ``syncopt``: more ``[syncopt]`` settings (early stopping: ``patience``,
    ``epoch_steps``, ``max_epochs``). Returns the coordinator's final weights, the agreed
    vocabulary and the checkpoint's metadata with the history's ``epoch`` records
    (``meta["epochs"]``)."""
    import shutil
    import tempfile

    from fedagent.errors import FedagentError
    from fedagent.local.federation import Federation

    work = Path(tempfile.mkdtemp(prefix="fedagent-gfedntm-"))
    fed = Federation(work, agents=agents, rounds=1, alpha=0.0)
    started = time.monotonic()
    try:
        fed.prepare()
        fed.prepare_syncopt(
            "prodlda",
            lambda i: {**options, "shard": i, "shards": agents},
            {**options, "shard": 0, "shards": agents},
            {
                "steps": steps,
                "expected_agents": agents,
                "min_agents": agents,
                "step_timeout": 120.0,
                "on_fault": "abort",
                "checkpoint_every": 200,
                **(syncopt or {}),
            },
        )
        fed.start_all()
        last = -1
        while True:
            fed.check_alive()
            s = fed.status("coordinator")
            if s is not None:
                if s["phase"] in ("done", "aborted"):
                    break
                done = int(s.get("steps_done") or 0)
                if console is not None and done // 100 != last // 100:
                    console.print(f"  daemons: {s['phase']}, {done}/{steps} steps")
                last = done
            if time.monotonic() - started > timeout:
                raise FedagentError(f"the federation did not finish in {timeout:.0f} s; logs in {work / 'logs'}")
            time.sleep(0.5)
        if s["phase"] != "done":
            raise FedagentError(f"Sync-Opt aborted; logs in {work / 'logs'}")
        weights, meta = fed.final_weights()
        weights = {k: v for k, v in weights.items() if not k.startswith("optim/")}
        state = work / "state" / "coordinator" / "coordinator" / fed.fed
        terms = json.loads((state / "vocabulary.json").read_text())["terms"]
        records = history.read_records(state / "history.jsonl")
        finished = [r for r in records if r.get("event") == "finished"]
        return (
            weights,
            terms,
            {
                **meta,
                "epochs": [r for r in records if r.get("event") == "epoch"],
                "finished_reason": finished[-1]["reason"] if finished else "",
            },
        )
    finally:
        fed.close()
        shutil.rmtree(work, ignore_errors=True)


def run_daemon_setting(
    scale: Scale,
    shared: int,
    eta: float,
    in_process: dict | None = None,
    console=None,
    steps: int | None = None,
    in_process_steps: int | None = None,
    dtype: str = "float32",
) -> DaemonResult:
    """The setting (``shared``, ``eta``, seed ``scale.seed``) through the real coordinator
    and agents, scored next to in-process Sync-Opt and centralized training on the
    concatenated per-step batches.

    With ``scale.patience`` the coordinator stops by the agents' validation losses
    itself (one epoch = the smallest node's batches, at most ``scale.epochs``), and the
    in-process reference is the same early-stopping loop in this process
    (:func:`syncopt_early_stopped`): ``in_process`` is what :func:`run_setting` kept
    (weights, terms, steps, stop, val_losses), else it is run here. The result holds
    both runs' epochs, kept epoch and pooled validation losses, and the kept weights'
    distance. ``dtype = "float64"`` trains every model in float64 and runs the
    coordinator in float64 mode (gradients summed in the participants' order).

    Without early stopping: ``steps`` Sync-Opt steps (default ``scale.epochs`` passes);
    ``in_process_steps``: the steps an in-process early-stopped model kept, for the
    report."""
    t0 = time.monotonic()
    data = setting_data(scale, shared, eta)
    task_extra: dict[str, Any] = {} if dtype == "float32" else {"dtype": dtype}
    tasks, terms = joint_tasks(scale, data, **task_extra)
    epoch_steps = min(t.num_batches() for t in tasks)
    extra: dict[str, Any] = {"float64": True} if dtype == "float64" else {}
    if scale.patience > 0:
        extra.update(patience=scale.patience, max_epochs=scale.epochs, epoch_steps=epoch_steps)
        steps = scale.epochs * epoch_steps
    elif steps is None:
        steps = scale.epochs * epoch_steps
    weights, agreed, meta = syncopt_through_daemons(
        {**data.opts, **task_extra}, scale.nodes, steps, console, syncopt=extra
    )
    seconds = time.monotonic() - t0
    epochs = meta.get("epochs", [])
    trained = int(meta.get("trained_version", meta.get("model_version", steps)))
    steps = int(meta.get("model_version", steps))  # the kept model's steps
    if agreed != terms:
        raise RuntimeError("the coordinator agreed on another vocabulary than the union the experiment computes")
    usable = (
        in_process is not None
        and in_process.get("terms") == terms
        and in_process.get("dtype", "float32") == tasks[0].dtype_name
    )
    if scale.patience > 0:
        if not (usable and in_process is not None and "stop" in in_process):
            if console is not None:
                console.print("  the same early-stopped Sync-Opt in this process")
            losses: list[float] = []
            model, stop = syncopt_early_stopped(tasks, scale, losses)
            in_process = {"weights": get_weights(model), "steps": stop.steps, "stop": stop, "val_losses": losses}
        in_process_steps = int(in_process["steps"])
    elif not (usable and in_process is not None and in_process.get("steps") == steps):
        in_process = {"weights": get_weights(in_process_syncopt(tasks, steps))}
    if console is not None:
        console.print(f"  centralized training on the concatenated batches, {steps} steps")
    central = tasks[0].build_model()
    opt = tasks[0].make_optimizer(central.parameters())
    for step in range(steps):
        centralized_step(central, opt, tasks, step)
    stopped = in_process.get("stop")
    res = DaemonResult(
        shared=shared,
        eta=eta,
        steps=steps,
        vocabulary=len(terms),
        seconds=seconds,
        exact=bool(meta.get("exact")),
        finished_reason=str(meta.get("finished_reason", "")),
        best_epoch=int(epochs[-1]["best_epoch"]) if epochs else 0,
        epochs=len(epochs),
        steps_trained=trained,
        in_process_steps=in_process_steps,
        val_losses=[float(r["val_loss"]) for r in epochs],
        seed=scale.seed,
        dtype=tasks[0].dtype_name,
        in_process_epochs=stopped.epochs if stopped is not None else None,
        in_process_best_epoch=stopped.best_epoch if stopped is not None else None,
        in_process_val_losses=[float(x) for x in in_process.get("val_losses", [])],
    )
    runs = {
        "daemons (Mosquitto)": weights,
        "in-process Sync-Opt": in_process["weights"],
        "centralized, concatenated batches": get_weights(central),
    }
    for name, w in runs.items():
        model = tasks[0].build_model()
        set_weights(model, w)
        res.tss[name], res.tss_decoder[name], res.doc_sim[name] = score_model(data, tasks[0], model)
        res.max_abs_diff[name] = max(float(np.max(np.abs(np.asarray(w[k], np.float64) - weights[k]))) for k in weights)
    res.total_seconds = time.monotonic() - t0
    return res


def run_daemons_only(
    out: Path,
    scale: Scale,
    setting: tuple[int, float] = (10, 0.01),
    seeds: Sequence[int] = (0,),
    dtype: str = "float32",
    console=None,
) -> Path:
    """Only the run through the daemons, for ``seeds``, merged into the report of an
    earlier run in ``out`` (its ``results.json``: the in-process tables are kept as
    they are). A result replaces an earlier one of the same setting, seed and dtype,
    and every result of the fixed-step protocol (no early stopping in the daemons)."""
    from rich.console import Console

    from fedagent.errors import ConfigError

    console = console or Console()
    path = out / "results.json"
    if not path.exists():
        raise ConfigError(f"no earlier run in {out} (results.json) to merge the daemon runs into")
    data = json.loads(path.read_text())
    theirs = {k: v for k, v in data["scale"].items() if k not in ("seed", "seeds")}
    ours = {k: v for k, v in asdict(scale).items() if k not in ("seed", "seeds")}
    if theirs != ours:
        raise ConfigError(f"the report in {out} was made at another scale ({theirs}) than this run's ({ours})")
    torch.set_num_threads(1)
    daemons = load_daemons(data)
    for seed in seeds:
        console.print(
            f"[bold]K'={setting[0]} eta={setting[1]} seed={seed} ({dtype}) through a coordinator and "
            f"{scale.nodes} agent processes over Mosquitto (mutual TLS), stopping by validation loss itself[/]"
        )
        d = run_daemon_setting(replace(scale, seed=seed), setting[0], setting[1], console=console, dtype=dtype)
        console.print(
            f"daemons: epochs {d.epochs}, best {d.best_epoch} ({d.finished_reason}); in process: epochs "
            f"{d.in_process_epochs}, best {d.in_process_best_epoch}; max |dw| {d.max_abs_diff}; "
            f"{d.seconds:.0f} s (all {d.total_seconds:.0f} s)"
        )
        daemons = [
            x
            for x in daemons
            if x.finished_reason and (x.shared, x.eta, x.seed, x.dtype) != (d.shared, d.eta, d.seed, d.dtype)
        ]
        daemons.append(d)
        daemons.sort(key=lambda x: (x.shared, x.eta, x.seed, x.dtype))
        # every finished seed is in the report at once: a later failure loses nothing
        write_synthetic_report(
            out,
            Scale(**data["scale"]),
            [SettingResult(**r) for r in data["results"]],
            data["seconds"],
            daemons,
            data.get("run_note", ""),
        )
    console.print(f"report: [green]{out / 'report.md'}[/]")
    return out / "report.md"


Key = tuple[int, float, int]  # (K', eta, seed)


def _settings_in_processes(
    scale: Scale, todo: list[Key], jobs: int, out: Path, console, on_done: Callable[[Key, SettingResult], None]
) -> dict[Key, SettingResult]:
    """Each setting and seed in a worker process of its own (``python -m
    fedagent_experiments.gfedntm``, results as JSON files), at most ``jobs`` at a time: on
    a machine shared with other work, N single-threaded processes get N shares of the CPU."""
    import shutil
    import subprocess
    import sys

    todo = list(todo)
    running: list[tuple[Key, subprocess.Popen, Path]] = []
    done: dict[Key, SettingResult] = {}
    work = out / ".settings"
    work.mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < jobs:
            key = todo.pop(0)
            k, eta, seed = key
            path = work / f"k{k}-eta{eta}-seed{seed}.json"
            spec = json.dumps({"scale": asdict(replace(scale, seed=seed)), "shared": k, "eta": eta, "out": str(path)})
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedagent_experiments.gfedntm", spec],
                stdout=subprocess.DEVNULL,
                stderr=path.with_suffix(".log").open("w"),
            )
            running.append((key, proc, path))
        for item in list(running):
            key, proc, path = item
            code = proc.poll()
            if code is None:
                continue
            running.remove(item)
            if code != 0:
                raise RuntimeError(
                    f"setting K'={key[0]} eta={key[1]} seed={key[2]} failed (exit {code}); "
                    f"see {path.with_suffix('.log')}"
                )
            done[key] = SettingResult(**json.loads(path.read_text()))
            on_done(key, done[key])
        time.sleep(1.0)
    shutil.rmtree(work, ignore_errors=True)
    return done


def run_synthetic(
    out: Path,
    scale: Scale,
    k_primes: Sequence[int] = K_PRIME,
    etas: Sequence[float] = ETAS,
    trainer: FederatedTrainer = in_process_syncopt,
    console=None,
    daemons: tuple[int, float] | None = (10, 0.01),
    jobs: int = 1,
) -> Path:
    """Fig. 2: every setting with ``scale.seeds`` seeds, in this process or (``jobs`` > 1)
    in that many worker processes; then the setting ``daemons`` (K', eta) with the first
    seed once more through a real coordinator and agents over Mosquitto (None: skip),
    for as many Sync-Opt steps as the early-stopped federated model took."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    torch.set_num_threads(1)
    plan = [("A", k, 0.01) for k in k_primes] + [("B", 10, e) for e in etas]
    seeds = [scale.seed + i for i in range(scale.seeds)]
    # K'=10, eta=0.01 is in A and in B: trained once per seed
    todo: list[Key] = [(k, eta, seed) for k, eta in dict.fromkeys((k, eta) for _, k, eta in plan) for seed in seeds]
    console.print(
        f"[bold]gFedNTM Fig. 2[/]: {len(plan)} settings x {len(seeds)} seeds ({len(todo)} trainings), "
        f"scale {asdict(scale)}"
    )
    t0 = time.monotonic()
    done: dict[Key, SettingResult] = {}
    kept: dict = {}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bar:
        job = bar.add_task("settings", total=len(todo))

        def finished(key: Key, r: SettingResult) -> None:
            done[key] = r
            bar.advance(job)
            console.print(
                f"K'={key[0]} eta={key[1]} seed={key[2]}: TSS softmax(beta) "
                + ", ".join(f"{m} {r.tss[m]:.3f}" for m in MODELS)
                + "; decoder "
                + ", ".join(f"{m} {r.tss_decoder[m]:.3f}" for m in MODELS)
                + f"; best epochs {r.best_epoch} ({r.seconds:.0f} s)"
            )
            out.mkdir(parents=True, exist_ok=True)  # partial results survive a crash
            (out / "partial.json").write_text(json.dumps([asdict(x) for x in done.values()]))

        if jobs > 1:
            if trainer is not in_process_syncopt:
                raise ValueError("worker processes train with in-process Sync-Opt only")
            _settings_in_processes(scale, todo, jobs, out, console, finished)
        else:
            for key in todo:
                k, eta, seed = key
                keep = kept if daemons is not None and (k, eta, seed) == (*daemons, scale.seed) else None
                finished(
                    key,
                    run_setting(
                        replace(scale, seed=seed),
                        k,
                        eta,
                        "A",
                        trainer,
                        progress=lambda m: bar.update(job, description=m),
                        keep=keep,
                    ),
                )
    results = [replace(done[(k, eta, seed)], group=group) for group, k, eta in plan for seed in seeds]
    daemon: DaemonResult | None = None
    if daemons is not None:
        steps = int(done[(*daemons, scale.seed)].steps["federated"])
        how = "stopping by validation loss itself" if scale.patience else f"{steps} steps"
        console.print(
            f"[bold]K'={daemons[0]} eta={daemons[1]} seed={scale.seed} through a coordinator and "
            f"{scale.nodes} agent processes over Mosquitto (mutual TLS), {how}[/]"
        )
        daemon = run_daemon_setting(
            scale, daemons[0], daemons[1], kept or None, console, steps=steps, in_process_steps=steps
        )
        console.print(
            f"daemons: {daemon.steps} steps in {daemon.seconds:.0f} s; TSS {daemon.tss}; max |dw| {daemon.max_abs_diff}"
        )
    report = write_synthetic_report(out, scale, results, time.monotonic() - t0, daemon)
    (out / "partial.json").unlink(missing_ok=True)
    console.print(report.read_text().split("\n## Plots")[0])
    console.print(f"report: [green]{report}[/]")
    return report


# ---- newsgroups ------------------------------------------------------------------------
@dataclass(frozen=True)
class NewsScale:
    model: str = "combinedtm"
    n_topics: int = 10
    epochs: int = 60
    batch_size: int = 16
    seed: int = 0
    n_words: int = 8


def run_newsgroups(out: Path, scale: NewsScale, trainer: FederatedTrainer = in_process_syncopt, console=None) -> Path:
    from rich.console import Console

    console = console or Console()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    groups = sorted({g for g, _ in ntm_data.load_newsgroups()})
    shards = len(groups)
    opts = {
        "corpus": "newsgroups",
        "shards": shards,
        "n_topics": scale.n_topics,
        "batch_size": scale.batch_size,
        "seed": scale.seed,
    }
    console.print(f"[bold]gFedNTM on 20-newsgroups[/]: {shards} agents ({', '.join(groups)}), {scale.model}")
    local_topics: list[list[list[str]]] = []
    model: nn.Module
    for s in range(shards):
        task = load_ntm(scale.model, {**opts, "shard": s})
        model = train_local(task, scale.epochs)
        # Ranked in the decoder's topics: softmax(beta) is not identified under the
        # decoder BatchNorm (see ProdLDA.decoder_topic_word).
        local_topics.append(task.topics(model, scale.n_words, task.infer_theta(model, "train")))
        console.print(
            f"  local model of agent {s} ({groups[s]}): {task.num_samples()} posts, "
            f"{len(task.terms)} terms, {task.evaluate(model)}"
        )
    tasks = [load_ntm(scale.model, {**opts, "shard": s}) for s in range(shards)]
    terms = common_vocabulary(tasks)
    for t in tasks:
        t.set_vocabulary(terms)
    steps = scale.epochs * min(t.num_batches() for t in tasks)
    model = trainer(tasks, steps)
    fed_topics = tasks[0].topics(model, scale.n_words, np.concatenate([t.infer_theta(model, "train") for t in tasks]))
    seconds = time.monotonic() - t0

    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# gFedNTM on real text: the 20-newsgroups sample, one newsgroup per agent",
        "",
        f"{scale.model}, K = {scale.n_topics}, {scale.epochs} passes, batch {scale.batch_size}; top words of the "
        f"decoder's topics (documents: the agents' own posts); "
        f"common vocabulary {len(terms)} terms (union of the agents'); {steps} Sync-Opt steps; "
        f"wall time {seconds:.0f} s.",
        "",
        "| topic | federated | " + " | ".join(f"agent {s} ({g}) local" for s, g in enumerate(groups)) + " |",
        "|---|---|" + "---|" * shards,
    ]
    for k in range(scale.n_topics):
        cells = [" ".join(fed_topics[k])] + [" ".join(local_topics[s][k]) for s in range(shards)]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    (out / "newsgroups.json").write_text(
        json.dumps({"federated": fed_topics, "local": local_topics, "groups": groups, "scale": asdict(scale)}, indent=1)
    )
    path = out / "newsgroups.md"
    path.write_text("\n".join(lines))
    console.print("\n".join(lines))
    console.print(f"report: [green]{path}[/]")
    return path


def _worker(spec: str) -> None:
    """One setting for :func:`_settings_in_processes`: a JSON spec in, a JSON result file out."""
    args = json.loads(spec)
    torch.set_num_threads(1)
    res = run_setting(Scale(**args["scale"]), int(args["shared"]), float(args["eta"]), "A")
    Path(args["out"]).write_text(json.dumps(asdict(res)))


if __name__ == "__main__":
    import sys

    _worker(sys.argv[1])


__all__ = [
    "MODELS",
    "SCALES",
    "DaemonResult",
    "Scale",
    "SettingResult",
    "report_from_json",
    "write_synthetic_report",
]
