"""Getting a trained model out of fedagent: a checkpoint written as a plain PyTorch
``state_dict`` file (``torch.load(path, weights_only=True)`` opens it) or as safetensors.

A daemon's checkpoint (``global.ckpt``, or ``model.ckpt`` for a gossip agent) is the
msgpack document of :mod:`fedagent.storage.checkpoint`. Exporting reads it through the same
validating decoder, drops what is not model weights (a Sync-Opt coordinator keeps its
optimizer state next to the weights under ``optim/``) and writes the tensors in one of
the two formats other tools read. The safetensors writer is a few lines of this module
(the format is an 8-byte header length, a JSON header and the raw little-endian tensor
bytes), so exporting needs no package beyond the core install.

A checkpoint records what the model's fingerprint says of its tensors (``meta["model"]``,
:meth:`~fedagent.protocols.fingerprint.Fingerprint.meta`): the export restores each
tensor's model dtype (a bfloat16 tensor is float32 inside fedagent, and is rounded back
to nearest even, as ``load_state_dict`` would) and counts parameters and buffers apart.
An agent that keeps its own normalisation layers (``[rounds] local_norm``) holds them
beside the global model; :func:`site_weights` puts the two together.
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
#: An agent's own normalisation layers under ``[rounds] local_norm`` (FedBN), beside the
#: global model it holds (the agent writes it after each round it trains).
LOCAL_LAYERS = "local_layers.ckpt"

_SAFETENSORS_DTYPES: dict[Any, str] = {
    np.dtype("float64"): "F64",
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    "bfloat16": "BF16",
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


def site_weights(path: Path, layers: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The model an agent that keeps its own normalisation layers uses: the global model
    of checkpoint ``path`` with the layers of ``layers`` (its ``local_layers.ckpt``)."""
    weights, meta = model_weights(path)
    loaded = checkpoint.load(layers)
    if loaded is None:
        raise FedagentError(
            f"no {layers.name} beside {path}: this agent keeps no layers of its own ([rounds] local_norm is off, "
            "or it has not trained yet), so its model is the global one: export without --site"
        )
    own, _ = loaded
    unknown = sorted(set(own) - set(weights))
    if unknown:
        raise FedagentError(f"{layers} holds {unknown[0]!r}, which the global model has not")
    return {**weights, **own}, {**meta, "site": True}


def export(
    source: Path,
    out: Path,
    fmt: str | None = None,
    *,
    weights: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write the model of checkpoint ``source`` (or ``weights``, a model and its
    metadata already read) to ``out``; the format comes from ``fmt`` or from the suffix
    of ``out`` (``.pt``/``.pth`` or ``.safetensors``). Returns a summary: format, tensor
    count, parameters and buffers (tensors and values), the dtypes restored, model version."""
    fmt = fmt or _format_from_suffix(out)
    if fmt not in FORMATS:
        raise FedagentError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    model, meta = weights if weights is not None else model_weights(source)
    found = meta.get("model")
    described: dict[str, Any] = found if isinstance(found, dict) else {}
    dtypes = {k: v for k, v in dict(described.get("dtypes") or {}).items() if k in model}
    out.parent.mkdir(parents=True, exist_ok=True)
    # A file the user asked for: the permission bits of any new file of theirs (umask).
    if fmt == "pt":
        atomic_write_with(out, lambda f: _write_pt(f, model, dtypes), mode=None)
    else:
        atomic_write_with(out, lambda f: _write_safetensors(f, model, meta, dtypes), mode=None)
    buffers = set(described.get("buffers") or ()) & set(model)
    frozen = set(described.get("frozen") or ()) & set(model)
    params = [k for k in model if k not in buffers]
    return {
        "format": fmt,
        "tensors": len(model),
        # Without the model's description (a checkpoint of an earlier release) every
        # tensor counts as a parameter: nothing says which are buffers.
        "described": bool(described),
        "parameters": int(sum(int(model[k].size) for k in params)),
        "parameter_tensors": len(params),
        "frozen_tensors": len(frozen),
        "buffers": int(sum(int(model[k].size) for k in buffers)),
        "buffer_tensors": len(buffers),
        "dtypes_restored": dict(sorted(dtypes.items())),
        "model_version": meta.get("model_version"),
        "site": bool(meta.get("site")),
        "path": str(out),
    }


def _format_from_suffix(out: Path) -> str:
    suffix = out.suffix.lower()
    if suffix in (".pt", ".pth"):
        return "pt"
    if suffix == ".safetensors":
        return "safetensors"
    raise FedagentError(f"cannot tell the format from {out.name!r}: name it *.pt or *.safetensors, or pass --format")


def _model_dtype(name: str, arr: np.ndarray, dtypes: dict[str, str]) -> Any:
    """The tensor as the model holds it: ``arr``, or a bfloat16 torch tensor rounded from
    it (to nearest even, as ``load_state_dict`` rounds)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr).copy())
    want = dtypes.get(name)
    if want is None:
        return t
    if want != "bfloat16" or arr.dtype != np.float32:
        raise FedagentError(f"tensor {name!r}: cannot restore dtype {want} from {arr.dtype}")
    return t.to(torch.bfloat16)


def _write_pt(f: BinaryIO, weights: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    import torch

    state = {name: _model_dtype(name, arr, dtypes) for name, arr in weights.items()}
    torch.save(state, f)


def _write_safetensors(
    f: BinaryIO, weights: dict[str, np.ndarray], meta: dict[str, Any], dtypes: dict[str, str]
) -> None:
    header: dict[str, Any] = {}
    offset = 0
    arrays = []
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name])
        dtype = _SAFETENSORS_DTYPES.get(dtypes.get(name, arr.dtype))
        if name in dtypes:
            import torch

            # bfloat16's bits, as 2-byte integers: safetensors stores the raw bytes.
            arr = _model_dtype(name, arr, dtypes).view(torch.int16).numpy()
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
