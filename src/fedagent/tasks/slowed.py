"""A task trained as if on a slower device, for demos and benchmarks of unequal agents.

``[task] name = "fedagent.tasks.slowed:make"`` with ``inner`` (the task it slows: a
built-in name or ``module:attribute``, default ``digits``), ``slowdown`` (how many times
as long each training takes, at least 1), ``at_least`` (seconds a training takes on the
device before the slowdown, default 0) and the inner task's own options. Each
``fit``/``fit_steps`` runs the inner one and then waits until ``slowdown`` times the
longer of what it took and ``at_least`` has passed: the agent is that much slower without
taking more of a machine's CPU that other agents share (a slow device's CPU is its own).
``at_least`` makes a task that trains in a tenth of a second here behave like one that
takes seconds on a phone, so that a demo's waiting shows. Everything else is the inner
task's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from fedagent.config.paths import TaskOptions
from fedagent.errors import ConfigError
from fedagent.tasks.base import Task, load_task


class SlowedTask(Task):
    def __init__(self, inner: Task, slowdown: float, at_least: float = 0.0) -> None:
        self.inner = inner
        self.slowdown = slowdown
        self.at_least = at_least
        self.uses_torch_optimiser = inner.uses_torch_optimiser  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # What the agent may look for beyond the interface (a vocabulary, sync methods).
        return getattr(self.inner, name)

    def _slowly(self, started: float) -> None:
        took = time.monotonic() - started
        time.sleep(max(0.0, self.slowdown * max(took, self.at_least) - took))

    def build_model(self) -> torch.nn.Module:
        return self.inner.build_model()

    def num_samples(self) -> int:
        return self.inner.num_samples()

    def fit(self, model: torch.nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        started = time.monotonic()
        out = self.inner.fit(model, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
        self._slowly(started)
        return out

    def fit_steps(
        self, model: torch.nn.Module, *, steps: int, lr: float, batch_size: int, seed: int
    ) -> dict[str, float]:
        started = time.monotonic()
        out = self.inner.fit_steps(model, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        self._slowly(started)
        return out

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.inner.evaluate(model)


def make(options: Mapping[str, Any]) -> SlowedTask:
    opts = dict(options)
    inner = opts.pop("inner", "digits")
    slowdown = opts.pop("slowdown", 1.0)
    at_least = opts.pop("at_least", 0.0)
    if not isinstance(inner, str) or not inner:
        raise ConfigError("[task] inner must name the task to slow down")
    if (
        isinstance(slowdown, bool)
        or not isinstance(slowdown, int | float)
        or not (math.isfinite(slowdown) and slowdown >= 1)
    ):
        raise ConfigError(f"[task] slowdown must be a number >= 1, not {slowdown!r}")
    if (
        isinstance(at_least, bool)
        or not isinstance(at_least, int | float)
        or not (math.isfinite(at_least) and 0 <= at_least <= 3600)
    ):
        raise ConfigError(f"[task] at_least must be a number of seconds in [0, 3600], not {at_least!r}")
    base = options.base_dir if isinstance(options, TaskOptions) else None
    return SlowedTask(load_task(inner, TaskOptions(opts, base)), float(slowdown), float(at_least))
