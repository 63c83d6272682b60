"""Smoke runs of ``fedagent experiment gfedntm`` at a tiny scale: the report is written,
its numbers are real scores, and the federated trainer is the pluggable hook."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from fedagent_experiments import gfedntm, gfedntm_report

from fedagent.cli import main

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


def _daemon_result(seed: int, dtype: str, *, stopping: bool = True, same: bool = True) -> gfedntm.DaemonResult:
    names = ["daemons (Mosquitto)", "in-process Sync-Opt", "centralized, concatenated batches"]
    losses = [5.0, 4.0, 4.5]
    return gfedntm.DaemonResult(
        shared=10,
        eta=0.01,
        steps=6,
        vocabulary=72,
        seconds=10.0,
        tss=dict.fromkeys(names, 2.0),
        tss_decoder=dict.fromkeys(names, 2.5),
        doc_sim=dict.fromkeys(names, 11.0),
        max_abs_diff={names[0]: 0.0, names[1]: 0.0 if same else 3e-6, names[2]: 1e-13},
        exact=True,
        finished_reason="early stopped" if stopping else "",
        best_epoch=2 if stopping else 0,
        epochs=3 if stopping else 0,
        steps_trained=9,
        val_losses=losses if stopping else [],
        seed=seed,
        dtype=dtype,
        in_process_epochs=3,
        in_process_best_epoch=2,
        in_process_val_losses=losses if same else [5.0, 4.0, 4.25],
    )


def test_daemons_only_merges_its_runs_into_the_report_and_keeps_the_tables(tmp_path, monkeypatch):
    """--daemons-only: the in-process tables of the earlier run stay as they are; a new
    daemon run replaces the one of the same seed and dtype and every fixed-step one, and
    the section compares the coordinator's stop with the in-process loop's."""
    out = tmp_path / "report"
    scale = gfedntm.SCALES["tiny"]
    scores = dict.fromkeys([*gfedntm.MODELS, "random topics"], 3.0)
    results = [
        gfedntm.SettingResult(
            "A",
            10,
            0.01,
            tss=scores,
            tss_decoder=scores | {"non-collaborative": 3.5},
            doc_sim=scores,
            seed=s,
            best_epoch=dict.fromkeys(gfedntm.MODELS, 2),
            epochs_run=dict.fromkeys(gfedntm.MODELS, 3),
        )
        for s in (0, 1)
    ]
    old = [_daemon_result(0, "float32", stopping=False), _daemon_result(1, "float64", same=False)]
    gfedntm.write_synthetic_report(out, scale, results, 60.0, old)
    tables = (out / "report.md").read_text().split("## The real federated path")[0]
    before = json.loads((out / "results.json").read_text())["results"]

    calls = []

    def fake(scale, shared, eta, console=None, dtype="float32", **_):
        calls.append((scale.seed, shared, eta, dtype))
        return _daemon_result(scale.seed, dtype)

    monkeypatch.setattr(gfedntm, "run_daemon_setting", fake)
    result = CliRunner().invoke(
        main,
        ["experiment", "gfedntm", "--corpus", "synthetic", "--scale", "tiny", "--daemons-only", "--float64"]
        + ["--seed", "1", "--seeds", "2", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert calls == [(1, 10, 0.01, "float64"), (2, 10, 0.01, "float64")]
    data = json.loads((out / "results.json").read_text())
    assert data["results"] == before and "daemon" not in data
    assert [(d["seed"], d["dtype"]) for d in data["daemons"]] == [(1, "float64"), (2, "float64")]
    report = (out / "report.md").read_text()
    assert report.split("## The real federated path")[0] == tables
    assert "in 2 of 2 runs" in report and "bit for bit in 2 of 2" in report
    assert "equal in all 3 epochs" in report and "| 1 | float64 | 3 / 2 (early stopped) | 3 / 2 |" in report
    assert "centralized, pooled (tables)" in report  # seed 1 is in the tables, seed 2 is not
    assert report.count("centralized, pooled (tables)") == 1

    # the topic-slots study, when its files are there, is the report's one place for the decoder gap
    (out / "slots").mkdir()
    for seed, local_k50, local_seen, fed_spare in ((0, 3.5, 2.5, 3.8), (1, 3.5, 3.2, 3.2)):
        study = {"shared": 10, "eta": 0.01, "seed": seed, "seen": 18, "k_fed": 139}
        study |= {"k50": {"federated": 3.0, "non-collaborative": local_k50}, "local_no_spare": {"tss": local_seen}}
        (out / "slots" / f"slots-10-{seed}.json").write_text(
            json.dumps(study | {"federated_spare": {"tss": fed_spare}})
        )
    union = {"shared": 10, "eta": 0.01, "seed": 1, "local_no_spare": {"tss": 3.1}, "vocabulary": "union"}
    (out / "slots" / "vocabulary-10-1.json").write_text(json.dumps(union))
    gfedntm.report_from_json(out)
    report = (out / "report.md").read_text()
    assert "What is left is not the vocabulary (below)" in report
    assert "score K' = 10 seed 1: 3.10 vs 3.20 (federated K = 50: -0.10)" in report
    assert "measured in the section on topic slots" in report
    assert "| 10, 0 | 18 | -0.50 | **+0.50** | **+0.30** (K = 139) |" in report
    assert "- K' = 10 (seeds 0, 1): **partly explained**. Equal slots shrink the gap by 60%-200% (1 each)" in report
    assert "ahead with equal slots in 1 of 2 seeds" in report
    assert report.split("## The decoder reading")[0].split("## A:")[1] == tables.split("## A:")[1]

    # a different validation-loss history is shown where it starts, not hidden
    assert "differ from epoch 3 (max abs diff 2.50e-01" in gfedntm_report._losses_cell(
        _daemon_result(0, "f", same=False)
    )

    # the report's scale is the run's: another one is refused before anything runs
    result = CliRunner().invoke(
        main,
        ["experiment", "gfedntm", "--corpus", "synthetic", "--daemons-only", "--out", str(out)],
    )
    assert result.exit_code != 0 and "another scale" in result.output and len(calls) == 2
    result = CliRunner().invoke(main, ["experiment", "gfedntm", "--corpus", "synthetic", "--float64"])
    assert result.exit_code != 0 and "--daemons-only" in result.output


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
@pytest.mark.procs
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_setting_through_coordinator_and_agent_processes_equals_in_process(tmp_path, dtype):
    """The real federated path of the experiment: a coordinator and five agent processes
    over a private Mosquitto with mutual TLS, the coordinator stopping by the agents'
    validation losses itself, stop where in-process early-stopped Sync-Opt stops and keep
    its model: the same epochs, the same pooled losses, the same steps, the weights of
    in-process Sync-Opt and of centralized training on the concatenated batches, hence
    the same scores; in float64 mode the kept weights are those of the in-process run
    bit for bit."""
    scale = gfedntm.SCALES["tiny"]
    kept: dict = {}
    gfedntm.run_setting(scale, 5, 0.05, "A", keep=kept)
    # float32: the experiment's own in-process run is the reference; float64: run here
    d = gfedntm.run_daemon_setting(scale, 5, 0.05, kept, dtype=dtype)
    assert d.dtype == dtype and d.exact and d.in_process_steps == d.steps
    if dtype == "float32":
        assert d.steps == kept["steps"] and d.in_process_val_losses == kept["val_losses"]
    assert d.finished_reason in ("early stopped", "max epochs") and 1 <= d.best_epoch <= d.epochs <= scale.epochs
    assert (d.epochs, d.best_epoch) == (d.in_process_epochs, d.in_process_best_epoch)
    assert len(d.val_losses) == d.epochs and d.steps_trained >= d.steps
    names = ["daemons (Mosquitto)", "in-process Sync-Opt", "centralized, concatenated batches"]
    assert list(d.tss) == names
    for name in names[1:]:
        assert d.max_abs_diff[name] <= (1e-5 if dtype == "float32" else 1e-9)
        assert abs(d.tss[name] - d.tss[names[0]]) <= 1e-4 and abs(d.doc_sim[name] - d.doc_sim[names[0]]) <= 1e-3
    if dtype == "float64":
        assert d.val_losses == d.in_process_val_losses and d.max_abs_diff["in-process Sync-Opt"] == 0.0
    report = gfedntm.write_synthetic_report(tmp_path, scale, [gfedntm.run_setting(scale, 5, 0.05, "A")], 1.0, d)
    text = report.read_text()
    assert "## The real federated path" in text and "in 1 of 1 runs" in text
    assert f"| {d.seed} | {dtype} | {d.epochs} / {d.best_epoch} ({d.finished_reason}) |" in text
