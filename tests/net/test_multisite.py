"""Two sites, one federation: each site runs its own Mosquitto bridged to a central
one; agents talk only to their site broker; the coordinator sits at the hub. Built
from network namespaces joined by veth pairs to a bridge (tests/netns.py).
The bridges carry agents' traffic up and only ``global/`` and the coordinator's own
messages down, and a bridge identity cannot broadcast at the hub."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from netfed import wait_for
from netns import Lab, requires_netns

from fedagent import config, mosquitto
from fedagent.config import TlsConfig
from fedagent.errors import FedagentError
from fedagent.node.control import request
from fedagent.security import pki

pytestmark = [pytest.mark.root, requires_netns]

PORT = 8883
FED = "sites"


def status(path: Path) -> dict | None:
    try:
        return request(path, "status", timeout=2)
    except FedagentError:
        return None


@pytest.fixture
def sites(tmp_path):
    s = Lab(tmp_path, ["hub", "s1", "s2"])
    try:
        s.up()
        yield s
    finally:
        s.close()


def test_two_bridged_sites_train_one_federation(sites, tmp_path):
    ca = tmp_path / "pki"
    pki.create_ca(ca, FED)
    agents = {"agent-1": "s1", "agent-2": "s1", "agent-3": "s2"}
    for name, site in [("hub-broker", "hub"), ("s1-broker", "s1"), ("s2-broker", "s2")]:
        pki.issue(ca, ca, name, "broker", sans=[sites.ip[site]])
    # hub-op: an operator's coordinator-level login at the hub (what a compromised hub
    # could publish); watch-s2: a member at site s2 that watches what comes down.
    for name in ("coordinator", "hub-op", *agents, "watch-s2"):
        pki.issue(ca, ca, name, "coordinator" if name in ("coordinator", "hub-op") else "agent")
    for name in ("bridge-s1", "bridge-s2"):
        pki.issue(ca, ca, name, "agent")
    # Brokers: the hub lists the sites' bridges; sites bridge to the hub.
    for site in ("hub", "s1", "s2"):
        d = tmp_path / f"{site}-broker"
        (d / "data").mkdir(parents=True)
        if site == "hub":
            acl = mosquitto.render_acl([FED], ["coordinator", "hub-op"], bridges=["bridge-s1", "bridge-s2"])
        else:
            acl = mosquitto.render_acl([FED], ["coordinator"])
        (d / "acl").write_text(acl)
        conf = mosquitto.render_config(
            port=PORT,
            bind=sites.ip[site],
            ca=ca / "ca.crt",
            cert=ca / f"{site}-broker.crt",
            key=ca / f"{site}-broker.key",
            acl=d / "acl",
            persistence_dir=d / "data",
            log_path=d / "mosquitto.log",
        )
        if site != "hub":
            conf += mosquitto.render_bridge(
                name=f"bridge-{site}",
                remote_host=sites.ip["hub"],
                remote_port=PORT,
                federations=[FED],
                ca=ca / "ca.crt",
                cert=ca / f"bridge-{site}.crt",
                key=ca / f"bridge-{site}.key",
                coordinators=["coordinator"],
            )
        (d / "mosquitto.conf").write_text(conf)
        sites.spawn(f"{site}-broker", site, [mosquitto.find_mosquitto(), "-c", str(d / "mosquitto.conf")])
    for site in ("s1", "s2"):
        hub_log = tmp_path / "hub-broker" / "mosquitto.log"
        wait_for(
            lambda s=site: hub_log.exists() and f"as bridge-{s} " in hub_log.read_text(),
            20,
            f"the {site} bridge",
            sites,
        )

    def write(name: str, site: str, options: dict, rounds: dict | None) -> Path:
        p = tmp_path / f"{name}.toml"
        p.write_text(
            config.render(
                node_id=name,
                federation=FED,
                broker=f"mqtts://{sites.ip[site]}:{PORT}",
                tls=TlsConfig(ca / "ca.crt", ca / f"{name}.crt", ca / f"{name}.key"),
                state_dir=tmp_path / "state" / name,
                runtime_dir=tmp_path / "run" / name,
                task_options=options,
                rounds=rounds,
            )
        )
        return p

    rounds = 4
    coord_cfg = write(
        "coordinator",
        "hub",
        {},
        {"rounds": rounds, "min_agents": 3, "expected_agents": 3, "round_timeout": 60, "local_epochs": 2},
    )
    sites.spawn("coordinator", "hub", [sys.executable, "-m", "fedagent", "coordinator", "--config", str(coord_cfg)])
    for i, (name, site) in enumerate(agents.items()):
        cfg = write(name, site, {"shard": i, "shards": 3, "alpha": 0.5}, None)
        sites.spawn(name, site, [sys.executable, "-m", "fedagent", "agent", "--config", str(cfg)])

    coord_sock = tmp_path / "run" / "coordinator" / "coordinator.sock"
    done = wait_for(
        lambda: (lambda s: s if s and s["phase"] == "done" else None)(status(coord_sock)),
        150,
        "the two-site federation to finish",
        sites,
    )
    assert done["completed_rounds"] == rounds
    # Every agent, whichever site it is in, took part in every round.
    hist = tmp_path / "state" / "coordinator" / "coordinator" / FED / "history.jsonl"
    recs = [json.loads(line) for line in hist.read_text().splitlines()]
    assert [r["participants"] for r in recs if r["event"] == "round"] == [sorted(agents)] * rounds
    # Agents reached the coordinator only through their own site's broker and the bridge.
    a3 = status(tmp_path / "run" / "agent-3" / "agent.sock")
    assert a3["broker"] == f"mqtts://{sites.ip['s2']}:{PORT}" and a3["coordinator"] == "coordinator"
    # Only global/ and the coordinator's messages come down a bridge: agent-3 knows its
    # coordinator from the broadcasts, and no presence of the hub or the other site
    # reaches it over MQTT (mDNS may list them).
    assert a3["peers"].get("agent-2", {}).get("online") is None
    assert a3["peers"].get("coordinator", {}).get("online") is None

    def mqtt(site: str, name: str, *argv: str) -> list[str]:
        return [
            "mosquitto_pub" if argv[0] == "pub" else "mosquitto_sub",
            *("-h", sites.ip[site], "-p", str(PORT), "-V", "mqttv5"),
            *("--cafile", str(ca / "ca.crt"), "--cert", str(ca / f"{name}.crt"), "--key", str(ca / f"{name}.key")),
            *argv[1:],
        ]

    root = f"fedagent/v1/{FED}"
    # A bridge identity at the hub (bridge-s1's certificate, from site s1) cannot broadcast.
    forged = sites.run("s1", *mqtt("hub", "bridge-s1", "pub", "-t", f"{root}/global/model", "-m", "forged", "-q", "1"))
    assert "Not authorized" in forged.stderr
    # What the hub has under other nodes' subtrees does not come down to a site; what
    # the coordinator addresses to a node there does.
    watch = sites.spawn("watch-s2", "s2", mqtt("s2", "watch-s2", "sub", "-t", f"{root}/#", "-v", "-W", "60"))
    wait_for(lambda: "as watch-s2 " in (tmp_path / "s2-broker" / "mosquitto.log").read_text(), 20, "the watcher", sites)
    for topic, payload in (
        (f"{root}/node/agent-1/to/watch-s2/update", "forged-inbox"),
        (f"{root}/node/ghost/presence", "forged-presence"),
        (f"{root}/node/coordinator/to/watch-s2/model", "from-the-coordinator"),
        (f"{root}/global/marker", "marker"),
    ):
        sites.run("hub", *mqtt("hub", "hub-op", "pub", "-t", topic, "-m", payload, "-q", "1"))
    seen = wait_for(lambda: "marker" in sites.log("watch-s2") and sites.log("watch-s2"), 30, "the marker at s2", sites)
    watch.terminate()
    sites.forget("watch-s2")
    assert "forged" not in seen
    assert f"{root}/node/coordinator/to/watch-s2/model from-the-coordinator" in seen
