"""The federation's held-out metrics: the agents' evaluations of one global model.

Every agent evaluates each global model it receives on its own held-out data and tells
the coordinator (an :class:`~fedagent.protocols.messages.Evaluation`). The coordinator
shows, next to its training loss, the sample-weighted mean of those evaluations for the
newest model version any agent has reported on, and how many agents that mean covers.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedagent.protocols.aggregation import weighted_metrics

#: Model versions whose reports are kept (a late report of an older version is dropped).
KEEP_VERSIONS = 2


class HeldOut:
    def __init__(self) -> None:
        # model version -> agent -> (samples, metrics); each agent's latest report counts.
        self._reports: dict[int, dict[str, tuple[int, dict[str, float]]]] = {}

    def add(self, agent: str, model_version: int, samples: int, metrics: Mapping[str, float]) -> bool:
        """Record ``agent``'s evaluation of ``model_version``; False when it is too old to keep."""
        if samples <= 0 or not metrics:
            return False
        if self._reports and model_version < min(self._reports) and len(self._reports) >= KEEP_VERSIONS:
            return False
        self._reports.setdefault(model_version, {})[agent] = (samples, dict(metrics))
        for old in sorted(self._reports)[:-KEEP_VERSIONS]:
            del self._reports[old]
        return True

    def summary(self) -> dict[str, Any]:
        """{model_version, agents, samples, metrics} for the newest version reported; {} before any."""
        if not self._reports:
            return {}
        version = max(self._reports)
        reports = self._reports[version]
        return {
            "model_version": version,
            "agents": sorted(reports),
            "samples": sum(n for n, _ in reports.values()),
            "metrics": weighted_metrics([(m, n) for n, m in reports.values()]),
        }
