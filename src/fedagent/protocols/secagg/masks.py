"""Quantisation and masking of an update, block by block: the floating tensors as one
vector (:func:`flatten`), quantised to integers mod 2³² (:func:`quantise`), the
pseudo-random mask streams added to them (:class:`MaskStreams`), and the sum
dequantised (:func:`dequantise_sum`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedagent.protocols.secagg.params import SecAggError, SecAggParams

Weights = dict[str, np.ndarray]

BLOCK = 1 << 15  # values per block of the fused passes (256 KiB of float64: stays in cache)
SELF_NONCE = b"\x01" + bytes(15)  # the self mask's stream, apart from any pairwise one


def mask_sign(a: str, b: str) -> int:
    """How ``a`` adds the pairwise mask it shares with ``b`` (+ if it sorts first, −
    after): the two cancel in the sum."""
    return 1 if a < b else -1


class MaskStreams:
    """Pseudo-random mask streams of uint32 (AES-256 in counter mode, keyed by a 32-byte
    seed), each added (or subtracted) into a vector block by block: a block's values
    and its keystream stay in the CPU cache, so the vector is read and written once
    whatever the number of streams, and no model-sized keystream buffer is made. A
    stream drawn in blocks is the same stream as drawn whole (the cipher keeps its
    counter between blocks)."""

    def __init__(self) -> None:
        self._zeros = memoryview(bytes(4 * BLOCK))
        self._buf = bytearray(4 * BLOCK + 15)  # update_into wants a block of slack
        self._streams: list[tuple[Any, int]] = []

    def add_stream(self, seed: bytes, nonce: bytes = bytes(16), sign: int = 1) -> None:
        self._streams.append((Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor(), sign))

    def __len__(self) -> int:
        return len(self._streams)

    def apply(self, y: np.ndarray) -> None:
        """Adds the next ``y.size`` values of every stream into ``y`` (uint32, a block
        at most; wraps mod 2³²)."""
        m = y.size
        zeros, buf = self._zeros[: 4 * m], self._buf
        for enc, sign in self._streams:
            enc.update_into(zeros, buf)
            k = np.frombuffer(buf, dtype="<u4", count=m)
            if sign > 0:
                np.add(y, k, out=y)
            else:
                np.subtract(y, k, out=y)

    def add_all(self, y: np.ndarray) -> None:
        """Every stream over the whole of ``y`` (uint32, contiguous)."""
        for lo in range(0, y.size, BLOCK):
            self.apply(y[lo : lo + BLOCK])


def _layout(weights: Mapping[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(weights[k].shape)) for k in sorted(weights) if weights[k].dtype.kind == "f"]


def flatten(weights: Mapping[str, np.ndarray]) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray]:
    """The floating tensors of ``weights`` in name order, as one float64 vector."""
    layout = _layout(weights)
    if not layout:
        return layout, np.zeros(0)
    return layout, np.concatenate([np.asarray(weights[k], dtype=np.float64).reshape(-1) for k, _ in layout])


def unflatten(
    layout: Sequence[tuple[str, tuple[int, ...]]], vec: np.ndarray, like: Mapping[str, np.ndarray]
) -> Weights:
    out: Weights = {}
    pos = 0
    for k, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))
        out[k] = vec[pos : pos + n].reshape(shape).astype(like[k].dtype)
        pos += n
    return out


def layout_size(weights: Mapping[str, np.ndarray]) -> int:
    return sum(int(w.size) for w in weights.values() if w.dtype.kind == "f")


def quantise(v: np.ndarray, params: SecAggParams, scale: float = 1.0) -> np.ndarray:
    """``scale · v`` clipped and rounded to its level:
    ``round((clip(scale·v, −c, c) + c) / step)``, computed as
    ``round(clip(scale·v/step, −L/2, L/2) + L/2)`` (c/step = L/2 for L levels)."""
    out = np.empty(v.size, np.uint32)
    work = np.empty(min(v.size, BLOCK))
    for lo in range(0, v.size, BLOCK):
        quantise_block(v.reshape(-1)[lo : lo + BLOCK], params, scale, out[lo : lo + BLOCK], work)
    return out


def quantise_block(v: np.ndarray, params: SecAggParams, scale: float, out: np.ndarray, work: np.ndarray) -> None:
    """:func:`quantise` of one block into ``out`` (uint32), with ``work`` (float64, at
    least as long) as scratch."""
    half = params.levels / 2
    w = work[: v.size]
    np.multiply(v, scale / params.step, out=w, dtype=np.float64, casting="unsafe")
    np.clip(w, -half, half, out=w)
    w += half
    np.rint(w, out=w)
    # In [0, 2^30]: the same value in int32, whose conversion is the faster one.
    np.copyto(out.view(np.int32), w, casting="unsafe")


class Delta:
    """An update's difference from the round's model, as the pairs of floating tensors
    (trained, global) in :func:`flatten` order: read block by block when it is masked,
    never flattened into a model-sized float64 copy."""

    def __init__(self, new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray]) -> None:
        layout = _layout(old)
        if _layout(new) != layout:
            raise SecAggError("the trained weights do not have the round model's floating tensors")
        self.pairs = [(np.asarray(new[k]).reshape(-1), np.asarray(old[k]).reshape(-1)) for k, _ in layout]
        self.size = sum(a.size for a, _ in self.pairs)

    def blocks(self, work: np.ndarray) -> Iterator[np.ndarray]:
        """The difference in consecutive blocks of at most ``work.size`` values (float64,
        in ``work``; each block is valid until the next is drawn)."""
        for a, b in self.pairs:
            for lo in range(0, a.size, work.size):
                m = min(work.size, a.size - lo)
                yield np.subtract(a[lo : lo + m], b[lo : lo + m], out=work[:m], dtype=np.float64, casting="unsafe")


def delta_blocks(delta: np.ndarray | Delta, work: np.ndarray) -> Iterator[np.ndarray]:
    """``delta`` (flat, or a :class:`Delta`) in blocks of at most ``work.size`` values."""
    if isinstance(delta, Delta):
        yield from delta.blocks(work)
        return
    flat = delta.reshape(-1)
    for lo in range(0, flat.size, work.size):
        yield flat[lo : lo + work.size]


def dequantise_sum(s: np.ndarray, count: int, params: SecAggParams) -> np.ndarray:
    """The real-valued sum of ``count`` quantised inputs whose integer sum is ``s``."""
    return s.astype(np.float64) * params.step - count * params.clip
