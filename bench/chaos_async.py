"""The chaos soak's asynchronous federation (bench/chaos.py ``--mode async``): a coordinator
publishing a model from every ``buffer_size`` updates (FedBuff, docs/modes/async.md) and
agents that train whenever they hold a task.

Recovery after a fault: models published since it was cleared hold, between them, an
update of every agent (an agent that was down has trained and been counted again).
Invariants, from the coordinator's history, log and checkpoint and the agents' histories:

* model versions contiguous, one history line each;
* no update counted twice: an (agent, task, base version) in at most one model;
* no acknowledged update lost: each update an agent recorded as sent (its broker
  acknowledged it, after its outbox kept it on disk) is in a model, refused with a
  recorded reason (``stale``, ``duplicate``, ``share``...), in a buffer given up
  (``abandoned``, its updates listed), queued at a broker that was killed, or in the
  buffer when the run stopped;
* no signed frame refused for its timestamp (the clock jumps).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from bench.chaos_base import Fault, Site, _invariant
from bench.chaos_setups import FedAvgSetup, timestamp_invariant
from fedagent.local.federation import Federation
from fedagent.storage import checkpoint
from fedagent.storage.history import read_records

# The coordinator's log line for a refused update of the asynchronous mode.
_REFUSED = re.compile(r"rejected from (\S+) \(task (\d+)\): (\w+)")
_LABEL = re.compile(r"^(.+)/(\d+)/(\d+)$")

Key = tuple[str, int, int]  # agent, task, base version: how the coordinator tells updates apart


class AsyncSetup(FedAvgSetup):
    name = "async"

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        self.agents = [f"agent-{i + 1}" for i in range(args.agents)]
        self.rounds_seen: list[dict[str, Any]] = []
        self.tail = None
        return Federation(
            work,
            agents=args.agents,
            rounds=1,
            alpha=args.alpha,
            mode="async",
            round_timeout=args.round_timeout,
            agent_broker_by_mdns=False,
            broker_bind=broker_bind,
            rounds_options={"min_agents": max(1, args.agents // 2), "expected_agents": args.agents},
            fedbuff={
                # A model from every ``agents`` updates, published until the coordinator is stopped;
                # a task unanswered for a round timeout frees its place.
                "buffer_size": args.agents,
                "versions": 0,
                "max_staleness": 20,
                "task_timeout": args.round_timeout,
            },
        )

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        self.poll(site)
        since: set[str] = set()
        for r in self.rounds_seen[mark["seen"] :]:
            since.update(r.get("participants", []))
        return set(self.agents) <= since

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        records = self.coordinator_records(site)
        models = [r for r in records if r.get("event") == "round"]
        versions = [r["model_version"] for r in models]
        out.append(
            _invariant(
                "model versions contiguous, one history line each",
                bool(versions) and versions == list(range(1, len(versions) + 1)),
                {
                    "versions": f"1..{len(versions)}" if versions else "none",
                    "lines restored from the checkpoint": sum(1 for r in models if r.get("recovered")),
                },
            )
        )
        counted: dict[Key, int] = {}
        for r in models:
            for u in r.get("updates", []):
                key = (u["agent"], int(u["task"]), int(u["base_version"]))
                counted[key] = counted.get(key, 0) + 1
        twice = [k for k, n in counted.items() if n > 1]
        # A model whose history line came back from its checkpoint (a crash between the
        # two) lists no updates: the final checkpoint's accepted keys cover the recent ones.
        loaded = checkpoint.load(self.history_path(site).parent / "global.ckpt")
        accepted = {(str(a), int(t), int(b)) for a, t, b in (loaded[1].get("accepted", []) if loaded else [])}
        restored = [r for r in models if r.get("recovered")]
        lost_in: set[Key] = set()
        for r in records:
            if r.get("event") == "abandoned":
                for label in r.get("lost", []):
                    m = _LABEL.match(str(label))
                    if m:
                        lost_in.add((m.group(1), int(m.group(2)), int(m.group(3))))
        refused = _refusals(site.work / "logs" / "coordinator.log")
        sent: dict[str, list[dict[str, Any]]] = {
            a: [u for u in read_records(self.history_path(site, a)) if u.get("event") == "update"] for a in self.agents
        }
        broker_kills = [
            (f["wall"], f["wall"] + f["hold"] + 5) for f in run["faults"] if f["kind"] == "broker" and "wall" in f
        ]
        # The last line's wall time, not the greatest: the coordinator's clock may have jumped ahead.
        last_model_time = models[-1]["time"] if models else 0.0
        kept = {
            "in a model": 0,
            "in the final checkpoint's accepted updates": 0,
            "sent again (one model holds it)": 0,
            "in a model whose history line was restored": 0,
            "refused with a reason": 0,
            "in a buffer given up": 0,
            "queued at a killed broker": 0,
            "in the buffer at the end": 0,
        }
        reasons: dict[str, int] = {}
        unexplained = []
        mine: set[Key] = set()
        for a, updates in sent.items():
            for u in updates:
                key = (a, int(u["task"]), int(u["base_version"]))
                again = key in mine
                mine.add(key)
                why = refused.get((a, key[1]))
                if again and (key in counted or key in accepted):
                    kept["sent again (one model holds it)"] += 1
                elif key in counted:
                    kept["in a model"] += 1
                elif key in accepted:
                    kept["in the final checkpoint's accepted updates"] += 1
                elif why is not None:
                    kept["refused with a reason"] += 1
                    reasons[why] = reasons.get(why, 0) + 1
                elif key in lost_in:
                    kept["in a buffer given up"] += 1
                elif any(a in r.get("participants", []) and r["time"] >= u["time"] for r in restored):
                    kept["in a model whose history line was restored"] += 1
                elif any(lo - 2 <= u["time"] <= hi for lo, hi in broker_kills):
                    kept["queued at a killed broker"] += 1
                elif u["time"] >= last_model_time - 5:
                    kept["in the buffer at the end"] += 1
                else:
                    unexplained.append(key)
        # In a model without its agent's record: sent, then the agent killed (or its disk
        # full) before the history line that follows the broker's acknowledgement.
        unrecorded = [k for k in counted if k not in mine]
        crashed = {e["name"] for e in run["exits"]}
        phantom = [k for k in unrecorded if k[0] not in crashed]
        out.append(
            _invariant(
                "every update counted at most once (agent, task, base version in one model)",
                not twice,
                {"updates in models": sum(counted.values()), "counted twice": twice[:20]},
            )
        )
        out.append(
            _invariant(
                "no acknowledged update lost (in a model, refused with a reason, or accounted for)",
                not unexplained and not phantom,
                {
                    **kept,
                    "refusals": reasons,
                    "in a model, its agent's record lost in a crash": len(unrecorded) - len(phantom),
                    "not accounted for": unexplained[:20],
                    "in a model without being sent": phantom[:20],
                },
            )
        )
        out.append(timestamp_invariant(site))
        return out


def _refusals(path: Path) -> dict[tuple[str, int], str]:
    """(agent, task) -> the reason the coordinator gave for refusing its update."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return {}
    return {(m.group(1), int(m.group(2))): m.group(3) for m in _REFUSED.finditer(text)}
