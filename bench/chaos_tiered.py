"""The chaos soak's federation in two tiers (bench/chaos.py ``--mode tiered``,
docs/multisite.md): the hub's coordinator on the hub broker, two site aggregators each on
a broker of its own (the aggregator carries what crosses tiers, as
:class:`~fedagent.local.tiers.TieredFederation` builds it) and the agents split between
the sites. Faults are drawn over every daemon of both tiers and all three brokers. As
root the tiers live on hosts of their own, as they are deployed: the hub (its broker and
coordinator) in one network namespace, each site (its broker, aggregator and agents) in
another, its agents reaching their broker over the site's loopback. The ``partition``
fault cuts a site's host off (nft drop-all but loopback): the site goes on inside, its
aggregator's uplink to the hub is what is cut; then it is healed. Not as root, all on
loopback and no partition.

Recovery after a fault: a hub round aggregated from both sites since it was cleared, and,
if an agent was hit, a round of its site since then with that agent in it. Invariants,
from the hub's and the sites' histories:

* hub model versions contiguous, each hub round once;
* each hub round's sites accounted: in it, or recorded ``missing`` (selected, not in
  time), or, if neither, the round fell while a fault held that site (or its broker, or
  enough of its agents) down, so the hub never selected it, or it closed after the run's
  shutdown had stopped the site, the hub or enough of the site's agents to leave it below
  its quorum (the agents are stopped first);
* no site's work counted twice: a hub round names a site at most once, and every site
  the hub counted in a round has a ``site_round`` line for it (or the site was killed
  between its result going up and the line); a site that answered one hub round with two
  site rounds (the hub killed in that round and restarted) is counted in the figures;
* no signed frame refused for its timestamp (the clock jumps).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.chaos_base import Fault, Site, Tail, _invariant, in_netns
from bench.chaos_setups import FedAvgSetup, timestamp_invariant
from fedagent.local.tiers import HUB, TieredFederation

SITES = 2
HUB_HOST = "hub"  # the hub's namespace: its broker and coordinator


class TieredSetup(FedAvgSetup):
    name = "tiered"

    def daemons(self, agents: int) -> list[str]:
        self.site_ids = [f"site-{s + 1}" for s in range(SITES)]
        self.sizes = [agents // SITES + (1 if s < agents % SITES else 0) for s in range(SITES)]
        # Agent k (counted over the sites in order) is in the site TieredFederation puts it in.
        self.members: dict[str, list[str]] = {}
        k = 0
        for s, size in zip(self.site_ids, self.sizes, strict=True):
            self.members[s] = [f"agent-{k + i + 1}" for i in range(size)]
            k += size
        return [HUB, *self.site_ids, *(f"agent-{i + 1}" for i in range(agents))]

    def hosts(self, names: list[str]) -> list[str]:
        # A host per tier's place: the hub, and each site with its broker and agents, as
        # sites are deployed; a site's agents reach their broker over its loopback.
        return [HUB_HOST, *self.site_ids]

    def host(self, name: str) -> str:
        if name in (HUB, "broker", f"broker-{HUB_HOST}"):
            return HUB_HOST
        for s, members in self.members.items():
            if name in (s, f"broker-{s}", *members):
                return s
        raise KeyError(f"chaos: no host for {name!r}")

    def partition_targets(self, names: list[str]) -> list[str]:
        # A whole site cut off from the hub (its aggregator's uplink and nothing else,
        # since everything else of the site is on its host), then healed.
        return list(self.site_ids)

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> TieredFederation:
        if args.agents < 2 * SITES:
            raise SystemExit(f"chaos: the tiered mode needs at least {2 * SITES} agents")
        self.agents = [f"agent-{i + 1}" for i in range(args.agents)]
        self.rounds_seen: list[dict[str, Any]] = []
        self.site_rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in self.site_ids}
        self.tail = None
        self.site_tails: dict[str, Tail] = {}
        sizes = self.sizes
        self.site_quorum = max(1, min(sizes) // 2)
        options: dict[str, Any] = {
            "sites": sizes,
            "rounds": 1_000_000,
            "alpha": args.alpha,
            "round_timeout": args.round_timeout,
            # The hub goes on with one site; a site with half its agents (an agent silent
            # for a keep-alive is left out of the round in progress).
            "hub_rounds": {"min_agents": 1, "expected_agents": SITES, "min_updates": 1},
            "site_rounds": {"min_agents": self.site_quorum, "min_updates": 1},
        }
        fed = TieredFederation(work, **options) if self.lab is None else NamespacedTiers(work, self.lab, **options)
        if fed.agents != self.members:
            raise SystemExit(f"chaos: the sites' agents are not where the hosts put them: {fed.agents}")
        return fed

    def brokers(self, fed: Any) -> dict[str, Any]:
        return {f"broker-{name}": b for name, b in fed.brokers.items()}

    def configure(self, site: Site) -> None:
        super().configure(site)
        self.site_tails = {s: Tail(self.history_path(site, s)) for s in self.site_ids}

    def history_path(self, site: Site, node: str = HUB) -> Path:
        role = "coordinator" if node == HUB or node in self.site_ids else "agent"
        return site.work / "state" / node / role / site.fed.fed / "history.jsonl"

    def clock_node(self, names: list[str]) -> str:
        return HUB

    def stop_order(self, names: list[str]) -> list[str]:
        # Agents, then the sites, then the hub: nobody waits for a vanished tier.
        return [*self.agents, *self.site_ids, HUB]

    def poll(self, site: Site) -> dict[str, Any]:
        out = super().poll(site)
        for s, tail in self.site_tails.items():
            for rec in tail.read():
                if rec.get("event") == "site_round":
                    self.site_rounds[s].append({"t": round(site.now(), 2), **rec})
        out["site_seen"] = {s: len(v) for s, v in self.site_rounds.items()}
        return out

    def _up_id(self, s: str) -> str:
        return f"{s}-up"  # the site aggregator's name at the hub

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        self.poll(site)
        ups = {self._up_id(s) for s in self.site_ids}
        if not any(ups <= set(r["participants"]) for r in self.rounds_seen[mark["seen"] :]):
            return False
        if fault.target in self.agents:
            home = next(s for s, m in self.members.items() if fault.target in m)
            since = self.site_rounds[home][mark["site_seen"][home] :]
            return any(fault.target in r.get("participants", []) for r in since)
        return True

    def _down_windows(self, run: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
        """Per site, the harness times (s) a fault held it (its aggregator, its broker, one
        of its agents, the hub or the hub's broker) down or its host cut off, or it had
        not yet recovered, plus a round timeout either side for the round it overlapped. A
        clock jump takes nobody down."""
        pad = self.round_timeout
        out: dict[str, list[tuple[float, float]]] = {s: [] for s in self.site_ids}
        for f in run["faults"]:
            if f["kind"] == "clock":
                continue
            end = (f["cleared"] or f["at"]) + (f["recovered"] or 0) + pad
            for s in self.site_ids:
                mine = {s, f"broker-{s}", *self.members[s], HUB, "broker-hub"}
                if f["target"] in mine:
                    out[s].append((f["at"] - pad, end))
        for e in run["exits"]:
            for s in self.site_ids:
                if e["name"] in {s, *self.members[s], HUB}:
                    out[s].append((e["at"] - pad, e["at"] + site_restart_pad(run) + pad))
        return out

    def _shut_out(self, stops: dict[str, float]) -> dict[str, float]:
        """Per site, the harness time from which the run's shutdown kept it out of the hub's
        rounds: its aggregator or the hub stopped, or so many of its agents that it fell
        below its quorum (it then announces itself offline upstream and the hub no longer
        selects it: nothing is recorded). A round read after that time closed after it
        (``stop_site`` reads the histories before each stop)."""
        out: dict[str, float] = {}
        for s in self.site_ids:
            at = [stops[n] for n in (s, HUB) if n in stops]
            agents = sorted(stops[a] for a in self.members[s] if a in stops)
            below = len(self.members[s]) - self.site_quorum + 1  # agents stopped to fall below it
            if len(agents) >= below:
                at.append(agents[below - 1])
            if at:
                out[s] = min(at)
        return out

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        self.round_timeout = float(site.args.round_timeout)
        out: list[dict[str, Any]] = []
        records = self.coordinator_records(site)
        rounds = [r for r in records if r.get("event") == "round"]
        versions = [r["model_version"] for r in rounds]
        numbers = [r["round"] for r in rounds]
        out.append(
            _invariant(
                "hub model versions contiguous, each hub round once",
                bool(versions) and versions == list(range(1, len(versions) + 1)) and numbers == sorted(set(numbers)),
                {"versions": f"1..{len(versions)}" if versions else "none"},
            )
        )
        seen_at = {r["round"]: r["t"] for r in self.rounds_seen}
        windows = self._down_windows(run)
        shut = self._shut_out(run.get("stops", {}))
        tally = {
            "in the round": 0,
            "recorded missing": 0,
            "absent while a fault held it down": 0,
            "absent while the run shut down": 0,
        }
        unaccounted = []
        for r in rounds:
            for s in self.site_ids:
                up = self._up_id(s)
                if up in r["participants"]:
                    tally["in the round"] += 1
                elif up in r.get("missing", []) or up in r.get("dropped", []):
                    tally["recorded missing"] += 1
                else:
                    t = seen_at[r["round"]]
                    if any(lo <= t <= hi for lo, hi in windows[s]):
                        tally["absent while a fault held it down"] += 1
                    elif t > shut.get(s, float("inf")):
                        tally["absent while the run shut down"] += 1
                    else:
                        unaccounted.append((r["round"], s))
        out.append(
            _invariant(
                "each hub round's sites accounted (in it, recorded missing, or down under a fault)",
                not unaccounted,
                {**tally, "not accounted for": unaccounted[:20]},
            )
        )
        twice = [r["round"] for r in rounds if len(set(r["participants"])) != len(r["participants"])]
        sent_twice: list[tuple[str, int]] = []
        unrecorded = 0
        phantom: list[tuple[int, str]] = []
        exits = {s: [e["at"] for e in run["exits"] if e["name"] == s] for s in self.site_ids}
        by_round = {r["round"]: r for r in rounds}
        for s in self.site_ids:
            lines = self.site_rounds[s]  # every one since the start, as read while appended
            ups = [int(r["upstream_round"]) for r in lines]
            sent_twice += [(s, u) for u in sorted(set(ups)) if ups.count(u) > 1]
            have = set(ups)
            for n, r in by_round.items():
                if self._up_id(s) not in r["participants"] or n in have:
                    continue
                t = seen_at.get(n)
                if t is not None and any(t - 2 * self.round_timeout <= e <= t + 10 for e in exits[s]):
                    unrecorded += 1
                else:
                    phantom.append((n, s))
        out.append(
            _invariant(
                "no site's work counted twice (a site once per hub round, each from a site round)",
                not twice and not phantom,
                {
                    "site results in hub rounds": tally["in the round"],
                    "its site_round line lost in a crash": unrecorded,
                    "hub rounds naming a site twice": twice[:20],
                    # Measured: a site that answered one hub round with two site rounds
                    # (the hub killed in that round, restarted and asked again); the hub counts one.
                    "hub rounds a site answered twice": sent_twice[:20],
                    "counted without a site round": phantom[:20],
                },
            )
        )
        out.append(timestamp_invariant(site))
        return out


def site_restart_pad(run: dict[str, Any]) -> float:
    """How long a daemon that exited stays away: the supervisor's delay and its start-up."""
    return float(run["settings"]["restart_sec"]) + 30.0


class NamespacedTiers(TieredFederation):
    """The tiers on hosts of their own (a run as root): the hub's broker and coordinator on
    host ``hub``, each site's broker, aggregator and agents on the site's host
    (:meth:`TieredSetup.hosts`). Each broker listens on its host's address, which exists
    only in that namespace, so it is started there (and started again there after a
    ``broker`` fault: ``Site.broker_start``)."""

    def __init__(self, work: Path, lab: Any, **options: Any) -> None:
        self.lab = lab
        super().__init__(work, **options)

    def broker_bind(self, key: str) -> str:
        return str(self.lab.ip[key])

    def start_broker(self, key: str) -> None:
        with in_netns(self.lab.ns(key)):
            super().start_broker(key)
