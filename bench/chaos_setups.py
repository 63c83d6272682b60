"""The chaos soak's FedAvg and gossip federations (bench/chaos.py ``--mode``): how each
is configured, what recovery means and which invariants it checks."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

from bench.chaos_base import Fault, Setup, Site, Tail, _invariant, digits_accuracy, log
from fedagent.errors import FedagentError
from fedagent.local.federation import BATCH, SEED, Federation
from fedagent.storage import checkpoint
from fedagent.storage.history import read_records


class FedAvgSetup(Setup):
    name = "fedavg"

    def daemons(self, agents: int) -> list[str]:
        return ["coordinator", *(f"agent-{i + 1}" for i in range(agents))]

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        self.agents = [f"agent-{i + 1}" for i in range(args.agents)]
        self.rounds_seen: list[dict[str, Any]] = []  # (harness time, record) of aggregated rounds
        self.tail: Tail | None = None
        return Federation(
            work,
            agents=args.agents,
            rounds=1_000_000,
            alpha=args.alpha,
            round_timeout=args.round_timeout,
            agent_broker_by_mdns=False,
            broker_bind=broker_bind,
            rounds_options={
                # Rounds go on with part of the federation down; an agent silent for a
                # keep-alive is left out of the round in progress.
                "min_agents": max(1, args.agents // 2),
                "min_updates": max(1, args.agents // 2),
                "expected_agents": args.agents,
            },
        )

    def configure(self, site: Site) -> None:
        self.tail = Tail(self.history_path(site))
        self.records: list[dict[str, Any]] = []

    def coordinator_records(self, site: Site) -> list[dict[str, Any]]:
        """Every record of the coordinator's history since the start, as the run read them
        while they were appended: the files at the end may have lost their oldest to
        rotation (on the small disk a node keeps 1 MiB and two rotated files, less than a
        30-minute run of the asynchronous coordinator writes)."""
        self.poll(site)
        return list(self.records)

    def history_path(self, site: Site, node: str = "coordinator") -> Path:
        role = "coordinator" if node == "coordinator" else "agent"
        return site.work / "state" / node / role / site.fed.fed / "history.jsonl"

    def clock_node(self, names: list[str]) -> str:
        return "coordinator"  # its deadlines and its checks of the agents' timestamps

    def poll(self, site: Site) -> dict[str, Any]:
        assert self.tail is not None
        for rec in self.tail.read():
            self.records.append(rec)
            if rec.get("event") == "round":
                self.rounds_seen.append({"t": round(site.now(), 2), **rec})
        last = self.rounds_seen[-1] if self.rounds_seen else {}
        return {"t": site.now(), "version": last.get("model_version", 0), "seen": len(self.rounds_seen)}

    def stopping(self, site: Site, name: str) -> None:
        # The rounds closed before this stop get a time before it; those closed during
        # the shutdown are read later, so the checks can tell them apart.
        self.poll(site)

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        self.poll(site)
        return any(set(self.agents) <= set(r["participants"]) for r in self.rounds_seen[mark["seen"] :])

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        records = self.coordinator_records(site)
        rounds = [r for r in records if r.get("event") == "round"]
        abandoned = {r["round"] for r in records if r.get("event") == "abandoned"}
        versions = [r["model_version"] for r in rounds]
        numbers = [r["round"] for r in rounds]
        out.append(
            _invariant(
                "model versions contiguous, each round aggregated once",
                versions == list(range(1, len(versions) + 1)) and numbers == sorted(set(numbers)) and versions,
                {"versions": f"1..{len(versions)}" if versions else "none", "rounds abandoned": len(abandoned)},
            )
        )
        sent: dict[str, list[dict[str, Any]]] = {
            a: [u for u in read_records(self.history_path(site, a)) if u.get("event") == "update"] for a in self.agents
        }
        by_round = {r["round"]: r for r in rounds}
        seen_at = {r["round"]: r["t"] for r in self.rounds_seen}
        exits = {a: [e["at"] for e in run["exits"] if e["name"] == a] for a in self.agents}
        window = site.args.round_timeout + 10
        # While its disk is full an agent's update goes out, then its history line fails
        # (and it exits 74, seconds later on a busy machine).
        full = [(f["target"], f["at"], (f["cleared"] or f["at"]) + 2) for f in run["faults"] if f["kind"] == "disk"]
        phantom = []
        unrecorded = 0
        twice = []
        for r in rounds:
            if len(set(r["participants"])) != len(r["participants"]):
                twice.append(r["round"])
            for a in r["participants"]:
                if any(u["round"] == r["round"] and u["base_version"] == r["model_version"] - 1 for u in sent[a]):
                    continue
                # An agent records an update once the broker has acknowledged it: killed
                # (or its disk full) in between, the update went out unrecorded.
                t = seen_at.get(r["round"])
                if t is not None and any(t - window <= e <= t + 10 for e in exits[a]):
                    unrecorded += 1
                elif t is not None and any(a == node and lo <= t <= hi for node, lo, hi in full):
                    unrecorded += 1
                else:
                    phantom.append((r["round"], a))
        # Acknowledged updates that were not aggregated, and why.
        stale = _stale_refusals(site.work / "logs" / "coordinator.log")
        last_started = max([*numbers, *abandoned], default=0)
        kept: dict[str, int] = {"aggregated": 0, "refused as stale": 0, "round abandoned": 0, "broker killed": 0}
        unexplained = []
        broker_kills = [
            (f["wall"], f["wall"] + f["hold"] + 5) for f in run["faults"] if f["kind"] == "broker" and "wall" in f
        ]
        for a, updates in sent.items():
            for u in updates:
                r = by_round.get(u["round"])
                if r is not None and a in r["participants"] and u["base_version"] == r["model_version"] - 1:
                    kept["aggregated"] += 1
                elif (a, u["round"]) in stale:
                    kept["refused as stale"] += 1
                elif u["round"] in abandoned:
                    kept["round abandoned"] += 1
                elif any(lo - 2 <= u["time"] <= hi for lo, hi in broker_kills):
                    kept["broker killed"] += 1
                elif u["round"] >= last_started:
                    continue  # the round in flight when the run stopped
                else:
                    unexplained.append((a, u["round"], u["base_version"]))
        out.append(
            _invariant(
                "every acknowledged update aggregated exactly once",
                not phantom and not twice and not unexplained,
                {
                    **kept,
                    "aggregated, its agent's record lost in a crash or to the full disk": unrecorded,
                    "not accounted for": unexplained[:20],
                    "aggregated without being sent": phantom[:20],
                    "rounds with an agent twice": twice[:20],
                },
            )
        )
        out.append(timestamp_invariant(site))
        return out

    def accuracy(self, site: Site) -> float | None:
        loaded = checkpoint.load(self.history_path(site).parent / "global.ckpt")
        if loaded is None:
            return None
        return digits_accuracy({k: v for k, v in loaded[0].items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)})


_STALE = re.compile(r"rejected from (\S+) \(round (\d+)\): stale")
_TIMESTAMP = re.compile(r"rejected message from \S+: stale \(timestamp")


def timestamp_invariant(site: Site) -> dict[str, Any]:
    """Signed frames carry, and are checked against, a clock that wall-clock jumps do not
    move (fedagent.security.signing.SteadyClock): none may be refused for its time."""
    refused = {n: _timestamp_refusals(site.work / "logs" / f"{n}.log") for n in site.names}
    return _invariant(
        "no signed frame refused for its timestamp (the clock jumps)",
        not any(refused.values()),
        {n: c for n, c in refused.items() if c} or "none",
    )


def _timestamp_refusals(path: Path) -> int:
    try:
        return len(_TIMESTAMP.findall(path.read_text(errors="replace")))
    except FileNotFoundError:
        return 0


def _stale_refusals(path: Path) -> set[tuple[str, int]]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return set()
    return {(m.group(1), int(m.group(2))) for m in _STALE.finditer(text)}


class GossipSetup(Setup):
    name = "gossip"
    PERIOD_S = 0.5
    accuracy_of = "the agents' consensus model (their saved models, push-sum mass-weighted)"

    def daemons(self, agents: int) -> list[str]:
        return [f"agent-{i + 1}" for i in range(agents)]

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        self.agents = self.daemons(args.agents)
        self.last: dict[str, dict[str, int]] = {a: {"period": 0, "merged": 0} for a in self.agents}
        periods = int(args.minutes * 60 / self.PERIOD_S) + 600
        return Federation(
            work,
            agents=args.agents,
            rounds=1,
            alpha=args.alpha,
            mode="gossip",
            agent_broker_by_mdns=False,
            broker_bind=broker_bind,
            gossip={
                "periods": periods,
                "period_steps": 10,
                "lr": 0.1,
                "batch_size": BATCH,
                "seed": SEED,
                "period_seconds": self.PERIOD_S,
                "send_timeout": 5.0,
                "eval_every": 20,
                "min_peers": 1,
            },
        )

    def configure(self, site: Site) -> None:
        if site.lab is None:
            return
        # Peers find each other by mDNS: each daemon advertises and browses on its namespace's address.
        for name in self.agents:
            path = site.fed.config_path(name)
            doc = tomllib.loads(path.read_text())
            doc.setdefault("discovery", {})["interfaces"] = [site.lab.ip[name]]
            path.write_text(tomli_w.dumps(doc))

    def poll(self, site: Site) -> dict[str, Any]:
        # An agent that does not answer (stopped, restarting, busy) keeps its last figures.
        for a in self.agents:
            st = site.status(a)
            if st:
                self.last[a] = {"period": st.get("period", 0), "merged": (st.get("gossip") or {}).get("merged", 0)}
        return {
            "t": site.now(),
            "periods": {a: v["period"] for a, v in self.last.items()},
            "merged": {a: v["merged"] for a, v in self.last.items()},
            "version": min((v["period"] for v in self.last.values()), default=0),
        }

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        now = self.poll(site)
        for a, period in now["periods"].items():
            if period < mark["periods"].get(a, 0):
                # Restarted from its last checkpoint (every eval_every periods): its
                # progress counts from where it resumed.
                mark["periods"][a] = period
        ahead = all(now["periods"].get(a, 0) >= mark["periods"].get(a, 0) + 2 for a in self.agents)
        target = fault.target if fault.target in self.agents else None
        merging = target is None or now["merged"].get(target, 0) != mark["merged"].get(target, 0)
        return ahead and merging

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        evals = {
            a: [
                r["period"]
                for r in read_records(site.work / "state" / a / "agent" / site.fed.fed / "history.jsonl")
                if r.get("event") == "gossip_eval"
            ]
            for a in self.agents
        }
        # Push-sum's mass: the agents' checkpointed masses against their sample counts
        # (measured, not checked: a crash loses what a process merged since its last checkpoint).
        masses = {a: None if m is None else round(m[1], 3) for a, m in self.saved_models(site).items()}
        run["gossip_masses"] = masses  # the consensus's weights (``accuracy``)
        run["gossip_mass"] = sum(m for m in masses.values() if m is not None)
        return [
            _invariant(
                "every agent went on training (periods evaluated)",
                all(len(v) >= 2 for v in evals.values()),
                {a: (v[-1] if v else None) for a, v in evals.items()},
            )
        ]

    def saved_models(self, site: Site) -> dict[str, tuple[dict[str, np.ndarray], float] | None]:
        """Each agent's model as it saved it at its stop, with its push-sum mass (None:
        no readable checkpoint)."""
        out: dict[str, tuple[dict[str, np.ndarray], float] | None] = {}
        for a in self.agents:
            try:
                loaded = checkpoint.load(site.fed.model_path(a))
            except FedagentError as exc:
                log(f"{a}'s model: {exc}")
                loaded = None
            if loaded is None:
                out[a] = None
                continue
            weights = {k: v for k, v in loaded[0].items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)}
            out[a] = (weights, float(loaded[1].get("mass", 0.0)))
        return out

    def accuracy(self, site: Site) -> float | None:
        """The federation's model: the agents' saved models averaged with their push-sum
        masses, the consensus that gossip averaging converges to. One agent's model moves
        by several points from one period to the next (agent-1's non-IID shard pulls it
        back between merges, in the fault-free twin as well), so the mean of the agents'
        single end snapshots measures mostly when each was taken; the consensus measures
        what the federation learnt, the same way on the faulted run and on its twin.
        Each agent's own model is still checked (``agent_accuracies``)."""
        models = [m for m in self.saved_models(site).values() if m is not None]
        total = sum(mass for _, mass in models)
        if not models or total <= 0:
            return None
        consensus = {}
        for name, first in models[0][0].items():
            mean = sum(weights[name].astype(np.float64) * mass for weights, mass in models) / total
            consensus[name] = (np.rint(mean) if first.dtype.kind in "iub" else mean).astype(first.dtype)
        return digits_accuracy(consensus)

    def agent_accuracies(self, site: Site) -> dict[str, float | None]:
        return {a: None if m is None else digits_accuracy(m[0]) for a, m in self.saved_models(site).items()}
