"""The time-to-accuracy benchmark's model and training loop, shared word for word by
fedagent's side (bench/tta_task.py) and Flower's (the scripts next to this file, run in
bench/.venv-flower): it imports only torch, never fedagent.

A CNN over the 8x8 digit images: two 3x3 convolutions, a 2x2 max-pool, a 1,024-unit
hidden layer; 1,083,338 parameters (4.3 MB as float32). Every node trains with SGD
(momentum 0.9, a fresh optimiser each round) on its own shard, as fedagent's built-in
digits task does.
"""

from __future__ import annotations

import torch
from torch import nn

#: Training settings every framework in the benchmark uses (fedagent's localfed ones).
LOCAL_EPOCHS = 2
LR = 0.05
BATCH = 32
SEED = 0
ALPHA = 0.5  # Dirichlet concentration of the label-skew split
CLIENTS = 10


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)))


def build_model(seed: int = SEED) -> DigitsCNN:
    """The same initial weights wherever it is called with the same seed."""
    torch.manual_seed(seed)
    return DigitsCNN()


def train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float, batch_size: int, seed: int
) -> dict[str, float]:
    """``epochs`` passes over (x, y) in shuffled mini-batches; the mean training loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    total, count = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), batch_size):
            b = order[start : start + batch_size]
            opt.zero_grad()
            loss = loss_fn(model(x[b]), y[b])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
            count += len(b)
    return {"loss": total / max(count, 1)}


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the held-out set."""
    model.eval()
    logits = model(x)
    return {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "test_loss": float(nn.functional.cross_entropy(logits, y)),
    }
