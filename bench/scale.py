"""How cost grows with the number of agents: many agents over one real broker.

Each agent has its own MQTT connection and certificate; the coordinator is the real
``fedagent coordinator`` process. Training is off (a numpy step), the model small, so
the figures are the framework's per-round cost. For every number of agents it reports
round time, the CPU per round of the coordinator, of Mosquitto and of the swarm (the
processes driving the agents, measured apart from the rest) as seconds and as a share of
one core (CPU / wall), and the peak RSS of the coordinator and of Mosquitto.

Run: ``python bench/scale.py [--agents 10,30,100,300,1000] [--procs 2] [--params 1000]
[--rounds 3] [--case-limit 900] [--json FILE] [--plot FILE.png]``; ``--plot`` alone with
``--from FILE.json`` redraws a plot from a saved run. Every case stops by itself within
its limit (connecting, then the rounds); a case that fails or overruns ``--budget`` ends
the sweep (larger cases would only take longer).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Run as a script (python bench/NAME.py), the checkout's root is not on the path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.swarm import run_federation  # noqa: E402


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _share(cpu: list[float], wall: list[float]) -> float | None:
    """Median share of one core: CPU seconds / wall seconds, per round."""
    return statistics.median(c / w for c, w in zip(cpu, wall, strict=True) if w > 0) if cpu and wall else None


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def measure(
    agents: list[int],
    params: int,
    rounds: int,
    compression: str,
    console,
    on_row=None,
    procs: int = 0,
    case_limit: float = 900.0,
    budget: float | None = None,
    tmp: Path | None = None,
) -> list[dict]:
    """One row per number of agents; ``procs`` swarm processes (0: this process). ``tmp``:
    where each case's directory (the coordinator's state and journals, the broker's) is
    made; the system's temporary directory if None."""
    rows = []
    for n in agents:
        with tempfile.TemporaryDirectory(prefix=f"fedagent-scale-{n}-", dir=tmp) as d:
            t = time.monotonic()
            load_before = _loadavg()
            try:
                r = run_federation(
                    Path(d),
                    agents=n,
                    params=params,
                    rounds=rounds,
                    compression=compression,
                    progress=lambda s, n=n: console.log(f"[{n}] {s}"),
                    timeout=case_limit,
                    connect_limit=case_limit,
                    procs=procs,
                )
            except Exception as exc:  # reported as a failed case; the sweep ends
                console.log(f"N={n}: failed: {type(exc).__name__}: {exc}")
                rows.append({"agents": n, "procs": procs, "params": params, "rounds": 0, "failed": str(exc)[:500]})
                if on_row is not None:
                    on_row(rows)
                break
            secs = r.round_seconds
            if len(secs) < rounds or r.errors:
                console.log(f"N={n}: {len(secs)}/{rounds} rounds, errors {r.errors[:3]}\n{r.coordinator_log}")
            cpu_c, cpu_b, cpu_s = _med(r.round_cpu), _med(r.round_cpu_broker), _med(r.round_cpu_agents)
            rows.append(
                {
                    "agents": n,
                    "procs": r.procs,
                    "state_on": str(tmp or tempfile.gettempdir()),
                    "params": params,
                    "compression": compression,
                    "rounds": len(secs),
                    "errors": len(r.errors),
                    "round_median_s": _med(secs),
                    "round_max_s": max(secs) if secs else None,
                    "per_agent_ms": 1000 * statistics.median(secs) / n if secs else None,
                    "coordinator_cpu_per_round_s": cpu_c,
                    "coordinator_cpu_per_update_ms": 1000 * cpu_c / n if cpu_c is not None else None,
                    "coordinator_core_share": _share(r.round_cpu, r.round_wall),
                    "broker_cpu_per_round_s": cpu_b,
                    "broker_cpu_per_update_ms": 1000 * cpu_b / n if cpu_b is not None else None,
                    "broker_core_share": _share(r.round_cpu_broker, r.round_wall),
                    "agents_cpu_per_round_s": cpu_s,
                    "swarm_cpu_per_agent_ms": 1000 * cpu_s / n if cpu_s is not None else None,
                    "swarm_core_share": _share(r.round_cpu_agents, r.round_wall),
                    "swarm_busiest_core_share": _share(r.round_cpu_swarm_max, r.round_wall),
                    "setup_s": r.setup_seconds,
                    "connect_s": r.connect_seconds,
                    "wall_s": time.monotonic() - t,
                    "coordinator_idle_rss_mb": r.rss_idle / 2**20,
                    "coordinator_peak_rss_mb": r.rss_peak / 2**20,
                    "broker_idle_rss_mb": r.broker_rss_idle / 2**20,
                    "broker_peak_rss_mb": r.broker_rss_peak / 2**20,
                    "broker_fds": r.broker_fds,
                    "coordinator_fds": r.coordinator_fds,
                    "loadavg_before": load_before,
                    "loadavg_after": _loadavg(),
                    "finished_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                }
            )
            if on_row is not None:
                on_row(rows)
            if len(secs) < rounds or (budget is not None and time.monotonic() - t > budget):
                console.log(f"N={n}: incomplete or over the budget ({time.monotonic() - t:.0f} s): sweep ends here")
                break
    return rows


def plot(rows: list[dict], out: Path, title: str = "") -> None:
    """Round time, CPU share of one core and peak RSS against the number of agents."""
    from fedagent.extras import require

    require("matplotlib", "report", "the plot of bench/scale.py")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("round_median_s")]

    def key(r: dict) -> tuple[int, str]:
        on = r.get("state_on", "")
        return r["procs"], "tmpfs" if on.startswith("/dev/shm") else "disk"

    groups = sorted({key(r) for r in ok})
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    (ax_t, ax_u), (ax_c, ax_m) = axes
    markers = ["o", "s", "^", "D"]
    styles = ["-", "--", "-.", ":"]
    for gi, g in enumerate(groups):
        p, on = g
        rs = sorted((r for r in ok if key(r) == g), key=lambda r: r["agents"])
        swarm = "swarm in the bench process" if p == 0 else f"swarm in {p} process{'es' if p > 1 else ''}"
        label = f"{swarm}, state on {on}"
        n = [r["agents"] for r in rs]
        m, ls = markers[gi % len(markers)], styles[gi % len(styles)]
        line = ax_t.plot(n, [r["round_median_s"] for r in rs], marker=m, ls=ls, label=f"median ({label})")
        ax_t.plot(n, [r["round_max_s"] for r in rs], marker=m, ls="none", alpha=0.5, color=line[0].get_color())
        suffix = "" if len(groups) == 1 else f" ({p} proc, {on})"
        for k, what, color in (
            ("coordinator_cpu_per_update_ms", "coordinator", "tab:blue"),
            ("broker_cpu_per_update_ms", "Mosquitto", "tab:red"),
            ("swarm_cpu_per_agent_ms", "swarm (the agents' side)", "tab:green"),
        ):
            ax_u.plot(n, [r[k] for r in rs], marker=m, ls=ls, color=color, label=what + suffix)
        for k, what, color in (
            ("broker_core_share", "Mosquitto", "tab:red"),
            ("coordinator_core_share", "coordinator", "tab:blue"),
            ("swarm_core_share", "swarm, all processes", "tab:green"),
            ("swarm_busiest_core_share", "swarm, busiest process", "tab:olive"),
        ):
            if k == "swarm_busiest_core_share" and p <= 1:
                continue
            ax_c.plot(n, [r[k] for r in rs], marker=m, ls=ls, color=color, label=what + suffix)
        ax_m.plot(
            n,
            [r["coordinator_peak_rss_mb"] for r in rs],
            marker=m,
            ls=ls,
            color="tab:blue",
            label="coordinator" + suffix,
        )
        ax_m.plot(
            n, [r["broker_peak_rss_mb"] for r in rs], marker=m, ls=ls, color="tab:red", label="Mosquitto" + suffix
        )
    if ok:
        lo, hi = min(r["agents"] for r in ok), max(r["agents"] for r in ok)
        base = min((r for r in ok if r["agents"] == lo), key=lambda r: r["round_median_s"])
        ax_t.plot(
            [lo, hi],
            [base["round_median_s"], base["round_median_s"] * hi / lo],
            color="grey",
            ls=":",
            lw=1,
            label=f"linear from {lo} agents",
        )
    ax_c.axhline(1.0, color="black", lw=0.8, ls=":")
    ax_c.text(ax_c.get_xlim()[0] if ok else 1, 1.02, "one core", fontsize=8)
    for ax, ylabel, t in (
        (ax_t, "seconds per round", "Round time"),
        (ax_u, "CPU ms per update (per agent for the swarm)", "CPU per update"),
        (ax_c, "CPU s / wall s during the rounds", "CPU, share of one core"),
        (ax_m, "MiB", "Peak RSS"),
    ):
        ax.set_xscale("log")
        ax.set_xlabel("agents (one broker)")
        ax.set_ylabel(ylabel)
        ax.set_title(t)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_yscale("log")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    cols = (
        ("agents", "agents", "{}"),
        ("procs", "swarm procs", "{}"),
        ("rounds", "rounds", "{}"),
        ("round_median_s", "median round (s)", "{:.2f}"),
        ("round_max_s", "max round (s)", "{:.2f}"),
        ("coordinator_cpu_per_update_ms", "coord CPU/update (ms)", "{:.2f}"),
        ("coordinator_core_share", "coord cores", "{:.2f}"),
        ("broker_cpu_per_update_ms", "broker CPU/update (ms)", "{:.2f}"),
        ("broker_core_share", "broker cores", "{:.2f}"),
        ("swarm_cpu_per_agent_ms", "swarm CPU/agent (ms)", "{:.2f}"),
        ("swarm_core_share", "swarm cores", "{:.2f}"),
        ("coordinator_peak_rss_mb", "coord peak RSS (MiB)", "{:.0f}"),
        ("broker_peak_rss_mb", "broker peak RSS (MiB)", "{:.0f}"),
        ("broker_fds", "broker FDs", "{}"),
        ("connect_s", "connect (s)", "{:.0f}"),
    )
    for _, head, _ in cols:
        t.add_column(head, justify="right")
    for r in rows:
        t.add_row(*("-" if r.get(k) is None else f.format(r[k]) for k, _, f in cols))
    return t


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="10,100,1000")
    ap.add_argument("--procs", type=int, default=0, help="swarm processes (0: the agents run in this process)")
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compression", default="none")
    ap.add_argument("--case-limit", type=float, default=900.0, help="seconds for connecting, and again for the rounds")
    ap.add_argument("--budget", type=float, default=None, help="no larger case after one that took longer (s)")
    ap.add_argument(
        "--tmp", type=Path, help="make each case's directory (coordinator state, journals) here, e.g. /dev/shm"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    ap.add_argument("--from", dest="source", type=Path, action="append", help="plot rows from saved JSON files")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    title = f"FedAvg round vs agents ({args.params} params, training off, mTLS, one Mosquitto)"
    if args.source:
        rows = [r for f in args.source for r in json.loads(f.read_text())]
    else:
        save = (lambda rows: args.json.write_text(json.dumps(rows, indent=2))) if args.json else None
        rows = measure(
            [int(x) for x in args.agents.split(",")],
            args.params,
            args.rounds,
            args.compression,
            console,
            on_row=save,
            procs=args.procs,
            case_limit=args.case_limit,
            budget=args.budget,
            tmp=args.tmp,
        )
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    Console(width=220).print(table(rows, title))
    Console().print(f"load average now: {_loadavg()} on {os.cpu_count()} CPUs (timings on a shared machine)")
    if args.plot:
        plot(rows, args.plot, title)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
