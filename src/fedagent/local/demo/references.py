"""What the demo compares a federated model with: the same digits model trained with plain
local SGD on one agent's shard (local only) or on the union of the shards (centralized)."""

from __future__ import annotations

import math
from typing import Any

from fedagent.local.federation import BATCH, LR, SEED


def train_reference(options: dict[str, Any], epochs: int) -> float:
    """Accuracy of a model trained with plain local SGD on the data ``options`` selects."""
    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    for e in range(epochs):
        task.fit(model, epochs=1, lr=LR, batch_size=BATCH, seed=e + 1)
    return task.evaluate(model)["accuracy"]


def train_reference_steps(options: dict[str, Any], steps: int, lr: float = LR, cosine: bool = False) -> float:
    """Accuracy after ``steps`` plain local SGD mini-batches (gossip's local-only and
    centralized baselines), with the gossip agents' cosine step-size decay if asked."""

    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    done, chunk = 0, 10
    while done < steps:
        n = min(chunk, steps - done)
        lr_t = lr * 0.5 * (1.0 + math.cos(math.pi * done / steps)) if cosine else lr
        task.fit_steps(model, steps=n, lr=lr_t, batch_size=BATCH, seed=done + 1)
        done += n
    return task.evaluate(model)["accuracy"]
