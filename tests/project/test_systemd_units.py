"""The shipped systemd units: lint-clean and hardened (exposure score <= 2.0)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "systemd").glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
pytestmark = [pytest.mark.procs, pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")]


def install(unit: Path, root: Path) -> Path:
    """Copy a unit into a temporary root, pointing ExecStart at a binary that exists."""
    target = root / "etc" / "systemd" / "system" / unit.name
    target.parent.mkdir(parents=True, exist_ok=True)
    fedagent = Path(sys.executable).with_name("fedagent")
    assert fedagent.exists(), "the fedagent console script must be installed"
    target.write_text(unit.read_text().replace("/usr/bin/fedagent", str(fedagent)))
    return target


def test_the_units_exist():
    assert [u.name for u in UNITS] == [
        "fedagent-agent.service",
        "fedagent-aggregator.service",
        "fedagent-coordinator.service",
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies_without_any_output(unit, tmp_path):
    path = install(unit, tmp_path)
    out = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
    # verify exits 0 even for unknown keys: any output at all is a finding.
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", out.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_hardening_score(unit, tmp_path):
    path = install(unit, tmp_path)
    out = subprocess.run([ANALYZE, "security", "--offline=true", str(path)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    assert m, out.stdout[-500:] + out.stderr[-500:]
    assert float(m.group(1)) <= 2.0


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_notify_with_watchdog_and_no_restart_loop_on_config_errors(unit):
    text = unit.read_text()
    role = unit.name.removeprefix("fedagent-").removesuffix(".service")  # "fedagent-" itself contains "agent"
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "RestartPreventExitStatus=78",
        "DynamicUser=yes",
        f"StateDirectory=fedagent-{role}",
        f"RuntimeDirectory=fedagent-{role}",
        "ConfigurationDirectory=fedagent",
        "LoadCredential=node.key:",
    ):
        assert line in text, line


def test_install_script_into_a_temporary_root(tmp_path):
    """scripts/install-service.sh lays out units, CLI and configs; the installed units
    lint clean and score <= 2.0; the config template fails clearly until edited."""
    root = tmp_path / "root"
    fedagent = Path(sys.executable).with_name("fedagent")
    subprocess.run(
        [
            str(ROOT / "scripts" / "install-service.sh"),
            "--root",
            str(root),
            "--no-venv",
            "--fedagent-bin",
            str(fedagent),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    cli = root / "usr" / "bin" / "fedagent"
    assert subprocess.run([str(cli), "--version"], capture_output=True, text=True, check=True).stdout.startswith(
        "fedagent"
    )
    assert oct((root / "etc" / "fedagent" / "tls").stat().st_mode & 0o777) == "0o700"
    for unit in ("fedagent-agent.service", "fedagent-coordinator.service", "fedagent-aggregator.service"):
        path = root / "etc" / "systemd" / "system" / unit
        path.write_text(path.read_text().replace("/usr/bin/fedagent", str(cli)))
        out = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stderr
        sec = subprocess.run([ANALYZE, "security", "--offline=true", str(path)], capture_output=True, text=True)
        assert float(re.search(r"exposure level for \S+: ([0-9.]+)", sec.stdout).group(1)) <= 2.0
    conf = root / "etc" / "fedagent" / "agent.toml"
    # The untouched template: a clear configuration error, exit 78 (no restart loop).
    run = subprocess.run([str(cli), "agent", "--config", str(conf)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 78 and "invalid id 'CHANGE-ME'" in run.stderr
    agg = root / "etc" / "fedagent" / "aggregator.toml"
    run = subprocess.run([str(cli), "aggregator", "--config", str(agg)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 78 and "CHANGE-ME" in run.stderr, run.stderr
    from fedagent import config

    conf.write_text(conf.read_text().replace('id = "CHANGE-ME"', 'id = "site-a"'))
    creds = tmp_path / "creds"
    env_cfg = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from fedagent import config; c = config.load(sys.argv[1], 'agent'); print(c.tls.key)",
            str(conf),
        ],
        env={**__import__("os").environ, "CREDENTIALS_DIRECTORY": str(creds)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert env_cfg.stdout.strip() == str(creds / "node.key")
    # An existing config is never overwritten by a re-install.
    subprocess.run(
        [
            str(ROOT / "scripts" / "install-service.sh"),
            "--root",
            str(root),
            "--no-venv",
            "--fedagent-bin",
            str(fedagent),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert 'id = "site-a"' in conf.read_text()
    assert config.load(conf, "agent").id == "site-a"
