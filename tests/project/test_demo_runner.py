"""The demo's runner: what it leaves behind."""

from __future__ import annotations

import os
import tempfile

from fedagent.local.demo.runner import _torch_scratch_in


def test_the_demo_puts_torchs_compiler_cache_in_its_work_directory(tmp_path, monkeypatch):
    # torch makes $TMPDIR/torchinductor_<user> in every process that builds an optimiser
    # and never removes it; the demo's processes make theirs in the work directory.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _torch_scratch_in(tmp_path / "work")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "work" / "torchinductor")
    # torch's default, set by an earlier call in this process: moved too
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "tmp" / "torchinductor_root"))
    _torch_scratch_in(tmp_path / "work2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "work2" / "torchinductor")
    # a directory the user chose: kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    _torch_scratch_in(tmp_path / "work3")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
