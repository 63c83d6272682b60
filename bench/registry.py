"""Benchmark sections and the rows they report.

A section is a function ``fn(ctx: Context) -> list[Row]`` registered under a name with
:func:`section`, which also says how many rows it must return for a context
(``rows=``); ``bench/run.py`` imports the modules listed in ``MODULES``, runs the
sections in registration order (``--only NAME`` picks some) and exits non-zero when a
section returns fewer rows than it declared, a row that is not a measurement (a value
or baseline that is not a finite positive number), or reports something as not
measured: a row that silently stops appearing is a failed run, not a shorter table.
To add one, write a module with ``@section("name", rows=...)`` functions and append the
module to ``MODULES``.

Every :class:`Row` pairs a measurement with the baseline it is compared to, both
taken in the same run, so a ratio never mixes two machines or two load levels.
"""

from __future__ import annotations

import math
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
    "bench.tta",
    "bench.fedbuff",
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
        try:
            return self.value / self.baseline_value if self.baseline_value else float("nan")
        except TypeError:  # not a measurement (check_rows says so)
            return float("nan")


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
#: section name -> the number of rows it must return in a context
EXPECTED_ROWS: dict[str, Callable[[Context], int]] = {}


def section(name: str, *, rows: Callable[[Context], int]) -> Callable:
    """Register ``fn`` as section ``name``; ``rows(ctx)`` is how many rows it must return
    when run with ``ctx`` (its default sizes): :func:`check_rows` holds it to that."""

    def register(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        if name in SECTIONS:
            raise ValueError(f"benchmark section {name!r} registered twice")
        SECTIONS[name] = fn
        EXPECTED_ROWS[name] = rows
        return fn

    return register


def check_rows(name: str, ctx: Context, rows: list[Row]) -> list[str]:
    """What is wrong with the rows section ``name`` returned: too few for what it
    declared, rows of another section, values that are not measurements."""
    problems = []
    expected = EXPECTED_ROWS[name](ctx)
    if len(rows) < expected:
        problems.append(f"section {name}: {len(rows)} of the {expected} rows it should measure")
    for r in rows:
        if r.section != name:
            problems.append(f"section {name}: a row of section {r.section!r} ({r.subject})")
        for what, v in (("value", r.value), ("baseline", r.baseline_value)):
            # CPU seconds of a tiny run may be 0 (clock ticks); a wall time or size never is.
            ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 or ("CPU" in r.subject and v == 0))
            if not ok:
                problems.append(f"section {name}: {r.subject}: {what} {v!r} is not a measurement")
    return problems


def summary(times: list[float]) -> tuple[float, float]:
    """(median, maximum): a stall shows in the maximum, never hidden by the median."""
    return statistics.median(times), max(times)
