"""A user-defined fedagent task: logistic regression on your own CSV file.

Point an agent at it in its config::

    [task]
    name = "custom_task:make"     # module:attribute; the module must be importable
    csv = "data/train.csv"        # relative to the config file's directory

(put this file's directory on PYTHONPATH, or install it as a package). ``make`` gets
the ``[task]`` table without ``name`` and returns a :class:`fedagent.tasks.base.Task`;
``@file_options("csv")`` says that ``csv`` names a file, so a relative path is taken
from the config file's directory. Every node of a federation must build the same
architecture; the data stays local.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fedagent.tasks.base import Task, file_options


class CsvLogistic(Task):
    def __init__(self, csv: str | None, features: int, classes: int) -> None:
        if csv:
            data = np.loadtxt(csv, delimiter=",", dtype=np.float32)
            x, y = data[:, :-1], data[:, -1].astype(np.int64)
        else:  # no file given: a small synthetic problem, so the example runs as is
            rng = np.random.default_rng(0)
            x = rng.normal(size=(200, features)).astype(np.float32)
            y = (x[:, 0] > 0).astype(np.int64)
        split = int(0.8 * len(y))
        self.x, self.y = torch.from_numpy(x[:split]), torch.from_numpy(y[:split])
        self.xt, self.yt = torch.from_numpy(x[split:]), torch.from_numpy(y[split:])
        self.features, self.classes = x.shape[1], classes

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)  # same initial weights on every node
        return nn.Linear(self.features, self.classes)

    def num_samples(self) -> int:
        return len(self.y)

    def fit(self, model, *, epochs, lr, batch_size, seed):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for idx in torch.randperm(len(self.y), generator=gen).split(batch_size):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
                loss.backward()
                opt.step()
        return {"loss": float(loss.detach())}

    @torch.no_grad()
    def evaluate(self, model):
        return {"accuracy": float((model(self.xt).argmax(1) == self.yt).float().mean())}


@file_options("csv")
def make(options: dict[str, Any]) -> CsvLogistic:
    return CsvLogistic(options.get("csv"), int(options.get("features", 4)), int(options.get("classes", 2)))
