"""Pure helpers of the SEEC study (no training): the man-page section, the quality
measures that do not depend on agreement, and the grid of settings."""

from __future__ import annotations

from fedagent_experiments.seec import Scale, options
from fedagent_experiments.seec_study import main, quality, scales, section


def test_section_reads_the_digit_of_the_title():
    assert section("open(2)") == "2"
    assert section("open_how(2type)") == "2"
    assert section("EOF(3const)") == "3"
    assert section("conf(5)") == "5"
    assert section("untitled") == ""


def test_quality_counts_majority_sections_and_distinct_neighbours():
    labels = ["a", "a", "b", "b", "b"]
    # the lists collapse onto documents 1 and 2: 3 distinct documents in all lists
    hub = [[2, 1], [2, 1], [1, 0], [2, 1], [2, 1]]
    q = quality(hub, labels, 2)
    assert q["hubness"] == 3 and q["max_in"] == 5
    # docs 0 and 1: a tie b/a goes to the nearest's label (b): wrong; doc 2: a, a: wrong;
    # docs 3 and 4: the tie goes to b: right
    assert q["knn_section"] == 2 / 5
    good = [[1, 0], [0, 1], [3, 4], [4, 2], [3, 2]]
    q = quality(good, labels, 2)
    assert q["knn_section"] == 1.0 and q["hubness"] == 5 and q["max_in"] == 2
    # k cuts each list
    assert quality([[1, 2, 3], [0, 2, 3]], ["a", "a", "b", "b"], 1)["hubness"] == 2


def test_grid_settings_reach_the_task_options(tmp_path):
    import argparse

    args = argparse.Namespace(
        seed=[0, 1], min_count=[2], epochs=[10], dim=[50, 100], negative=[5], sample=[1e-3, 0.0], limit=0
    )
    grid = scales(args)
    assert len(grid) == 8 and [s.seed for s in grid[:4]] == [0] * 4
    assert {(s.dim, s.sample) for s in grid} == {(50, 1e-3), (50, 0.0), (100, 1e-3), (100, 0.0)}
    o = options(Scale(dim=100, negative=15, sample=0.0))
    assert (o["dim"], o["negative"], o["sample"]) == (100, 15, 0.0)
    # the defaults are the task's own
    from fedagent.tasks.doc2vec import DEFAULTS

    assert (Scale.negative, Scale.sample) == (DEFAULTS["negative"], DEFAULTS["sample"])
    # a bad value is refused by the command line before anything trains
    try:
        main([str(tmp_path / "x.jsonl"), "--dim", "fifty"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--dim fifty was accepted")
