"""The two scores of gFedNTM Sec. 4.1 (shared/seeds/000), for a synthetic corpus whose
true topics ``beta`` and document proportions ``theta`` are known.

Both rest on the similarity of two distributions p, q derived from their Hellinger
distance, ``s(p, q) = 1 - H^2(p, q)`` with ``H^2(p, q) = 1/2 sum_i (sqrt p_i - sqrt q_i)^2
= 1 - sum_i sqrt(p_i q_i)``; so ``s(p, q) = sum_i sqrt(p_i q_i)`` (the Bhattacharyya
coefficient), 1 for identical and 0 for disjoint distributions. (The paper prints
``1 - (sqrt(theta_i) sqrt(theta_j)^T)^2``, which would give 0 for identical
distributions; its text defines the similarity as ``1 - H^2``, which is what is
implemented here.)

* Doc-similarity score: ``sum_{i<j} |s(theta_i, theta_j) - s(theta*_i, theta*_j)|`` over
  every pair of documents, theta from the model and theta* the truth. Smaller is better;
  it compares similarity structure, so the model's topics need not be aligned with the
  true ones (nor have the same number).
* Topic similarity score: ``TSS = sum_k max_k' s(beta*_k, beta_k')``, each true topic
  matched to its closest learnt topic. At most K (the number of true topics); larger is
  better.
"""

from __future__ import annotations

import numpy as np


def _check(p: np.ndarray, name: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of distributions (one per row)")
    if (p < -1e-12).any() or not np.isfinite(p).all():
        raise ValueError(f"{name} has negative or non-finite entries")
    return np.clip(p, 0.0, None)


def similarity(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``1 - H^2`` between every row of ``p`` (n x d) and every row of ``q`` (m x d)."""
    p, q = _check(p, "p"), _check(q, "q")
    if p.shape[1] != q.shape[1]:
        raise ValueError("p and q are distributions over different supports")
    return np.sqrt(p) @ np.sqrt(q).T


def doc_similarity_score(
    theta_model: np.ndarray, theta_true: np.ndarray, chunk: int = 2048, per_document: bool = False
) -> float:
    """Sum over document pairs i < j of |s_model(i, j) - s_true(i, j)|. With
    ``per_document`` the sum over all ordered pairs divided by the number of documents
    (twice the pair sum over n), the scale of the authors' released evaluation code,
    which does not grow with the size of the evaluation set."""
    a, b = np.sqrt(_check(theta_model, "theta_model")), np.sqrt(_check(theta_true, "theta_true"))
    if a.shape[0] != b.shape[0]:
        raise ValueError("theta_model and theta_true describe different numbers of documents")
    n, total = a.shape[0], 0.0
    # Row blocks keep memory at chunk x n instead of n x n for thousands of documents.
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        diff = np.abs(a[start:stop] @ a.T - b[start:stop] @ b.T)
        rows = np.arange(start, stop)[:, None]
        total += float(diff[np.arange(n)[None, :] > rows].sum())
    return 2.0 * total / max(n, 1) if per_document else total


def topic_similarity_score(beta_true: np.ndarray, beta_model: np.ndarray) -> float:
    """TSS: sum over true topics of the similarity to the closest learnt topic."""
    sim = similarity(beta_true, beta_model)
    return float(sim.max(axis=1).sum())
