"""Built-in task: 1,797 real 8x8 digit images (UCI optdigits' test set), split non-IID.

The data set ships inside fedagent (``tasks/data/digits.csv.gz``, the file scikit-learn's
``load_digits`` reads; see the README next to it), so this runs offline and needs
nothing beyond numpy and torch. A fixed 25 % test split
is held out (the same on every node); the rest is split across ``shards`` nodes by a
Dirichlet(``alpha``) draw over each class, the usual label-skew non-IID split: with a
small alpha a node sees few classes, and its local-only model is poor on the others.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch import nn

from fedagent.errors import ConfigError
from fedagent.tasks.base import Task

DIGITS_FILE = "digits.csv.gz"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Pixels scaled to [0, 1] (N x 64, float32) and digits (N, int64)."""
    with resources.files("fedagent.tasks").joinpath("data", DIGITS_FILE).open("rb") as raw, gzip.open(raw) as f:
        data = np.loadtxt(f, delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    return x, data[:, -1].astype(np.int64)


def train_test_split(
    x: np.ndarray, y: np.ndarray, seed: int = 0, test_fraction: float = 0.25
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def dirichlet_split(y: np.ndarray, shards: int, alpha: float, seed: int = 0, min_size: int = 10) -> list[np.ndarray]:
    """Indices of each shard: every class divided by proportions ~ Dirichlet(alpha)."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(shards)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * shards)) * len(idx)).astype(int)[:-1]
            for s, chunk in enumerate(np.split(idx, cuts)):
                parts[s].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ConfigError(f"could not split {len(y)} samples into {shards} shards of >= {min_size} (alpha={alpha})")


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsTask(Task):
    uses_torch_optimiser = True

    def __init__(self, *, shard: int | None, shards: int, alpha: float, seed: int) -> None:
        x, y = load_digits_arrays()
        (xtr, ytr), (xte, yte) = train_test_split(x, y, seed=seed)
        if shard is not None:
            if not 0 <= shard < shards:
                raise ConfigError(f"digits: shard {shard} not in 0..{shards - 1}")
            idx = dirichlet_split(ytr, shards, alpha, seed=seed)[shard]
            xtr, ytr = xtr[idx], ytr[idx]
        self.x_train, self.y_train = torch.from_numpy(xtr), torch.from_numpy(ytr)
        self.x_test, self.y_test = torch.from_numpy(xte), torch.from_numpy(yte)
        self.seed = seed

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return DigitsMLP()

    def num_samples(self) -> int:
        return len(self.y_train)

    def _train(self, model: nn.Module, lr: float, batches: Iterator[torch.Tensor]) -> dict[str, float]:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        total, count = 0.0, 0
        for b in batches:
            opt.zero_grad()
            loss = loss_fn(model(self.x_train[b]), self.y_train[b])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
            count += len(b)
        return {"loss": total / max(count, 1)}

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        gen = torch.Generator().manual_seed(seed)
        n = len(self.y_train)

        def batches() -> Iterator[torch.Tensor]:
            for _ in range(epochs):
                order = torch.randperm(n, generator=gen)
                for start in range(0, n, batch_size):
                    yield order[start : start + batch_size]

        return self._train(model, lr, batches())

    def fit_steps(self, model: nn.Module, *, steps: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        """``steps`` mini-batches, each drawn without replacement within an epoch's
        permutation (a new permutation, from ``seed``, whenever one runs out)."""
        gen = torch.Generator().manual_seed(seed)
        n = len(self.y_train)

        def batches() -> Iterator[torch.Tensor]:
            order, pos = torch.randperm(n, generator=gen), 0
            for _ in range(steps):
                if pos >= n:
                    order, pos = torch.randperm(n, generator=gen), 0
                yield order[pos : pos + batch_size]
                pos += batch_size

        return self._train(model, lr, batches())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        model.eval()
        logits = model(self.x_test)
        loss = nn.functional.cross_entropy(logits, self.y_test)
        acc = (logits.argmax(1) == self.y_test).float().mean()
        return {"accuracy": float(acc), "test_loss": float(loss)}


def make(options: dict[str, Any]) -> DigitsTask:
    """Options: ``shard`` (this node's index; absent = all training data), ``shards``,
    ``alpha`` (Dirichlet concentration, default 0.5), ``seed`` (same on every node)."""
    known = {"shard", "shards", "alpha", "seed"}
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"digits: unknown options {sorted(unknown)}; known: {sorted(known)}")
    shard = options.get("shard")
    return DigitsTask(
        shard=None if shard is None else int(shard),
        shards=int(options.get("shards", 1)),
        alpha=float(options.get("alpha", 0.5)),
        seed=int(options.get("seed", 0)),
    )
