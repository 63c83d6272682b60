"""Fixtures of the benchmark's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def flower_python() -> Path:
    """The Python of ``bench/.venv-flower``, with the Flower release the benchmark
    measures: made on first use (pip from the package index, about a minute), as
    ``bench/run.py --only flower`` makes it, so a test that needs Flower runs instead of
    being skipped on a fresh machine."""
    from bench import flower

    return flower.flower_python(print)
