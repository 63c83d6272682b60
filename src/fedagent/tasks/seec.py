"""SEEC's vector-space mapper (Algorithm 2, ``Map_j``), as a plain torch function.

Two sites that trained their own embedding models vectorise the same *public* documents
(SEEC uses 20-newsgroups); site i learns a map from its vectors to site j's with a
multi-layer perceptron: one hidden layer of 1200 units, dropout 0.2, the cosine
embedding loss (the search ranks by cosine), Adam with learning rate 1e-5, 20 epochs,
batches of 64 (Sec. V-A-2). Input and output sizes may differ. The paper does not name
the hidden activation; this uses ReLU. Only vectors of public documents are needed, so
only they would ever cross the network. With SEEC's 18,846 public documents its
settings make ~5,900 Adam steps; the 200-post sample gensim ships gives 80, so callers
on the small sample pass a larger ``lr`` or more ``epochs`` (and say so).

The live protocol that uses it (public-vector exchange, a mapper per peer, the query
mapped into each peer's space) is :mod:`fedagent.agent.search` with
``[search] space = "mapped"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

HIDDEN, DROPOUT, LR, EPOCHS, BATCH = 1200, 0.2, 1e-5, 20, 64


# ---- a site's own model in a mapped federation --------------------------------------------------
# The agent (agent/search.py, ``[search] space = "mapped"``) and the SEEC experiment's
# in-process mapping rows both call these, so the two compute the same thing for the same
# ``[search] seed``.
def train_own_model(task: Any, *, epochs: int, lr: float, batch_size: int, seed: int) -> nn.Module:
    """A site's own model on its own documents: one epoch at a time with the step decaying
    to 0 along a half cosine (the coordinator's "cosine" schedule; a constant step leaves
    the last epochs' noise in the vectors), epoch ``e`` (0-based) drawn with seed
    ``seed * 1000 + e + 1``."""
    model = task.build_model()
    for e in range(epochs):
        step = lr * 0.5 * (1.0 + math.cos(math.pi * e / epochs))
        task.fit(model, epochs=1, lr=step, batch_size=batch_size, seed=seed * 1000 + e + 1)
    return model


def public_vectors(task: Any, model: nn.Module, public: Sequence[Sequence[str]], seed: int) -> np.ndarray:
    """The public documents as vectors of a site's own model (what mappers learn from)."""
    return np.asarray(task.infer_vectors(model, list(public), seed=seed + 5)[0], dtype=np.float32)


class Mapper(nn.Module):
    def __init__(self, d_in: int, d_out: int, hidden: int = HIDDEN, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train_mapper(
    source: np.ndarray,
    target: np.ndarray,
    *,
    hidden: int = HIDDEN,
    dropout: float = DROPOUT,
    lr: float = LR,
    epochs: int = EPOCHS,
    batch_size: int = BATCH,
    seed: int = 0,
) -> Mapper:
    """Fit a mapper from ``source`` rows to ``target`` rows (the same public documents)."""
    # Copies: a peer's public vectors arrive as read-only views of the message buffer,
    # which torch.from_numpy accepts only with a warning on the agent's stderr.
    source = np.array(source, dtype=np.float32)
    target = np.array(target, dtype=np.float32)
    if source.ndim != 2 or target.ndim != 2 or len(source) != len(target) or not len(source):
        raise ValueError("source and target must be 2-D with one row per public document each")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout masks draw from the global generator
    mapper = Mapper(source.shape[1], target.shape[1], hidden, dropout)
    x, y = torch.from_numpy(source), torch.from_numpy(target)
    opt = torch.optim.Adam(mapper.parameters(), lr=lr)
    loss_fn = nn.CosineEmbeddingLoss()
    ones = torch.ones(len(x))
    mapper.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for start in range(0, len(x), batch_size):
            b = order[start : start + batch_size]
            opt.zero_grad()
            loss_fn(mapper(x[b]), y[b], ones[: len(b)]).backward()
            opt.step()
    mapper.eval()
    return mapper


@torch.no_grad()
def map_vectors(mapper: Mapper, vectors: np.ndarray) -> np.ndarray:
    mapper.eval()
    return mapper(torch.from_numpy(np.array(vectors, dtype=np.float32))).numpy()  # a copy: see train_mapper
