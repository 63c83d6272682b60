"""Atomic writes (fedagent.storage.statefile): the permission bits a file gets, and a write
that fails leaving the previous version and no temporary file behind."""

from __future__ import annotations

import os
import stat

import pytest

from fedagent.errors import StateWriteError
from fedagent.storage.statefile import atomic_write, atomic_write_with


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_is_0600_whatever_the_umask_and_a_users_file_follows_the_umask(tmp_path, umask_027):
    atomic_write(tmp_path / "state", b"s")
    atomic_write(tmp_path / "cert", b"c", mode=0o644)
    atomic_write(tmp_path / "export", b"e", mode=None)
    atomic_write(tmp_path / "cache", b"c", durable=False)
    assert [mode(tmp_path / n) for n in ("state", "cert", "export", "cache")] == [0o600, 0o644, 0o640, 0o600]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "cert", "export", "state"]


@pytest.mark.parametrize("error", [ValueError("a tensor the format cannot hold"), KeyboardInterrupt()])
def test_a_write_that_fails_leaves_the_previous_version_and_no_temporary_file(tmp_path, error):
    target = tmp_path / "model"
    atomic_write(target, b"old", mode=None)

    def write(f) -> None:
        f.write(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        atomic_write_with(target, write, mode=None)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_an_os_error_is_a_state_write_error(tmp_path):
    with pytest.raises(StateWriteError, match="previous version is intact"):
        atomic_write(tmp_path / "missing-dir" / "file", b"x")
