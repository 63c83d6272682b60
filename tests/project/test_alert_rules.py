"""The Prometheus rules in prometheus/ stay tied to what the daemons serve and to their tests.

promtool checks and unit-tests them (scripts/lint.sh); this checks, without a process,
that every alert has a unit test in which it fires, every recording rule is evaluated in
one, every metric a rule reads is one :class:`~fedagent.node.metrics.NodeMetrics` serves,
and operators.md explains every alert.
"""

from __future__ import annotations

import re
from pathlib import Path

from fedagent.node.metrics import NodeMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus"
ALERTS = RULES / "fedagent-alerts.yml"
RECORDING = RULES / "fedagent-recording.yml"


def _names(path: Path, key: str) -> list[str]:
    return re.findall(rf"^\s*- {key}: (\S+)\s*$", path.read_text(), re.M)


def _served() -> set[str]:
    """Every sample name a daemon's endpoint can serve (counters with _total, histograms
    with their series)."""
    m = NodeMetrics("coordinator", "c", "f")
    out = set()
    for family in m.registry.collect():
        out.add(family.name)
        if family.type == "counter":
            out.add(family.name + "_total")
        if family.type == "histogram":
            out |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    return out


def test_every_alert_fires_in_a_unit_test():
    alerts = _names(ALERTS, "alert")
    assert len(alerts) == len(set(alerts)) >= 8, alerts
    tests = (RULES / "fedagent-alerts.test.yml").read_text()
    # an alert_rule_test of that alert expecting it to fire (exp_alerts with an entry)
    firing = set(re.findall(r"alertname: (\S+)\n\s+exp_alerts:\n\s+- exp_labels:", tests))
    assert set(alerts) == firing, set(alerts) ^ firing


def test_every_recording_rule_is_evaluated_in_a_unit_test():
    records = _names(RECORDING, "record")
    tests = (RULES / "fedagent-recording.test.yml").read_text()
    evaluated = set(re.findall(r"- expr: ([\w:]+)", tests))
    assert set(records) <= evaluated, set(records) - evaluated


def test_rules_read_only_metrics_the_daemons_serve():
    served = _served()
    records = set(_names(RECORDING, "record"))
    text = ALERTS.read_text() + RECORDING.read_text()
    exprs = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    # (series names outside the annotations' templates: fedagent_... and the recorded ones)
    used = set(re.findall(r"(?<![\w:$.])(fedagent_[a-z_]+)", exprs))
    unknown = {u for u in used if u not in served}
    assert not unknown, f"rules read metrics no daemon serves: {sorted(unknown)}"
    read_records = set(re.findall(r"(?<![\w:])(\w+:fedagent_[a-z_]+(?::\w+)?)", ALERTS.read_text()))
    assert read_records <= records, read_records - records


def test_operators_guide_explains_every_alert():
    guide = (ROOT / "docs" / "operators.md").read_text()
    section = guide[guide.index("\n## Alerts\n") :]
    missing = [a for a in _names(ALERTS, "alert") if f"`{a}`" not in section]
    assert not missing, f"docs/operators.md, Alerts, does not explain {missing}"
