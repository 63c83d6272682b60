"""The in-process gossip Word2Vec study's pure helpers: the row-wise merge of messages
that carry only changed rows, the traffic arithmetic of its mixing table, and the outer
step (base-step progress scaled at the exchange)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from fedagent_experiments.gossip_w2v_study import (
    FACTOR_NAMES,
    VARIANTS,
    Budget,
    Variant,
    outer_step,
    rowwise_mean,
    simulate,
    summarize_mixing,
    traffic_of,
)

from fedagent.tasks.word2vec import sgns_update


def test_rowwise_mean_averages_each_row_over_the_entries_that_carry_it() -> None:
    own = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], dtype=np.float32)
    a = np.array([[5.0, 5.0], [np.nan, np.nan], [7.0, 7.0]], dtype=np.float32)
    b = np.array([[np.nan, np.nan], [np.nan, np.nan], [11.0, 11.0]], dtype=np.float32)
    out = rowwise_mean([own, a, b], np.array([2.0, 1.0, 1.0]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0], [(2 * 1 + 5) / 3] * 2)  # own and a
    np.testing.assert_allclose(out[1], [2.0, 2.0])  # only own carries row 1
    np.testing.assert_allclose(out[2], [(2 * 3 + 7 + 11) / 4] * 2)


def test_traffic_counts_one_model_per_peer_at_every_boundary_but_the_last() -> None:
    base = {"period_steps": 10, "merge": "pushsum", "fanout": 1, "mix_periods": 0}
    assert traffic_of(base, 2760) == 275
    assert traffic_of({**base, "fanout": 2, "period_steps": 2}, 2760) == 2 * 1379
    assert traffic_of({**base, "merge": "allreduce", "period_steps": 1}, 2760) == 2760


def test_mixing_variants_keep_the_infrequent_configurations_five_times_less_frequent() -> None:
    by_name = {v.name: v for v in VARIANTS}
    for name in ("fan2-rate5", "rate10", "fan2-rows-rate5"):
        assert name in FACTOR_NAMES
        f, i = by_name[f"topic-frequent/{name}"], by_name[f"topic-infrequent/{name}"]
        assert i.period_steps == 5 * f.period_steps
        assert f.max_incoming == 2 * f.fanout
    assert by_name["random-frequent/fan2-rows-rate5"].changed_rows
    assert not by_name["random-frequent/fan2-rate5"].changed_rows


def test_mixing_table_reports_loss_and_bytes_per_node(tmp_path: Path) -> None:
    variant = {"period_steps": 2, "merge": "pushsum", "fanout": 2, "mix_periods": 0}
    data = {
        "central": [{"wordsim353": 0.5, "overlap_consensus": 100.0}] * 3,
        "random-frequent/fan2-rate5/seed1": {
            "wordsim353": 0.49,
            "overlap_consensus": 90.0,
            "cpu_s": 80.0,
            "models_per_node": 2758.0,
            "touched_bytes_per_node": 2.0e9,
            "variant": variant,
        },
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    table = summarize_mixing([path], 2760, ["fan2-rate5"], 8890)
    row = next(line for line in table.splitlines() if line.startswith("| random-frequent"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == "2.0 (2.0)" and cells[5] == "10.0 (10.0)"
    assert cells[6] == "2758"
    assert cells[7] == f"{2758 * 2 * 8890 * 32 * 4 / 1e6:.0f} (x 2758)"
    assert cells[8].startswith("2000 (x ")
    assert "Average over the six" not in table  # one configuration only


def test_outer_step_of_one_sgd_step_is_that_step_scaled() -> None:
    """With one batch between boundaries, the base step's progress scaled by N is the
    step at N x the base step: the outer variant then is the agents' x N rule."""
    gen = torch.Generator().manual_seed(3)
    w_in, w_out = torch.randn(20, 4, generator=gen) * 0.3, torch.randn(20, 4, generator=gen) * 0.3
    centers, contexts = torch.randint(20, (16,), generator=gen), torch.randint(20, (16,), generator=gen)
    noise = torch.randint(20, (16, 3), generator=gen)
    big_in, big_out = w_in.clone(), w_out.clone()
    sgns_update(big_in, big_out, centers, contexts, noise, 0.025 * 10)
    small_in, small_out = w_in.clone(), w_out.clone()
    sgns_update(small_in, small_out, centers, contexts, noise, 0.025)
    out_in = outer_step(w_in.numpy(), small_in.numpy(), 10.0)
    out_out = outer_step(w_out.numpy(), small_out.numpy(), 10.0)
    np.testing.assert_allclose(out_in, big_in.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_out, big_out.numpy(), rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(20)) - set(centers.tolist()))
    assert untouched and np.array_equal(out_in[untouched], w_in.numpy()[untouched])


def test_outer_variants_train_at_the_base_step() -> None:
    by_name = {v.name: v for v in VARIANTS}
    for cfg in ("random-frequent", "topic-infrequent"):
        assert by_name[cfg].outer is None and by_name[cfg].lr_factor == 10.0
        for name, scale in (("outer", 10.0), ("outer5", 5.0), ("outer20", 20.0)):
            v = by_name[f"{cfg}/{name}"]
            assert (v.lr_factor, v.outer, v.merge) == (1.0, scale, "pushsum")
            assert v.period_steps == by_name[cfg].period_steps
            assert name in FACTOR_NAMES


def test_outer_step_with_one_batch_per_period_is_the_agents_rule_in_the_simulation() -> None:
    """The wiring: exchanging after every batch (push-sum), base step + outer x 10 ends
    where the x 10 step does (4 batches per node on the real corpus; the base step
    alone ends 4e-3 to 1e-2 away, measured)."""
    b = Budget(local_steps=4)
    today = simulate(Variant("t", "random", 1), b, 1)
    outer = simulate(Variant("o", "random", 1, lr_factor=1.0, outer=10.0), b, 1)
    for x, y in zip(today, outer):
        for k in x:
            np.testing.assert_allclose(y[k], x[k], atol=1e-6)
