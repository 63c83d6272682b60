"""A test-only task factory whose agent sends sign-flipped updates (see byzantine.py).

Reachable only as ``task = { name = "byzantine_task:make" }`` with this directory on
``PYTHONPATH``: nothing in the installed package can make an agent malicious.
"""

from __future__ import annotations

from typing import Any

import torch

from fedagent.tasks.digits import DigitsTask
from fedagent.tasks.digits import make as make_digits


class SignFlipping(DigitsTask):
    """Trains like an honest agent, then sends ``g − factor·(w − g)``."""

    factor = 10.0

    def fit(self, model, **kw) -> dict[str, float]:
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        metrics = super().fit(model, **kw)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    v.copy_(start[k] - self.factor * (v - start[k]))
        return metrics


def make(options: dict[str, Any]) -> SignFlipping:
    task = make_digits(options)
    task.__class__ = SignFlipping
    return task
