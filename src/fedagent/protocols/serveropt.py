"""The coordinator's server optimizer: how the global model moves from one round's
aggregate to the next model (pure logic, no I/O).

Write ``x`` for the global model a round started from, ``a`` for the round's aggregate
(the weighted mean of the agents' models, or whatever the robust aggregation, the
secure sum or the privacy stage made of them) and ``Δ = a − x`` for the step the
agents' mean took. With the server step ``η`` (``[rounds] server_lr``) and the server
momentum ``β`` (``[rounds] server_momentum``):

* ``β = 0``: ``x' = x + η·Δ`` (plain FedAvg when ``η = 1``; :func:`server_step`);
* ``β > 0``: ``v' = β·v + Δ``, ``x' = x + η·v'``, the velocity ``v`` starting at zero
  (FedAvgM, Hsu, Qi and Brown 2019, "Measuring the effects of non-identical data
  distribution for federated visual classification", Algorithm 1 with the server's
  pseudo-gradient ``−Δ``).

The velocity covers the floating tensors only (counters are the aggregate's, as in
:func:`server_step`), is held in each tensor's dtype and is part of the coordinator's
checkpoint: a restart continues with the velocity the checkpointed model was made with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fedagent.protocols.aggregation import check_server_lr, server_step

Weights = dict[str, np.ndarray]

#: Checkpoint keys of the velocity: this prefix and the tensor's name (the coordinator
#: puts them under the checkpoint's optimizer prefix).
VELOCITY = "velocity/"


def check_momentum(beta: float) -> None:
    """A server momentum must be a finite number in [0, 1)."""
    if not (isinstance(beta, int | float) and not isinstance(beta, bool) and math.isfinite(beta) and 0 <= beta < 1):
        raise ValueError(f"server_momentum must be in [0, 1), not {beta!r}")


def check_velocity(reference: Mapping[str, np.ndarray], velocity: Mapping[str, np.ndarray]) -> None:
    """A velocity read back (from a checkpoint) must name floating tensors of the model,
    each with the tensor's shape and dtype, and be finite."""
    for name, v in velocity.items():
        ref = reference.get(name)
        if ref is None or np.asarray(ref).dtype.kind != "f":
            raise ValueError(f"velocity of {name!r}: no floating tensor of the model has that name")
        ref = np.asarray(ref)
        if v.shape != ref.shape or v.dtype != ref.dtype:
            raise ValueError(
                f"velocity of {name!r}: {v.dtype}{list(v.shape)}, the model's is {ref.dtype}{list(ref.shape)}"
            )
        if not np.isfinite(v).all():
            raise ValueError(f"velocity of {name!r} is not finite")


def momentum_step(
    reference: Mapping[str, np.ndarray],
    aggregate: Weights,
    velocity: Mapping[str, np.ndarray],
    *,
    lr: float,
    beta: float,
) -> tuple[Weights, Weights]:
    """The next global model and the next velocity (module docstring), computed in
    float64 and stored in each tensor's dtype. A tensor without a velocity yet starts
    from zero. Neither ``reference`` nor ``velocity`` is changed: the caller keeps both
    until it adopts the results (a round whose aggregate is refused keeps the old ones)."""
    check_server_lr(lr)
    check_momentum(beta)
    if beta == 0:
        return server_step(reference, aggregate, lr), {}
    out: Weights = {}
    vel: Weights = {}
    for name, agg in aggregate.items():
        ref = np.asarray(reference[name])
        if ref.dtype.kind != "f":
            out[name] = agg
            continue
        ref64 = ref.astype(np.float64)
        v = np.asarray(agg, np.float64) - ref64
        old = velocity.get(name)
        if old is not None:
            v += beta * np.asarray(old, np.float64)
        vel[name] = v.astype(ref.dtype, copy=False)
        # The model moves by the velocity as it is kept, so that a restart (which reads
        # the stored velocity) continues exactly where the run without one would be.
        ref64 += lr * vel[name].astype(np.float64)
        out[name] = ref64.astype(ref.dtype, copy=False)
    return out, vel
