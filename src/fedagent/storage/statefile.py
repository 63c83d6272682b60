"""Crash-safe files: a reader sees the old content or the new, never a torn mix.

The sequence is the one Pillai et al. (OSDI '14) show applications need on Linux
file systems: write a temporary file in the same directory, fsync it, rename it over
the target, then fsync the directory so the rename itself is durable.
"""

from __future__ import annotations

import os
import secrets
import struct
import tempfile
import zlib
from pathlib import Path

import msgpack

from fedagent.errors import FedagentError, StateWriteError

TEMP_PREFIX = ".fedagent-tmp-"


def atomic_write(path: Path, data: bytes, mode: int | None = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: a reader sees the old content or the new, never a
    mix. See :func:`atomic_write_with` for ``mode`` and ``durable``."""
    atomic_write_with(path, lambda f: f.write(data), mode, durable=durable)


def atomic_write_with(path: Path, write, mode: int | None = 0o600, *, durable: bool = True) -> None:
    """:func:`atomic_write` of what ``write(file)`` writes: a large file (a checkpoint)
    can be written piece by piece from memory that already holds it, never assembled.

    ``mode``: the file's permission bits from its first byte (0600: state and keys), or
    None for those of any new file (0666 less the umask: a file the user asked for).
    ``durable``: synced before it replaces ``path`` and the rename synced too, so it
    survives a power loss; False for a cache that is rebuilt when found damaged. Any
    failure leaves ``path`` as it was and no temporary file behind; an OSError is raised
    as :class:`StateWriteError`."""
    path = Path(path)
    tmp: str | None = None
    try:
        if mode is None:
            fd, tmp = _new_temp(path.parent)
        else:
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        if durable:
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            raise StateWriteError(
                f"cannot write {path}: {exc.strerror or exc}; the previous version is intact"
            ) from exc
        raise


def make_dirs(path: Path, mode: int = 0o777) -> None:
    """``mkdir -p path``, durably: a new directory exists after a power cut only once its
    parent's entry for it is on disk, so the parent of each directory made here is
    fsynced after the ``mkdir``. Without that, a node's first state directory (and every
    file synced into it) could be gone after a power cut however carefully each file
    was written. An OSError is raised as :class:`StateWriteError`."""
    path = Path(path)
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    try:
        for d in reversed(missing):
            try:
                d.mkdir(mode)
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue  # made meanwhile by another process, which syncs its parent
            sync_dir(d.parent)
    except OSError as exc:
        raise StateWriteError(f"cannot create {missing[0]}: {exc.strerror or exc}") from exc


def sync_dir(directory: Path) -> None:
    """fsync a directory: the entries made, renamed or removed in it become durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temp(directory: Path) -> tuple[int, str]:
    """A new temporary file in ``directory`` with the permission bits any new file gets
    (``mkstemp`` makes it 0600 whatever the umask)."""
    for _ in range(100):
        name = os.path.join(directory, TEMP_PREFIX + secrets.token_hex(8))
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name in {directory}")


def read_bytes(path: Path, max_bytes: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise FedagentError(f"{path} is {size} bytes, more than the {max_bytes} allowed")
            return f.read()
    except FileNotFoundError:
        return None


def cleanup_temp_files(directory: Path) -> int:
    """Remove temp files a killed process left behind; returns how many."""
    n = 0
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
            n += 1
    return n


def append_line(path: Path, line: bytes) -> None:
    """Append one record and make it durable, or leave the file exactly as it was.

    A full disk can accept part of a write; a half line would make every later reader
    of the file fail, so on any error the file is cut back to its previous length.
    """
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            created = False
    except OSError as exc:
        raise StateWriteError(f"cannot append to {path}: {exc.strerror or exc}") from exc
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            if created:
                # A new file's records survive a power cut only with its directory entry.
                sync_dir(Path(path).parent)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise StateWriteError(
                f"cannot append to {path}: {exc.strerror or exc}; earlier records are intact"
            ) from exc
    finally:
        os.close(fd)


# -- append-only journals of framed records (replay journal, round journal) ------------------
RECORD_HEADER = struct.Struct(">II")  # payload length, CRC-32 of the payload


def record(doc: dict) -> bytes:
    """One journal record: the header, then ``doc`` as msgpack."""
    payload = msgpack.packb(doc, use_bin_type=True)
    return RECORD_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def append_record(fd: int, data: bytes, size: int) -> None:
    """Append ``data`` at the end of the journal open on ``fd`` (``size`` bytes long) and
    fdatasync. On failure the file is cut back to ``size`` (a half record would hide every
    later one behind it) and the OSError is raised."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fdatasync(fd)
    except OSError:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise
