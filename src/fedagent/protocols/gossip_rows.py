"""Per-row push-sum for embedding tables (the thesis's per-word counts, Ch. 5).

Plain push-sum gives a whole model one mass: a word that only one node ever sees is
averaged with the other nodes' untrained copies of its row, so the node's update is
diluted N-fold and its own copy must overshoot by N to move the consensus by the right
amount. Here every row of an exchanged table carries its own mass, initially the
node's count of the word (+1, so no row is massless): a row is merged as the
mass-weighted mean of its copies, the masses add, and a send halves them, exactly as
push-sum does for a whole model. With training off, every row converges to the
count-weighted mean of its initial copies, and nothing is lost (the masses of each row
add up to the same total everywhere, at all times).

The matching step size (stochastic gradient push per row): a node moves a row's
consensus by ``its row mass / the row's total mass`` of its own change, so to make the
consensus follow the sum of all nodes' updates the node scales its step on the row by
``total / own`` (:func:`row_step_scale`, clipped): about N for a word every node sees
as often, about 1 for a word only this node sees.

Pure numpy: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def initial_row_mass(local_counts: np.ndarray) -> np.ndarray:
    """A node's starting mass per row: its count of the word + 1."""
    c = np.asarray(local_counts, dtype=np.float64)
    if c.ndim != 1 or np.any(c < 0) or not np.all(np.isfinite(c)):
        raise ValueError("local counts must be a finite, non-negative vector")
    return c + 1.0


def merge_rows(entries: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise mass-weighted mean of ``(table V x d, mass V)`` pairs and the summed masses."""
    if not entries:
        raise ValueError("nothing to merge")
    shape = entries[0][0].shape
    total = np.zeros(shape[0], dtype=np.float64)
    acc = np.zeros(shape, dtype=np.float64)
    for table, mass in entries:
        m = np.asarray(mass, dtype=np.float64)
        if table.shape != shape or m.shape != (shape[0],):
            raise ValueError(f"table {table.shape} / mass {m.shape} do not match {shape}")
        if np.any(m < 0) or not np.all(np.isfinite(m)):
            raise ValueError("row masses must be finite and non-negative")
        acc += m[:, None] * table
        total += m
    safe = np.where(total > 0, total, 1.0)
    merged = acc / safe[:, None]
    # a row nobody has mass for keeps the first entry's values
    merged[total <= 0] = entries[0][0][total <= 0]
    return merged.astype(entries[0][0].dtype), total


def split_mass(mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A send: half of every row's mass travels, half stays."""
    half = np.asarray(mass, dtype=np.float64) / 2
    return half, half.copy()


def row_step_scale(total_mass: np.ndarray, own_mass: np.ndarray, low: float, high: float) -> np.ndarray:
    """Per-row step factor ``total / own`` clipped to ``[low, high]``."""
    if not 0 < low <= high:
        raise ValueError("0 < low <= high is required")
    own = np.maximum(np.asarray(own_mass, dtype=np.float64), 1e-12)
    return np.clip(np.asarray(total_mass, dtype=np.float64) / own, low, high).astype(np.float32)
