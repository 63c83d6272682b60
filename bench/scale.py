"""Round time vs number of agents: many agents in one process over the real broker.

Each agent has its own MQTT connection and certificate; the coordinator is the real
``fedagent coordinator`` process. Training is off (a numpy step), the model small, so
the figures are the framework's per-round cost. Run: ``python bench/scale.py
[--agents 10,100,1000] [--params 1000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedagent.experiments.swarm import run_federation


def measure(agents: list[int], params: int, rounds: int, compression: str, console: Console, on_row=None) -> list[dict]:
    rows = []
    for n in agents:
        with tempfile.TemporaryDirectory(prefix=f"fedagent-scale-{n}-") as d:
            t = time.monotonic()
            r = run_federation(
                Path(d),
                agents=n,
                params=params,
                rounds=rounds,
                compression=compression,
                progress=lambda s: console.log(f"[{n}] {s}"),
                timeout=600,
            )
            secs = r.round_seconds
            if len(secs) < rounds or r.errors:
                console.log(f"[red]N={n}: {len(secs)}/{rounds} rounds, errors {r.errors[:3]}\n{r.coordinator_log}")
            rows.append(
                {
                    "agents": n,
                    "params": params,
                    "compression": compression,
                    "rounds": len(secs),
                    "round_median_s": statistics.median(secs) if secs else None,
                    "round_max_s": max(secs) if secs else None,
                    "per_agent_ms": 1000 * statistics.median(secs) / n if secs else None,
                    "coordinator_cpu_per_round_s": statistics.median(r.round_cpu) if r.round_cpu else None,
                    "coordinator_cpu_per_update_ms": 1000 * statistics.median(r.round_cpu) / n if r.round_cpu else None,
                    "broker_cpu_per_round_s": statistics.median(r.round_cpu_broker) if r.round_cpu_broker else None,
                    "agents_cpu_per_round_s": statistics.median(r.round_cpu_agents) if r.round_cpu_agents else None,
                    "setup_s": r.setup_seconds,
                    "wall_s": time.monotonic() - t,
                    "coordinator_peak_rss_mb": r.rss_peak / 2**20,
                }
            )
            if on_row is not None:
                on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="10,100,1000")
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compression", default="none")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    save = (lambda rows: args.json.write_text(json.dumps(rows, indent=2))) if args.json else None
    rows = measure(
        [int(x) for x in args.agents.split(",")], args.params, args.rounds, args.compression, console, on_row=save
    )
    table = Table(title=f"FedAvg round time vs agents ({args.params} params, training off, TLS)")
    for col in (
        "agents",
        "rounds",
        "median round (s)",
        "max round (s)",
        "per agent (ms)",
        "coordinator CPU / update (ms)",
        "coordinator peak RSS (MiB)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
        table.add_row(
            str(r["agents"]),
            str(r["rounds"]),
            fmt(r["round_median_s"]),
            fmt(r["round_max_s"]),
            fmt(r["per_agent_ms"], "{:.2f}"),
            fmt(r["coordinator_cpu_per_update_ms"], "{:.2f}"),
            fmt(r["coordinator_peak_rss_mb"], "{:.0f}"),
        )
    Console().print(table)
    Console().print(
        f"load average while measuring: {open('/proc/loadavg').read().split()[:3]} on "
        f"{__import__('os').cpu_count()} CPUs (timings on a shared machine)"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
