"""The operator's path: agents start outside any federation, `fedagent join` finds the
coordinator by mDNS and the running agents take part; `peers` and `leave` work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from netfed import running, wait_for

from fedagent import config


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedagent", *args], capture_output=True, text=True, timeout=60, check=check
    )


@pytest.fixture(scope="module")
def idle_federation(tmp_path_factory):
    def outside_any_federation(fed) -> None:
        for aid in fed.agent_ids:
            config.update_membership(fed.config_path(aid), "", "")

    with running(
        tmp_path_factory.mktemp("join"), configure=outside_any_federation, agents=2, rounds=10_000, alpha=0.5
    ) as fed:
        yield fed


def test_join_by_mdns_then_same_round(idle_federation):
    fed = idle_federation
    for aid in fed.agent_ids:
        s = wait_for(lambda a=aid: fed.status(a), 60, f"{aid} control socket", fed)
        assert s["connection"] == "not joined" and s["federation"] is None
    for aid in fed.agent_ids:
        out = cli("join", fed.fed, "--config", str(fed.config_path(aid)))
        assert f"found broker {fed.broker.uri}" in out.stdout
        assert f"the running agent {aid} is joining {fed.fed}" in out.stdout
        assert config.load(fed.config_path(aid), "agent").federation == fed.fed

    def same_round():
        c = fed.status("coordinator")
        agents = [fed.status(a) for a in fed.agent_ids]
        if not c or c["round"] < 2 or not all(agents):
            return None
        rounds = {c["round"], *(a["round"] for a in agents)}
        return rounds if len(rounds) == 1 else None

    assert wait_for(same_round, 90, "coordinator and agents in the same round", fed)
    s = json.loads(cli("status", "--json", "--config", str(fed.config_path("agent-1"))).stdout)
    assert s["federation"] == fed.fed and s["connection"] == "connected" and s["round"] >= 2


def test_peers_lists_coordinator_and_other_agent(idle_federation):
    fed = idle_federation
    wait_for(lambda: (fed.status("agent-1") or {}).get("connection") == "connected", 60, "agent-1 joined", fed)
    peers = wait_for(
        lambda: (lambda p: p if {"coordinator", "agent-2"} <= set(p) else None)(
            json.loads(cli("peers", "--json", "--config", str(fed.config_path("agent-1"))).stdout)["peers"]
        ),
        30,
        "peers of agent-1",
        fed,
    )
    assert peers["coordinator"]["role"] == "coordinator" and peers["coordinator"]["online"] is True
    assert peers["coordinator"]["broker"] == fed.broker.uri
    human = cli("peers", "--config", str(fed.config_path("agent-1"))).stdout
    assert "coordinator" in human and "agent-2" in human


def test_leave_goes_offline_and_clears_membership(idle_federation):
    fed = idle_federation
    wait_for(lambda: (fed.status("agent-1") or {}).get("connection") == "connected", 60, "agent-1 joined", fed)
    out = cli("leave", "--config", str(fed.config_path("agent-1")))
    assert "left" in out.stdout
    assert config.load(fed.config_path("agent-1"), "agent").federation == ""
    assert fed.status("agent-1")["connection"] == "not joined"
    wait_for(
        lambda: fed.status("coordinator")["peers"].get("agent-1", {}).get("online") is False,
        30,
        "coordinator to see agent-1 offline",
        fed,
    )
    again = cli("leave", "--config", str(fed.config_path("agent-1")), check=False)
    assert again.returncode == 78 and "nothing to leave" in again.stderr


def test_join_without_a_running_agent_says_so(idle_federation, tmp_path):
    fed = idle_federation
    text = fed.config_path("agent-2").read_text().replace(str(fed.work / "run" / "agent-2"), str(tmp_path / "run"))
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    out = cli("join", fed.fed, "--broker", fed.broker.uri, "--config", str(cfg))
    assert "no running agent answered" in out.stdout and "fedagent agent --config" in out.stdout
    assert config.load(cfg, "agent").broker == fed.broker.uri
