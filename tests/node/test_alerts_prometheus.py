"""The shipped alerting rules in a real Prometheus that scrapes a running federation.

A coordinator and three agents (real daemons, a private Mosquitto) finish a short
federation and stay up; Debian's ``prometheus``, started here with a configuration of
its own (storage in the test's directory, loopback only, a 1 s scrape and evaluation
interval), scrapes them with the rules of ``prometheus/``. One agent is stopped with
SIGSTOP: the coordinator stops hearing its heartbeats, its ``fedagent_agent_silent``
series turns 1, and ``FedagentAgentSilent`` fires naming that agent (its endpoint, served
from the stopped process, stops answering too: ``FedagentDaemonDown`` for its instance).

The rules' ``for:`` durations are cut to 2 s here: the promtool unit tests
(``prometheus/*.test.yml``) hold those; this test holds the path from a stopped process
to a firing alert, in seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from netfed import coordinator_in, running, wait_for

from fedagent.mosquitto import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.procs,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (scripts/bootstrap.sh installs it)"),
]

STOPPED = "agent-2"


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def _target(metrics_url: str) -> str:
    return urllib.parse.urlsplit(metrics_url).netloc  # host:port


def _firing(base: str, alertname: str) -> list[dict[str, str]]:
    return [
        a["labels"]
        for a in _get(base, "/api/v1/alerts")["alerts"]
        if a["state"] == "firing" and a["labels"].get("alertname") == alertname
    ]


def _write_config(d: Path, coordinator: str, agents: list[str]) -> Path:
    d.mkdir()
    shutil.copy(RULES / "fedagent-recording.yml", d)
    alerts = (RULES / "fedagent-alerts.yml").read_text()
    (d / "fedagent-alerts.yml").write_text(re.sub(r"(?m)^(\s+for:) \S+$", r"\1 2s", alerts))
    targets = ", ".join(f'"{t}"' for t in agents)
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "rule_files: [fedagent-recording.yml, fedagent-alerts.yml]\n"
        "scrape_configs:\n"
        f'  - job_name: fedagent-coordinator\n    static_configs: [{{targets: ["{coordinator}"]}}]\n'
        f"  - job_name: fedagent-agent\n    static_configs: [{{targets: [{targets}]}}]\n"
    )
    return d / "prometheus.yml"


def test_a_stopped_agent_fires_the_silent_agent_alert(tmp_path):
    with running(tmp_path / "fed", agents=3, rounds=2, alpha=0.5) as fed:
        done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the federation to finish", fed)
        agent_urls = {}
        for aid in fed.agent_ids:
            s = wait_for(lambda aid=aid: fed.status(aid), 30, f"{aid}'s status", fed)
            agent_urls[aid] = s["metrics_url"]
        config = _write_config(
            tmp_path / "prometheus", _target(done["metrics_url"]), [_target(u) for u in agent_urls.values()]
        )
        assert PROMETHEUS is not None
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = (tmp_path / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        stopped = fed.proc(STOPPED).popen.pid
        try:

            def alive() -> None:
                fed.check_alive()
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]

            both = SimpleNamespace(check_alive=alive)  # a wait fails at once if a process died
            wait_for(lambda: _ready(base), 60, "Prometheus to be ready", both)
            # every daemon scraped, the coordinator's view of each agent in: all live
            wait_for(
                lambda: len(_get(base, "/api/v1/query", query="up == 1")["result"]) == 1 + len(agent_urls),
                30,
                "every daemon to be scraped",
                both,
            )

            def live() -> set[str] | None:
                result = _get(base, "/api/v1/query", query="fedagent_agent_silent == 0")["result"]
                agents = {x["metric"]["agent"] for x in result}
                return agents if agents == set(agent_urls) else None

            wait_for(live, 30, "the coordinator's agents to be recorded live", both)
            assert _firing(base, "FedagentAgentSilent") == []

            os.kill(stopped, signal.SIGSTOP)
            t0 = time.monotonic()
            # The coordinator declares it silent after a keep-alive (10 s) without a heartbeat.
            fired = wait_for(lambda: _firing(base, "FedagentAgentSilent"), 90, "FedagentAgentSilent to fire", both)
            print(f"FedagentAgentSilent fired {time.monotonic() - t0:.1f} s after the SIGSTOP")
            assert [a["agent"] for a in fired] == [STOPPED], fired
            alert = fired[0]
            assert alert["severity"] == "warning" and alert["node"] == fed.coordinator_id, alert
            assert alert["role"] == "coordinator" and alert["job"] == "fedagent-coordinator", alert
            down = wait_for(lambda: _firing(base, "FedagentDaemonDown"), 60, "FedagentDaemonDown to fire", both)
            assert [a["instance"] for a in down] == [_target(agent_urls[STOPPED])], down
            # the federation is over: no quorum alert; nobody else is silent
            assert _firing(base, "FedagentQuorumLost") == []
            assert [a["agent"] for a in _firing(base, "FedagentAgentSilent")] == [STOPPED]
        finally:
            os.kill(stopped, signal.SIGCONT)
            prom.terminate()
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
            log.close()
