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

The step moves the trainable parameters only. A model's buffers (BatchNorm's running
statistics) and frozen parameters are named ``fixed``: they are the aggregate itself
(the weighted mean of the agents' values), never extrapolated by ``η`` or a velocity: a
running variance moved like a weight went negative within three rounds at β = 0.7, and
the model's outputs with it to NaN. Counters (integer tensors) are the aggregate's too.
The velocity covers the floating tensors (a fixed one's is zero) and is held in each
tensor's dtype. The coordinator keeps it in a
:class:`VelocityStore` (a file beside its checkpoint) and a restart continues with the
velocity the checkpointed model was made with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from fedagent.protocols.aggregation import check_server_lr, floating_pairs, server_step

Weights = dict[str, np.ndarray]

#: The server momentum a coordinator uses unless ``[rounds] server_momentum`` says
#: otherwise, when its rounds are not differentially private (results/tta/report.md,
#: "Server momentum as the default": fewer rounds to a target and a higher final
#: accuracy on every non-private FedAvg workload fedagent ships). 0 turns it off.
DEFAULT_MOMENTUM = 0.7


def default_momentum(*, private: bool) -> float:
    """The server momentum when the configuration names none: :data:`DEFAULT_MOMENTUM`,
    but 0 for differentially private rounds. The velocity sums the noise of past
    releases as well as their steps, so the model carries up to ``1 / (1 − β)`` times
    the noise of one round; on the DP experiment at ε = 3 momentum 0.7 took the
    accuracy from 0.89 to below 0.5 (same report). An operator can still set it."""
    return 0.0 if private else DEFAULT_MOMENTUM


#: Checkpoint keys of the velocity in checkpoints written before it had a file of its
#: own: this prefix and the tensor's name, under the checkpoint's optimizer prefix.
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
    fixed: frozenset[str] = frozenset(),
) -> tuple[Weights, Weights]:
    """The next global model and the next velocity (module docstring), computed in each
    tensor's dtype (:func:`_momentum_block`). A tensor without a velocity yet starts from
    zero; a ``fixed`` one is the aggregate's and has none. Neither ``reference`` nor
    ``velocity`` is changed: the caller keeps both until it adopts the results (a round
    whose aggregate is refused keeps the old ones)."""
    check_server_lr(lr)
    check_momentum(beta)
    if beta == 0:
        return server_step(reference, aggregate, lr, fixed), {}
    out: Weights = {}
    vel: Weights = {}
    for name, agg, ref in floating_pairs(reference, aggregate, out, fixed):
        new = np.array(agg, dtype=ref.dtype, copy=True)
        old = velocity.get(name)
        v = np.empty_like(ref)
        _momentum_block(new, ref, None if old is None else np.asarray(old, ref.dtype), v, np.empty_like(ref), lr, beta)
        out[name], vel[name] = new, v
    return out, vel


def _momentum_block(
    agg: np.ndarray,
    ref: np.ndarray,
    old: np.ndarray | None,
    v: np.ndarray,
    tmp: np.ndarray,
    lr: float,
    beta: float,
) -> None:
    """One block of the step, in the tensor's dtype and in place: ``v = (agg − ref) +
    β·old``, then ``agg = ref + lr·v`` (the model moves by the velocity as it is kept, so
    a restart that reads the kept velocity continues exactly). ``tmp``: scratch of the
    block's size. Both the in-memory and the streamed step use it, so they agree to the
    bit."""
    t = ref.dtype.type
    np.subtract(agg, ref, out=v)
    if old is not None:
        np.multiply(old, t(beta), out=tmp)
        v += tmp
    if lr == 1:
        np.add(ref, v, out=agg)
    else:
        np.multiply(v, t(lr), out=tmp)
        np.add(ref, tmp, out=agg)


# ---- a velocity kept outside the coordinator's memory ---------------------------------
#: Elements of a tensor handled at a time by :func:`momentum_step_into`: its two
#: scratch blocks and the block read are 3 × 16 K × 4 bytes = 192 KiB for a float32
#: model, whatever its size.
BLOCK = 1 << 14

#: (name, dtype, shape) of each floating tensor, in the order a velocity is written.
Layout = list[tuple[str, np.dtype, tuple[int, ...]]]


def velocity_layout(reference: Mapping[str, np.ndarray]) -> Layout:
    """The tensors a velocity covers: the floating ones, in the model's order."""
    return [
        (k, np.asarray(v).dtype, tuple(np.shape(v))) for k, v in reference.items() if np.asarray(v).dtype.kind == "f"
    ]


class VelocityWriter(Protocol):
    def write(self, name: str, block: np.ndarray) -> None:
        """The next elements (flat, in order) of tensor ``name``'s new velocity, in the
        tensor's dtype; tensors come in the layout's order."""


class VelocityStore(Protocol):
    """Where the server momentum's velocity lives between rounds, so that the
    coordinator does not hold a model-sized buffer for it: the step reads the current
    velocity and writes the next one a block at a time (the coordinator's store is a
    file beside its checkpoint: coordinator/velocity.py)."""

    def read(self, name: str, start: int, stop: int) -> np.ndarray | None:
        """Flat elements ``[start, stop)`` of the current velocity of ``name`` in the
        tensor's dtype; None when there is no velocity yet (it is zero)."""

    def begin(self, layout: Layout, model_version: int) -> VelocityWriter:
        """A new velocity to be written, tensor by tensor in ``layout``'s order; it goes
        with the global model ``model_version``."""

    def adopt(self, writer: VelocityWriter) -> None:
        """The written velocity becomes the current one."""

    def discard(self, writer: VelocityWriter) -> None:
        """The written velocity is dropped (its round's aggregate was refused)."""


def momentum_step_into(
    reference: Mapping[str, np.ndarray],
    aggregate: Weights,
    store: VelocityStore,
    writer: VelocityWriter,
    *,
    lr: float,
    beta: float,
    block: int = BLOCK,
    fixed: frozenset[str] = frozenset(),
) -> Weights:
    """:func:`momentum_step` a block at a time, with the velocity read from ``store``
    and the next one written to ``writer``: the same values to the last bit. The next
    model is written into ``aggregate``'s floating tensors where the caller owns them
    (writable, contiguous, of the model's dtype and not sharing memory with
    ``reference``; otherwise into a copy), so that the step needs no model-sized buffer
    beyond the aggregate. ``reference`` is not changed. A ``fixed`` tensor is the
    aggregate's; its velocity is written as zeros (the file's layout is every floating
    tensor's, whatever the model's buffers)."""
    check_server_lr(lr)
    check_momentum(beta)
    if beta == 0:
        raise ValueError("momentum_step_into is the momentum step: without momentum use server_step")
    out: Weights = {}
    for name, agg in aggregate.items():
        ref = np.asarray(reference[name])
        if ref.dtype.kind != "f" or name in fixed:
            out[name] = agg
            if ref.dtype.kind == "f":  # in the layout's order, as every velocity block
                zeros = np.zeros(min(block, max(ref.size, 1)), ref.dtype)
                for start in range(0, max(ref.size, 1), block):
                    writer.write(name, zeros[: min(block, ref.size - start)])
            continue
        dst = agg
        owned = (
            isinstance(dst, np.ndarray)
            and dst.flags.writeable
            and dst.flags.c_contiguous
            and dst.dtype == ref.dtype
            and dst.shape == ref.shape
            and not np.shares_memory(dst, ref)
        )
        if not owned:
            dst = np.array(agg, dtype=ref.dtype, order="C", copy=True)
        flat = dst.reshape(-1)
        rflat = ref.reshape(-1)
        v = np.empty(min(block, max(flat.size, 1)), ref.dtype)
        tmp = np.empty_like(v)
        for start in range(0, max(flat.size, 1), block):  # an empty tensor writes an empty block
            stop = min(start + block, flat.size)
            n = stop - start
            old = store.read(name, start, stop)
            _momentum_block(
                flat[start:stop],
                rflat[start:stop],
                None if old is None else np.asarray(old, ref.dtype),
                v[:n],
                tmp[:n],
                lr,
                beta,
            )
            writer.write(name, v[:n])
        out[name] = dst
    return out


class MemoryVelocity:
    """A :class:`VelocityStore` in memory (tests)."""

    def __init__(self, velocity: Mapping[str, np.ndarray] | None = None) -> None:
        self.current: Weights = {k: np.array(v) for k, v in (velocity or {}).items()}
        self.model_version: int | None = None

    def read(self, name: str, start: int, stop: int) -> np.ndarray | None:
        v = self.current.get(name)
        return None if v is None else v.reshape(-1)[start:stop]

    def begin(self, layout: Layout, model_version: int) -> _MemoryWriter:
        return _MemoryWriter(layout, model_version)

    def adopt(self, writer: VelocityWriter) -> None:
        assert isinstance(writer, _MemoryWriter)
        self.current = writer.finish()
        self.model_version = writer.model_version

    def discard(self, writer: VelocityWriter) -> None:
        pass


class _MemoryWriter:
    def __init__(self, layout: Layout, model_version: int) -> None:
        self.layout = layout
        self.model_version = model_version
        self.parts: dict[str, list[np.ndarray]] = {name: [] for name, _, _ in layout}

    def write(self, name: str, block: np.ndarray) -> None:
        self.parts[name].append(np.array(block))

    def finish(self) -> Weights:
        return {
            name: np.concatenate(self.parts[name]).astype(dtype, copy=False).reshape(shape)
            for name, dtype, shape in self.layout
        }
