"""Chaos soak: a federation of real daemons under random faults from a seeded schedule.

    .venv/bin/python bench/chaos.py --out DIR                       # FedAvg, 30 minutes, seed 1
    .venv/bin/python bench/chaos.py --minutes 3 --seed 7 --out DIR  # the size CI runs
    .venv/bin/python bench/chaos.py --mode gossip --minutes 10 --out DIR
    .venv/bin/python bench/chaos.py --mode async --minutes 3 --seed 11 --out DIR  # or --mode tiered

A coordinator and agents (``--agents``, 4) train the digits task through a private
Mosquitto with mutual TLS, each daemon supervised as systemd would (an exited daemon is
started again after ``--restart-sec``, 5 s as in the units). As root every daemon and the
broker run in network namespaces of their own (tests/netns.py: one bridge, one veth per
host), otherwise all on loopback. From a schedule drawn from ``--seed``, one fault at a
time, each kind in turn in a shuffled order, with random gaps and lengths:

``kill``       ``kill -9`` of a daemon; the supervisor starts it again after ``--restart-sec``
``broker``     Mosquitto ``SIGKILL``ed (its queues lost) and started again seconds later
``partition``  a daemon's namespace cut off (nft drop-all both ways), then healed (root)
``stop``       ``SIGSTOP`` of a daemon for 2-20 s (past its keep-alive at times), then ``SIGCONT``
``disk``       one node's state directory, a small tmpfs, filled up for a while, then freed (root)
``clock``      the wall clock of one daemon jumps (its Python ``time.time()``: bench/chaos_site;
               the monotonic clock is untouched) and 5-30 s later jumps back (NTP's step)

After each fault is cleared the soak waits for the federation to recover (FedAvg: a round
aggregated from every agent; gossip: every agent two periods further, the target merging
again; async: models holding an update of every agent; tiered: a hub round from both
sites and the hit agent in a round of its site), records how long that took, and goes on after a random gap. The last stretch of
the run (``--quiet``) is fault-free: a fault is held no further than its start (its
length cut to fit, or no fault when even its kind's shortest would not), so the
federation settles before it is judged. Then everything is stopped and checked:

* model versions contiguous, each round aggregated once (the coordinator's history);
* every update an agent had acknowledged by the broker aggregated exactly once: each
  participant of a round sent that round's update on that round's model (the agents'
  histories), and an acknowledged update not aggregated is accounted for (refused as
  stale by the coordinator, its round abandoned, or queued at a broker that was killed);
* no signed frame refused for its timestamp (the jumped clock must not matter);
* no daemon left dead, none exited on its own other than with 74 on the full disk;
* the final model within ``--tolerance`` (1 point) of a fault-free run of the same
  length: its twin, the same federation started beside it on the same machine (its own
  broker, on loopback) and never touched (``--reference none``: no twin). Where every
  agent keeps a model of its own (gossip) the federation's model is their consensus (the
  saved models' push-sum mass-weighted mean), and each agent's own model must be
  readable and no more than ``AGENT_MARGIN`` under the twin's worst agent;
* every process's memory bounded: its peak RSS in the second half of the run at most
  1.25 x its peak in the first half (after start-up) + 30 MB; and every fault recovered
  within ``--recovery-timeout``.

The report goes to ``--out``: ``report.md`` (settings, faults with recovery times,
invariants, memory), ``report.json`` (everything, with the time series) and ``chaos.png``
(needs matplotlib, the ``report`` extra). Exit status 0 only if every invariant holds.

Modes: ``fedavg`` and ``gossip`` (bench/chaos_setups.py), ``async`` (bench/chaos_async.py)
and ``tiered`` (bench/chaos_tiered.py: hub, two sites; as root the hub and each site on
a host of its own, where ``partition`` cuts a whole site off from the hub). A mode is a
:class:`~bench.chaos_base.Setup` subclass in ``SETUPS``: how its federation is
configured, what recovery means and which invariants it checks (the checks above are the
FedAvg ones; each mode's module says its own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the bench package beside it

from bench.chaos_async import AsyncSetup  # noqa: E402
from bench.chaos_base import (  # noqa: E402
    KINDS,
    MB,
    Fault,
    Injector,
    Sampler,
    Setup,
    Site,
    _invariant,
    log,
    scheduled,
)
from bench.chaos_setups import FedAvgSetup, GossipSetup  # noqa: E402
from bench.chaos_tiered import TieredSetup  # noqa: E402

SETUPS: dict[str, Callable[[], Setup]] = {
    "fedavg": FedAvgSetup,
    "gossip": GossipSetup,
    "async": AsyncSetup,
    "tiered": TieredSetup,
}


# -- the run -----------------------------------------------------------------------------------
def memory_check(samples: list[dict[str, Any]], warmup: float, end: float) -> dict[str, Any]:
    """Per process: peak RSS after start-up in the first and the second half of the rest."""
    mid = warmup + (end - warmup) / 2
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    for s in samples:
        if s["t"] < warmup:
            continue
        half = first if s["t"] < mid else second
        for name, rss in s["rss"].items():
            half[name] = max(half.get(name, 0), rss)
    table = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name, 0), second.get(name, 0)
        bound = int(1.25 * a + 30 * MB) if a else 0
        table[name] = {"first_half_peak": a, "second_half_peak": b, "bound": bound, "ok": not a or b <= bound}
    return table


def stop_site(site: Site, setup: Setup) -> dict[str, float]:
    """SIGTERM every daemon in the mode's order (what each holds is on disk when it returns).
    Returns the harness time at which each was stopped (or, if it was not running, found
    down), each taken just after the mode's look at its federation (``Setup.stopping``):
    what that look read came before the stop, what later looks read came after it."""
    stops: dict[str, float] = {}
    for name in setup.stop_order(site.names):
        setup.stopping(site, name)
        stops[name] = round(site.now(), 2)
        proc = site.proc(name)
        if proc is not None:
            site.fed.stop(proc)
            site.fed.procs.remove(proc)
    site.fed.close()
    return stops


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The federation under faults for ``args.minutes`` (from its first progress) and, beside it on the same machine,
    its fault-free twin (``--reference twin``): the same settings, never touched, the
    accuracy the faulted one is held to."""
    rng = random.Random(args.seed)
    setup = SETUPS[args.mode]()
    twin_setup = SETUPS[args.mode]() if args.reference == "twin" else None
    twin_args = argparse.Namespace(**{**vars(args), "netns": False, "faults": []})
    with contextlib.ExitStack() as stack:
        site = Site(work / "chaos", args, setup, rng)
        stack.callback(site.close)
        twin = None
        if twin_setup is not None:
            twin = Site(work / "twin", twin_args, twin_setup, random.Random(args.seed))
            stack.callback(twin.close)
        return _run(args, rng, setup, site, twin_setup, twin)


