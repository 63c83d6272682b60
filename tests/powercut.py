"""A power cut, modelled at the level of Python's file-system calls.

A process that will lose power calls :func:`install` (or is started with the
environment of :func:`child_env`, whose ``sitecustomize`` calls it) before it touches
its state. From then on, for everything below ``root``, a *trace* records what a disk
is obliged to keep after a power loss:

* a file's content as of its last ``fsync``/``fdatasync`` (read back just before the
  real call: the bytes written until then are what the call makes durable);
* a directory's entries (name → which file or directory) as of its last ``fsync``.

Nothing else is durable. A file written and never synced comes back empty; a file
created, renamed or deleted comes back as the directory's last sync saw it; a new
directory exists only if its parent was synced after the ``mkdir``. The root itself
stands for the mount point and always exists; what was in it at :func:`install` counts
as on disk.

After the process is killed (``SIGKILL``: the cut), :func:`restore` moves the tree
aside (``<root>.before-cut``) and builds the durable image in its place. With ``rng``
it also lets a random prefix of each file's unsynced appended bytes survive (a write
partly on disk: the torn tails of journals and logs), as disks do.

What it does not model: bytes of an unsynced write landing out of order or in the
middle of a file (only appended prefixes survive), reordering between two files both
synced (a sync is durable on return), metadata such as permissions and times, writes
that bypass Python's ``os`` module (C extensions, ``mmap``), and anything outside
``root``. Files are told apart by inode number and a generation counted up whenever
their last link goes (an inode number is reused after that).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import sys
import threading
from pathlib import Path
from typing import Any

ENV_ROOT = "POWERCUT_ROOT"
ENV_TRACE = "POWERCUT_TRACE"
SITE_DIR = Path(__file__).with_name("powercut_site")
LOG = "trace.jsonl"

_real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace", "rename", "unlink", "remove", "rmdir")}
_recorder: Recorder | None = None


class Recorder:
    """Records, for the tree below ``root``, what a power cut would leave (see the module)."""

    def __init__(self, root: Path, trace: Path) -> None:
        self.root = Path(root).absolute()
        self.trace = Path(trace).absolute()
        self.blobs = self.trace / "blobs"
        self.lock = threading.RLock()
        self.gen: dict[int, int] = {}
        self.count = 0
        self.blobs.mkdir(parents=True, exist_ok=True)
        fresh = not (self.trace / LOG).exists()
        # A process restarted after a plain kill goes on with the trace of the one before
        # (its page cache survived); the generations counted there still hold.
        for event in read_trace(self.trace):
            if event["t"] == "free":
                self.gen[event["ino"]] = event["gen"]
        self._log_fd = os.open(self.trace / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if fresh:
            self.root.mkdir(parents=True, exist_ok=True)
            self._snapshot_tree()

    # -- identities ------------------------------------------------------------------------
    def fid(self, ino: int) -> str:
        return f"{ino}:{self.gen.get(ino, 0)}"

    def _inside(self, path: str | os.PathLike[str] | int) -> str | None:
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
        full = os.path.abspath(os.fsdecode(path))
        root = str(self.root)
        return full if full == root or full.startswith(root + os.sep) else None

    # -- the trace -------------------------------------------------------------------------
    def _log(self, event: dict[str, Any]) -> None:
        os.write(self._log_fd, (json.dumps(event) + "\n").encode())

    def _blob(self, data: bytes) -> str:
        self.count += 1
        name = f"{os.getpid()}-{self.count}"
        with open(self.blobs / name, "wb") as f:
            f.write(data)
        return name

    def _dir_event(self, path: str, st: os.stat_result) -> dict[str, Any]:
        entries = {}
        with os.scandir(path) as it:
            for e in it:
                try:
                    kind = (
                        "dir" if e.is_dir(follow_symlinks=False) else "file" if e.is_file(follow_symlinks=False) else ""
                    )
                    ino = e.inode()
                except OSError:
                    continue
                if kind:
                    entries[e.name] = [self.fid(ino), kind]
        return {"t": "dir", "fid": self.fid(st.st_ino), "mode": stat.S_IMODE(st.st_mode), "entries": entries}

    def _snapshot_tree(self) -> None:
        """Everything below the root at the start is on disk already."""
        with self.lock:
            st = os.stat(self.root)
            self._log({"t": "root", "fid": self.fid(st.st_ino)})
            for dirpath, _dirnames, filenames in os.walk(self.root):
                self._log(self._dir_event(dirpath, os.stat(dirpath)))
                for name in filenames:
                    p = os.path.join(dirpath, name)
                    fst = os.lstat(p)
                    if stat.S_ISREG(fst.st_mode):
                        with open(p, "rb") as f:
                            self._log({"t": "file", "fid": self.fid(fst.st_ino), "blob": self._blob(f.read())})

    # -- the wrapped calls -----------------------------------------------------------------
    def sync(self, real: Any, fd: int) -> None:
        path = self._inside(fd)
        if path is None:
            real(fd)
            return
        with self.lock:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                event = self._dir_event(path, st)
            else:
                # A descriptor opened write-only cannot be read: open the same file again.
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    event = {"t": "file", "fid": self.fid(st.st_ino), "blob": self._blob(f.read())}
            real(fd)
            # Logged once the real call returned: a kill before this line is a cut before
            # the sync, and the process had not acted on it yet.
            self._log(event)

    def _freed(self, st: os.stat_result | None) -> None:
        if st is not None and (stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1):
            self.gen[st.st_ino] = self.gen.get(st.st_ino, 0) + 1
            self._log({"t": "free", "ino": st.st_ino, "gen": self.gen[st.st_ino]})

    def remove(self, real: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dir_fd") is not None or self._inside(path) is None:
            real(path, *args, **kwargs)
            return
        with self.lock:
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            real(path, *args, **kwargs)
            self._freed(st)

    def move(self, real: Any, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs or args or self._inside(dst) is None:
            real(src, dst, *args, **kwargs)
            return
        with self.lock:
            try:
                old, new = os.lstat(dst), os.lstat(src)
                victim = old if old.st_ino != new.st_ino else None
            except OSError:
                victim = None
            real(src, dst)
            self._freed(victim)


def install(root: Path, trace: Path) -> Recorder:
    """Record, from now on in this process, what a power cut would leave below ``root``."""
    global _recorder
    rec = Recorder(root, trace)
    _recorder = rec
    os.fsync = lambda fd: rec.sync(_real["fsync"], fd)  # type: ignore[assignment]
    os.fdatasync = lambda fd: rec.sync(_real["fdatasync"], fd)  # type: ignore[assignment]
    for name in ("unlink", "remove", "rmdir"):
        os.__dict__[name] = lambda path, *a, _r=_real[name], **k: rec.remove(_r, path, *a, **k)
    for name in ("replace", "rename"):
        os.__dict__[name] = lambda src, dst, *a, _r=_real[name], **k: rec.move(_r, src, dst, *a, **k)
    return rec


def uninstall() -> None:
    global _recorder
    for name, fn in _real.items():
        os.__dict__[name] = fn
    _recorder = None


def child_env(root: Path, trace: Path) -> dict[str, str]:
    """Environment for a Python process that installs the recorder before anything else
    (``tests/powercut_site/sitecustomize.py``)."""
    path = os.pathsep.join(p for p in (str(SITE_DIR), str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    return {ENV_ROOT: str(root), ENV_TRACE: str(trace), "PYTHONPATH": path}


# -- after the cut --------------------------------------------------------------------------
def read_trace(trace: Path) -> list[dict[str, Any]]:
    try:
        text = (Path(trace) / LOG).read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # the line a kill cut short: its call had not returned
    return events


def restore(root: Path, trace: Path, rng: random.Random | None = None) -> dict[str, int]:
    """Replace ``root`` by what the disk holds after a power cut at this moment (the
    process that wrote it must be dead). The tree before the cut is kept beside it as
    ``<root>.before-cut`` (replacing an older one); the trace is emptied, so the next
    :func:`install` starts from the restored tree. With ``rng``, a random prefix of the
    bytes each file had appended since its last sync survives as well. Returns counts:
    files and directories restored, files whose unsynced bytes were lost, torn tails."""
    root, trace = Path(root).absolute(), Path(trace).absolute()
    events = read_trace(trace)
    root_fid = next(e["fid"] for e in events if e["t"] == "root")
    files: dict[str, str] = {}
    dirs: dict[str, dict[str, Any]] = {}
    gen: dict[int, int] = {}
    for e in events:
        if e["t"] == "file":
            files[e["fid"]] = e["blob"]
        elif e["t"] == "dir":
            dirs[e["fid"]] = e
        elif e["t"] == "free":
            gen[e["ino"]] = e["gen"]
    # What each file holds now (the page cache a plain kill leaves): for torn tails.
    now: dict[str, Path] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                now[f"{st.st_ino}:{gen.get(st.st_ino, 0)}"] = p
    image = root.with_name(root.name + ".restoring")
    shutil.rmtree(image, ignore_errors=True)
    counts = {"files": 0, "dirs": 0, "lost_writes": 0, "torn": 0}

    def build(fid: str, path: Path, mode: int) -> None:
        path.mkdir(mode=0o700)
        os.chmod(path, mode)
        counts["dirs"] += 1
        d = dirs.get(fid)
        for name, (child, kind) in (d["entries"] if d else {}).items():
            if kind == "dir":
                build(child, path / name, dirs.get(child, {}).get("mode", 0o700))
                continue
            data = (trace / "blobs" / files[child]).read_bytes() if child in files else b""
            current = now[child].read_bytes() if child in now else None
            if current is not None and current != data:
                counts["lost_writes"] += 1
                if rng is not None and current.startswith(data) and len(current) > len(data):
                    keep = rng.randint(0, len(current) - len(data))
                    if keep:
                        counts["torn"] += 1
                        data = current[: len(data) + keep]
            (path / name).write_bytes(data)
            os.chmod(path / name, 0o600)
            counts["files"] += 1

    build(root_fid, image, dirs.get(root_fid, {}).get("mode", 0o700))
    before = root.with_name(root.name + ".before-cut")
    shutil.rmtree(before, ignore_errors=True)
    os.rename(root, before)
    os.rename(image, root)
    shutil.rmtree(trace)
    return counts


def installed_from_env() -> None:
    """What ``sitecustomize`` runs: install when the environment names a root."""
    root, trace = os.environ.get(ENV_ROOT), os.environ.get(ENV_TRACE)
    if root and trace and _recorder is None:
        install(Path(root), Path(trace))
        # Children of this process (none expected) must not record into the same trace.
        for key in (ENV_ROOT, ENV_TRACE):
            os.environ.pop(key, None)


if __name__ == "__main__":  # pragma: no cover - a manual check: python tests/powercut.py ROOT TRACE
    print(restore(Path(sys.argv[1]), Path(sys.argv[2])))
