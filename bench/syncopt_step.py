"""Sync-Opt step time, split into compute and communication.

A real federation on this machine: a private Mosquitto with mutual TLS, a coordinator
and 5 agent processes running ``mode = "syncopt"`` on ProdLDA with V = 5000 terms and
K = 50 topics (the paper's Sec. 4.1 sizes; a synthetic corpus with flat topics so that
every one of the 5000 terms occurs and the agreed vocabulary has exactly 5000), batch 64
per agent. Every step the coordinator broadcasts W (770,200 float32 parameters, 3.1 MB)
and receives 5 gradients of the same size.

Per step, from the daemons' own records:

* ``step``: wall time at the coordinator from broadcasting W(e) to having W(e+1);
* ``agents fwd/bwd``: the slowest agent's time to load W and compute its gradient
  (they run in parallel, so the slowest one is on the critical path);
* ``optimizer``: the coordinator's Adam step on the aggregate;
* ``communication``: the rest — encoding, TLS, the broker, decoding, validating and
  aggregating the gradients, and waiting; split further into the time until the last
  agent has decoded W, the time from the slowest agent's gradient being computed to the
  coordinator having all gradients (encode, send, broker, decode, validate, aggregate),
  and the coordinator's remainder (overlaps make it negative).

Run it (a few minutes; in the background on a shared machine)::

    nice -n 10 .venv/bin/python bench/syncopt_step.py --steps 40 > syncopt-bench.log 2>&1

Results vary with the machine's load; the script prints the load average with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: ``python bench/syncopt_step.py``
    sys.path.insert(0, str(ROOT))

from bench.registry import Context, Row, section, summary  # noqa: E402
from fedagent.local.federation import Federation  # noqa: E402
from fedagent.storage import history  # noqa: E402

AGENTS = 5
OPTIONS = {
    "corpus": "synthetic",
    "vocab_size": 5000,
    "true_topics": 50,
    "shared_topics": 10,
    "eta": 1.0,
    "docs": 400,
    "val_docs": 10,
    "n_topics": 50,
    "batch_size": 64,
    "seed": 0,
    "data_seed": 0,
}


def read_history(path: Path) -> list[dict]:
    return history.read_records(path)  # with its rotated files


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (all its threads) from /proc, 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(fed: Federation) -> dict[str, float]:
    """CPU seconds used so far by the coordinator, the agents together and the broker."""
    broker = getattr(fed.broker, "_proc", None)
    return {
        "coordinator": cpu_seconds(fed.proc("coordinator").popen.pid),
        "agents": sum(cpu_seconds(fed.proc(a).popen.pid) for a in fed.agent_ids),
        "broker": cpu_seconds(broker.pid if broker is not None else None),
    }


def measure(
    steps: int,
    warmup: int,
    work: Path,
    progress=None,
    agents: int = AGENTS,
    options: dict | None = None,
    chunk_bytes: int | None = None,
) -> dict[str, list[float] | int]:
    """Run the federation for ``steps`` steps under ``work``; per measured step (after
    ``warmup``), the parts listed in the module docstring, in seconds. ``agents`` and the
    task ``options`` (default :data:`OPTIONS`) make it smaller (the test suite's run).
    ``chunk_bytes``: ``[transfer] max_chunk_bytes`` of every node (default: the config's),
    so that W and the gradients travel as several chunks the broker relays one by one."""
    options = OPTIONS if options is None else options
    fed = Federation(work, agents=agents, rounds=1, alpha=0.0, agent_broker_by_mdns=False)
    started = time.monotonic()
    try:
        fed.prepare()
        fed.prepare_syncopt(
            "prodlda",
            lambda i: {**options, "shard": i, "shards": agents},
            {**options, "shard": 0, "shards": agents},
            {
                "steps": steps,
                "expected_agents": agents,
                "min_agents": agents,
                "step_timeout": 300.0,
                "on_fault": "abort",
                "checkpoint_every": steps,
            },
        )
        if chunk_bytes is not None:
            for stem in ["coordinator", *fed.agent_ids]:
                path = fed.config_path(stem)
                path.write_text(path.read_text() + f"\n[transfer]\nmax_chunk_bytes = {int(chunk_bytes)}\n")
        fed.start_all()
        cpu0: tuple[int, dict[str, float]] | None = None
        cpu1: tuple[int, dict[str, float]] | None = None
        while True:
            fed.check_alive()
            s = fed.status("coordinator")
            if s is not None:
                # CPU of the measured steps: sampled once past the warm-up and again at
                # the end (whole steps between the two samples, whichever they are).
                done = int(s.get("steps_done") or 0)
                if cpu0 is None and s["phase"] == "steps" and done > warmup:
                    cpu0 = (done, cpu_by_role(fed))
                if cpu0 is not None and cpu1 is None and s["phase"] == "done":
                    cpu1 = (done, cpu_by_role(fed))
                if progress is not None:
                    progress(
                        f"coordinator: {s['phase']}, step {s['step']}/{steps}, vocabulary {s.get('vocabulary_size')}"
                    )
                if s["phase"] in ("done", "aborted"):
                    break
            if time.monotonic() - started > 1800:
                raise SystemExit("the federation did not finish in 30 minutes")
            time.sleep(0.5)
        if s["phase"] != "done":
            raise SystemExit(f"Sync-Opt aborted: see {work / 'logs'}")
        # Agents flush their step records when the final model arrives.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            (fed.status(a) or {}).get("phase") == "finished" for a in fed.agent_ids
        ):
            time.sleep(0.2)
        coord = [
            r
            for r in read_history(work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl")
            if r.get("event") == "step"
        ]
        by_step: dict[int, list[dict]] = {}
        for aid in fed.agent_ids:
            for r in read_history(work / "state" / aid / "agent" / fed.fed / "history.jsonl"):
                if r.get("event") == "gradient":
                    by_step.setdefault(r["step"], []).append(r)
        full = [
            (r, by_step[r["step"]]) for r in coord if r["step"] > warmup and len(by_step.get(r["step"], [])) == agents
        ]
        if not full:
            raise SystemExit("no complete step records")
        step = [r["seconds"] for r, _ in full]
        cpu: dict[str, float] = {}
        if cpu0 is not None and cpu1 is not None and cpu1[0] > cpu0[0]:
            n = cpu1[0] - cpu0[0]
            cpu = {k: (cpu1[1][k] - cpu0[1][k]) / n for k in cpu0[1]}
        # CPU of the gradients themselves (thread time of the agents' worker threads),
        # summed over the agents: what the step costs the machine without any network.
        compute_cpu = [sum(a.get("compute_cpu_s", 0.0) for a in ags) for _, ags in full]
        fwd = [max(a["compute_s"] for a in ags) for _, ags in full]
        opt = [r["optimizer_s"] for r, _ in full]
        comm = [s_ - f - o for s_, f, o in zip(step, fwd, opt)]
        # Where the communication goes (same clock: every process runs on this machine).
        down = [max(a["received_t"] for a in ags) - r["started_t"] for r, ags in full]
        up = [r["last_gradient_t"] - max(a["computed_t"] for a in ags) for r, ags in full]
        other = [c - d - u for c, d, u in zip(comm, down, up)]
        return {
            "vocab": s.get("vocabulary_size"),
            "step": step,
            "fwd": fwd,
            "opt": opt,
            "comm": comm,
            "down": down,
            "up": up,
            "other": other,
            "cpu": cpu,
            "compute_cpu": compute_cpu,
            "total": time.monotonic() - started,
        }
    finally:
        fed.close()


def cpu_note(m: dict) -> str:
    cpu = m["cpu"]
    if not cpu:
        return ""
    parts = ", ".join(f"{k} {1000 * v:.0f}" for k, v in cpu.items())
    return f"; CPU ms per step: {parts} (gradients alone {1000 * statistics.median(m['compute_cpu']):.0f})"


@section("syncopt", rows=lambda ctx: 1)
def syncopt_section(
    ctx: Context, agents: int = AGENTS, options: dict | None = None, steps: tuple[int, int] | None = None
) -> list[Row]:
    """One Sync-Opt step against its own compute: the ratio is what the network part
    (W out, gradients in, over TLS and the broker) multiplies the step by. ``steps`` is
    (steps, warm-up steps left out)."""
    options = OPTIONS if options is None else options
    steps, warmup = steps or ((12, 3) if ctx.quick else (30, 5))
    m = measure(steps, warmup, ctx.work / "syncopt", progress=None, agents=agents, options=options)
    step_med, step_max = summary(m["step"])
    compute = [f + o for f, o in zip(m["fwd"], m["opt"])]
    comm_share = statistics.fmean(m["comm"]) / statistics.fmean(m["step"])
    return [
        Row(
            "syncopt",
            f"Sync-Opt step, {agents} agents, ProdLDA V={m['vocab']} K={options['n_topics']}",
            step_med,
            "compute only (slowest agent fwd/bwd + Adam)",
            statistics.median(compute),
            note=f"max {step_max:.2f} s; communication {comm_share:.0%} of the mean step "
            f"(W out median {1000 * statistics.median(m['down']):.0f} ms, gradients in "
            f"{1000 * statistics.median(m['up']):.0f} ms); {len(m['step'])} steps" + cpu_note(m),
        )
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the statistics")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--chunk-bytes", type=int, default=None, help="[transfer] max_chunk_bytes of every node (default 4 MiB)"
    )
    args = ap.parse_args()
    console = Console(width=max(120, Console().width))
    work = Path(tempfile.mkdtemp(prefix="fedagent-syncopt-bench-"))
    try:
        with console.status("starting 5 agents and the coordinator, vocabulary consensus, steps ...") as st:
            m = measure(args.steps, args.warmup, work, progress=st.update, chunk_bytes=args.chunk_bytes)
        step = m["step"]
        table = Table(
            title=f"Sync-Opt step, {AGENTS} agents, ProdLDA V={m['vocab']} K={OPTIONS['n_topics']}, batch "
            f"{OPTIONS['batch_size']}/agent, Mosquitto + mTLS, {len(step)} steps "
            f"(after {args.warmup} warm-up)",
            title_justify="left",
        )
        for col in ("part", "median ms", "mean ms", "p90 ms", "max ms", "share of mean step"):
            table.add_column(col, justify="left" if col == "part" else "right")
        mean_step = statistics.fmean(step)

        def row(name: str, xs: list[float]) -> None:
            q = sorted(xs)
            table.add_row(
                name,
                f"{1000 * statistics.median(xs):.1f}",
                f"{1000 * statistics.fmean(xs):.1f}",
                f"{1000 * q[int(0.9 * (len(q) - 1))]:.1f}",
                f"{1000 * max(xs):.1f}",
                f"{statistics.fmean(xs) / mean_step:.0%}",
            )

        row("step (coordinator wall time)", step)
        row("compute: agents fwd/bwd (slowest)", m["fwd"])
        row("compute: coordinator optimizer", m["opt"])
        row("communication (the rest)", m["comm"])
        row("  of which W to the last agent", m["down"])
        row("  of which gradients after the slowest agent", m["up"])
        row("  of which coordinator other (overlap < 0)", m["other"])
        console.print(table)
        nbytes = 4 * 770_200
        cpu, ccpu = m["cpu"], statistics.median(m["compute_cpu"])
        if cpu:
            total = sum(cpu.values())
            console.print(
                "CPU per step (all threads, from /proc): "
                + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in cpu.items())
                + f"; total {1000 * total:.1f} ms"
                + (
                    f" against {1000 * ccpu:.1f} ms of gradient computation (the agents' worker threads, "
                    f"summed), {total / ccpu:.2f}x"
                    if ccpu > 0
                    else ""
                )
            )
        console.print(
            f"per step: W broadcast once ({nbytes / 1e6:.1f} MB) to {AGENTS} agents, {AGENTS} gradients "
            f"of {nbytes / 1e6:.1f} MB back; load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs; total run {m['total']:.0f}s"
        )
        return 0
    finally:
        if args.keep:
            console.print(f"kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
