"""Where a gossip exchange's time goes: one peer per process, every frame timestamped.

Runs ``--repeats`` exchanges of the ``gossip`` section's fedagent side (its own broker
under a temporary directory) with tracing on in both peers, and prints the timeline of
the last one: milliseconds from ``go``, per peer, frame by frame (``publish``/``puback``
of each frame sent, ``frame`` of each frame received, ``decode`` of the reassembled
message, ``deliver``/``handled`` of each message).

    python -m bench.gossip_trace --params 1100000 --repeats 3 [--quiet] [--profile /tmp/gossip.prof]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.env import BenchBroker
from bench.gossip import _PeerProcesses


def timeline(path: Path, exchange: int) -> list[str]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    events = [e for e in events if e[1] == exchange]
    t0 = min(e[2] for e in events if e[3] == "go")
    lines = []
    for who, _r, t, what, detail, nbytes in sorted(events, key=lambda e: e[2]):
        short = detail.rsplit("/", 1)[-1]
        lines.append(f"{(t - t0) * 1e3:8.2f} ms  {who:8s} {what:8s} {short:12s} {nbytes:>10,d}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1_100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quiet", action="store_true", help="the times only, no timeline")
    ap.add_argument(
        "--profile", type=Path, default=None, help="cProfile each peer's exchanges into PROFILE.agent-1 / .agent-2"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gossip-trace-") as tmp:
        work = Path(tmp)
        trace = work / "trace.jsonl"
        with BenchBroker(work, 2) as bb:
            peers = _PeerProcesses(bb, args.params, trace=trace, profile=args.profile)
            try:
                times = [peers.exchange(r) for r in range(args.repeats)]
            finally:
                peers.stop()
        for r, (t, cpu) in enumerate(times):
            print(f"exchange {r}: {t * 1e3:.1f} ms, CPU of both peers {cpu * 1e3:.1f} ms")
        print(
            f"median after the first: {statistics.median(t for t, _ in times[1:] or times) * 1e3:.1f} ms, "
            f"CPU {statistics.median(c for _, c in times[1:] or times) * 1e3:.1f} ms"
        )
        if not args.quiet:
            print("\n".join(timeline(trace, args.repeats - 1)))


if __name__ == "__main__":
    main()
