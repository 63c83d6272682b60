"""Model checkpoints: msgpack (the wire codec's tensor form), written atomically.

A checkpoint is ``{"format": 1, "meta": {...}, "weights": {...}}``; reading it goes
through the same validating decoder as network input (no pickle, no ``torch.load``),
so a corrupted or hostile file gives a clear error, never code execution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from fedagent.errors import CodecError, FedagentError
from fedagent.protocols.codec import Limits, bin_header, decode_weights, encode_weights
from fedagent.storage.statefile import atomic_write_with

FORMAT = 1
#: Key prefix of optimizer state saved next to the weights (a Sync-Opt coordinator's).
OPTIMIZER_PREFIX = "optim/"


def save(path: Path, weights: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    wire = encode_weights(weights)
    meta_bytes = msgpack.packb(meta, use_bin_type=True)  # fails here, before any file is touched
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        # The same msgpack document packb would make, written piece by piece: tensor
        # bytes go from the arrays to the file, so saving a model costs no model-sized
        # buffer (packb built one, and bytes() of it a second: 2 models at the peak).
        pk = msgpack.Packer(use_bin_type=True)
        f.write(pk.pack_map_header(3) + pk.pack("format") + pk.pack(FORMAT) + pk.pack("meta"))
        f.write(meta_bytes)
        f.write(pk.pack("weights") + pk.pack_map_header(len(wire)))
        for name, t in wire.items():
            data = memoryview(t["data"]).cast("B")
            f.write(
                pk.pack(name)
                + pk.pack_map_header(3)
                + pk.pack("dtype")
                + pk.pack(t["dtype"])
                + pk.pack("shape")
                + pk.pack(t["shape"])
                + pk.pack("data")
                + bin_header(data.nbytes)
            )
            f.write(data)

    atomic_write_with(path, write)


def load(path: Path, *, max_bytes: int = 2**31) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """``None`` when there is no checkpoint yet; FedagentError when it is unreadable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FedagentError(f"cannot read checkpoint {path}: {exc}") from exc
    if len(data) > max_bytes:
        raise FedagentError(f"checkpoint {path} is larger than {max_bytes} bytes")
    try:
        doc = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=max_bytes, max_str_len=2**20
        )
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("meta"), dict):
            raise CodecError("not a fedagent checkpoint")
        limits = Limits(max_message_bytes=max_bytes, max_bin_len=max_bytes)
        return decode_weights(doc["weights"], limits), doc["meta"]
    except (CodecError, ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise FedagentError(f"checkpoint {path} is unreadable ({exc}); move it away to start afresh") from exc
