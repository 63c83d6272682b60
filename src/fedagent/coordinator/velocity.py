"""The server momentum's velocity on disk, beside the coordinator's checkpoint.

A velocity is one more model-sized buffer. Kept in memory it would take the
coordinator's peak from about 2.5 to about 3.5 times the model; kept here, the round's
momentum step (protocols/serveropt.py, ``momentum_step_into``) reads the current one and
writes the next one a block at a time, and the coordinator holds none of it.

One file per model version, ``velocity-<version>.bin``:

* ``MAGIC``, then the header's length (4 bytes, little-endian) and the header (JSON:
  ``model_version`` and ``tensors``, a list of ``[name, dtype, shape]``);
* each tensor's values in that order, raw, little-endian, in the tensor's dtype;
* the CRC-32 of everything before it (4 bytes, little-endian).

The next velocity is written to ``velocity.tmp`` and renamed when its round is adopted;
the file of the previous version stays until the checkpoint of the new model is written
(:meth:`FileVelocity.prune`), so a crash in between finds the velocity that goes with
whichever checkpoint it finds. A file is checked before it is used (header, sizes,
CRC-32, finite values) and refused with an error that names it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from fedagent.errors import FedagentError, StateWriteError
from fedagent.protocols.serveropt import BLOCK, Layout, VelocityWriter, velocity_layout

MAGIC = b"fedagent-velocity-1\n"
MAX_HEADER = 16 << 20  # bytes: a header is a few bytes a tensor
DIGEST = 4  # bytes of the CRC-32 at the end
PATTERN = "velocity-*.bin"


def _name(version: int) -> str:
    return f"velocity-{version}.bin"


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")


def _offsets(tensors: Layout, header: bytes) -> tuple[dict[str, tuple[int, np.dtype, int]], int]:
    """Where each tensor's values start in a file with this header (name -> offset,
    little-endian dtype, number of values), and where the values end."""
    at = len(MAGIC) + 4 + len(header)
    offsets: dict[str, tuple[int, np.dtype, int]] = {}
    for name, dtype, shape in tensors:
        size = int(np.prod(shape, dtype=np.int64))
        offsets[name] = (at, _le(dtype), size)
        at += size * dtype.itemsize
    return offsets, at


class _FileWriter:
    def __init__(self, path: Path, layout: Layout, model_version: int) -> None:
        self.path = path
        self.model_version = model_version
        self._expect = iter([(name, int(np.prod(shape, dtype=np.int64)), dtype) for name, dtype, shape in layout])
        self._name, self._left, self._dtype = "", 0, np.dtype(np.float32)
        self._crc = 0
        try:
            self._f = open(path, "wb")  # closed by finish or abort
        except OSError as exc:
            raise _write_error(path, exc) from exc
        header = json.dumps(
            {
                "model_version": model_version,
                "tensors": [[name, _le(dtype).str, list(shape)] for name, dtype, shape in layout],
            }
        ).encode()
        self._put(MAGIC + struct.pack("<I", len(header)) + header)
        self.offsets, _ = _offsets(layout, header)

    def _put(self, data: bytes | memoryview) -> None:
        self._crc = zlib.crc32(data, self._crc)
        try:
            self._f.write(data)
        except OSError as exc:
            raise _write_error(self.path, exc) from exc

    def write(self, name: str, block: np.ndarray) -> None:
        if self._left == 0 and name != self._name:
            self._name, self._left, self._dtype = next(self._expect)
        if name != self._name or block.size > self._left:
            raise ValueError(f"velocity block of {name!r} out of the layout's order")
        self._left -= block.size
        data = np.ascontiguousarray(block, _le(self._dtype))
        self._put(memoryview(cast(Any, data)).cast("B"))

    def complete(self) -> bool:
        """Every value of every tensor of the layout is written."""
        return not self._left and next(self._expect, None) is None

    def finish(self) -> None:
        try:
            self._f.write(struct.pack("<I", self._crc))
            self._f.close()  # synced later, off the event loop: FileVelocity.sync
        except OSError as exc:
            raise _write_error(self.path, exc) from exc

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # what it could not write goes with the file
        self.path.unlink(missing_ok=True)


class FileVelocity:
    """A :class:`~fedagent.protocols.serveropt.VelocityStore` in ``directory`` (the
    coordinator's state directory)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path: Path | None = None  # the current velocity's file
        self._offsets: dict[str, tuple[int, np.dtype, int]] = {}  # name -> (offset, dtype, size)
        self._fd: int | None = None

    # -- the current velocity ----------------------------------------------------------
    def open(self, model_version: int, weights: Mapping[str, np.ndarray]) -> bool:
        """Use the velocity that goes with the checkpointed model ``model_version`` (False:
        there is none, the velocity starts at zero). Files of other versions are removed.
        FedagentError if the file does not fit ``weights`` or is damaged."""
        path = self.dir / _name(model_version)
        found = path.exists()
        if found:
            self._use(path, check_file(path, weights, model_version))
        for p in [*self.dir.glob(PATTERN), self.dir / "velocity.tmp"]:
            if p != path:
                p.unlink(missing_ok=True)
        return found

    def _use(self, path: Path, offsets: dict[str, tuple[int, np.dtype, int]]) -> None:
        self.close()
        self._fd = os.open(path, os.O_RDONLY)
        self.path, self._offsets = path, offsets

    def read(self, name: str, start: int, stop: int) -> np.ndarray | None:
        if self._fd is None or name not in self._offsets:
            return None
        offset, dtype, size = self._offsets[name]
        stop = min(stop, size)
        want = (stop - start) * dtype.itemsize
        data = os.pread(self._fd, want, offset + start * dtype.itemsize)
        if len(data) != want:
            raise FedagentError(f"{self.path}: cut short while in use")
        return np.frombuffer(data, dtype)

    # -- the next one ------------------------------------------------------------------
    def begin(self, layout: Layout, model_version: int) -> VelocityWriter:
        self.dir.mkdir(parents=True, exist_ok=True)
        return _FileWriter(self.dir / "velocity.tmp", layout, model_version)

    def adopt(self, writer: VelocityWriter) -> None:
        assert isinstance(writer, _FileWriter)
        if not writer.complete():
            writer.abort()
            raise ValueError("a velocity adopted before all of it was written")
        path = self.dir / _name(writer.model_version)
        try:
            writer.finish()
            os.replace(writer.path, path)
        except StateWriteError:
            writer.abort()
            raise
        except OSError as exc:
            writer.abort()
            raise _write_error(path, exc) from exc
        self._use(path, writer.offsets)

    def sync(self, model_version: int) -> None:
        """Make the velocity of ``model_version`` durable (its file and its name): called
        before the checkpoint of that model is written, in the same worker thread, so
        that a checkpoint on disk always has its velocity on disk."""
        path = self.dir / _name(model_version)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _sync_dir(self.dir)
        except FileNotFoundError:
            return  # no velocity for that version (a round without momentum)
        except OSError as exc:
            raise _write_error(path, exc) from exc

    def discard(self, writer: VelocityWriter) -> None:
        assert isinstance(writer, _FileWriter)
        writer.abort()

    def prune(self, below: int) -> None:
        """Remove the files of model versions before ``below`` (called once the
        checkpoint of that version is written); the current one stays in any case."""
        for p in self.dir.glob(PATTERN):
            version = _version(p)
            if version is not None and version < below and p != self.path:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- a velocity handed over in memory (a checkpoint of an earlier version) ----------
    def write_all(
        self, velocity: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray], model_version: int
    ) -> None:
        """Store ``velocity`` (all in memory) as the one of ``model_version``."""
        layout = velocity_layout(weights)
        writer = self.begin(layout, model_version)
        assert isinstance(writer, _FileWriter)
        try:
            for name, dtype, shape in layout:
                v = velocity.get(name)
                flat = (
                    np.zeros(int(np.prod(shape, dtype=np.int64)), dtype)
                    if v is None
                    else np.asarray(v, dtype).reshape(-1)
                )
                writer.write(name, flat)
        except BaseException:
            writer.abort()
            raise
        self.adopt(writer)
        self.sync(model_version)


