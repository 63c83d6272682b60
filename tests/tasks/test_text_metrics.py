"""Word and document vector quality measures, checked against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedagent.tasks.text_metrics import (
    WordVectors,
    nearest,
    neighbour_overlap,
    overlap_at_k,
    sim_k,
    similarity_benchmark,
    spearman,
)


def test_spearman_hand_computed():
    # ranks x: 1 2 3 4 5; y: 2 1 4 3 5 -> d^2 = 1+1+1+1+0 = 4, rho = 1 - 6*4/(5*24) = 0.8
    assert spearman([1, 2, 3, 4, 5], [20, 10, 40, 30, 50]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 2], [1, 2]))
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_similarity_benchmark_uses_covered_pairs_only():
    v = WordVectors(["cat", "tiger", "car", "plane"], np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.2, 1.0]]))
    pairs = [("Cat", "Tiger", 9.0), ("car", "plane", 6.0), ("cat", "car", 1.0), ("cat", "unicorn", 5.0)]
    s = similarity_benchmark(pairs, v)
    # cosines: cat-tiger 0.994, car-plane 0.981, cat-car 0 -> same order as the human scores
    assert s.rho == pytest.approx(1.0)
    assert (s.pairs_used, s.pairs_total) == (3, 4)
    assert s.coverage == pytest.approx(0.75)


def test_nearest_excludes_self_and_breaks_ties_by_row():
    m = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.7, 0.7]])
    assert nearest(m, [0], 2).tolist() == [[1, 3]]
    assert nearest(m, [0], 2, include_self=True).tolist() == [[0, 1]]
    assert nearest(m, [], 2, query_vectors=np.array([0.0, 2.0])).tolist() == [[2, 3]]


def test_neighbour_overlap_counts_shared_neighbours():
    terms = ["a", "b", "c", "d", "e"]
    ref = WordVectors(terms, np.array([[1, 0], [0.99, 0.1], [0.9, 0.4], [0, 1], [-1, 0]], dtype=float))
    # model: a's 2 nearest are c, d (ref: b, c) -> 1 shared; d's are c, b (ref: c, b) -> 2 shared
    model = WordVectors(terms, np.array([[1, 0], [0.1, 1], [0.95, 0.3], [0.3, 1], [-1, 0]], dtype=float))
    s = neighbour_overlap(model, ref, words=["a", "d", "zzz"], n=2)
    assert dict(s.per_word) == {"a": 1, "d": 2}
    assert s.total == 3 and s.words_used == 2
    assert s.fraction == pytest.approx(3 / 4)
    assert neighbour_overlap(ref, ref, words=["a", "d"], n=2).fraction == 1.0


def test_sim_k_hand_computed():
    central = [["d1", "d2", "d3"], ["d4", "d5", "d6"]]
    federated = [["d2", "d9", "d1"], ["d7", "d8", "d9"]]
    # (2/3 + 0/3) / 2
    assert overlap_at_k(central, federated, 3) == pytest.approx(1 / 3)
    assert overlap_at_k(central, federated, 1) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        overlap_at_k(central, federated[:1], 3)


def test_sim_k_on_vectors_is_one_for_a_rotation_and_lower_for_noise():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8))
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    assert sim_k(x, x @ q, k=10) == pytest.approx(1.0)  # cosine neighbours survive a rotation
    noisy = sim_k(x, x + rng.normal(scale=1.0, size=x.shape), k=10)
    assert 0.0 < noisy < 0.9
    unrelated = sim_k(x, rng.normal(size=x.shape), k=10)
    assert unrelated < noisy


def test_analogy_accuracy_excludes_question_words_and_reports_coverage():
    # king - man + woman = (1, 1) -> queen (1, 1) wins over king itself (excluded)
    v = WordVectors(
        ["king", "man", "woman", "queen", "apple"],
        np.array([[1.0, 0.2], [1.0, 0.0], [0.8, 0.8], [0.75, 0.8], [-1.0, 0.1]]),
    )
    from fedagent.tasks.text_metrics import analogy_accuracy

    s = analogy_accuracy(
        v, [("man", "king", "woman", "queen"), ("man", "woman", "king", "apple"), ("man", "king", "woman", "princess")]
    )
    # question 2: woman - man + king = (0.8, 1.0) -> queen, not apple: wrong
    assert (s.pairs_used, s.pairs_total) == (2, 3)
    assert s.rho == pytest.approx(0.5)
