"""Early stopping on a validation loss: the loss of the federated model pooled from one
scalar and one count per participant, and the patience rule that decides when training
ends and which epoch's model is kept."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


def pooled_validation_loss(losses: Mapping[str, tuple[float, int]]) -> float:
    """Σ n_ℓ L_ℓ / Σ n_ℓ from each participant's (mean validation loss, documents): the
    validation loss of the federated model over the union of the nodes' held-out
    documents, built from one scalar per node (no document leaves it)."""
    if any(int(n) < 0 for _, n in losses.values()):
        raise ValueError("a negative number of validation documents")
    total = sum(int(n) for _, n in losses.values())
    if total <= 0:
        raise ValueError("no validation documents")
    if not all(math.isfinite(float(loss)) for loss, n in losses.values() if int(n) > 0):
        return math.inf  # a diverged node makes the epoch a non-improvement
    return sum(float(loss) * int(n) for loss, n in losses.values() if int(n) > 0) / total


@dataclass(slots=True)
class PatienceStop:
    """Early stopping on a validation loss measured once per epoch, the rule of the
    ProdLDA/CombinedTM package gFedNTM's authors train with (contextualized-topic-models,
    ``CTM.fit(..., patience=5, delta=0)`` with ``num_epochs=100``): an epoch improves when
    its loss is at most ``best - delta``; training stops after ``patience`` epochs in a
    row without improvement, or after ``max_epochs``; the model kept is the best epoch's.
    A non-finite loss never improves. Pure: the caller measures, this decides."""

    patience: int = 5
    delta: float = 0.0
    max_epochs: int = 100
    best: float = math.inf
    best_epoch: int = -1
    epochs: int = 0
    bad_epochs: int = 0
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.patience < 1 or self.max_epochs < 1:
            raise ValueError("patience and max_epochs must be at least 1")
        if not (math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError("delta must be a finite non-negative number")

    def observe(self, loss: float) -> bool:
        """Record the next epoch's validation loss; True when it is the new best (the
        caller keeps that model). Sets ``stopped`` when training must end."""
        if self.stopped:
            raise RuntimeError("training already stopped")
        epoch, self.epochs = self.epochs, self.epochs + 1
        improved = math.isfinite(loss) and (self.best_epoch < 0 or loss <= self.best - self.delta)
        if improved:
            self.best, self.best_epoch, self.bad_epochs = float(loss), epoch, 0
        else:
            self.bad_epochs += 1
        self.stopped = self.bad_epochs >= self.patience or self.epochs >= self.max_epochs
        return improved