def _write_error(path: Path, exc: OSError) -> StateWriteError:
    return StateWriteError(
        f"cannot write {path}: {exc.strerror or exc}; the previous velocity and checkpoint are intact"
    )


def _version(path: Path) -> int | None:
    digits = path.name[len("velocity-") : -len(".bin")]
    return int(digits) if digits.isdigit() else None


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _header_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
            raise FedagentError(f"{path}: not a fedagent velocity file")
        (n,) = struct.unpack("<I", head[len(MAGIC) :])
        if n > MAX_HEADER:
            raise FedagentError(f"{path}: header of {n} bytes (at most {MAX_HEADER})")
        header = f.read(n)
        if len(header) != n:
            raise FedagentError(f"{path}: cut short in its header")
        return header


def check_file(
    path: Path, weights: Mapping[str, np.ndarray], model_version: int
) -> dict[str, tuple[int, np.dtype, int]]:
    """The tensors' offsets in a velocity file (:func:`_offsets`), once the file is
    checked against the model ``weights`` it goes with: the same floating tensors (names,
    dtypes, shapes), the exact size, the CRC-32 and finite values. FedagentError otherwise."""
    header = _header_bytes(path)
    try:
        meta = json.loads(header)
        tensors = [(str(n), np.dtype(d), tuple(int(x) for x in s)) for n, d, s in meta["tensors"]]
        version = int(meta["model_version"])
    except (ValueError, TypeError, KeyError) as exc:
        raise FedagentError(f"{path}: unreadable header ({exc})") from None
    want = [(n, _le(d).str, s) for n, d, s in velocity_layout(weights)]
    if [(n, d.str, s) for n, d, s in tensors] != want or version != model_version:
        raise FedagentError(
            f"{path}: a velocity for model version {version} with other tensors than the "
            f"checkpoint's model (version {model_version}); move it away to start the momentum afresh"
        )
    offsets, at = _offsets(tensors, header)
    if path.stat().st_size != at + DIGEST:
        raise FedagentError(f"{path}: {path.stat().st_size} bytes, its header says {at + DIGEST}")
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(len(MAGIC) + 4 + len(header)))
        for name, (_, dtype, size) in offsets.items():
            step = BLOCK * 16
            for start in range(0, size, step):
                data = f.read(min(step, size - start) * dtype.itemsize)
                crc = zlib.crc32(data, crc)
                if not np.isfinite(np.frombuffer(data, dtype)).all():
                    raise FedagentError(f"{path}: the velocity of {name!r} is not finite")
        if f.read(DIGEST) != struct.pack("<I", crc):
            raise FedagentError(f"{path}: damaged (its CRC-32 does not match)")
    return offsets


def load(path: Path, weights: Mapping[str, np.ndarray], model_version: int) -> dict[str, np.ndarray]:
    """A checked velocity file, all in memory (tests and tools)."""
    offsets = check_file(path, weights, model_version)
    out = {}
    with open(path, "rb") as f:
        for name, (offset, dtype, size) in offsets.items():
            f.seek(offset)
            out[name] = np.frombuffer(f.read(size * dtype.itemsize), dtype).reshape(np.shape(weights[name])).copy()
    return out
