"""Tensors on the wire: an array as ``{dtype, shape, data}`` (the data little-endian in C
order, decoded zero-copy), or without its all-zero slices; a named set of them (a
model's weights, a gradient); and the checks aggregation runs on decoded ones.

Dtypes come from an allow-list (:data:`DTYPES`), and a tensor's byte size is computed
from its shape with Python ints and checked against the limits and against the data
actually received before numpy sees anything."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.limits import DEFAULT_LIMITS as _DEFAULT_LIMITS
from fedagent.protocols.limits import Limits
from fedagent.protocols.limits import short as _short

_MAX_TENSOR_NAME = 200

# The allow-list of tensor dtypes: wire name -> little-endian numpy dtype. Nothing
# else is ever passed to np.dtype(), so "O", "V8", "<U4", "object" cannot get in.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
}
_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` with the data little-endian in C order.

    Raises CodecError for a dtype outside the allow-list :data:`DTYPES`.
    """
    if not isinstance(a, np.ndarray):
        raise CodecError(f"expected a numpy array, not {type(a).__name__}")
    name = a.dtype.name
    wire = DTYPES.get(name)
    if wire is None or a.dtype.kind not in "biuf" or a.dtype.fields is not None:
        raise CodecError(f"dtype {a.dtype.str!r} cannot be sent; allowed: {', '.join(DTYPES)}")
    if a.dtype != wire:
        a = a.astype(wire)
    if a.flags.c_contiguous:
        # A view of the array, not a copy: the encoder copies the bytes once, into the
        # message (a.tobytes() here was one more pass over every model byte).
        data: bytes | memoryview = a.reshape(-1).view(np.uint8).data
    else:
        data = a.tobytes(order="C")
    return {"dtype": name, "shape": list(a.shape), "data": data}


def _tensor_head(
    obj: dict[str, Any], limits: Limits, expect_dtype: str | None, expect_shape: tuple[int, ...] | None
) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """A wire tensor's dtype name, numpy dtype, shape and dense byte size, checked
    against the allow-list, the limits and the expectations (Python ints: no overflow)."""
    name = obj["dtype"]
    if type(name) is not str or name not in DTYPES:
        raise CodecError(f"tensor dtype {_short(name)} not allowed; allowed: {', '.join(DTYPES)}")
    if expect_dtype is not None and name != expect_dtype:
        raise CodecError(f"tensor dtype {name} where {expect_dtype} was expected")
    dtype = DTYPES[name]
    dims = obj["shape"]
    if not isinstance(dims, list | tuple):
        raise CodecError("tensor shape must be a list of ints")
    if len(dims) > limits.max_tensor_dims:
        raise CodecError(f"tensor of {len(dims)} dimensions exceeds max_tensor_dims {limits.max_tensor_dims}")
    for d in dims:
        if type(d) is not int:
            raise CodecError(f"tensor dimension {_short(d)} is not an int")
        if d < 0:
            raise CodecError(f"negative tensor dimension {d}")
        if d > limits.max_tensor_bytes:  # also keeps every dim inside numpy's intp
            raise CodecError(f"tensor dimension {_short(d)} exceeds max_tensor_bytes")
    shape = tuple(dims)
    if expect_shape is not None and shape != tuple(expect_shape):
        raise CodecError(f"tensor shape {list(shape)} where {list(expect_shape)} was expected")
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: cannot overflow
    if nbytes > limits.max_tensor_bytes:
        raise CodecError(f"tensor of {nbytes} bytes exceeds max_tensor_bytes {limits.max_tensor_bytes}")
    return name, dtype, shape, nbytes


def _binary_len(data: object, what: str) -> int:
    if isinstance(data, bytes | bytearray):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    raise CodecError(f"tensor {what} must be binary, not {type(data).__name__}")


