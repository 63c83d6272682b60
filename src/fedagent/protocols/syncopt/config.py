"""The configuration of the Sync-Opt step machine (:class:`SyncOptConfig`), checked when
it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedagent.protocols.syncopt.gradients import AGGREGATORS

FAULT_POLICIES = ("continue", "abort")


@dataclass(frozen=True, slots=True)
class SyncOptConfig:
    steps: int = 500  # I in Algorithm 1
    tol: float = 0.0  # stop when the relative weight change is below this (0 = never)
    step_timeout: float = 60.0  # seconds a step waits for its gradients
    on_fault: str = "continue"  # "continue" | "abort" (see the module docstring)
    min_gradients: int = 1  # "continue": aggregate a faulty step with at least this many
    max_norm: float | None = None  # refuse gradients with a larger L2 norm
    aggregation: str = "weighted"  # a key of AGGREGATORS
    # early stopping on the pooled validation loss (0 = off; see the module docstring)
    patience: int = 0
    delta: float = 0.0
    max_epochs: int = 100
    epoch_steps: int = 0  # Sync-Opt steps in one epoch (needed when patience > 0)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.min_gradients < 1:
            raise ValueError("steps and min_gradients must be at least 1")
        if self.patience < 0 or self.max_epochs < 1 or self.epoch_steps < 0:
            raise ValueError("patience and epoch_steps must be >= 0 and max_epochs >= 1")
        if self.patience > 0 and self.epoch_steps < 1:
            raise ValueError("early stopping (patience > 0) needs epoch_steps >= 1")
        if not (math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError("delta must be a finite non-negative number")
        if not (math.isfinite(self.tol) and self.tol >= 0):
            raise ValueError("tol must be a finite non-negative number")
        if not (math.isfinite(self.step_timeout) and self.step_timeout > 0):
            raise ValueError("step_timeout must be positive")
        if self.on_fault not in FAULT_POLICIES:
            raise ValueError(f"on_fault must be one of {FAULT_POLICIES}, not {self.on_fault!r}")
        if self.aggregation not in AGGREGATORS:
            raise ValueError(f"aggregation must be one of {sorted(AGGREGATORS)}, not {self.aggregation!r}")
        if self.max_norm is not None and not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError("max_norm must be positive")
