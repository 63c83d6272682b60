"""Pieces of ``fedagent experiment gossip-w2v`` that need no daemons: the centralized
reference must be a function of its seed alone, because the learning curve reuses the
reference run as its point at the full budget."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.experiments.gossip_w2v import Scale, centralized, learning_curve
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
