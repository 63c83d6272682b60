"""``synthetic``: a model of a chosen size and no real data, for benchmarks.

``params`` float32 parameters split over ``tensors`` tensors (default 4); ``fit`` moves
every weight by a small seeded step (so updates differ per node and round) unless
``train = false``. It measures what the framework costs — moving, checking and
aggregating updates — with the training time taken out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedagent.errors import ConfigError
from fedagent.tasks.base import Task


class FlatModel(nn.Module):
    def __init__(self, params: int, tensors: int) -> None:
        super().__init__()
        sizes = [params // tensors + (1 if i < params % tensors else 0) for i in range(tensors)]
        g = torch.Generator().manual_seed(0)
        self.parts = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g) * 0.01) for s in sizes)


class SyntheticTask(Task):
    def __init__(self, params: int, tensors: int, samples: int, train: bool, shard: int) -> None:
        self.params, self.tensors, self.samples, self.train, self.shard = params, tensors, samples, train, shard

    def build_model(self) -> nn.Module:
        return FlatModel(self.params, self.tensors)

    def num_samples(self) -> int:
        return self.samples

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        if self.train:
            g = torch.Generator().manual_seed(seed * 1_000_003 + self.shard)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * lr * 0.01)
        return {"loss": 1.0}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": 1.0}


def make(options: dict[str, Any]) -> SyntheticTask:
    try:
        params = int(options.get("params", 1000))
        tensors = int(options.get("tensors", 4))
        samples = int(options.get("samples", 100))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"synthetic task: {exc}") from None
    if params < tensors or tensors < 1 or samples < 1:
        raise ConfigError("synthetic task: needs params >= tensors >= 1 and samples >= 1")
    return SyntheticTask(params, tensors, samples, bool(options.get("train", True)), int(options.get("shard", 0)))
