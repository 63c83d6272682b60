"""Pieces of ``fedagent experiment gossip-w2v`` that need no daemons: the centralized
reference must be a function of its seed alone, because the learning curve reuses the
reference run as its point at the full budget."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from fedagent_experiments.gossip_w2v import Scale, centralized, learning_curve

from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import load_task

pytestmark = pytest.mark.usefixtures("text_cache_one_thread")


def test_centralized_run_depends_on_its_seed_only_and_the_curve_reuses_it():
    task = load_task("word2vec", {"limit": 12, "dim": 8, "min_count": 2, "seed": 0})
    scale = Scale(agents=2, dim=8, local_steps=6, batch_size=64, curve=(0.5, 1.0))
    first, _ = centralized(task, scale, seed=1)
    task.stream.next(1000)  # leave the stream mid-epoch, as a gossip run would
    again, _ = centralized(task, scale, seed=1)
    other, _ = centralized(task, scale, seed=2)
    np.testing.assert_array_equal(first.vectors, again.vectors)
    assert not np.array_equal(first.vectors, other.vectors)
    rows = learning_curve(task, scale, first, other)
    assert [r["batches"] for r in rows] == [6, 12]
    full = rows[1]
    assert full["overlap_central"] == tm.neighbour_overlap(first, first).total > 0
    assert full["w2v_sim"] == tm.neighbour_overlap(first, other).total


def _vectors(seed: int, terms: list[str], noise: float) -> tm.WordVectors:
    rng = np.random.default_rng(0)
    base = rng.normal(size=(len(terms), 6))
    return tm.WordVectors(terms, base + noise * np.random.default_rng(seed).normal(size=base.shape))


def test_consensus_neighbours_follow_the_mean_similarity():
    terms = [f"w{i}" for i in range(40)] + list(tm.THESIS_EVAL_WORDS[:3])
    refs = [_vectors(s, terms, 0.3) for s in range(3)]
    cons = tm.consensus_neighbours(refs, tm.THESIS_EVAL_WORDS[:3], 5)
    assert set(cons) == set(tm.THESIS_EVAL_WORDS[:3]) and all(len(v) == 5 for v in cons.values())
    # identical references: the consensus is their own neighbour list, so overlap is maximal
    same = tm.consensus_neighbours([refs[0], refs[0]], tm.THESIS_EVAL_WORDS[:3], 5)
    assert tm.overlap_with_neighbours(refs[0], same) == 15
    # a model unrelated to the references shares fewer neighbours than a reference does
    unrelated = tm.WordVectors(terms, np.random.default_rng(9).normal(size=(len(terms), 6)))
    assert tm.overlap_with_neighbours(unrelated, cons) < tm.overlap_with_neighbours(refs[1], cons)


def test_report_averages_seeds_and_measures_loss_against_the_centralized_mean(tmp_path):
    from fedagent_experiments.gossip_w2v import SIX, Judge, Result, write_report

    terms = [f"w{i}" for i in range(60)] + list(tm.THESIS_EVAL_WORDS)
    centrals = [_vectors(s, terms, 0.2) for s in range(3)]
    judge = Judge(centrals, None)
    central = [judge(c, central_index=i) for i, c in enumerate(centrals)]
    # leave-one-out: a centralized seed is scored against the other two only
    assert central[0]["overlap_consensus"] == tm.overlap_with_neighbours(centrals[0], judge.loo[0])
    results = {}
    for k, name in enumerate(SIX):
        runs = []
        for seed in (1, 2):
            r = Result(name, "topic", 10, 5, 1.0, seed=seed)
            r.per_agent = {"a": judge(_vectors(100 + 10 * k + seed, terms, 0.2 + 0.1 * k))}
            runs.append(r)
        results[name] = runs
    task = type("T", (), {"vocab": terms})()
    (tmp_path / "status.md").write_text("**Status.** Seeds 2 and 3 did not run.\n")
    s = write_report(
        tmp_path, Scale(seeds=(1, 2)), task, {"wordsim353": 0.5, "simlex999": 0.2}, central, 1.0, 20.0, results, {}, 1.0
    )
    rows = {r["config"]: r for r in s["rows"]}
    cm = s["central_mean"]["overlap_consensus"]
    for name, runs in results.items():
        mean = np.mean([r.mean("overlap_consensus") for r in runs])
        assert rows[name]["overlap_consensus"] == pytest.approx(mean)
        assert rows[name]["loss_overlap_consensus_pct"] == pytest.approx(100 * (cm - mean) / cm)
    av = s["average_six"]
    assert av["configs"] == 6 and len(av["overlap_consensus_per_seed"]) == 2
    assert av["overlap_consensus"] == pytest.approx(np.mean(av["overlap_consensus_per_seed"]))
    # noisier gossip models lose more
    assert rows[SIX[-1]]["overlap_consensus"] < rows[SIX[0]]["overlap_consensus"]
    text = (tmp_path / "report.md").read_text()
    assert "Average quality loss over the 6 full-exchange configurations" in text and "6.904" in text
    # the directory's status paragraph sits under the title
    assert text.splitlines()[2] == "**Status.** Seeds 2 and 3 did not run."


def test_pacing_reaches_the_scale_and_keeps_earlier_runs_and_centralized_models(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from fedagent_experiments import gossip_w2v

    from fedagent.cli import main

    seen: list[Scale] = []
    monkeypatch.setattr(gossip_w2v, "run_experiment", lambda out, scale, configs, **kw: seen.append(scale))
    runner = CliRunner()
    for args in (["--period-seconds", "0"], [], ["--scale", "tiny"]):
        result = runner.invoke(main, ["experiment", "gossip-w2v", *args, "--out", str(tmp_path)])
        assert result.exit_code == 0, result.output
    # paced by default at the default scale; the tiny smoke test is not paced
    assert [s.period_seconds for s in seen] == [0.0, 1.2, 0.0]
    seen.pop()
    result = runner.invoke(main, ["experiment", "gossip-w2v", "--period-seconds", "-1", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--period-seconds" in result.output
    unpaced, paced = seen
    # runs saved before the setting existed are still reused unpaced, not paced
    assert "period_seconds" not in gossip_w2v._run_key(unpaced)
    assert gossip_w2v._run_key(paced)["period_seconds"] == 1.2
    # pacing changes nothing in the centralized models
    assert gossip_w2v._central_key(unpaced) == gossip_w2v._central_key(paced)
    assert "at least 1.2 s per 10 batches" in gossip_w2v._gossip_step({**asdict(paced), "lr": 0.025})
    # every exchanging configuration is paced to the same time per batch; local-only is not paced
    by_name = {c.name: gossip_w2v.agent_gossip(c, paced) for c in gossip_w2v.configurations(paced)}
    assert by_name["random-frequent"]["period_seconds"] == pytest.approx(1.2)
    assert by_name["random-infrequent"]["period_seconds"] == pytest.approx(6.0)
    assert "period_seconds" not in by_name["local"]
    assert all("period_seconds" not in gossip_w2v.agent_gossip(c, unpaced) for c in gossip_w2v.configurations(unpaced))
    assert "at least" not in gossip_w2v._gossip_step({**asdict(unpaced), "lr": 0.025})
