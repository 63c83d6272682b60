"""The federation's held-out metrics: the agents' evaluations of one global model.

Every agent evaluates each global model it receives on its own held-out data and tells
the coordinator (an :class:`~fedagent.protocols.messages.Evaluation`). The coordinator
shows, next to its training loss, the agents' evaluations of the newest model version
that more than one agent has reported on (the newest reported at all, flagged, while
only one has).

Any member may send an evaluation, so nothing in the figure may rest on one member's
word: a report is taken only for a model version that exists (at most the current one,
and recent), each metric shown is the (lower) median over the agents that reported,
which one member cannot move past an honest agent's figure (a sample-weighted mean would
follow whoever claims the most samples), and the samples shown count each agent at most
:data:`SAMPLES_CAP` times the median count. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Model versions whose reports are kept (a late report of an older version is dropped).
KEEP_VERSIONS = 4
#: In the samples shown, an agent counts at most this many times the median count.
SAMPLES_CAP = 2


def _lower_median(values: list[float]) -> float:
    s = sorted(values)
    return s[(len(s) - 1) // 2]


class HeldOut:
    def __init__(self) -> None:
        # model version -> agent -> (samples, metrics); each agent's latest report counts.
        self._reports: dict[int, dict[str, tuple[int, dict[str, float]]]] = {}

    @staticmethod
    def refusal(model_version: int, current: int) -> str:
        """Why a report of ``model_version`` must not be taken while the global model is
        at ``current`` (a version that does not exist yet), or ''."""
        if model_version > current:
            return f"evaluation of model version {model_version}, which does not exist (current {current})"
        return ""

    def add(
        self, agent: str, model_version: int, samples: int, metrics: Mapping[str, float], *, current: int | None = None
    ) -> bool:
        """Record ``agent``'s evaluation of ``model_version``; False when it is not kept
        (too old, empty, or with ``current`` given, of a version that does not exist)."""
        if samples <= 0 or not metrics:
            return False
        if current is not None and (self.refusal(model_version, current) or model_version <= current - KEEP_VERSIONS):
            return False
        if self._reports and model_version < min(self._reports) and len(self._reports) >= KEEP_VERSIONS:
            return False
        self._reports.setdefault(model_version, {})[agent] = (samples, dict(metrics))
        for old in sorted(self._reports)[:-KEEP_VERSIONS]:
            del self._reports[old]
        return True

    def summary(self) -> dict[str, Any]:
        """{model_version, agents, samples (counts capped), metrics (median over agents),
        single_source} for the newest version more than one agent reported (else the
        newest); {} before any."""
        if not self._reports:
            return {}
        shared = [v for v, r in self._reports.items() if len(r) > 1]
        version = max(shared) if shared else max(self._reports)
        reports = self._reports[version]
        keys = set.intersection(*(set(m) for _, m in reports.values()))
        cap = SAMPLES_CAP * _lower_median([float(n) for n, _ in reports.values()])
        capped = {a: min(float(n), cap) for a, (n, _) in reports.items()}
        return {
            "model_version": version,
            "agents": sorted(reports),
            "samples": int(sum(capped.values())),
            "metrics": {k: _lower_median([float(m[k]) for _, m in reports.values()]) for k in sorted(keys)},
            # one agent's word only: status says so
            "single_source": len(reports) == 1,
        }
