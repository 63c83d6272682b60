"""Pure helpers of the SEEC experiment (no network): the live mapped-search row and the
joint run's rounds."""

from __future__ import annotations

from dataclasses import asdict, replace
from types import SimpleNamespace

import numpy as np
from fedagent_experiments.seec import (
    SCALES,
    Scale,
    command_line,
    joint_local_steps,
    joint_plan,
    joint_rounds,
    others_top_k,
    query_text,
)


def test_query_text_cuts_long_articles_at_a_word_boundary():
    tokens = ["alpha", "beta", "gamma", "delta"]
    assert query_text(tokens, 100) == ("alpha beta gamma delta", False)
    text, cut = query_text(tokens, 13)  # "alpha beta ga|mma ..." -> the last whole word goes
    assert cut and text == "alpha beta"
    assert query_text(tokens, len("alpha beta gamma delta")) == ("alpha beta gamma delta", False)


def test_others_top_k_drops_the_searched_article_and_keeps_the_merge_order():
    row_of = {"A": 0, "B": 1, "C": 2, "D": 3}
    hits = [{"site": "agent-1", "doc_id": d, "score": s} for d, s in (("B", 0.9), ("A", 0.8), ("D", 0.5), ("C", 0.1))]
    assert others_top_k(hits, row_of, 0, 2) == [1, 3]
    # Not found among the hits (its vector was inferred afresh): the first k others count.
    assert others_top_k(hits, row_of, 3, 3) == [1, 0, 2]


def test_joint_rounds_split_each_pass_over_the_data():
    # Two sites whose words are all kept: 4096 and 6144 pairs an epoch, 4 and 6 batches of 1024.
    sites = [
        SimpleNamespace(keep=np.ones(5), encoded=[np.zeros(n, np.int64) for n in (1024, 3072)]),
        SimpleNamespace(keep=np.ones(5), encoded=[np.zeros(6144, np.int64)]),
    ]
    one = Scale(epochs=10, batch_size=1024)
    assert joint_rounds(one) == 10 and joint_local_steps(sites, one) == 0  # whole local epochs
    fifth = replace(one, rounds_per_epoch=5)
    assert joint_rounds(fifth) == 50 and joint_local_steps(sites, fifth) == 1  # mean epoch 5 batches / 5
    assert joint_local_steps(sites, replace(one, rounds_per_epoch=100)) == 1  # never below one batch
    text = joint_plan({"epochs": 10, "rounds_per_epoch": 5, "server_lr": 3.0}, {"local_steps": 1})
    assert "50 FedAvg rounds of 1/5" in text and "local_steps = 1" in text and "server step 3" in text
    assert joint_plan({"epochs": 10}, {}) == "10 FedAvg rounds of one local epoch"


def test_command_line_names_every_option_that_is_not_the_default():
    # The report's command must rerun the report's experiment: a seed other than 0 or a
    # joint setting other than the corpus's default has to appear in it.
    default = asdict(replace(SCALES["default"], corpus="manpages", rounds_per_epoch=10, server_lr=2.0, dim=100))
    assert command_line(default, "out") == "fedagent experiment seec --corpus manpages --out out"
    d50 = {**default, "dim": 50}  # the man pages' runs before d = 100 became their default
    assert command_line(d50, "o") == "fedagent experiment seec --corpus manpages --dim 50 --out o"
    seed1 = {**default, "seed": 1}
    assert command_line(seed1, "r/s1") == "fedagent experiment seec --corpus manpages --seed 1 --out r/s1"
    plain = {**default, "rounds_per_epoch": 1, "server_lr": 1.0, "sites": 4}
    assert command_line(plain, "o") == (
        "fedagent experiment seec --corpus manpages --sites 4 --rounds-per-epoch 1 --server-lr 1 --out o"
    )
    wiki = asdict(replace(SCALES["default"], seed=2))
    assert command_line(wiki, "o") == "fedagent experiment seec --seed 2 --out o"
    tiny = asdict(replace(SCALES["tiny"], epochs=3))
    assert command_line(tiny, "o") == "fedagent experiment seec --scale tiny --epochs 3 --out o"


def test_the_command_picks_each_corpus_dim_unless_told(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from fedagent_experiments import seec

    from fedagent.cli import main

    seen: list[Scale] = []
    monkeypatch.setattr(seec, "run_experiment", lambda out, scale, keep=False: seen.append(scale))
    runner = CliRunner()
    for args in (["--corpus", "manpages"], [], ["--corpus", "manpages", "--dim", "50"]):
        result = runner.invoke(main, ["experiment", "seec", *args, "--out", str(tmp_path)])
        assert result.exit_code == 0, result.output
    assert [s.dim for s in seen] == [seec.CORPUS_DIM["manpages"], 50, 50]
    assert seen[0].rounds_per_epoch == 10 and seen[1].rounds_per_epoch == 1
    result = runner.invoke(main, ["experiment", "seec", "--dim", "0", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--dim" in result.output
