"""The shipped systemd units: lint-clean and hardened (exposure score <= 2.0)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "systemd").glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def install(unit: Path, root: Path) -> Path:
    """Copy a unit into a temporary root, pointing ExecStart at a binary that exists."""
    target = root / "etc" / "systemd" / "system" / unit.name
    target.parent.mkdir(parents=True, exist_ok=True)
    fedagent = Path(sys.executable).with_name("fedagent")
    assert fedagent.exists(), "the fedagent console script must be installed"
    target.write_text(unit.read_text().replace("/usr/bin/fedagent", str(fedagent)))
    return target


def test_both_units_exist():
    assert [u.name for u in UNITS] == ["fedagent-agent.service", "fedagent-coordinator.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies_without_any_output(unit, tmp_path):
    path = install(unit, tmp_path)
    out = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
    # verify exits 0 even for unknown keys: any output at all is a finding.
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", out.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_hardening_score(unit, tmp_path):
    path = install(unit, tmp_path)
    out = subprocess.run([ANALYZE, "security", "--offline=true", str(path)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    assert m, out.stdout[-500:] + out.stderr[-500:]
    assert float(m.group(1)) <= 2.0


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_notify_with_watchdog_and_no_restart_loop_on_config_errors(unit):
    text = unit.read_text()
    for line in ("Type=notify", "WatchdogSec=", "RestartPreventExitStatus=78", "DynamicUser=yes",
                 "StateDirectory=fedagent", "RuntimeDirectory=fedagent", "ConfigurationDirectory=fedagent"):
        assert line in text, line
