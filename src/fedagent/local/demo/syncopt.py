"""``fedagent demo --mode syncopt`` (gFedNTM): vocabulary consensus and Sync-Opt steps of
ProdLDA over the network, then the same steps centralized in this process; the two
models must agree and find the true topics."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from fedagent.errors import FedagentError
from fedagent.local.demo.runner import Plan, Watch, elapsed, need_agents, run, work_dir
from fedagent.local.federation import Federation

# ProdLDA on the paper's synthetic generator (Sec. 4.1), at a size that trains in about a
# minute on 2 cores: 500 terms, 5 true topics shared by every agent and private ones
# (with the default 5 agents, one each: 10 true topics). See syncopt_options.
SYNCOPT_OPTIONS: dict[str, Any] = {
    "corpus": "synthetic",
    "vocab_size": 500,
    "true_topics": 10,
    "shared_topics": 5,
    "eta": 0.05,
    "docs": 400,
    "val_docs": 50,
    "doc_length": [50, 100],
    "data_seed": 0,
    "seed": 0,
    "n_topics": 10,
    "batch_size": 32,
}


def syncopt_options(agents: int) -> dict[str, Any]:
    """The demo's corpus for this many agents: every agent gets the same number of private
    topics (the generator needs the private ones to split evenly), 5 // agents of them but at
    least one; the model has as many topics as the corpus."""
    shared = SYNCOPT_OPTIONS["shared_topics"]
    true_topics = shared + agents * max(1, (SYNCOPT_OPTIONS["true_topics"] - shared) // agents)
    return {**SYNCOPT_OPTIONS, "true_topics": true_topics, "n_topics": true_topics}


def run_syncopt_demo(*, agents: int = 5, steps: int = 300, keep: bool = False, console: Console | None = None) -> int:
    """Vocabulary consensus and Sync-Opt steps over the network, then the same steps
    centralized in this process: the two models must agree and find the true topics."""
    import numpy as np
    import torch

    from fedagent.tasks import ntm, ntm_data, ntm_scores
    from fedagent.tasks.base import get_weights, load_task, set_weights

    console = console or Console()
    need_agents(agents)
    torch.set_num_threads(1)
    fed = Federation(work_dir("fedagent-syncopt-demo-"), agents=agents, rounds=1, alpha=0.0)
    started = time.monotonic()
    o = syncopt_options(agents)

    def options(i: int) -> dict[str, Any]:
        return {**o, "shard": i, "shards": agents}

    def configure(fed: Federation) -> None:
        syncopt = {
            "steps": steps,
            "expected_agents": agents,
            "min_agents": agents,
            "step_timeout": 60.0,
            "on_fault": "continue",
            "checkpoint_every": 50,
        }
        fed.prepare_syncopt("prodlda", options, options(0), syncopt)

    last: dict[str, Any] = {}

    def watch(fed: Federation) -> Watch | None:
        s = fed.status("coordinator")
        if s is None:
            return None
        last.update(s)
        if s["phase"] == "vocabulary":
            desc = f"vocabulary: {len(s.get('vocabulary_offers') or [])}/{agents} offers"
        else:
            loss = s.get("last_loss")
            desc = f"{s['phase']}: step {s['step']}, vocabulary {s.get('vocabulary_size')} terms" + (
                f", loss {loss:.2f}" if loss is not None else ""
            )
        return Watch(s["steps_done"], desc, s["phase"] in ("done", "aborted"))

    def collect(fed: Federation) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        if last.get("phase") != "done":
            raise FedagentError(f"Sync-Opt aborted; logs in {fed.work / 'logs'}")
        weights, meta = fed.final_weights()
        weights = {k: v for k, v in weights.items() if not k.startswith("optim/")}
        vocab = (fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "vocabulary.json").read_text()
        return weights, meta, json.loads(vocab)["terms"]

    def ntm_task(i: int) -> ntm.NtmTask:
        task = load_task("prodlda", options(i))
        if not isinstance(task, ntm.NtmTask):
            raise FedagentError(f"prodlda is not a topic-model task ({type(task).__name__})")
        return task

    def evaluate(collected: tuple[dict[str, Any], dict[str, Any], list[str]]) -> int:
        weights, meta, terms = collected
        console.print(
            f"federation finished {meta['model_version']} steps in {elapsed(started)} "
            f"(exact: {meta['exact']}); training the same steps centralized in this process ..."
        )
        tasks = [ntm_task(i) for i in range(agents)]
        for t in tasks:
            t.set_vocabulary(terms)
        central = tasks[0].build_model()
        opt = tasks[0].make_optimizer(central.parameters())
        for step in range(steps):
            ntm.centralized_step(central, opt, tasks, step)
        federated = tasks[0].build_model()
        set_weights(federated, weights)
        cw = get_weights(central)
        diff = max(float(np.max(np.abs(weights[k].astype(np.float64) - cw[k]))) for k in cw)
        # The true topics on the agreed vocabulary (terms nobody used are dropped).
        all_terms = ntm_data.synthetic_terms(o["vocab_size"])
        col = {t: j for j, t in enumerate(all_terms)}
        beta = ntm_data.true_topics(o["vocab_size"], o["true_topics"], o["eta"], o["data_seed"])[
            :, [col[t] for t in terms]
        ]
        beta = beta / beta.sum(axis=1, keepdims=True)
        tss_fed = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(federated))
        tss_central = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(central))
        table = Table(title="federated ProdLDA topics (top 8 words)", title_justify="left")
        table.add_column("topic", justify="right")
        table.add_column("words")
        for k, words in enumerate(tasks[0].topics(federated, 8)):
            table.add_row(str(k), " ".join(words))
        console.print(table)
        res = Table(title="federated vs centralized", title_justify="left")
        res.add_column("measure")
        res.add_column("value", justify="right")
        res.add_row("max |w_federated - w_centralized|", f"{diff:.2e}")
        res.add_row(f"TSS federated (max {o['true_topics']})", f"{tss_fed:.3f}")
        res.add_row("TSS centralized", f"{tss_central:.3f}")
        console.print(res)
        ok = diff <= 1e-3 and abs(tss_fed - tss_central) <= 0.01
        console.print(
            (
                "[green]federated training matches centralized training[/]"
                if ok
                else "[red]federated training differs from centralized training[/]"
            )
            + f"; total {elapsed(started)}"
        )
        return 0 if ok else 1

    plan = Plan(
        title=f"[bold]fedagent demo --mode syncopt[/] (gFedNTM): federation [cyan]{fed.fed}[/], {agents} "
        f"agents with {o['docs']} synthetic documents each ({o['vocab_size']} terms, "
        f"{o['true_topics']} true topics, {o['shared_topics']} shared); ProdLDA with {o['n_topics']} "
        f"topics, {steps} Sync-Opt steps of {o['batch_size']} documents per agent",
        started=lambda fed: (
            f"broker [green]{fed.broker_uri}[/] (mutual TLS, per-agent ACL); agents find the "
            "coordinator by mDNS, send it their vocabularies (terms and counts, never a document), then one "
            "gradient per step"
        ),
        total=steps,
        limit=900,
        watch=watch,
        collect=collect,
        evaluate=evaluate,
        configure=configure,
    )
    return run(fed, plan, keep=keep, console=console)
