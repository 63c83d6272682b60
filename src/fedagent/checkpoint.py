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
from fedagent.protocols.codec import Limits, decode_weights, encode_weights
from fedagent.statefile import atomic_write

FORMAT = 1


def save(path: Path, weights: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    data = msgpack.packb({"format": FORMAT, "meta": meta, "weights": encode_weights(weights)},
                         use_bin_type=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


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
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0,
                              max_bin_len=max_bytes, max_str_len=2**20)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("meta"), dict):
            raise CodecError("not a fedagent checkpoint")
        limits = Limits(max_message_bytes=max_bytes, max_bin_len=max_bytes)
        return decode_weights(doc["weights"], limits), doc["meta"]
    except (CodecError, ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise FedagentError(f"checkpoint {path} is unreadable ({exc}); move it away to start afresh") from exc