def decode_tensor(
    obj: object,
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect_dtype: str | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The array described by ``obj`` (a read-only view of its bytes, no copy).

    The byte size is computed from the shape with Python ints and must equal the data
    length exactly, before numpy sees anything.
    """
    if not isinstance(obj, dict):
        raise CodecError(f"tensor must be a map, not {type(obj).__name__}")
    if obj.keys() != _TENSOR_KEYS:
        raise CodecError(f"tensor must have exactly the fields dtype, shape, data; got {sorted(map(_short, obj))[:5]}")
    name, dtype, shape, nbytes = _tensor_head(obj, limits, expect_dtype, expect_shape)
    data = obj["data"]
    have = _binary_len(data, "data")
    if have != nbytes:
        raise CodecError(f"tensor data has {have} bytes; {name}{list(shape)} needs {nbytes}")
    try:
        if name == "bool" and nbytes and np.frombuffer(data, dtype=np.uint8).max() > 1:
            # numpy would carry a byte 2 as a bool that is neither True nor False.
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except CodecError:
        raise
    except Exception as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"tensor data unusable: {exc}") from exc


# --- sliced tensors: the non-zero slices of a tensor along one axis ---------------------
#
# A gradient often has whole slices that are exactly zero: the first layer of a
# bag-of-words encoder gets no gradient for the terms its mini-batch does not contain.
# Sent as ``{dtype, shape, axis, index, data}``: ``index`` the positions along ``axis``
# of the slices that are sent (uint32 little-endian, strictly increasing), ``data`` those
# slices in C order; every other slice is zero. Lossless: a slice is left out only when
# every one of its bytes is 0 (so -0.0 travels), and the receiver rebuilds the tensor
# bit for bit.

_SLICED_KEYS = frozenset(("dtype", "shape", "axis", "index", "data"))
#: Tensors smaller than this are always sent whole (the search is not worth it).
SLICE_FROM = 64 * 1024
#: A tensor is sliced only when that leaves out at least this share of its bytes.
#: Gathering the slices (sender) and scattering them into zeros (receiver) cost about
#: 1.5 + 2.3 ms of CPU for a 100 x 5000 float32 gradient, more than 9 % fewer bytes
#: save in hashing, TLS and copies on the way (measured: a net loss); at a third of
#: the bytes the two are about even.
SLICE_MIN_SAVING = 1 / 3
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode_tensor_sliced(a: np.ndarray) -> dict[str, Any]:
    """The wire form of ``a`` without its all-zero slices along the axis that leaves the
    fewest bytes, when that (index included) is at most ``1 - SLICE_MIN_SAVING`` of the
    whole tensor's bytes; else the plain :func:`encode_tensor` form."""
    dense = encode_tensor(a)
    if a.nbytes < SLICE_FROM or a.ndim == 0 or a.size == 0 or max(a.shape) >= 2**32:
        return dense
    wire = DTYPES[a.dtype.name]
    a = np.ascontiguousarray(a, dtype=wire)
    bits = a.view(_UINT_OF_SIZE[wire.itemsize])
    if a.size - np.count_nonzero(bits) < a.size * SLICE_MIN_SAVING:
        return dense  # too few zero elements for any slicing to save enough (a quick count)
    nonzero = bits != 0
    best: tuple[int, int, np.ndarray] | None = None  # (bytes, axis, kept positions)
    for axis in range(a.ndim):
        others = tuple(i for i in range(a.ndim) if i != axis)
        kept = np.flatnonzero(nonzero.any(axis=others)) if others else np.flatnonzero(nonzero)
        size = 4 * kept.size + kept.size * (a.size // a.shape[axis]) * wire.itemsize
        if best is None or size < best[0]:
            best = (size, axis, kept)
    assert best is not None
    size, axis, kept = best
    if size > a.nbytes * (1 - SLICE_MIN_SAVING):
        return dense
    part = np.ascontiguousarray(np.take(a, kept, axis=axis))
    return {
        "dtype": dense["dtype"],
        "shape": dense["shape"],
        "axis": axis,
        "index": kept.astype("<u4").tobytes(),
        "data": part.reshape(-1).view(np.uint8).data,
    }


def decode_tensor_sliced(
    obj: dict[str, Any],
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect_dtype: str | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The dense array of a sliced tensor (a new, writable array). Everything is checked
    before the array is allocated: the dtype, the shape and its dense size against the
    limits, the axis, that the index holds whole uint32s, at most as many as the axis
    has positions, strictly increasing and in range, and that the data holds exactly
    that many slices."""
    if obj.keys() != _SLICED_KEYS:
        raise CodecError(
            f"sliced tensor must have exactly the fields {', '.join(sorted(_SLICED_KEYS))}; "
            f"got {sorted(map(_short, obj))[:6]}"
        )
    name, dtype, shape, _dense = _tensor_head(obj, limits, expect_dtype, expect_shape)
    axis = obj["axis"]
    if type(axis) is not int or not 0 <= axis < len(shape):
        raise CodecError(f"sliced tensor axis {_short(axis)} is not an axis of shape {list(shape)}")
    index = obj["index"]
    have_index = _binary_len(index, "index")
    if have_index % 4:
        raise CodecError(f"sliced tensor index of {have_index} bytes is not a whole number of uint32")
    k = have_index // 4
    if k > shape[axis]:
        raise CodecError(f"sliced tensor index of {k} positions for an axis of {shape[axis]}")
    slice_items = math.prod(shape[:axis]) * math.prod(shape[axis + 1 :])
    data = obj["data"]
    want = k * slice_items * dtype.itemsize
    have = _binary_len(data, "data")
    if have != want:
        raise CodecError(f"sliced tensor data has {have} bytes; {k} slices of {name}{list(shape)} need {want}")
    try:
        idx = np.frombuffer(index, dtype="<u4")
        if k and int(idx[-1]) >= shape[axis]:
            raise CodecError(f"sliced tensor index {int(idx[-1])} out of range for an axis of {shape[axis]}")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise CodecError("sliced tensor index is not strictly increasing")
        part = np.frombuffer(data, dtype=dtype)
        if name == "bool" and part.size and part.view(np.uint8).max() > 1:
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        out = np.zeros(shape, dtype=dtype)  # its bytes (_dense) <= max_tensor_bytes: checked above
        cut = list(shape)
        cut[axis] = k
        where: tuple[Any, ...] = (slice(None),) * axis + (idx.astype(np.intp),)
        out[where] = part.reshape(cut)
        return out
    except CodecError:
        raise
    except Exception as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"sliced tensor unusable: {exc}") from exc


def _check_tensor_name(name: object) -> str:
    if type(name) is not str or not 1 <= len(name) <= _MAX_TENSOR_NAME or not name.isprintable():
        raise CodecError(f"invalid tensor name {_short(name)}: use 1-{_MAX_TENSOR_NAME} printable characters")
    return name


def encode_weights(w: Mapping[str, np.ndarray], *, sliced: bool = False) -> dict[str, dict[str, Any]]:
    """A named set of tensors in wire form; ``sliced``: without the all-zero slices of
    the tensors that have them (:func:`encode_tensor_sliced`; only for a receiver that
    decodes with ``sliced=True``)."""
    enc = encode_tensor_sliced if sliced else encode_tensor
    if not isinstance(w, Mapping):
        raise CodecError(f"weights must be a mapping, not {type(w).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for name, a in w.items():
        _check_tensor_name(name)
        try:
            out[name] = enc(a)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from exc
    return out


def decode_weights(
    obj: object,
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    sliced: bool = False,
) -> dict[str, np.ndarray]:
    """Decode a named set of tensors; with ``expect`` (name -> (dtype, shape)) the names,
    dtypes and shapes must match exactly. ``sliced``: tensors may also come without
    their zero slices (:func:`decode_tensor_sliced`; those come back as new dense
    arrays). Errors name the tensor."""
    if not isinstance(obj, dict):
        raise CodecError(f"weights must be a map, not {type(obj).__name__}")
    if len(obj) > limits.max_map_len:
        raise CodecError(f"{len(obj)} tensors exceed max_map_len {limits.max_map_len}")
    for name in obj:
        _check_tensor_name(name)
    if expect is not None:
        missing = sorted(expect.keys() - obj.keys())
        if missing:
            raise CodecError(
                f"tensor {missing[0]!r} missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        unexpected = sorted(obj.keys() - expect.keys())
        if unexpected:
            raise CodecError(
                f"unexpected tensor {unexpected[0]!r}"
                + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            )
    out: dict[str, np.ndarray] = {}
    for name, t in obj.items():
        want_dtype, want_shape = expect[name] if expect is not None else (None, None)
        try:
            if sliced and isinstance(t, dict) and "axis" in t:
                out[name] = decode_tensor_sliced(t, limits, expect_dtype=want_dtype, expect_shape=want_shape)
            else:
                out[name] = decode_tensor(t, limits, expect_dtype=want_dtype, expect_shape=want_shape)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from exc
    return out


def weights_nbytes(weights: Mapping[str, Any]) -> int:
    """Total tensor bytes of ``weights``, decoded (arrays) or in wire form (dicts)."""
    total = 0
    for name, t in weights.items():
        if isinstance(t, np.ndarray):
            total += t.nbytes
        elif isinstance(t, dict) and isinstance(t.get("data"), bytes | bytearray | memoryview):
            data = t["data"]
            total += data.nbytes if isinstance(data, memoryview) else len(data)
        else:
            raise CodecError(f"tensor {_short(name)}: neither an array nor a wire tensor")
    return total


_FINITE_BLOCK = 1 << 20  # elements checked at a time: bounds the temporary bool array


def check_finite(weights: Mapping[str, np.ndarray]) -> None:
    """Raise CodecError naming the first tensor that holds a NaN or an infinity.

    The codec itself only checks structure; this is for aggregation to call.
    """
    for name, a in weights.items():
        if not isinstance(a, np.ndarray):
            raise CodecError(f"tensor {_short(name)}: not an array")
        if a.dtype.kind not in "fc":
            continue
        flat = a.reshape(-1)
        bad = 0
        for start in range(0, flat.size, _FINITE_BLOCK):
            bad += int(np.count_nonzero(~np.isfinite(flat[start : start + _FINITE_BLOCK])))
        if bad:
            raise CodecError(f"tensor {_short(name)} holds {bad} non-finite values (NaN or Inf)")


def bin_header(n: int) -> bytes:
    """msgpack's header of a binary value of ``n`` bytes (bin 8, 16 or 32), for a body
    written separately (a file record or checkpoint tensor written from where it lies)."""
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 2**16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")
