"""gFedNTM's Hellinger-based scores against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedagent.tasks.ntm_scores import doc_similarity_score, similarity, topic_similarity_score

R = math.sqrt(0.5)  # sqrt(0.5 * 1): similarity of (1/2, 1/2) and (1, 0)


def test_similarity_is_one_minus_squared_hellinger():
    p = np.array([[1.0, 0.0], [0.5, 0.5], [0.25, 0.75]])
    q = np.array([[0.0, 1.0], [1.0, 0.0], [0.75, 0.25]])
    s = similarity(p, q)
    assert s.shape == (3, 3)
    assert s[0, 0] == pytest.approx(0.0)  # disjoint
    assert s[0, 1] == pytest.approx(1.0)  # identical
    assert s[1, 1] == pytest.approx(R)
    assert s[2, 2] == pytest.approx(2 * math.sqrt(0.1875))  # 0.8660
    # 1 - H^2 with H^2 = 1/2 sum (sqrt p - sqrt q)^2, computed the long way
    h2 = 0.5 * ((math.sqrt(0.25) - math.sqrt(0.75)) ** 2 + (math.sqrt(0.75) - math.sqrt(0.25)) ** 2)
    assert s[2, 2] == pytest.approx(1 - h2)


def test_topic_similarity_score_matches_each_true_topic_to_its_closest():
    beta_true = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    beta_model = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert topic_similarity_score(beta_true, beta_model) == pytest.approx(2 * R)
    assert topic_similarity_score(beta_true, beta_true) == pytest.approx(2.0)
    # more learnt topics than true ones: still at most K
    assert topic_similarity_score(beta_true, np.vstack([beta_model, beta_true])) == pytest.approx(2.0)


@pytest.mark.parametrize("chunk", [1, 2, 2048])
def test_doc_similarity_score_sums_absolute_differences_over_pairs(chunk):
    theta_true = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    theta_model = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # true pair similarities: (0,1) 0, (0,2) R, (1,2) R; model: all 1
    expected = 1.0 + 2 * (1 - R)
    assert doc_similarity_score(theta_model, theta_true, chunk=chunk) == pytest.approx(expected)
    assert doc_similarity_score(theta_true, theta_true, chunk=chunk) == pytest.approx(0.0)
    assert doc_similarity_score(theta_model, theta_true, chunk=chunk, per_document=True) == pytest.approx(
        2 * expected / 3
    )


def test_scores_refuse_mismatched_inputs():
    with pytest.raises(ValueError):
        similarity(np.ones((2, 3)) / 3, np.ones((2, 4)) / 4)
    with pytest.raises(ValueError):
        doc_similarity_score(np.ones((3, 2)) / 2, np.ones((4, 2)) / 2)
    with pytest.raises(ValueError):
        topic_similarity_score(np.array([[-0.5, 1.5]]), np.array([[0.5, 0.5]]))
