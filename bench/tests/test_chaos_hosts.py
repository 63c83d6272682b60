"""Where the chaos soak (bench/chaos.py) puts each daemon and broker when it runs as root,
without starting anything: FedAvg gives every daemon a network namespace of its own
beside the broker's; the tiered federation puts the hub on one host and each site (its
broker, aggregator and agents) on another, so that a partition cuts a whole site off
from the hub while the site goes on inside. And the end checks see every record of the
coordinator's history, the rotated-away ones too."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from bench.chaos_setups import FedAvgSetup
from bench.chaos_tiered import NamespacedTiers, TieredSetup
from fedagent.local.tiers import TieredFederation
from fedagent.storage.history import read_records


def test_fedavg_puts_every_daemon_on_a_host_of_its_own():
    setup = FedAvgSetup()
    names = setup.daemons(3)
    assert setup.hosts(names) == ["broker", "coordinator", "agent-1", "agent-2", "agent-3"]
    assert [setup.host(n) for n in ["broker", *names]] == ["broker", *names]
    assert setup.partition_targets(names) == names


def test_tiered_puts_each_site_with_its_broker_and_agents_on_one_host():
    setup = TieredSetup()
    names = setup.daemons(5)
    assert setup.hosts(names) == ["hub", "site-1", "site-2"]
    brokers = ["broker", "broker-hub", "broker-site-1", "broker-site-2"]
    assert {n: setup.host(n) for n in [*names, *brokers]} == {
        "coordinator": "hub",
        "broker": "hub",
        "broker-hub": "hub",
        "site-1": "site-1",
        "broker-site-1": "site-1",
        "agent-1": "site-1",
        "agent-2": "site-1",
        "agent-3": "site-1",
        "site-2": "site-2",
        "broker-site-2": "site-2",
        "agent-4": "site-2",
        "agent-5": "site-2",
    }
    # A partition cuts a site's host: never a lone agent, never the hub.
    assert setup.partition_targets(names) == ["site-1", "site-2"]


def test_tiered_hosts_agree_with_the_federation_and_its_brokers_listen_on_them(tmp_path):
    args = argparse.Namespace(agents=5, alpha=0.5, round_timeout=20.0)
    setup = TieredSetup()
    setup.daemons(args.agents)
    flat = setup.federation(tmp_path / "loopback", args, "127.0.0.1")
    try:
        assert type(flat) is TieredFederation and flat.agents == setup.members
        assert flat.broker_bind("site-1") == "127.0.0.1"
    finally:
        flat.close()
    setup.lab = SimpleNamespace(ip={"hub": "10.77.9.1", "site-1": "10.77.9.2", "site-2": "10.77.9.3"})
    placed = setup.federation(tmp_path / "hosts", args, "10.77.9.1")
    try:
        assert isinstance(placed, NamespacedTiers) and placed.agents == setup.members
        assert [placed.broker_bind(k) for k in ("hub", "site-1", "site-2")] == ["10.77.9.1", "10.77.9.2", "10.77.9.3"]
    finally:
        placed.close()


def test_the_end_checks_read_every_coordinator_record_even_those_rotated_away(tmp_path):
    """A node on the small disk keeps two rotated history files: a 30-minute asynchronous
    coordinator writes more, so its first versions are gone from disk by the end. The
    checks use what the run read as it was appended, across rotations."""
    setup = FedAvgSetup()
    setup.rounds_seen = []
    site = SimpleNamespace(work=tmp_path, fed=SimpleNamespace(fed="f"), now=lambda: 1.0)
    setup.configure(site)
    path = setup.history_path(site)
    path.parent.mkdir(parents=True)

    def append(version: int) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"event": "round", "model_version": version}) + "\n")

    append(1)
    setup.poll(site)
    path.rename(path.with_name("history.jsonl.1"))
    append(2)
    setup.poll(site)
    path.with_name("history.jsonl.1").unlink()
    append(3)
    assert [r["model_version"] for r in read_records(path)] == [2, 3]
    assert [r["model_version"] for r in setup.coordinator_records(site)] == [1, 2, 3]
