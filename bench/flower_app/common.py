"""Shared by the Flower benchmark scripts (they run in bench/.venv-flower, not in
fedagent's virtualenv): the same model shape as fedagent's benchmark."""

from __future__ import annotations

import numpy as np


def model_weights(params: int, seed: int = 0, tensors: int = 16) -> list[np.ndarray]:
    """The tensors of bench/env.py's model_weights, as the list Flower passes around."""
    rng = np.random.default_rng(seed)
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    return [rng.standard_normal(n, dtype=np.float32) for n in sizes]
