"""A daemon's history: JSON lines of what happened (rounds, updates, evaluations), rotated
by size so that a daemon running for months keeps a bounded amount of it.

Every record is appended whole and made durable (:func:`fedagent.storage.statefile.append_line`:
a full disk never leaves half a line). When the next record would take the current file
past ``max_bytes`` the file is rotated first, the way logrotate numbers files:
``history.jsonl`` becomes ``history.jsonl.1``, ``.1`` becomes ``.2`` and so on, and the
oldest (``.keep``) is deleted; the directory is fsynced after the renames. A rename is
atomic, so a crash during a rotation leaves every line in exactly one file (a number may
be missing in the sequence); readers take whatever files exist, oldest first. The
history then holds at most ``(keep + 1) × max_bytes`` (plus one record).

Readers — ``fedagent report``, the coordinator's recovery, the tests and benchmarks —
go through :func:`history_files` / :func:`read_records`, never the current file alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedagent.errors import StateWriteError
from fedagent.storage.statefile import append_line, make_dirs, sync_dir

log = logging.getLogger(__name__)

NAME = "history.jsonl"
#: The current file is rotated once it would grow past this many bytes (at ~700 bytes a
#: round for a digits agent that is some 24,000 rounds a file).
DEFAULT_MAX_BYTES = 16 * 2**20
#: Rotated files kept beside the current one (the oldest is deleted at the next rotation).
DEFAULT_KEEP = 4
#: A file never rotates below this size (a tiny setting would rotate at every record).
MIN_MAX_BYTES = 64 * 2**10


def rotated(path: Path, n: int) -> Path:
    """The ``n``-th rotated file of the history at ``path`` (1: the newest)."""
    return path.with_name(f"{path.name}.{n}")


def history_files(path: Path) -> list[Path]:
    """The files of the history whose current file is ``path``, oldest first: the rotated
    ones by descending number, then ``path`` itself; only those that exist. Numbers past
    today's ``keep`` (a setting lowered since) are included: nothing on disk is skipped."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.([1-9][0-9]{0,5})")
    numbered: list[tuple[int, Path]] = []
    try:
        for entry in path.parent.iterdir():
            m = pattern.fullmatch(entry.name)
            if m and entry.is_file():
                numbered.append((int(m.group(1)), entry))
    except FileNotFoundError:
        return []
    out = [p for _, p in sorted(numbered, reverse=True)]
    if path.is_file():
        out.append(path)
    return out


def current_path(path: Path) -> Path:
    """``history.jsonl`` for ``history.jsonl`` or any of its rotated files."""
    path = Path(path)
    m = re.fullmatch(r"(.+\.jsonl)\.[1-9][0-9]{0,5}", path.name)
    return path.with_name(m.group(1)) if m else path


def find(state_dir: Path) -> list[Path]:
    """Every history below ``state_dir``, each named by its current file (which may not
    exist yet if a crash came between a rotation and the next record)."""
    found = {current_path(p) for p in Path(state_dir).glob(f"**/{NAME}*") if p.is_file()}
    return sorted(p for p in found if p.name == NAME)


def read_lines(path: Path) -> Iterator[str]:
    """Every line of the history at ``path``, oldest first, across its rotated files."""
    for f in history_files(path):
        try:
            text = f.read_text(errors="replace")
        except FileNotFoundError:  # rotated away while we were reading
            continue
        yield from text.splitlines()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The history's records, oldest first; lines that are not a JSON object are skipped."""
    out = []
    for line in read_lines(path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class History:
    """The append side: one JSON line per record, rotated at ``max_bytes``, ``keep``
    rotated files kept."""

    def __init__(self, path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        if max_bytes < MIN_MAX_BYTES or keep < 1:
            raise ValueError(f"a history needs max_bytes >= {MIN_MAX_BYTES} and keep >= 1")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.rotations = 0
        # Records come from the event loop and, rarely, a worker thread: one rotation at a time.
        self._lock = threading.Lock()
        make_dirs(path.parent)
        self._cut_partial_line()

    def _cut_partial_line(self) -> None:
        """A power cut during an append can leave the start of a record without its newline
        (written, not yet synced: never reported as appended). The next record would be
        glued to it and both lost to every reader, so the fragment goes first."""
        try:
            f = open(self.path, "r+b")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StateWriteError(f"cannot open {self.path}: {exc.strerror or exc}") from exc
        with f:
            end = f.seek(0, os.SEEK_END)
            keep = end
            while keep > 0:
                start = max(0, keep - 4096)
                f.seek(start)
                block = f.read(keep - start)
                if keep == end and block.endswith(b"\n"):
                    return
                newline = block.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                keep = start
            log.warning("%s: %d bytes of a record cut short by a crash removed", self.path, end - keep)
            try:
                f.truncate(keep)
                os.fsync(f.fileno())
            except OSError as exc:
                raise StateWriteError(f"cannot repair {self.path}: {exc.strerror or exc}") from exc

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps({"time": time.time(), **record}, sort_keys=True) + "\n").encode()
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                self._rotate()
            append_line(self.path, line)

    def _rotate(self) -> None:
        try:
            rotated(self.path, self.keep).unlink(missing_ok=True)
            for n in range(self.keep - 1, 0, -1):
                older = rotated(self.path, n)
                if older.exists():
                    os.replace(older, rotated(self.path, n + 1))
            os.replace(self.path, rotated(self.path, 1))
            sync_dir(self.path.parent)
        except OSError as exc:
            raise StateWriteError(
                f"cannot rotate {self.path}: {exc.strerror or exc}; earlier records are intact"
            ) from exc
        self.rotations += 1

    def tail(self, nbytes: int) -> list[bytes]:
        """The complete lines among the last ``nbytes`` of the history, oldest first,
        reaching into the rotated files when the current one is shorter."""
        chunks: list[bytes] = []
        left = nbytes
        for f in reversed(history_files(self.path)):
            try:
                with f.open("rb") as fh:
                    end = fh.seek(0, 2)
                    start = max(0, end - left)
                    fh.seek(start)
                    data = fh.read()
            except FileNotFoundError:
                continue
            if start > 0:
                data = data.split(b"\n", 1)[1] if b"\n" in data else b""  # drop the cut first line
            chunks.append(data)
            left -= end - start
            if left <= 0:
                break
        return [line for chunk in reversed(chunks) for line in chunk.splitlines() if line]
