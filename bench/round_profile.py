"""Profiling harness (not a section): where the CPU of the ``round`` section's fedagent
round goes, per process and per phase, through the real broker with mutual TLS.

It runs ``--rounds`` rounds of :class:`bench.round.FedRounds` (the coordinator here, ten
``bench/fed_agent.py`` processes) after one warm-up round, and prints the CPU seconds
(threads included) per round:

* coordinator: sending the RoundStart (``Messenger.send`` until its last PUBACK) and
  the rest of the round (reading, reassembling, checking and folding the ten updates);
  the same for its event-loop thread alone (what paces the intake: work handed to
  worker threads runs on another core meanwhile), the rest per update;
* agents (summed over the ten, and per agent): until the round start's first frame
  came (idle, keep-alives), receiving it (first frame to decoded: TLS reads,
  reassembly, digest, decode) and answering (decoded to the update's last PUBACK:
  envelope, chunking, SHA-256, signatures, TLS writes).

``--cprofile`` runs the coordinator and the agents under cProfile (worker-thread calls
made inline, so the profile sees them) and prints each side's top functions; compare
the phase figures of a run without it, as cProfile slows small calls down more than
large ones. CPU time is what to compare between builds on a shared machine, not wall
time; ``PYTHONPATH=<other checkout>/src:<other checkout>`` runs another build.

    .venv/bin/python -m bench.round_profile [--params 1.1e6] [--rounds 10] [--defaults] [--cprofile] [--daemon-malloc]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.env import BenchBroker
from bench.round import AGENTS, DEFAULTS, LIKE_C, FedRounds


def _faults(pids: list[int]) -> int:
    """Minor page faults so far of these live processes (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
        except OSError:
            continue
    return total


async def _run(work: Path, params: int, rounds: int, defaults: bool, prof: cProfile.Profile | None) -> list[dict]:
    out: list[dict] = []
    with BenchBroker(work / "bench", AGENTS) as bb:
        fed = FedRounds(bb, params, print)
        send = fed.messenger.send
        marks: dict[str, float] = {}

        async def timed_send(topic: str, message: Any, **kw: Any) -> int:
            t0, l0 = time.process_time(), time.thread_time()
            try:
                return await send(topic, message, **kw)
            finally:
                marks["send"] = time.process_time() - t0
                marks["loop_send"] = time.thread_time() - l0

        fed.messenger.send = timed_send  # type: ignore[method-assign]
        try:
            await fed.start()
            train = DEFAULTS if defaults else LIKE_C
            await fed.round(1, train)
            await fed.round(2, train)
            if prof is not None:
                prof.enable()
            pids = [p.pid for p in fed.procs]
            for r in range(3, rounds + 3):
                t0, l0 = time.process_time(), time.thread_time()
                f0, af0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _faults(pids)
                elapsed, _cpu, broker = await fed.round(r, train)
                own, loop = time.process_time() - t0, time.thread_time() - l0
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                agent_faults = _faults(pids) - af0
                out.append(
                    {
                        "round": r,
                        "wall": elapsed,
                        "coord": own,
                        "coord_send": marks["send"],
                        "loop": loop,
                        "loop_send": marks["loop_send"],
                        "agents": fed.phases["agents_cpu"],
                        "broker": broker,
                        "faults": faults,
                        "agent_faults": agent_faults,
                    }
                )
            if prof is not None:
                prof.disable()
        finally:
            await fed.stop()
    return out


def _agents(pdir: Path, first_round: int) -> dict[str, list[float]]:
    """Per round, the agents' CPU seconds in each phase summed over the agents."""
    per_round: dict[int, dict[str, float]] = {}
    for f in pdir.glob("*.jsonl"):
        prev_sent = None
        for line in f.read_text().splitlines():
            d = json.loads(line)
            r = d["round"]
            if r >= first_round and prev_sent is not None:
                acc = per_round.setdefault(r, {"idle": 0.0, "receive": 0.0, "answer": 0.0})
                acc["idle"] += d["first_frame"] - prev_sent
                acc["receive"] += d["decoded"] - d["first_frame"]
                acc["answer"] += d["sent"] - d["decoded"]
            prev_sent = d["sent"]
    out: dict[str, list[float]] = {"idle": [], "receive": [], "answer": []}
    for r in sorted(per_round):
        for k, v in per_round[r].items():
            out[k].append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.1e6)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--defaults", action="store_true", help="the round with fedagent's defaults (streamed int8)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile's top functions on each side")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument(
        "--daemon-malloc",
        action="store_true",
        help="the coordinator daemons' malloc setting (every block of 64 KiB or more mmapped: "
        "node.runtime.release_large_frees), which the round section's coordinator does not make",
    )
    args = ap.parse_args()
    if args.daemon_malloc:
        from fedagent.node.runtime import release_large_frees

        release_large_frees()
    with tempfile.TemporaryDirectory(prefix="fedagent-roundprof-") as tmp:
        work = Path(tmp)
        pdir = work / "profile"
        pdir.mkdir()
        os.environ["FEDAGENT_BENCH_PROFILE"] = str(pdir)
        prof = None
        if args.cprofile:
            os.environ["FEDAGENT_BENCH_CPROFILE"] = "1"
            prof = cProfile.Profile(time.process_time)  # CPU, not wall: the machine is shared

            async def inline(func, /, *a, **kw):
                return func(*a, **kw)

            asyncio.to_thread = inline  # type: ignore[assignment]
        rounds = asyncio.run(_run(work, int(args.params), args.rounds, args.defaults, prof))
        agents = _agents(pdir, rounds[0]["round"])

        def ms(xs: list[float]) -> str:
            return f"{statistics.median(xs) * 1e3:7.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"

        what = "defaults (streamed int8)" if args.defaults else "whole float32 updates"
        print(f"{args.params / 1e6:.1f}M params, {what}, {len(rounds)} rounds; CPU per round, median:")
        print(f"  wall                         {ms([r['wall'] for r in rounds])}")
        print(f"  coordinator                  {ms([r['coord'] for r in rounds])}")
        print(f"    RoundStart send            {ms([r['coord_send'] for r in rounds])}")
        print(f"    the rest (intake, fold)    {ms([r['coord'] - r['coord_send'] for r in rounds])}")
        print(f"  coordinator's event-loop thread {ms([r['loop'] for r in rounds])}")
        print(f"    RoundStart send            {ms([r['loop_send'] for r in rounds])}")
        print(f"    the rest, per update       {ms([(r['loop'] - r['loop_send']) / AGENTS for r in rounds])}")
        print(f"  agents (10)                  {ms([r['agents'] for r in rounds])}")
        for k in ("idle", "receive", "answer"):
            if agents[k]:
                print(f"    {k:26s} {ms(agents[k])}")
        print(f"  broker                       {ms([r['broker'] for r in rounds])}")
        print(
            f"  page faults per round: coordinator {statistics.median(r['faults'] for r in rounds):.0f}, "
            f"agents (10) {statistics.median(r['agent_faults'] for r in rounds):.0f} (median)"
        )
        if prof is not None:
            print("\ncoordinator (cProfile, tottime):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
            files = [str(p) for p in pdir.glob("*.prof")]
            if files:
                print("\nagents, all ten (cProfile, tottime):")
                pstats.Stats(*files).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
