"""Smoke runs of ``fedagent experiment gfedntm`` at a tiny scale: the report is written,
its numbers are real scores, and the federated trainer is the pluggable hook."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fedagent.cli import main
from fedagent.experiments import gfedntm

torch.set_num_threads(1)


def test_synthetic_report_through_the_cli(tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "experiment",
            "gfedntm",
            "--corpus",
            "synthetic",
            "--scale",
            "tiny",
            "--k-prime",
            "5",
            "--eta",
            "0.01",
            "--no-daemons",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "## A: shared topics K'" in report and "Done-criterion" in report
    assert (out / "fig2.png").stat().st_size > 10_000
    data = json.loads((out / "results.json").read_text())
    # one result per setting and seed; K'=5 is A only, the run's default eta list adds B at K'=10
    assert [(r["group"], r["seed"]) for r in data["results"]] == [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    assert "± " in report and "seed sd" in report
    r = data["results"][0]
    assert set(r["best_epoch"]) == set(gfedntm.MODELS)
    k = gfedntm.SCALES["tiny"].true_topics
    for name in ("centralized", "federated", "non-collaborative", "random topics"):
        assert 0 < r["tss"][name] <= k + 1e-9 and 0 < r["tss_decoder"][name] <= k + 1e-9
    for name in gfedntm.MODELS:
        assert r["doc_sim"][name] > 0
    assert len(r["tss_nodes"]) == gfedntm.SCALES["tiny"].nodes


def test_federated_trainer_hook_is_used(tmp_path):
    calls = []

    def trainer(tasks, steps):
        calls.append((len(tasks), steps, len(tasks[0].terms)))
        return gfedntm.in_process_syncopt(tasks, steps)

    # a trainer of fixed steps is the fixed-epochs protocol (patience 0: no split, no stopping)
    scale = replace(gfedntm.SCALES["tiny"], patience=0)
    res = gfedntm.run_setting(scale, 5, 0.05, "A", trainer=trainer)
    assert len(calls) == 1 and calls[0][:2] == (scale.nodes, scale.epochs * (scale.docs // scale.batch_size))
    assert 0 < calls[0][2] <= scale.vocab_size
    assert res.tss["federated"] > 0
    with pytest.raises(ValueError):
        gfedntm.run_setting(gfedntm.SCALES["tiny"], 5, 0.05, "A", trainer=trainer)


def test_early_stopping_keeps_the_best_epoch_of_every_model_kind():
    scale = gfedntm.SCALES["tiny"]
    res = gfedntm.run_setting(scale, 5, 0.05, "A")
    batches = round(scale.docs * (1 - scale.holdout)) // scale.batch_size
    for m in gfedntm.MODELS:
        assert 1 <= res.best_epoch[m] <= res.epochs_run[m] <= scale.epochs
    assert res.steps["federated"] == res.best_epoch["federated"] * batches
    assert res.steps["centralized"] == res.best_epoch["centralized"] * (
        scale.nodes * (scale.docs - round(scale.docs * scale.holdout)) // scale.batch_size
    )


def test_early_stopped_restores_the_weights_of_the_best_epoch():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    losses = iter([3.0, 1.0, 2.0, 2.5, 0.5])

    def step(i):
        with torch.no_grad():
            model.weight += 1.0  # after epoch e (3 steps each) the weight is 3e

    stop = gfedntm.early_stopped(model, step, lambda: next(losses), 3, gfedntm.PatienceStop(patience=2))
    assert (stop.best_epoch, stop.epochs, stop.steps, stop.best_loss) == (2, 4, 6, 1.0)
    assert model.weight.detach().tolist() == [[6.0, 6.0]]


def test_widen_puts_unseen_terms_at_zero():
    tw = np.array([[0.25, 0.75], [0.5, 0.5]])
    wide = gfedntm.widen(tw, ["b", "d"], ["a", "b", "c", "d"])
    assert wide.tolist() == [[0, 0.25, 0, 0.75], [0, 0.5, 0, 0.5]]


def test_newsgroups_report_lists_federated_and_local_topics(tmp_path):
    out = tmp_path / "news"
    path = gfedntm.run_newsgroups(out, gfedntm.NewsScale(model="prodlda", n_topics=3, epochs=2, n_words=4))
    text = path.read_text()
    assert "agent 0 (alt.atheism) local" in text and "agent 1 (sci.space) local" in text
    data = json.loads((out / "newsgroups.json").read_text())
    assert len(data["federated"]) == 3 and all(len(t) == 4 for t in data["federated"])
    assert len(data["local"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_setting_through_coordinator_and_agent_processes_equals_in_process(tmp_path):
    """The real federated path of the experiment: a coordinator and five agent processes
    over a private Mosquitto with mutual TLS, the coordinator stopping by the agents'
    validation losses itself, keep the model in-process early-stopped Sync-Opt keeps: the
    same steps, the weights of in-process Sync-Opt and of centralized training on the
    concatenated batches, hence the same scores."""
    scale = gfedntm.SCALES["tiny"]
    kept: dict = {}
    gfedntm.run_setting(scale, 5, 0.05, "A", keep=kept)
    d = gfedntm.run_daemon_setting(scale, 5, 0.05, kept, in_process_steps=kept["steps"])
    assert d.exact and d.steps == kept["steps"] and d.in_process_steps == kept["steps"]
    assert d.finished_reason in ("early stopped", "max epochs") and 1 <= d.best_epoch <= d.epochs <= scale.epochs
    assert len(d.val_losses) == d.epochs and d.steps_trained >= d.steps
    names = ["daemons (Mosquitto)", "in-process Sync-Opt", "centralized, concatenated batches"]
    assert list(d.tss) == names
    for name in names[1:]:
        assert d.max_abs_diff[name] <= 1e-5
        assert abs(d.tss[name] - d.tss[names[0]]) <= 1e-4 and abs(d.doc_sim[name] - d.doc_sim[names[0]]) <= 1e-3
    report = gfedntm.write_synthetic_report(tmp_path, scale, [gfedntm.run_setting(scale, 5, 0.05, "A")], 1.0, d)
    assert "## The real federated path" in report.read_text()
    assert f"kept epoch {d.best_epoch}'s model" in report.read_text()
