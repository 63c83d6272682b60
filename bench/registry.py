"""Benchmark sections and the rows they report.

A section is a function ``fn(ctx: Context) -> list[Row]`` registered under a name with
:func:`section`; ``bench/run.py`` imports the modules listed in ``MODULES`` and runs
the sections in registration order (``--only NAME`` picks some). To add one, write a
module with ``@section("name")`` functions and append the module to ``MODULES``.

Every :class:`Row` pairs a measurement with the baseline it is compared to, both
taken in the same run, so a ratio never mixes two machines or two load levels.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MODULES = [
    "bench.codec",
    "bench.round",
    "bench.secagg",
    "bench.flower",
    "bench.syncopt_step",
    "bench.gossip",
    "bench.scaling",
    "bench.replay_journal",
]


@dataclass(frozen=True, slots=True)
class Row:
    """``subject`` measured against ``baseline``; times in seconds unless ``unit`` says
    otherwise. ``ratio`` is subject/baseline: above 1 the subject is slower."""

    section: str
    subject: str
    value: float
    baseline: str
    baseline_value: float
    unit: str = "s"
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.value / self.baseline_value if self.baseline_value else float("nan")


@dataclass
class Context:
    """What every section may use: the run's size, scratch space, a progress printer."""

    quick: bool
    work: Path
    repeats: int
    log: Callable[[str], None] = print
    sizes: list[int] | None = None  # model sizes (parameters) to run; None: the default
    shared: dict = field(default_factory=dict)  # e.g. measurements one section reuses
    # A BenchBroker for N agents on a broker someone else runs (tests: the conftest
    # fixture); None: every broker section starts and stops its own.
    broker: Callable[[int], object] | None = None


SECTIONS: dict[str, Callable[[Context], list[Row]]] = {}


def section(name: str) -> Callable:
    def register(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        if name in SECTIONS:
            raise ValueError(f"benchmark section {name!r} registered twice")
        SECTIONS[name] = fn
        return fn

    return register


def summary(times: list[float]) -> tuple[float, float]:
    """(median, maximum): a stall shows in the maximum, never hidden by the median."""
    return statistics.median(times), max(times)
