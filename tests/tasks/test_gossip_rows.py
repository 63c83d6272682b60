"""Per-row push-sum (protocols/gossip_rows.py) and the per-row step of sgns_update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedagent.protocols.gossip_rows import initial_row_mass, merge_rows, row_step_scale, split_mass
from fedagent.tasks.word2vec import sgns_update


def test_merge_rows_weights_each_row_by_its_own_mass():
    a = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
    b = np.array([[3.0, 3.0], [4.0, 8.0]], np.float32)
    merged, mass = merge_rows([(a, np.array([3.0, 0.0])), (b, np.array([1.0, 2.0]))])
    assert merged.dtype == np.float32
    np.testing.assert_allclose(merged[0], [1.5, 1.5])  # (3*1 + 1*3) / 4
    np.testing.assert_allclose(merged[1], [4.0, 8.0])  # only b has mass for row 1
    np.testing.assert_allclose(mass, [4.0, 2.0])


def test_merge_rows_rejects_bad_input():
    t = np.zeros((2, 3))
    with pytest.raises(ValueError):
        merge_rows([])
    with pytest.raises(ValueError):
        merge_rows([(t, np.ones(3))])
    with pytest.raises(ValueError):
        merge_rows([(t, np.array([1.0, -1.0]))])
    with pytest.raises(ValueError):
        initial_row_mass(np.array([1.0, np.nan]))


def test_rowwise_pushsum_conserves_mass_and_reaches_the_count_weighted_mean():
    rng = np.random.default_rng(0)
    n, v, d = 8, 5, 3
    tables = [rng.normal(size=(v, d)) for _ in range(n)]
    counts = [rng.integers(0, 20, size=v).astype(float) for _ in range(n)]
    counts[0][4] = 50.0
    for c in counts[1:]:
        c[4] = 0.0  # word 4: (almost) only node 0 has seen it
    masses = [initial_row_mass(c) for c in counts]
    target = sum(m[:, None] * t for m, t in zip(masses, tables)) / sum(masses)[:, None]
    total = sum(masses)
    for _ in range(200):
        sends = []
        for i in range(n):
            travel, masses[i] = split_mass(masses[i])
            sends.append((int(rng.choice([j for j in range(n) if j != i])), tables[i].copy(), travel))
        inbox: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        for dst, t, m in sends:
            inbox[dst].append((t, m))
        for i in range(n):
            tables[i], masses[i] = merge_rows([(tables[i], masses[i])] + inbox[i])
        np.testing.assert_allclose(sum(masses), total)
    for t in tables:
        np.testing.assert_allclose(t, target, atol=1e-6)
    # the rare word's consensus is node 0's row, barely diluted by the others
    assert np.linalg.norm(target[4] - tables[0][4]) < 1e-6


def test_row_step_scale_is_total_over_own_clipped():
    f = row_step_scale(np.array([100.0, 100.0, 100.0]), np.array([10.0, 100.0, 1.0]), 1.0, 20.0)
    np.testing.assert_allclose(f, [10.0, 1.0, 20.0])
    with pytest.raises(ValueError):
        row_step_scale(np.ones(2), np.ones(2), 0.0, 1.0)


def test_sgns_row_scale_multiplies_each_rows_step():
    g = torch.Generator().manual_seed(0)
    w_in, w_out = torch.randn(6, 4, generator=g) * 0.1, torch.randn(6, 4, generator=g) * 0.1
    inputs, contexts = torch.tensor([0, 1, 1, 2]), torch.tensor([3, 4, 5, 3])
    noise = torch.tensor([[5, 4], [3, 0], [2, 2], [1, 5]])
    plain_in, plain_out = w_in.clone(), w_out.clone()
    sgns_update(plain_in, plain_out, inputs, contexts, noise, 0.1)
    scaled_in, scaled_out = w_in.clone(), w_out.clone()
    s_in = torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 1.0])
    s_out = torch.tensor([1.0, 1.0, 1.0, 0.5, 4.0, 1.0])
    sgns_update(scaled_in, scaled_out, inputs, contexts, noise, 0.1, row_scale=(s_in, s_out))
    torch.testing.assert_close(scaled_in - w_in, (plain_in - w_in) * s_in[:, None])
    torch.testing.assert_close(scaled_out - w_out, (plain_out - w_out) * s_out[:, None])