def _run(
    args: argparse.Namespace,
    rng: random.Random,
    setup: Setup,
    site: Site,
    twin_setup: Setup | None,
    twin: Site | None,
) -> dict[str, Any]:
    duration = args.minutes * 60
    quiet = min(args.quiet, duration / 3)
    out: dict[str, Any] = {
        "faults": [],
        "progress": [],
        "twin_progress": [],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    sampler = Sampler(site, args.sample_every)
    injector = Injector(site)
    cycle: list[str] = []
    try:
        site.prepare()
        site.start_all()
        if twin is not None:
            twin.prepare()
            twin.start_all()
        sampler.start()
        next_fault = float("inf")  # set once the federation has made progress
        last_log = 0.0
        current: Fault | None = None
        mark: dict[str, Any] = {}
        state = "idle"  # idle -> held -> recovering -> idle
        faults_over = False
        # The run's length counts from the first aggregated round (or gossip period), so a
        # slow start-up on a busy machine does not eat the time for faults; a start-up
        # that never gets there ends the run after --startup-timeout.
        end = args.startup_timeout
        # Past the end only to see the last fault's recovery through (bounded by its timeout).
        while site.now() < end or state == "recovering":
            site.supervise()
            progress = setup.poll(site)
            out["progress"].append({"t": round(progress["t"], 1), "version": progress["version"]})
            if twin is not None and twin_setup is not None:
                twin.supervise()
                tp = twin_setup.poll(twin)
                out["twin_progress"].append({"t": round(site.now(), 1), "version": tp["version"]})
            now = site.now()
            if next_fault == float("inf") and progress["version"] >= 1:
                out["first_progress"] = round(now, 1)
                next_fault = now + args.warmup
                end = now + duration
            budget_left = not args.cycles or len(out["faults"]) < args.cycles * len(args.faults)
            faulting = state == "idle" and args.faults and budget_left and not faults_over
            if faulting and now >= next_fault and now < end - quiet:
                current = scheduled(rng, args.faults, site, cycle, now, end - quiet)
                if current is None:
                    # Its hold would run into the quiet tail: the faults end here.
                    faults_over = True
                    log("no room for another fault before the quiet tail")
                    continue
                current.detail["wall"] = time.time()
                injector.inject(current)
                out["faults"].append(current)
                log(f"fault: {current.label()} for {current.hold:.1f}s")
                state = "held"
            elif state == "held" and current is not None and now >= current.at + current.hold:
                injector.clear(current)
                current.cleared = round(site.now(), 2)
                mark = setup.poll(site)
                state = "recovering"
            elif state == "recovering" and current is not None:
                if setup.recovered(site, current, mark):
                    current.recovered = round(site.now() - (current.cleared or 0), 2)
                    log(f"recovered from {current.label()} in {current.recovered:.1f}s")
                    state = "idle"
                    next_fault = site.now() + rng.uniform(args.gap_min, args.gap_max)
                    if args.cycles and len(out["faults"]) >= args.cycles * len(args.faults):
                        end = min(end, site.now() + quiet)  # every fault done: the quiet stretch, then stop
                elif now - (current.cleared or 0) > args.recovery_timeout:
                    log(f"NOT recovered from {current.label()} within {args.recovery_timeout:.0f}s")
                    state = "idle"
                    next_fault = site.now() + rng.uniform(args.gap_min, args.gap_max)
                    if args.cycles and len(out["faults"]) >= args.cycles * len(args.faults):
                        end = min(end, site.now() + quiet)
            if now - last_log >= args.log_every:
                last_log = now
                rss = sampler.samples[-1]["rss"] if sampler.samples else {}
                twin_v = f" (twin {out['twin_progress'][-1]['version']})" if out["twin_progress"] else ""
                log(
                    f"{now / 60:5.1f} min: version {progress['version']}{twin_v}, {len(out['faults'])} faults, "
                    f"{state}{' ' + current.label() if current and state != 'idle' else ''}; RSS MB "
                    + " ".join(f"{k}={v / MB:.0f}" for k, v in sorted(rss.items()))
                )
            time.sleep(0.25)
        if current is not None and state == "held":
            injector.clear(current)
            current.cleared = round(site.now(), 2)
        # A last look: everyone must be up after one more supervision pass.
        site.supervise()
        setup.poll(site)
        out["alive_at_end"] = {n: site.alive(n) for n in site.names}
        sampler.stopped.set()
        sampler.join()
        out["samples"] = sampler.samples
        out["end"] = round(site.now(), 1)
        out["stops"] = stop_site(site, setup)
        if twin is not None and twin_setup is not None:
            stop_site(twin, twin_setup)
        out["faults"] = [asdict(f) | {"wall": f.detail.pop("wall", None)} for f in out["faults"]]
        out["exits"] = [asdict(e) for e in site.exits]
        out["starts"] = site.starts
        out["disk_node"], out["clock_node"] = site.disk_node, site.clock_node
        out["invariants"] = setup.check(site, out)
        acc = setup.accuracy(site)
        ref = twin_setup.accuracy(twin) if twin is not None and twin_setup is not None else None
        out["accuracy"] = {"of": setup.accuracy_of, "chaos": acc, "fault_free_twin": ref}
        if ref is None:
            out["invariants"].append(
                _invariant(
                    f"final accuracy of {setup.accuracy_of} (no fault-free twin)", acc is not None, {"accuracy": acc}
                )
            )
        else:
            out["invariants"].append(
                _invariant(
                    f"final accuracy of {setup.accuracy_of} within {args.tolerance:g} of the fault-free twin",
                    acc is not None and acc >= ref - args.tolerance,
                    {"accuracy": acc, "fault-free twin": ref, "twin's progress": out["twin_progress"][-1]["version"]},
                )
            )
        agents = setup.agent_accuracies(site)
        if agents:
            twin_agents = twin_setup.agent_accuracies(twin) if twin is not None and twin_setup is not None else {}
            out["accuracy"] |= {"agents": agents, "twin_agents": twin_agents}
            out["invariants"].append(agents_invariant(agents, twin_agents))
    finally:
        sampler.stopped.set()
    return out


# How far one agent's own model may end below the fault-free twin's worst. A single
# model's accuracy swings with its last local steps (the twin's non-IID agent evaluated
# 0.85-0.97 over its last minute in fault-free runs): this bound is no measure of what
# the faults cost (the consensus is), it catches an agent whose model was lost or left
# far behind.
AGENT_MARGIN = 0.15


def agents_invariant(agents: dict[str, float | None], twin_agents: dict[str, float | None]) -> dict[str, Any]:
    """Every agent's own model readable at the end and, beside a twin, none more than
    ``AGENT_MARGIN`` under the twin's worst agent."""
    floor = min((v for v in twin_agents.values() if v is not None), default=None)
    lost = [a for a, v in agents.items() if v is None]
    low = [a for a, v in agents.items() if v is not None and floor is not None and v < floor - AGENT_MARGIN]
    name = "every agent's own model readable at the end"
    if twin_agents:
        name += f", none more than {AGENT_MARGIN:g} below the fault-free twin's worst"
    detail: dict[str, Any] = {"agents": {a: None if v is None else round(v, 4) for a, v in agents.items()}}
    if twin_agents:
        detail["twin"] = {a: None if v is None else round(v, 4) for a, v in twin_agents.items()}
    if lost:
        detail["unreadable"] = lost
    if low:
        detail["too low"] = low
    return _invariant(name, not lost and not low and (not twin_agents or floor is not None), detail)


def common_invariants(run: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = [
        _invariant(
            f"the federation made progress within {args.startup_timeout:.0f} s of its start",
            "first_progress" in run,
            {"first progress at (s)": run.get("first_progress")},
        )
    ]
    dead = [n for n, up in run["alive_at_end"].items() if not up]
    unexpected = [e for e in run["exits"] if not e["expected"]]
    out.append(_invariant("no daemon left dead", not dead, {"dead at the end": dead}))
    out.append(
        _invariant(
            "no daemon exited on its own (other than 74 on the full disk)",
            not unexpected,
            {"unexpected exits": unexpected[:20], "exits": len(run["exits"])},
        )
    )
    late = [f"{f['kind']} {f['target']}" for f in run["faults"] if f["recovered"] is None]
    out.append(
        _invariant(
            f"every fault recovered within {args.recovery_timeout:.0f} s",
            not late,
            {"not recovered": late, "faults": len(run["faults"])},
        )
    )
    mem = memory_check(run["samples"], run.get("first_progress", 0) + args.warmup, run["end"])
    run["memory"] = mem
    out.append(
        _invariant(
            "memory of every process bounded (second-half peak <= 1.25 x first-half peak + 30 MB)",
            all(m["ok"] for m in mem.values()),
            {k: f"{m['first_half_peak'] / MB:.0f} -> {m['second_half_peak'] / MB:.0f} MB" for k, m in mem.items()},
        )
    )
    return out


def write_report(out: Path, run: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(run, indent=1, default=str))
    s = run["settings"]
    lines = [
        f"# Chaos soak: {s['mode']}, {s['minutes']:g} min, seed {s['seed']}",
        "",
        f"{s['agents']} agents, digits (α = {s['alpha']}), round timeout {s['round_timeout']} s, "
        f"faults: {', '.join(s['faults'])}; network namespaces: {'yes' if s['netns'] else 'no'}; "
        f"small disk: {run.get('disk_node')}; faked clock: {run.get('clock_node')}; "
        f"load average at the start {run.get('load_start')}, at the end {run.get('load_end')}.",
        "",
        "## Invariants",
        "",
        "| invariant | holds | figures |",
        "|---|---|---|",
    ]
    for inv in run["invariants"]:
        lines.append(
            f"| {inv['name']} | {'yes' if inv['ok'] else '**NO**'} | {json.dumps(inv['detail'], default=str)} |"
        )
    lines += ["", "## Faults", "", "| # | at (s) | fault | held (s) | recovered after (s) |", "|---|---|---|---|---|"]
    for i, f in enumerate(run["faults"], 1):
        label = f"{f['kind']} {f['target']}" + (f" {f['detail']['offset']}" if "offset" in f["detail"] else "")
        rec = "—" if f["recovered"] is None else f"{f['recovered']:.1f}"
        lines.append(f"| {i} | {f['at']:.0f} | {label} | {f['hold']:.1f} | {rec} |")
    by_kind: dict[str, list[float]] = {}
    for f in run["faults"]:
        if f["recovered"] is not None:
            by_kind.setdefault(f["kind"], []).append(f["recovered"])
    lines += ["", "| fault | count | recovery median (s) | max (s) |", "|---|---|---|---|"]
    for kind, times in sorted(by_kind.items()):
        times.sort()
        lines.append(f"| {kind} | {len(times)} | {times[len(times) // 2]:.1f} | {times[-1]:.1f} |")
    lines += ["", "## Memory", "", "| process | peak RSS, first half (MB) | second half (MB) | bound (MB) |"]
    lines.append("|---|---|---|---|")
    for name, m in run.get("memory", {}).items():
        lines.append(
            f"| {name} | {m['first_half_peak'] / MB:.0f} | {m['second_half_peak'] / MB:.0f} | {m['bound'] / MB:.0f} |"
        )
    exits = run.get("exits", [])
    lines += ["", f"Exits: {len(exits)} ({sum(1 for e in exits if e['expected'] == 'kill')} by kill -9, "]
    lines[-1] += (
        f"{sum(1 for e in exits if e['expected'] == 'disk full')} with 74 on the full disk); starts: {run.get('starts')}."
    )
    lines += ["", "![faults, progress and memory](chaos.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    plot(out / "chaos.png", run)


def plot(path: Path, run: dict[str, Any]) -> None:
    try:
        from fedagent.extras import require

        require("matplotlib", "report", "the plot of bench/chaos.py")
    except Exception as exc:
        log(f"no plot: {exc}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    colors = {
        "kill": "red",
        "broker": "purple",
        "partition": "orange",
        "stop": "blue",
        "disk": "brown",
        "clock": "green",
    }
    prog = run["progress"][:: max(1, len(run["progress"]) // 4000)]
    ax1.plot([p["t"] / 60 for p in prog], [p["version"] for p in prog], color="black", lw=1, label="under faults")
    twin = run.get("twin_progress", [])[:: max(1, len(run.get("twin_progress", [])) // 4000)]
    if twin:
        ax1.plot([p["t"] / 60 for p in twin], [p["version"] for p in twin], color="grey", lw=1, ls="--", label="twin")
    ax1.set_ylabel("slowest agent's period" if run["settings"]["mode"] == "gossip" else "model version")
    for f in run["faults"]:
        end = (f["cleared"] or f["at"]) + (f["recovered"] or 0)
        for ax in (ax1, ax2):
            ax.axvspan(f["at"] / 60, max(end, f["at"] + 1) / 60, color=colors.get(f["kind"], "grey"), alpha=0.2, lw=0)
    for kind, c in colors.items():
        ax1.plot([], [], color=c, alpha=0.4, lw=6, label=kind)
    ax1.legend(loc="upper left", fontsize=8, ncol=6)
    ax1.set_title("faults (shaded: injected until recovered) and progress")
    names = sorted({n for s in run["samples"] for n in s["rss"]})
    for n in names:
        pts = [(s["t"] / 60, s["rss"][n] / MB) for s in run["samples"] if n in s["rss"]]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=n)
    ax2.set_ylabel("RSS (MB)")
    ax2.legend(loc="upper left", fontsize=7, ncol=4)
    rec = [f for f in run["faults"] if f["recovered"] is not None]
    ax3.scatter(
        [f["at"] / 60 for f in rec],
        [f["recovered"] for f in rec],
        c=[colors.get(f["kind"], "grey") for f in rec],
        s=18,
    )
    ax3.set_ylabel("recovery (s)")
    ax3.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for report.md, report.json, chaos.png")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mode", choices=sorted(SETUPS), default="fedavg")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5, help="digits shards' Dirichlet α (non-IID)")
    p.add_argument("--round-timeout", type=float, default=20.0)
    p.add_argument("--faults", default=",".join(KINDS), help="comma-separated kinds (default: all the machine allows)")
    p.add_argument(
        "--netns", choices=("auto", "on", "off"), default="auto", help="daemons in network namespaces (root)"
    )
    p.add_argument(
        "--minutes", type=float, default=30.0, help="length of the run, from the first progress (after start-up)"
    )
    p.add_argument(
        "--cycles",
        type=int,
        default=0,
        help="stop after this many rounds of every fault kind and a quiet stretch (0: run the whole time)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the first progress may take")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds from the first progress to the first fault")
    p.add_argument("--quiet", type=float, default=120.0, help="fault-free seconds at the end")
    p.add_argument("--gap-min", type=float, default=5.0)
    p.add_argument("--gap-max", type=float, default=20.0)
    p.add_argument("--restart-sec", type=float, default=5.0, help="delay before an exited daemon starts again")
    p.add_argument(
        "--hold-scale",
        type=float,
        default=1.0,
        help="scales how long broker, partition, stop, disk and clock faults last",
    )
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    p.add_argument("--tolerance", type=float, default=0.01, help="accuracy the run may lose to the fault-free one")
    p.add_argument(
        "--reference",
        choices=("twin", "none"),
        default="twin",
        help="run a fault-free twin federation beside the faulted one, for the accuracy check",
    )
    p.add_argument("--disk-mb", type=int, default=32, help="size of the small disk")
    p.add_argument("--sample-every", type=float, default=2.0)
    p.add_argument("--log-every", type=float, default=15.0)
    p.add_argument("--work", type=Path, help="keep the federation's files here (default: a temporary directory)")
    args = p.parse_args(argv)
    root = os.geteuid() == 0
    args.netns = args.netns == "on" or (args.netns == "auto" and root and shutil.which("ip") is not None)
    wanted = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = set(wanted) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds: {sorted(unknown)} (known: {', '.join(KINDS)})")
    skipped = []
    for k in list(wanted):
        if (k == "partition" and not args.netns) or (k == "disk" and not root):
            skipped.append(k)
    if skipped:
        log(f"skipping {', '.join(skipped)}: needs root (namespaces, a mount)")
    args.faults = [k for k in wanted if k not in skipped]
    return args


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    # Stopped from outside (SIGTERM, or SIGINT, which a shell's background job ignores):
    # unwind, so that daemons, namespaces and the small disk are cleaned up.
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        if args.work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedagent-chaos-")))
        else:
            work = args.work
            work.mkdir(parents=True, exist_ok=True)
        load_start = os.getloadavg()
        log(f"chaos run: {args.mode}, {args.minutes:g} min, seed {args.seed}, faults {', '.join(args.faults)}")
        out = run(args, work)
        out["invariants"] += common_invariants(out, args)
        out["load_start"] = [round(x, 1) for x in load_start]
        out["load_end"] = [round(x, 1) for x in os.getloadavg()]
        write_report(args.out, out)
    for inv in out["invariants"]:
        log(f"{'ok  ' if inv['ok'] else 'FAIL'} {inv['name']}: {json.dumps(inv['detail'], default=str)[:300]}")
    log(f"report: {args.out / 'report.md'}")
    return 0 if all(i["ok"] for i in out["invariants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
