"""Where a time-to-accuracy round's time goes in fedagent: the critical path of each round.

Runs the fedagent side of the ``tta`` section (bench/tta.py: a coordinator and 10 agent
daemons over Mosquitto with mutual TLS, the shared CNN) for a number of rounds while a
thread samples /proc/stat, then lines up the wall-clock marks the daemons write into
their history: the coordinator's round start, broadcast sent, each update in, aggregate
and checkpoint; each agent's model in, training start and end, update sent, and its
evaluation of each global model. Prints, per round and as medians over rounds 2 on::

    start -> broadcast sent -> first/last agent has the model -> training starts
    -> slowest training ends -> its update sent -> last update in -> aggregated
    -> checkpointed -> next round starts

and the share of the machine's CPU that was idle during the rounds. Usage::

    .venv/bin/python -m bench.tta_trace --out runs/tta-trace [--rounds 8] [--json FILE]

A measurement tool, not a benchmark section (its figures are wall-clock ones and vary with
the load; the ``tta`` section gives the figures that are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from bench.tta import _history, run_fedagent


class CpuSampler(threading.Thread):
    """(wall time, busy jiffies, total jiffies) of the whole machine every ``period`` s,
    and every ``proc_period`` s the CPU seconds of the processes whose command line names
    ``work`` (the run's daemons and broker)."""

    def __init__(self, work: Path, period: float = 0.05, proc_period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.proc_period = proc_period
        self.work = str(work)
        self.samples: list[tuple[float, int, int]] = []
        self.proc_samples: list[tuple[float, dict[str, float]]] = []
        self._halt = threading.Event()

    def procs_cpu(self) -> dict[str, float]:
        """CPU seconds (utime + stime) of the run's live processes by kind: "agents",
        "coordinator", "broker" (and "other")."""
        total = {"agents": 0.0, "coordinator": 0.0, "broker": 0.0, "other": 0.0}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():  # not this process (its relays)
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
                if self.work.encode() not in cmdline:
                    continue
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kind = (
                "coordinator"
                if b"\0coordinator\0" in cmdline
                else "agents"
                if b"\0agent\0" in cmdline
                else "broker"
                if b"mosquitto" in cmdline
                else "other"
            )
            total[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    @staticmethod
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        total = sum(fields[:8])
        return total - idle, total

    def run(self) -> None:
        next_proc = 0.0
        while not self._halt.is_set():
            busy, total = self.read()
            now = time.time()
            self.samples.append((now, busy, total))
            if now >= next_proc:
                self.proc_samples.append((now, self.procs_cpu()))
                next_proc = now + self.proc_period
            self._halt.wait(self.period)

    def procs_cpu_between(self, t0: float, t1: float, kind: str | None = None) -> float | None:
        """CPU seconds the run's processes (of ``kind``; None: all) used between wall
        times t0 and t1 (nearest samples inside, scaled to the interval; None if fewer
        than two)."""
        inside = [s for s in self.proc_samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None

        def used(sample: dict[str, float]) -> float:
            return sum(sample.values()) if kind is None else sample[kind]

        return (used(inside[-1][1]) - used(inside[0][1])) * (t1 - t0) / (inside[-1][0] - inside[0][0])

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def idle_share(self, t0: float, t1: float) -> float | None:
        """The share of CPU time idle between wall times t0 and t1 (nearest samples)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        busy = inside[-1][1] - inside[0][1]
        total = inside[-1][2] - inside[0][2]
        return 1 - busy / total if total else None


def trace(work: Path, rounds: int) -> dict:
    sampler = CpuSampler(work)
    sampler.start()
    try:
        run = run_fedagent(work, print, rounds=rounds, min_rounds=rounds)
    finally:
        sampler.stop()
    out = analyse(work / "fedagent-default" / "state", sampler)
    out["cpu"] = run.cpu
    rounds = out["rounds"][1:]
    if rounds:
        t0, t1 = rounds[0]["start"], rounds[-1]["end"]
        cpu = sampler.procs_cpu_between(t0, t1)
        out["cpu_per_round_2_on"] = None if cpu is None else cpu / len(rounds)
        # The agents' share, split by what their histories say their training and
        # evaluation threads used: the rest is moving models, messages and bookkeeping.
        split: dict[str, float | None] = {
            kind: sampler.procs_cpu_between(t0, t1, kind) for kind in ("agents", "coordinator", "broker")
        }
        train = [r["train_cpu_sum"] for r in rounds]
        evals = [r["eval_cpu_sum"] for r in rounds]
        if None not in train and None not in evals and split["agents"] is not None:
            split["agents_training"] = sum(train)  # type: ignore[arg-type]
            split["agents_evaluation"] = sum(evals)  # type: ignore[arg-type]
            split["agents_rest"] = split["agents"] - split["agents_training"] - split["agents_evaluation"]
        out["cpu_split_per_round_2_on"] = {k: None if v is None else v / len(rounds) for k, v in split.items()}
        cpu = split["coordinator"]
        out["coordinator_cpu_per_round_2_on"] = None if cpu is None else cpu / len(rounds)
    return out


def analyse(d: Path, sampler: CpuSampler | None = None) -> dict:
    """The per-round critical path from the histories under a run's state directory."""
    coord = [e for e in _history(next(d.glob("coordinator/coordinator/*/history.jsonl"))) if e.get("event") == "round"]
    agents: dict[str, list[dict]] = {}
    for path in sorted(d.glob("agent-*/agent/*/history.jsonl")):
        agents[path.parts[-4]] = _history(path)
    per_round = []
    for i, c in enumerate(coord):
        m = c.get("marks", {})
        rnd = c["round"]
        ups = {
            a: next((e for e in h if e.get("event") == "update" and e["round"] == rnd), None) for a, h in agents.items()
        }
        marks = {a: (u or {}).get("marks", {}) for a, u in ups.items()}
        if not m or any(not x for x in marks.values()):
            continue
        nxt = coord[i + 1]["marks"]["start"] if i + 1 < len(coord) and "marks" in coord[i + 1] else None
        train = {a: x["train_end"] - x["train_start"] for a, x in marks.items()}
        slowest = max(train, key=lambda a: marks[a]["train_end"])
        scored = [
            e
            for h in agents.values()
            for e in h
            if e.get("event") == "global_eval" and e.get("model_version") == c["model_version"] - 1
        ]
        evals = [e["seconds"] for e in scored if "seconds" in e]
        # CPU seconds of the agents' training of this round and of their evaluation of
        # the model it started from (which runs during this round): None from daemons
        # that do not record them.
        train_cpu = [x.get("train_cpu") for x in marks.values()]
        eval_cpu = [e.get("cpu") for e in scored]
        row = {
            "round": rnd,
            "start": m["start"],
            "end": m["aggregated"],
            "seconds": c["seconds"],
            "start_to_broadcast": m["broadcast"] - m["start"],
            "broadcast_to_first_model_in": min(x["model_in"] for x in marks.values()) - m["broadcast"],
            "broadcast_to_last_model_in": max(x["model_in"] for x in marks.values()) - m["broadcast"],
            "model_in_to_train_start_median": statistics.median(
                x["train_start"] - x["model_in"] for x in marks.values()
            ),
            "model_in_to_train_start_max": max(x["train_start"] - x["model_in"] for x in marks.values()),
            "train_min": min(train.values()),
            "train_median": statistics.median(train.values()),
            "train_max": max(train.values()),
            "slowest_agent": slowest,
            "slowest_train_start_after_round_start": marks[slowest]["train_start"] - m["start"],
            "slowest_train_end_to_sent": marks[slowest]["sent"] - marks[slowest]["train_end"],
            "last_sent_to_last_in": max(m["updates"].values()) - max(x["sent"] for x in marks.values()),
            "last_in_to_aggregated": m["aggregated"] - max(m["updates"].values()),
            "aggregated_to_checkpointed": m["checkpointed"] - m["aggregated"],
            "checkpointed_to_next_start": None if nxt is None else nxt - m["checkpointed"],
            "eval_seconds_median": statistics.median(evals) if evals else None,
            "train_cpu_sum": None if None in train_cpu else sum(train_cpu),
            "eval_cpu_sum": None if None in eval_cpu or len(eval_cpu) != len(agents) else sum(eval_cpu),
            "idle_share": None if sampler is None else sampler.idle_share(m["start"], m["aggregated"]),
            # fdatasync calls at the coordinator during the round (round journal, replay guard)
            "journal_syncs": c.get("syncs", {}).get("journal"),
            "replay_syncs": c.get("syncs", {}).get("replay"),
        }
        per_round.append(row)
    later = per_round[1:] or per_round
    medians = {
        k: statistics.median(r[k] for r in later if r[k] is not None)
        for k in per_round[0]
        if k not in ("round", "slowest_agent", "start", "end") and any(r[k] is not None for r in later)
    }
    return {"rounds": per_round, "median_rounds_2_on": medians, "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="work directory (state, logs)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", type=Path, help="write the trace here too")
    ap.add_argument("--analyse", action="store_true", help="only read the histories of an earlier run in --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.analyse:
        out = analyse(args.out.resolve() / "fedagent-default" / "state")
    else:
        out = trace(args.out.resolve(), args.rounds)
    for r in out["rounds"]:
        print(
            f"round {r['round']:2d}: {r['seconds']:.3f} s; broadcast {r['start_to_broadcast']:.3f}, models in "
            f"+{r['broadcast_to_first_model_in']:.3f}..+{r['broadcast_to_last_model_in']:.3f}, wait to train "
            f"{r['model_in_to_train_start_median']:.3f} (max {r['model_in_to_train_start_max']:.3f}), train "
            f"{r['train_min']:.3f}/{r['train_median']:.3f}/{r['train_max']:.3f} (slowest {r['slowest_agent']} "
            f"starts at +{r['slowest_train_start_after_round_start']:.3f}), send {r['slowest_train_end_to_sent']:.3f}, "
            f"last in +{r['last_sent_to_last_in']:.3f}, aggregate {r['last_in_to_aggregated']:.3f}, checkpoint "
            f"{r['aggregated_to_checkpointed']:.3f}, next start "
            f"{'-' if r['checkpointed_to_next_start'] is None else format(r['checkpointed_to_next_start'], '.3f')}; "
            f"eval {r['eval_seconds_median'] or 0:.3f}; idle {100 * (r['idle_share'] or 0):.0f} %"
        )
    print("median, rounds 2 on:", json.dumps({k: round(v, 4) for k, v in out["median_rounds_2_on"].items()}))
    print(
        "CPU s (whole run):",
        out.get("cpu"),
        "; CPU s per round (rounds 2 on, all processes of the run):",
        out.get("cpu_per_round_2_on"),
        "; of which the coordinator:",
        out.get("coordinator_cpu_per_round_2_on"),
        "; by kind, and the agents' by what their threads did:",
        json.dumps({k: None if v is None else round(v, 4) for k, v in out.get("cpu_split_per_round_2_on", {}).items()}),
        "; load:",
        out["load"],
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
