"""The tiered chaos soak's end checks (bench/chaos_tiered.py) on crafted histories, without
starting anything: the run's shutdown (bench/chaos.py ``stop_site``) stops the agents
first, and the hub goes on with the site that still has its quorum; a site left below
its quorum announces itself offline and is no longer selected, so the hub's rounds after
that name it nowhere. Those rounds are accounted to the shutdown, and only those: a site
left out while it could still answer is not."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.chaos import stop_site
from bench.chaos_tiered import TieredSetup
from fedagent.local.tiers import HUB

ACCOUNTED = "each hub round's sites accounted (in it, recorded missing, or down under a fault)"


class FakeSite:
    """A site of a tiered run whose daemons are names, not processes; the harness clock
    ticks on each look. ``on_stop[name]``: what the hub and the sites write to their
    histories once ``name`` has been stopped (while the next daemon is being stopped)."""

    def __init__(self, work: Path, setup: TieredSetup, on_stop: dict[str, list[tuple[str, dict[str, Any]]]]) -> None:
        self.work = work
        self.args = argparse.Namespace(agents=4, alpha=0.5, round_timeout=20.0)
        self.names = setup.daemons(self.args.agents)
        real = setup.federation(work / "fed", self.args, "127.0.0.1")
        real.close()
        self.setup = setup
        self.clock = itertools.count(1)
        self.on_stop = on_stop
        self.fed = SimpleNamespace(fed=real.fed, procs=[SimpleNamespace(name=n) for n in self.names])
        self.fed.stop = self._stop
        self.fed.close = lambda: None
        setup.configure(self)

    def now(self) -> float:
        return float(next(self.clock))

    def proc(self, name: str) -> Any:
        return next((p for p in self.fed.procs if p.name == name), None)

    def _stop(self, proc: Any) -> None:
        for node, rec in self.on_stop.get(proc.name, []):
            self.write(node, rec)

    def write(self, node: str, rec: dict[str, Any]) -> None:
        path = self.setup.history_path(self, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def hub_round(n: int, sites: list[str], missing: list[str] = ()) -> tuple[str, dict[str, Any]]:
    rec = {"event": "round", "round": n, "model_version": n, "participants": [f"{s}-up" for s in sites]}
    if missing:
        rec["missing"] = [f"{s}-up" for s in missing]
    return HUB, rec


def site_round(site: str, upstream: int) -> tuple[str, dict[str, Any]]:
    return site, {"event": "site_round", "round": upstream, "upstream_round": upstream, "participants": []}


def answered(n: int, sites: list[str], missing: list[str] = ()) -> list[tuple[str, dict[str, Any]]]:
    """Hub round ``n`` closed with ``sites`` in it, each with its site round."""
    return [*(site_round(s, n) for s in sites), hub_round(n, sites, missing)]


def end_of_run(tmp_path: Path, on_stop: dict[str, list[tuple[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Two hub rounds with both sites while the run goes on, then the shutdown with what
    ``on_stop`` has the tiers write meanwhile; the invariant that accounts for the sites."""
    setup = TieredSetup()
    site = FakeSite(tmp_path, setup, on_stop)
    for node, rec in [*answered(1, ["site-1", "site-2"]), *answered(2, ["site-1", "site-2"])]:
        site.write(node, rec)
    setup.poll(site)
    run: dict[str, Any] = {"faults": [], "exits": [], "settings": {"restart_sec": 5.0}}
    run["stops"] = stop_site(site, setup)
    assert list(run["stops"]) == ["agent-1", "agent-2", "agent-3", "agent-4", "site-1", "site-2", HUB]
    checks = {c["name"]: c for c in setup.check(site, run)}
    assert checks["no site's work counted twice (a site once per hub round, each from a site round)"]["ok"]
    return checks[ACCOUNTED]


def test_hub_rounds_closed_after_the_shutdown_left_a_site_below_its_quorum_are_the_shutdowns(tmp_path):
    """As at the end of the thirty-minute run: once agent-2 is stopped, site-1 (agents 1
    and 2, quorum 1) has no agent left; the round it was selected for records it
    missing, the next ones do not select it; site-2 goes on until agent-4 stops."""
    accounted = end_of_run(
        tmp_path,
        {
            "agent-1": answered(3, ["site-1", "site-2"]),  # agent-2 still answers for site-1
            "agent-2": [*answered(4, ["site-2"], missing=["site-1"]), *answered(5, ["site-2"])],
            "agent-3": answered(6, ["site-2"]),
            "agent-4": [(HUB, {"event": "abandoned", "round": 7})],
        },
    )
    assert accounted["ok"], accounted
    assert accounted["detail"]["in the round"] == 2 * 3 + 3
    assert accounted["detail"]["recorded missing"] == 1
    assert accounted["detail"]["absent while the run shut down"] == 2  # site-1 in rounds 5 and 6
    assert accounted["detail"]["not accounted for"] == []


def test_a_site_left_out_while_it_still_had_its_quorum_is_not_the_shutdowns(tmp_path):
    """After agent-1's stop site-1 still has agent-2 (its quorum): a hub round without it
    and without a ``missing`` record is unaccounted, and so is site-2 left out while
    none of its own was stopped."""
    accounted = end_of_run(
        tmp_path,
        {
            "agent-1": answered(3, ["site-2"]),
            "agent-2": answered(4, ["site-1"]),
        },
    )
    assert not accounted["ok"]
    assert accounted["detail"]["not accounted for"] == [(3, "site-1"), (4, "site-2")]
    assert accounted["detail"]["absent while the run shut down"] == 0
