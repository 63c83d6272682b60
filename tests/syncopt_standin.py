"""A tiny Sync-Opt task with the API of tasks/ntm.py (term_counts, set_vocabulary,
step_loss seeded by (seed, shard, step), make_optimizer): a bag-of-words logistic
regression with dropout on synthetic documents. Used by the Sync-Opt tests as
``task = "syncopt_standin:make"`` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedagent.tasks.base import Task

WORDS = [f"w{i:03d}" for i in range(60)]


class StandIn(Task):
    def __init__(self, shard: int, shards: int, seed: int, batch_size: int = 8, docs: int = 40) -> None:
        self.shard, self.seed, self.batch_size = shard, seed, batch_size
        rng = np.random.default_rng((seed, shard))
        # Each shard uses an overlapping slice of the words, so the union is bigger than any one.
        lo = 5 * shard
        self.local_terms = WORDS[lo:lo + 30]
        self.docs = [list(rng.choice(self.local_terms, size=int(rng.integers(5, 15)))) for _ in range(docs)]
        self.labels = np.array([int(d[0] < self.local_terms[15]) for d in self.docs], dtype=np.float32)
        self.terms = list(self.local_terms)
        self._index()

    def _index(self) -> None:
        col = {t: j for j, t in enumerate(self.terms)}
        x = np.zeros((len(self.docs), len(self.terms)), dtype=np.float32)
        for i, d in enumerate(self.docs):
            for w in d:
                if w in col:
                    x[i, col[w]] += 1
        self.x = x

    def term_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.docs:
            for w in d:
                out[w] = out.get(w, 0) + 1
        return out

    def set_vocabulary(self, terms) -> None:
        self.terms = list(terms)
        self._index()

    def build_model(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return nn.Sequential(nn.Linear(len(self.terms), 8), nn.Softplus(), nn.Linear(8, 1))

    def make_optimizer(self, params):
        return torch.optim.Adam(params, lr=2e-2, betas=(0.99, 0.999))

    def num_samples(self) -> int:
        return len(self.docs)

    def num_batches(self) -> int:
        return len(self.docs) // self.batch_size

    def step_loss(self, model: nn.Module, step: int):
        epoch, b = divmod(step, self.num_batches())
        perm = np.random.default_rng((self.seed, self.shard, epoch)).permutation(len(self.docs))
        idx = np.sort(perm[b * self.batch_size:(b + 1) * self.batch_size])
        gen = torch.Generator().manual_seed(hash((self.seed, self.shard, step)) % 2**31)
        x = torch.from_numpy(self.x[idx])
        mask = (torch.rand(x.shape, generator=gen) > 0.2).float() / 0.8
        logits = model(x * mask).squeeze(1)
        y = torch.from_numpy(self.labels[idx])
        return nn.functional.binary_cross_entropy_with_logits(logits, y), len(idx)

    def fit(self, model, *, epochs, lr, batch_size, seed):
        return {}

    def evaluate(self, model):
        return {}


def make(options: dict) -> StandIn:
    return StandIn(int(options.get("shard", 0)), int(options.get("shards", 1)), int(options.get("seed", 0)),
                   int(options.get("batch_size", 8)))


def centralized_step(model, optimizer, tasks, step) -> float:
    optimizer.zero_grad()
    losses, sizes = zip(*(t.step_loss(model, step) for t in tasks))
    loss = sum(n * l for n, l in zip(sizes, losses)) / sum(sizes)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
