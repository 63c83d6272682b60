"""Coordinator peak memory vs number of agents, streamed vs whole-message updates.

The coordinator is the real ``fedagent coordinator`` process; the agents are light
agents in this process (own connection and certificate each, training off). Its RSS is
sampled every 10 ms from /proc. ``idle`` is its RSS once connected with the global model
loaded and no agent yet; the model's share of the peak is ``peak − idle + 1 model``
(the global model is already in ``idle``). Run: ``python bench/memory.py``.

Default cases: N=10 with the issue's 11.2M parameters (44.8 MB); N=10 and N=50 with
1.1M parameters (4.4 MB) — 50 × 44.8 MB round starts and updates in flight at once
would need several GB in the agents' process and the broker on a shared 2-core machine.
``--whole`` also measures the path streaming replaced (each update reassembled whole
before it is aggregated) for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.swarm import run_federation

DEFAULT_CASES = [(10, 11_200_000), (10, 1_100_000), (50, 1_100_000)]


def measure(
    cases,
    rounds: int,
    whole_too: bool,
    console: Console,
    on_row=None,
    rounds_options=None,
    compression: str = "none",
    downlink: str | None = None,
) -> list[dict]:
    rows = []
    for n, params in cases:
        for whole in [False, True] if whole_too else [False]:
            with tempfile.TemporaryDirectory(prefix=f"fedagent-mem-{n}-") as d:
                r = run_federation(
                    Path(d),
                    agents=n,
                    params=params,
                    rounds=rounds,
                    whole=whole,
                    progress=lambda s: console.log(f"[{n}x{params}] {s}"),
                    timeout=900,
                    rounds_options=rounds_options,
                    compression=compression,
                    downlink=downlink,
                )
            model = r.model_bytes
            rows.append(
                {
                    "agents": n,
                    "params": params,
                    "model_mb": model / 1e6,
                    "path": "whole" if whole else "stream",
                    "rounds": len(r.round_seconds),
                    "idle_rss_mb": r.rss_idle / 1e6,
                    "peak_rss_mb": r.rss_peak / 1e6,
                    "hwm_mb": r.hwm / 1e6,
                    "peak_over_model": (r.rss_peak - r.rss_idle + model) / model,
                    # CPU seconds of the coordinator per round (rounds after the first)
                    "coordinator_cpu_s": sorted(r.round_cpu)[len(r.round_cpu) // 2] if r.round_cpu else None,
                    "errors": r.errors[:3],
                }
            )
            console.log(
                f"[{n}x{params}] {rows[-1]['path']}: idle {rows[-1]['idle_rss_mb']:.0f} MB, peak "
                f"{rows[-1]['peak_rss_mb']:.0f} MB, (peak - idle + model) / model = "
                f"{rows[-1]['peak_over_model']:.2f}"
            )
            if len(r.round_seconds) < rounds:
                console.log(f"[red]incomplete run:\n{r.coordinator_log}")
            if on_row is not None:
                on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default=",".join(f"{n}x{p}" for n, p in DEFAULT_CASES),
        help="AGENTSxPARAMS,... (default %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--whole", action="store_true", help="also measure whole-message updates")
    ap.add_argument(
        "--momentum", type=float, help="the coordinator's [rounds] server_momentum (default: the coordinator's default)"
    )
    ap.add_argument(
        "--compression",
        default="none",
        help="the agents' update compression ([transfer] compression; int8 also sends the model as int8 steps)",
    )
    ap.add_argument("--downlink", choices=("none", "int8"), help="the coordinator's [transfer] downlink")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    opts = {} if args.momentum is None else {"server_momentum": args.momentum}
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    console = Console(stderr=True)
    save = (lambda rows: args.json.write_text(json.dumps(rows, indent=2))) if args.json else None
    rows = measure(
        cases,
        args.rounds,
        args.whole,
        console,
        on_row=save,
        rounds_options=opts,
        compression=args.compression,
        downlink=args.downlink,
    )
    table = Table(title="Coordinator memory during FedAvg rounds (TLS, training off)")
    for col in ("agents", "model (MB)", "updates", "idle RSS (MB)", "peak RSS (MB)", "(peak − idle + model) / model"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["agents"]),
            f"{r['model_mb']:.1f}",
            r["path"],
            f"{r['idle_rss_mb']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['peak_over_model']:.2f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
