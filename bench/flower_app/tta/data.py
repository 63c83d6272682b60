"""Loads the benchmark's data file (written by bench/tta.py with fedagent's own digits
split, so every framework trains on the same shards and evaluates on the same held-out
set): ``x_test``/``y_test`` and ``x_<shard>``/``y_<shard>`` for every shard."""

from __future__ import annotations

import numpy as np
import torch


def load(path: str, shard: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) of ``shard`` (None: no training part)."""
    with np.load(path, allow_pickle=False) as f:
        xte, yte = torch.from_numpy(f["x_test"]), torch.from_numpy(f["y_test"])
        if shard is None:
            return xte[:0], yte[:0], xte, yte
        return torch.from_numpy(f[f"x_{shard}"]), torch.from_numpy(f[f"y_{shard}"]), xte, yte
