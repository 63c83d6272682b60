"""fedagent's side of the time-to-accuracy benchmark: the built-in digits task (its data,
its train/test split and its Dirichlet split) with the shared CNN and training loop of
bench/flower_app/tta/tta_model.py, which Flower's side runs too.

Config: ``[task] name = "bench.tta_task:make"`` with the digits options (``shard``,
``shards``, ``alpha``, ``seed``); the daemons need the repository root on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.flower_app.tta import tta_model
from fedagent.tasks import digits


class TtaDigitsTask(digits.DigitsTask):
    def build_model(self) -> nn.Module:
        return tta_model.build_model(self.seed)

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        return tta_model.train(
            model, self.x_train, self.y_train, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return tta_model.evaluate(model, self.x_test, self.y_test)


def make(options: dict[str, Any]) -> TtaDigitsTask:
    base = digits.make(options)  # validates the options the same way
    shard = options.get("shard")
    return TtaDigitsTask(
        shard=None if shard is None else int(shard),
        shards=int(options.get("shards", 1)),
        alpha=float(options.get("alpha", 0.5)),
        seed=base.seed,
    )
