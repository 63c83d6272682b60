"""Getting a trained model out of fedagent: a checkpoint written as a plain PyTorch
``state_dict`` file (``torch.load(path, weights_only=True)`` opens it) or as safetensors.

A daemon's checkpoint (``global.ckpt``, or ``model.ckpt`` for a gossip agent) is the
msgpack document of :mod:`fedagent.storage.checkpoint`. Exporting reads it through the same
validating decoder, drops what is not model weights (a Sync-Opt coordinator keeps its
optimizer state next to the weights under ``optim/``) and writes the tensors in one of
the two formats other tools read. The safetensors writer is a few lines of this module
(the format is an 8-byte header length, a JSON header and the raw little-endian tensor
bytes), so exporting needs no package beyond the core install.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedagent.errors import FedagentError
from fedagent.storage import checkpoint
from fedagent.storage.checkpoint import OPTIMIZER_PREFIX
from fedagent.storage.statefile import atomic_write_with

FORMATS = ("pt", "safetensors")

_SAFETENSORS_DTYPES = {
    np.dtype("float64"): "F64",
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("int64"): "I64",
    np.dtype("int32"): "I32",
    np.dtype("int16"): "I16",
    np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}


def checkpoint_of(state_dir: Path, federation: str, role: str) -> Path:
    """Where a daemon of ``role`` with this state directory keeps its latest model of
    ``federation``."""
    if not federation:
        raise FedagentError(f"the {role} config has no federation yet (run 'fedagent join' first)")
    base = state_dir / role / federation
    for name in ("global.ckpt", "model.ckpt"):
        if (base / name).exists():
            return base / name
    raise FedagentError(f"no model checkpoint in {base}: the {role} has not received or trained a model yet")


def model_weights(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The model tensors of a checkpoint (optimizer state left out) and its metadata."""
    loaded = checkpoint.load(path)
    if loaded is None:
        raise FedagentError(f"no checkpoint at {path}")
    weights, meta = loaded
    return {k: v for k, v in weights.items() if not k.startswith(OPTIMIZER_PREFIX)}, meta


def export(source: Path, out: Path, fmt: str | None = None) -> dict[str, Any]:
    """Write the model of checkpoint ``source`` to ``out``; the format comes from ``fmt``
    or from the suffix of ``out`` (``.pt``/``.pth`` or ``.safetensors``). Returns a
    summary: format, tensor count, parameter count, model version."""
    fmt = fmt or _format_from_suffix(out)
    if fmt not in FORMATS:
        raise FedagentError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    weights, meta = model_weights(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A file the user asked for: the permission bits of any new file of theirs (umask).
    if fmt == "pt":
        atomic_write_with(out, lambda f: _write_pt(f, weights), mode=None)
    else:
        atomic_write_with(out, lambda f: _write_safetensors(f, weights, meta), mode=None)
    return {
        "format": fmt,
        "tensors": len(weights),
        "parameters": int(sum(int(a.size) for a in weights.values())),
        "model_version": meta.get("model_version"),
        "path": str(out),
    }


def _format_from_suffix(out: Path) -> str:
    suffix = out.suffix.lower()
    if suffix in (".pt", ".pth"):
        return "pt"
    if suffix == ".safetensors":
        return "safetensors"
    raise FedagentError(f"cannot tell the format from {out.name!r}: name it *.pt or *.safetensors, or pass --format")


def _write_pt(f: BinaryIO, weights: dict[str, np.ndarray]) -> None:
    import torch

    state = {name: torch.from_numpy(np.ascontiguousarray(arr).copy()) for name, arr in weights.items()}
    torch.save(state, f)


def _write_safetensors(f: BinaryIO, weights: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    arrays = []
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name])
        dtype = _SAFETENSORS_DTYPES.get(arr.dtype)
        if dtype is None:
            raise FedagentError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors export does not support")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    header["__metadata__"] = {k: str(v) for k, v in meta.items() if isinstance(v, (str, int, float, bool))}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for arr in arrays:
        arr.tofile(f)  # raw bytes in C order
