"""The global model sent as an int8 step from the previous one, as pure code.

A FedAvg round start carries the global model. With ``[transfer] downlink = "int8"`` (the
default when updates are int8) the coordinator sends it, once a round has been
aggregated, as the step from the model of the version before: each float32 tensor's step
quantised to int8 with one scale, as agents quantise their updates
(:func:`~fedagent.protocols.compression.quantize_int8`), the other tensors (and the
model's buffers and frozen parameters) whole. A round start then carries a quarter of the
model's bytes.

No node drifts: the coordinator keeps as its global model exactly what every agent
rebuilds, ``base + int8 · scale`` in float32 by :func:`apply_step` on both sides, so
their models agree bit for bit, and checkpoints, the catch-up answer and the final model
are that model. What quantisation leaves out of a round's step is not carried into the
next one (measured to cost no accuracy: docs/streaming.md).

An agent can rebuild only from the version the step starts at. One that holds another
(it joined late, missed a round start, restarted) asks the coordinator for the current
model and trains once it has it:
:class:`~fedagent.protocols.participant.DeltaReceiver`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.codec import Limits, decode_weights, encode_weights
from fedagent.protocols.compression import quantize_int8

Weights = dict[str, np.ndarray]

MODES = ("none", "int8")
#: The encodings an agent of this release rebuilds besides the whole model: announced in
#: its presence, so that a coordinator sends steps only while every agent online reads them.
READS = ("int8",)
F32 = np.dtype(np.float32)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"downlink must be one of {', '.join(MODES)}, not {mode!r}")


def default_mode(compression: str) -> str:
    """The broadcast's encoding when the config names none: int8 when the updates are."""
    return "int8" if compression == "int8" else "none"


@dataclass(frozen=True, slots=True)
class ModelDelta:
    """A global model as the step from version ``base_version``: ``steps`` maps each
    float32 tensor to its int8 step and scale, ``whole`` holds the other tensors."""

    base_version: int
    steps: dict[str, tuple[np.ndarray, float]] = field(repr=False)
    whole: Weights = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q, _ in self.steps.values()) + sum(a.nbytes for a in self.whole.values())

    def to_body(self) -> dict[str, Any]:
        return {
            "from": self.base_version,
            "q": encode_weights({n: q for n, (q, _) in self.steps.items()}),
            "scales": {n: s for n, (_, s) in self.steps.items()},
            "whole": encode_weights(self.whole),
        }

    @classmethod
    def from_body(cls, body: object, limits: Limits) -> ModelDelta:
        if not isinstance(body, dict):
            raise CodecError("round_start: delta must be a map")
        base = body.get("from")
        if type(base) is not int or base < 0:
            raise CodecError("round_start: delta 'from' must be a version (int >= 0)")
        scales = body.get("scales")
        if not isinstance(scales, dict) or len(scales) > limits.max_map_len:
            raise CodecError("round_start: delta scales must be a map of tensor names")
        for name, s in scales.items():
            if type(s) is not float or not (math.isfinite(s) and s >= 0):
                raise CodecError(f"round_start: delta scale of {name!r} must be a finite float >= 0")
        q = decode_weights(body.get("q"), limits)
        if q.keys() != scales.keys():
            raise CodecError("round_start: the delta's steps and scales name different tensors")
        for name, a in q.items():
            if a.dtype != np.int8:
                raise CodecError(f"round_start: the step of {name!r} must be int8, not {a.dtype}")
        whole = decode_weights(body.get("whole"), limits)
        both = q.keys() & whole.keys()
        if both:
            raise CodecError(f"round_start: tensor {sorted(both)[0]!r} both as a step and whole")
        return cls(base, {n: (a, scales[n]) for n, a in q.items()}, whole)


def apply_step(base: np.ndarray, q: np.ndarray, scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """``base + q · scale`` in float32: the same arithmetic on the coordinator and on
    every agent, so all of them hold the same model to the bit. ``out``: a float32 array
    of ``base``'s shape to write it in (not ``base``)."""
    if out is None:
        t = q.astype(F32)
    else:
        t = out
        np.copyto(t, q, casting="unsafe")  # int8 → float32: exact, as astype
    np.multiply(t, F32.type(scale), out=t)
    np.add(base, t, out=t)
    return t


def quantize_step(
    old: Weights, new: Weights, base_version: int, *, whole: frozenset[str] = frozenset()
) -> tuple[Weights, ModelDelta]:
    """The model the agents will rebuild from ``old`` (version ``base_version``) and the
    delta that takes them there. ``new`` must hold finite values, and is taken over: its
    tensors leave the dict one by one, and each one's memory holds its step while it is
    quantised and then the rebuilt tensor: beyond ``old`` and ``new`` only the int8
    steps are allocated (a quarter of the model). The tensors named in ``whole`` (a
    model's buffers: a running variance one quantisation step off can be negative) are
    sent whole."""
    rebuilt: Weights = {}
    steps: dict[str, tuple[np.ndarray, float]] = {}
    kept: Weights = {}
    for name in list(new):
        n = new.pop(name)
        o = old.get(name)
        if name not in whole and o is not None and n.dtype == F32 and o.dtype == F32 and o.shape == n.shape:
            if n.flags.writeable and n.flags.c_contiguous and not np.may_share_memory(n, o):
                d = np.subtract(n, o, out=n)
            else:
                d = n - o
            del n
            q, scale = quantize_int8(d, in_place=True)
            steps[name] = (q, scale)
            rebuilt[name] = apply_step(o, q, scale, out=d)
        else:
            kept[name] = n
            rebuilt[name] = n
    return rebuilt, ModelDelta(base_version, steps, kept)


def rebuild(base: Mapping[str, np.ndarray], delta: ModelDelta) -> Weights:
    """The model ``delta`` describes, from ``base`` (the model of its base version).
    CodecError when the delta does not fit ``base`` (names, shapes or dtypes)."""
    names = delta.steps.keys() | delta.whole.keys()
    if names != base.keys():
        extra = sorted(names - base.keys())
        missing = sorted(base.keys() - names)
        raise CodecError(
            "round_start: the delta does not fit the model held: "
            + (f"unknown tensor {extra[0]!r}" if extra else f"tensor {missing[0]!r} missing")
        )
    out: Weights = {}
    for name, b in base.items():
        if name in delta.steps:
            q, scale = delta.steps[name]
            if b.dtype != F32 or q.shape != b.shape:
                raise CodecError(f"round_start: the step of {name!r} does not fit the model held")
            out[name] = apply_step(b, q, scale)
        else:
            w = delta.whole[name]
            if w.dtype != b.dtype or w.shape != b.shape:
                raise CodecError(f"round_start: tensor {name!r} does not fit the model held")
            out[name] = w
    return out
