"""Smoke runs of ``fedagent experiment gfedntm`` at a tiny scale: the report is written,
its numbers are real scores, and the federated trainer is the pluggable hook."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fedagent.cli import main
from fedagent.experiments import gfedntm

torch.set_num_threads(1)


def test_synthetic_report_through_the_cli(tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["experiment", "gfedntm", "--corpus", "synthetic", "--scale", "tiny",
                                       "--k-prime", "5", "--eta", "0.01", "--no-daemons", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "## A: shared topics K'" in report and "Done-criterion" in report
    assert (out / "fig2.png").stat().st_size > 10_000
    data = json.loads((out / "results.json").read_text())
    assert [r["group"] for r in data["results"]] == ["A", "B"]
    r = data["results"][0]
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

    scale = gfedntm.SCALES["tiny"]
    res = gfedntm.run_setting(scale, 5, 0.05, "A", trainer=trainer)
    assert len(calls) == 1 and calls[0][:2] == (scale.nodes, scale.epochs * (scale.docs // scale.batch_size))
    assert 0 < calls[0][2] <= scale.vocab_size
    assert res.tss["federated"] > 0


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
    over a private Mosquitto with mutual TLS give the weights of in-process Sync-Opt and
    of centralized training on the concatenated batches, hence the same scores."""
    scale = gfedntm.SCALES["tiny"]
    kept: dict = {}
    gfedntm.run_setting(scale, 5, 0.05, "A", keep=kept)
    d = gfedntm.run_daemon_setting(scale, 5, 0.05, kept)
    assert d.exact and d.steps == scale.epochs * (scale.docs // scale.batch_size)
    names = ["daemons (Mosquitto)", "in-process Sync-Opt", "centralized, concatenated batches"]
    assert list(d.tss) == names
    for name in names[1:]:
        assert d.max_abs_diff[name] <= 1e-5
        assert abs(d.tss[name] - d.tss[names[0]]) <= 1e-4 and abs(d.doc_sim[name] - d.doc_sim[names[0]]) <= 1e-3
    report = gfedntm.write_synthetic_report(tmp_path, scale, [gfedntm.run_setting(scale, 5, 0.05, "A")], 1.0, d)
    assert "## The real federated path" in report.read_text()
