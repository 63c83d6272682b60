"""How cost grows over tiers: the light agents of ``bench/scale.py`` spread over site
brokers, against the same agents on one broker.

A tiered case is what the product runs (:mod:`fedagent.local.tiers`, docs/multisite.md):
a hub Mosquitto with the real ``fedagent coordinator`` (``[tier] sites = true``), and per
site its own Mosquitto (mutual TLS, the generated configuration) with a real ``fedagent
aggregator``, which is the coordinator of its site broker and, at the hub broker, one
participant with a certificate of role ``aggregator``. Nothing is bridged: the site
aggregator carries what crosses tiers. Agent k connects to site k mod S, so the sites
are even. The agents are :class:`bench.swarm.LightAgent` (own connection, certificate and
signing key each; a numpy step instead of training) in swarm child processes, at most
``--per-proc`` each (one process holds at most 1,000 connections: ``select()``). A flat
case is ``bench.swarm.run_federation``, as in ``bench/scale.py``.

Per case: the hub's round time (median, max; flat: the coordinator's), and between the
ends of consecutive hub rounds the CPU of the hub coordinator, of each site aggregator, of
each Mosquitto and of the swarm, from ``/proc/PID/stat`` (10 ms ticks); every process's
peak RSS (``VmHWM``; Mosquitto of a flat case: sampled every 10 ms) and its RSS once
connected. :func:`bench.scale_tiers_report.fits` fits the curves (hub CPU against sites and agents, a site
aggregator's CPU against its agents, a broker's CPU against its connections) and
:func:`bench.scale_tiers_report.report` writes the table, the targets and the projection to 100,000 and 1,000,000
agents with the arithmetic.

Run: ``python bench/scale_tiers.py [--flat 1000,3000] [--tiered 1000,3000,10000]
[--sites 10] [--sweep 2,5] [--rounds 3] [--json FILE] [--plot FILE.png] [--report
FILE.md]``; ``--from FILE.json`` redraws the plot and the report from a saved run. Every
case stops by itself (``--case-limit`` for the rounds, ``--connect-limit``, by default the
same, for connecting); a case that fails ends the sweep of its mode. While a tiered
case's agents connect, the connections the site brokers hold are counted every few
seconds (logged every 30 s, kept in the row as ``connect_progress``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

# Run as a script (python bench/NAME.py), the checkout's root is not on the path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import ProcessTree  # noqa: E402
from bench.scale_tiers_report import plot, report, table_md, targets  # noqa: E402
from bench.swarm import (  # noqa: E402
    COORDINATOR,
    FEDERATION,
    MAX_PER_PROCESS,
    _Children,
    _cpu,
    _fds,
    _raise_nofile,
    _rss,
    issue_many,
    run_federation,
)
from fedagent.local.tiers import site_name  # noqa: E402
from fedagent.mosquitto import EmbeddedBroker  # noqa: E402
from fedagent.security import pki  # noqa: E402
from fedagent.storage.history import read_records  # noqa: E402

HUB = COORDINATOR
MB = 2**20
PER_PROC = 750  # agents per swarm process: 1,000 agents in 2, 3,000 in 4, 10,000 in 14


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def swarm_procs(agents: int, per_proc: int = PER_PROC) -> int:
    return max(1, -(-agents // min(per_proc, MAX_PER_PROCESS)))


# ---- connecting ------------------------------------------------------------------------------
CONNECT_SAMPLE_S = 5.0  # how often the agents connected so far are counted
CONNECT_SAY_S = 30.0  # and how often that is logged


class Connections:
    """The agents' connections the site brokers hold, counted from their open descriptors
    (one per client) above what each held before the agents came; ``samples`` keeps
    ``[seconds since connecting began, connections]`` for the row. TLS handshakes to
    10,000 agents take minutes on two cores: the count shows whether they still advance."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = [p for p in pids if p]
        self.before = [_fds(p) for p in self.pids]
        self.samples: list[list[float]] = []

    def held(self) -> int:
        return sum(max(0, _fds(p) - b) for p, b in zip(self.pids, self.before, strict=True))

    def sample(self, seconds: float) -> int:
        held = self.held()
        self.samples.append([round(seconds, 1), held])
        return held


async def _watch_connect(counted: Connections, n: int, t0: float, progress: Callable[[str], None]) -> None:
    said = t0
    while True:
        await asyncio.sleep(CONNECT_SAMPLE_S)
        now = time.monotonic()
        held = counted.sample(now - t0)
        if now - said >= CONNECT_SAY_S:
            said = now
            progress(f"{held} of {n} agents connected after {now - t0:.0f} s; load {_loadavg()}")


# ---- one tiered federation ------------------------------------------------------------------
def _config(
    workdir: Path,
    run_root: Path,
    node_id: str,
    broker: str,
    params: int,
    compression: str,
    rounds: dict[str, Any],
    tier: dict[str, Any],
) -> Path:
    ca = workdir / "ca"
    cfg = {
        "id": node_id,
        "federation": FEDERATION,
        "mode": "fedavg",
        "state_dir": str(workdir / "state" / node_id),
        "runtime_dir": str(run_root / node_id),
        "metrics_port": -1,
        "torch_threads": 1,
        "broker": {"uri": broker},
        "tls": {"ca": str(ca / pki.CA_CERT), "cert": str(ca / f"{node_id}.crt"), "key": str(ca / f"{node_id}.key")},
        "discovery": {"interfaces": ["127.0.0.1"], "advertise": False},
        "task": {"name": "synthetic", "params": params, "tensors": 4, "train": False},
        "rounds": rounds,
        "transfer": {"compression": compression},
        "tier": tier,
    }
    path = workdir / f"{node_id}.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


def _history(workdir: Path, node_id: str) -> Path:
    return workdir / "state" / node_id / "coordinator" / FEDERATION / "history.jsonl"


async def _wait_ready(workdir: Path, procs: dict[str, Any], limit: float) -> None:
    """Until every daemon logged that it runs (model built, connected to its broker)."""
    deadline = time.monotonic() + limit
    waiting = dict(procs)
    while waiting:
        for name, p in list(waiting.items()):
            log = workdir / "logs" / f"{name}.log"
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            if log.exists() and f" {name} of federation ".encode() in log.read_bytes():
                del waiting[name]
        if time.monotonic() > deadline:
            raise TimeoutError(f"not started within {limit:.0f} s: {', '.join(sorted(waiting))}")
        await asyncio.sleep(0.1)


async def _tiered(
    workdir: Path,
    n: int,
    sites: int,
    params: int,
    rounds: int,
    compression: str,
    procs: int,
    progress: Callable[[str], None],
    timeout: float,
    connect_limit: float,
) -> dict:
    t0 = time.monotonic()
    # Where a case's wall time goes (seconds per step), for planning a run of many cases.
    phases: dict[str, float] = {}
    lap_at = [t0]

    def lap(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - lap_at[0], 1)
        lap_at[0] = now

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    site_ids = [site_name(s) for s in range(sites)]
    per_site = -(-n // sites)
    # The site brokers, started from here, inherit the limit: one descriptor per agent.
    _raise_nofile(2 * per_site + 256)
    ca = workdir / "ca"
    pki.create_ca(ca, FEDERATION)
    pki.issue(ca, ca, HUB, "coordinator")
    for site in site_ids:
        pki.issue(ca, ca, site, "coordinator")
        pki.issue(ca, ca, f"{site}-up", "aggregator")
    names = [f"a{i:05d}" for i in range(n)]
    site_of = {a: site_ids[i % sites] for i, a in enumerate(names)}
    members = {s: [a for a in names if site_of[a] == s] for s in site_ids}
    progress(f"issuing {n} agent certificates")
    await asyncio.to_thread(issue_many, ca, workdir / "certs", names)
    lap("certificates")
    brokers = {"hub": EmbeddedBroker(workdir / "broker-hub", federations=[FEDERATION], coordinators=[HUB], ca_dir=ca)}
    for site in site_ids:
        brokers[site] = EmbeddedBroker(
            workdir / f"broker-{site}", federations=[FEDERATION], coordinators=[site], ca_dir=ca, name=f"broker-{site}"
        )
    # The daemons' control sockets live under the runtime directory: a Unix socket's path
    # has at most 107 bytes, so a deep work directory gets a short one in /tmp.
    run_root = workdir / "run"
    short_run = len(str(run_root / "site-100" / "coordinator.sock").encode()) > 100
    if short_run:
        run_root = Path(tempfile.mkdtemp(prefix="fedagent-run-", dir="/tmp"))
    children = _Children()
    tree = ProcessTree()
    marks: list[tuple[float, float, list[float], list[float], list[float]]] = []
    done: list[dict] = []
    try:
        progress(f"starting {1 + sites} brokers")
        for b in brokers.values():
            await asyncio.to_thread(b.start)
        lap("brokers")
        limit = max(120.0, timeout)
        hub_cfg = _config(
            workdir,
            run_root,
            HUB,
            brokers["hub"].uri,
            params,
            compression,
            {
                "rounds": rounds,
                "min_agents": sites,
                "expected_agents": sites,
                "min_updates": 1,
                "start_grace": 0.0,
                "round_timeout": limit,
            },
            {"sites": True},
        )
        daemons: dict[str, Any] = {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NOTIFY_SOCKET", None)

        def spawn(name: str, command: str, cfg: Path) -> None:
            with (workdir / "logs" / f"{name}.log").open("wb") as out:
                daemons[name] = tree.spawn(
                    [sys.executable, "-m", "fedagent", command, "--config", str(cfg)],
                    stdout=out,
                    stderr=out,
                    env=env,
                )

        spawn(HUB, "coordinator", hub_cfg)
        for site in site_ids:
            cfg = _config(
                workdir,
                run_root,
                site,
                brokers[site].uri,
                params,
                compression,
                {
                    "min_agents": len(members[site]),
                    "expected_agents": len(members[site]),
                    "min_updates": 1,
                    "start_grace": 0.0,
                    "server_momentum": 0.0,  # a site averages plainly; the hub moves the model
                    "round_timeout": limit,
                },
                {
                    "upstream": brokers["hub"].uri,
                    "upstream_id": f"{site}-up",
                    "upstream_cert": str(ca / f"{site}-up.crt"),
                    "upstream_key": str(ca / f"{site}-up.key"),
                },
            )
            spawn(site, "aggregator", cfg)
        progress(f"starting the hub coordinator and {sites} site aggregators")
        await _wait_ready(workdir, daemons, 300.0)
        lap("daemons")
        await asyncio.sleep(0.5)
        idle = {name: _rss(p.pid)[0] for name, p in daemons.items()}
        broker_idle = {k: _rss(b.pid)[0] if b.pid else 0 for k, b in brokers.items()}
        samples_of = {a: 50 + i % 100 for i, a in enumerate(names)}
        shares = [[[a, samples_of[a], brokers[site_of[a]].uri] for a in names[k::procs]] for k in range(procs)]
        common = {
            "broker": brokers["hub"].uri,  # every member names its own (its site's)
            "ca": str(ca / pki.CA_CERT),
            "certs": str(workdir / "certs"),
            "whole": False,
            "max_chunk": 4 * MB,
            "wave_limit": min(300.0, connect_limit),
        }
        progress(f"connecting {n} agents to {sites} site brokers from {procs} processes")
        site_pids = [brokers[s].pid or 0 for s in site_ids]
        counted = Connections(site_pids)
        t_connect = time.monotonic()
        watch = asyncio.create_task(_watch_connect(counted, n, t_connect, progress))
        try:
            await asyncio.wait_for(children.start(workdir, shares, common, connect_limit), connect_limit)
        except TimeoutError:
            held = counted.held()
            raise TimeoutError(
                f"{held} of {n} agents connected to the site brokers after {time.monotonic() - t_connect:.0f} s "
                f"(limit {connect_limit:.0f} s; load {_loadavg()}); progress {counted.samples[-6:]}"
            ) from None
        finally:
            watch.cancel()
        connect_s = time.monotonic() - t_connect
        counted.sample(connect_s)
        lap_at[0] = t_connect
        lap("connect")
        fds = {k: _fds(b.pid) for k, b in brokers.items()}
        progress(f"{n} agents online ({time.monotonic() - t0:.0f} s); waiting for {rounds} hub rounds")
        hub = daemons[HUB]
        history = _history(workdir, HUB)
        broker_pids = [b.pid or 0 for b in brokers.values()]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in daemons.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} during the rounds")
            if history.exists():
                done = read_records(history)
            finished = sum(1 for r in done if r.get("event") == "round")
            if finished > len(marks):
                mark = (
                    time.monotonic(),
                    _cpu(hub.pid),
                    [_cpu(daemons[s].pid) for s in site_ids],
                    [_cpu(pid) for pid in broker_pids],
                    [_cpu(pid) for pid in children.pids],
                )
                last = [r for r in done if r.get("event") == "round"][-1]
                progress(
                    f"hub round {finished}/{rounds}: {last.get('seconds', 0):.1f} s, "
                    f"{len(last.get('participants', []))} sites; load {_loadavg()}"
                )
                marks += [mark] * (finished - len(marks))
            if finished >= rounds:
                break
            if any(r.get("event") == "abandoned" for r in done):
                progress(f"a hub round was abandoned: {next(r for r in done if r.get('event') == 'abandoned')}")
                break
            await asyncio.sleep(0.05)
        lap("rounds")  # the first one's start included
        peak = {name: _rss(p.pid)[1] for name, p in daemons.items()}
        broker_peak = {k: _rss(b.pid)[1] if b.pid else 0 for k, b in brokers.items()}
        swarm_peak = [_rss(pid)[1] for pid in children.pids]
    finally:
        try:
            await children.stop()
        finally:
            children.kill()
            await asyncio.to_thread(tree.close)
            for b in brokers.values():
                b.stop()
            if short_run:
                shutil.rmtree(run_root, ignore_errors=True)
    lap("stop")
    progress(f"stopped in {phases['stop']:.0f} s; seconds per step: {phases}")
    rounds_done = [r for r in done if r.get("event") == "round"]
    pairs = list(itertools.pairwise(marks))
    site_seconds = {}
    for s in site_ids:
        recs = read_records(_history(workdir, s)) if _history(workdir, s).exists() else []
        site_seconds[s] = _med([r["seconds"] for r in recs if r.get("event") == "site_round"])
    broker_names = ["hub", *site_ids]
    return {
        "mode": "tiered",
        "agents": n,
        "sites": sites,
        "agents_per_site": per_site,
        "procs": procs,
        "params": params,
        "compression": compression,
        "rounds": len(rounds_done),
        "errors": children.error_count,
        "error_sample": children.errors[:3],
        "participants": [len(r.get("participants", [])) for r in rounds_done],
        "round_s": [r["seconds"] for r in rounds_done],
        "site_round_median_s": site_seconds,
        "wall_per_round_s": _med([b[0] - a[0] for a, b in pairs]),
        "hub_cpu_per_round_s": _med([b[1] - a[1] for a, b in pairs]),
        "aggregators_cpu_per_round_s": {s: _med([b[2][i] - a[2][i] for a, b in pairs]) for i, s in enumerate(site_ids)},
        "brokers_cpu_per_round_s": {k: _med([b[3][i] - a[3][i] for a, b in pairs]) for i, k in enumerate(broker_names)},
        "swarm_cpu_per_round_s": _med([sum(b[4]) - sum(a[4]) for a, b in pairs]),
        "swarm_busiest_cpu_per_round_s": _med([max(y - x for x, y in zip(a[4], b[4], strict=True)) for a, b in pairs]),
        "idle_rss_mb": {
            **{k: v / MB for k, v in idle.items()},
            **{f"broker-{k}": v / MB for k, v in broker_idle.items()},
        },
        "peak_rss_mb": {
            **{k: v / MB for k, v in peak.items()},
            **{f"broker-{k}": v / MB for k, v in broker_peak.items()},
            **{f"swarm-{k}": v / MB for k, v in enumerate(swarm_peak)},
        },
        "broker_fds": fds,
        "connect_s": connect_s,
        "connect_progress": counted.samples,
        "phases_s": phases,
        "setup_s": time.monotonic() - t0 - sum(b[0] - a[0] for a, b in pairs),
    }


def run_tiers(
    workdir: Path,
    *,
    agents: int,
    sites: int = 10,
    params: int = 1000,
    rounds: int = 3,
    compression: str = "none",
    procs: int | None = None,
    progress: Callable[[str], None] = lambda s: None,
    timeout: float = 900.0,
    connect_limit: float = 900.0,
) -> dict:
    """One tiered federation (see the module's text); the row :func:`measure` reports."""
    if not 1 <= sites <= agents:
        raise ValueError(f"{sites} sites for {agents} agents: every site needs an agent")
    procs = procs or swarm_procs(agents)
    if -(-agents // procs) > MAX_PER_PROCESS:
        raise ValueError(f"{agents} agents in {procs} processes: at most {MAX_PER_PROCESS} fit one process")
    return asyncio.run(
        _tiered(Path(workdir), agents, sites, params, rounds, compression, procs, progress, timeout, connect_limit)
    )


def _flat(
    workdir: Path, n: int, params: int, rounds: int, compression: str, procs: int, progress, limit, connect_limit
) -> dict:
    r = run_federation(
        workdir,
        agents=n,
        params=params,
        rounds=rounds,
        compression=compression,
        progress=progress,
        timeout=limit,
        connect_limit=connect_limit,
        procs=procs,
    )
    return {
        "mode": "flat",
        "agents": n,
        "sites": 0,
        "agents_per_site": n,
        "procs": r.procs,
        "params": params,
        "compression": compression,
        "rounds": len(r.round_seconds),
        "errors": len(r.errors),
        "error_sample": r.errors[:3],
        "participants": [len(x.get("participants", [])) for x in r.rounds if x.get("event") == "round"],
        "round_s": r.round_seconds,
        "site_round_median_s": {},
        "wall_per_round_s": _med(r.round_wall),
        "hub_cpu_per_round_s": _med(r.round_cpu),
        "aggregators_cpu_per_round_s": {},
        "brokers_cpu_per_round_s": {"broker": _med(r.round_cpu_broker)},
        "swarm_cpu_per_round_s": _med(r.round_cpu_agents),
        "swarm_busiest_cpu_per_round_s": _med(r.round_cpu_swarm_max),
        "idle_rss_mb": {HUB: r.rss_idle / MB, "broker-broker": r.broker_rss_idle / MB},
        "peak_rss_mb": {
            HUB: r.hwm / MB,
            "broker-broker": r.broker_rss_peak / MB,
            **{f"swarm-{k}": v / MB for k, v in enumerate(r.swarm_rss_peak)},
        },
        "broker_fds": {"broker": r.broker_fds},
        "connect_s": r.connect_seconds,
        "setup_s": r.setup_seconds,
        "log_tail": r.coordinator_log[-1500:] if len(r.round_seconds) < rounds else "",
    }


def derive(row: dict) -> dict:
    """The figures every table and target reads, from a measured row."""
    secs = row.get("round_s") or []
    out = dict(row)
    out["round_median_s"] = _med(secs)
    out["round_max_s"] = max(secs) if secs else None
    aggs = [v for v in row.get("aggregators_cpu_per_round_s", {}).values() if v is not None]
    brokers = row.get("brokers_cpu_per_round_s", {})
    sites = [v for k, v in brokers.items() if k not in ("hub", "broker") and v is not None]
    hub, swarm, wall = row.get("hub_cpu_per_round_s"), row.get("swarm_cpu_per_round_s"), row.get("wall_per_round_s")
    out["aggregator_cpu_per_round_median_s"] = _med(aggs)
    out["aggregator_cpu_per_round_max_s"] = max(aggs) if aggs else None
    out["site_broker_cpu_per_round_median_s"] = _med(sites)
    out["site_broker_cpu_per_round_max_s"] = max(sites) if sites else None
    out["hub_broker_cpu_per_round_s"] = brokers.get("hub", brokers.get("broker"))
    if hub is not None and swarm is not None:
        total = hub + sum(aggs) + sum(v for v in brokers.values() if v is not None) + swarm
        out["total_cpu_per_round_s"] = total
        out["swarm_cpu_share"] = swarm / total if total else None
        out["cores_busy"] = total / wall if wall else None
        out["swarm_cpu_per_agent_ms"] = 1000 * swarm / row["agents"]
    peaks = row.get("peak_rss_mb", {})
    kinds: dict[str, list[float]] = {}
    for name, mb in peaks.items():
        kind = (
            "swarm process"
            if name.startswith("swarm-")
            else "hub broker"
            if name in ("broker-hub", "broker-broker")
            else "site broker"
            if name.startswith("broker-")
            else "hub coordinator"
            if name == HUB
            else "site aggregator"
        )
        kinds.setdefault(kind, []).append(mb)
    out["peak_rss_by_kind_mb"] = {
        k: {"max": max(v), "median": statistics.median(v), "count": len(v)} for k, v in kinds.items()
    }
    out["peak_rss_total_mb"] = sum(peaks.values())
    return out


# ---- the sweep -----------------------------------------------------------------------------
def measure(
    flat: list[int],
    tiered: list[int],
    sites: int,
    console,
    *,
    sweep: tuple[int, ...] | list[int] = (),
    sweep_agents: int | None = None,
    params: int = 1000,
    rounds: int = 3,
    compression: str = "none",
    per_proc: int = PER_PROC,
    case_limit: float = 900.0,
    connect_limit: float | None = None,
    tmp: Path | None = None,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Flat cases, the smallest tiered case over ``sites`` sites, ``sweep_agents``
    (default: that case's agents) over each number of sites in ``sweep``, then the larger
    tiered cases, the largest last. A failed or incomplete case ends the cases of its kind
    (flat, tiered, the sweep): larger ones would only take longer. ``case_limit`` bounds a
    case's rounds, ``connect_limit`` (default: ``case_limit``) the connecting of its agents."""
    connect_limit = connect_limit or case_limit
    tiered = sorted(tiered)
    cases = [("flat", "flat", n, 0) for n in sorted(flat)] + [("tiered", "tiered", n, sites) for n in tiered[:1]]
    extra = sweep_agents or (tiered[0] if tiered else None)
    if extra is not None:
        cases += [("sweep", "tiered", extra, s) for s in sweep if s != sites or extra not in tiered]
    cases += [("tiered", "tiered", n, sites) for n in tiered[1:]]
    rows: list[dict] = []
    stopped: set[str] = set()
    for kind, mode, n, s in cases:
        if kind in stopped:
            continue
        procs = swarm_procs(n, per_proc)
        label = f"{mode} {n}" + (f"/{s} sites" if s else "")
        t = time.monotonic()
        load = _loadavg()
        with tempfile.TemporaryDirectory(prefix=f"fedagent-tiers-{n}-", dir=tmp) as d:

            def progress(msg: str, label: str = label) -> None:
                console.log(f"{label}: {msg}")

            try:
                if mode == "flat":
                    row = _flat(Path(d), n, params, rounds, compression, procs, progress, case_limit, connect_limit)
                else:
                    row = run_tiers(
                        Path(d),
                        agents=n,
                        sites=s,
                        params=params,
                        rounds=rounds,
                        compression=compression,
                        procs=procs,
                        progress=progress,
                        timeout=case_limit,
                        connect_limit=connect_limit,
                    )
            except Exception as exc:  # reported as a failed case
                console.log(f"{label}: failed: {type(exc).__name__}: {exc}")
                row = {"mode": mode, "agents": n, "sites": s, "procs": procs, "rounds": 0, "failed": str(exc)[:800]}
            row.update(
                state_on=str(tmp or tempfile.gettempdir()),
                wall_s=time.monotonic() - t,
                loadavg_before=load,
                loadavg_after=_loadavg(),
                finished_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            )
            # Saved before the case's directory is removed: removing 10,000 certificates on
            # a loaded machine takes a while, and an interrupt then lost the row once.
            rows.append(derive(row))
            if on_row is not None:
                on_row(rows)
            saved = time.monotonic()
        end = time.monotonic()
        console.log(f"{label}: {end - t:.0f} s in all, {end - saved:.0f} s of it removing its directory")
        if row.get("failed") or row["rounds"] < rounds:
            console.log(f"{label}: {row['rounds']}/{rounds} rounds: no larger {kind} case")
            stopped.add(kind)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flat", default="1000,3000", help="flat cases (agents on one broker); empty: none")
    ap.add_argument("--tiered", default="1000,3000,10000", help="tiered cases (agents over --sites sites)")
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--sweep", default="2,5", help="more numbers of sites for the smallest tiered case")
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compression", default="none")
    ap.add_argument("--per-proc", type=int, default=PER_PROC, help="agents per swarm process (at most 1000)")
    ap.add_argument("--case-limit", type=float, default=900.0, help="seconds for a case's rounds (and its connecting)")
    ap.add_argument(
        "--connect-limit", type=float, help="seconds for connecting a case's agents (default: --case-limit)"
    )
    ap.add_argument("--tmp", type=Path, help="make each case's directory here")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    ap.add_argument("--report", type=Path, help="write the report (markdown) here")
    ap.add_argument("--from", dest="source", type=Path, action="append", help="rows from saved JSON files")
    args = ap.parse_args(argv)
    console = Console(stderr=True)

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    if args.source:
        rows = [derive(r) for f in args.source for r in json.loads(f.read_text())]
    else:
        save = (lambda rows: args.json.write_text(json.dumps(rows, indent=2))) if args.json else None
        rows = measure(
            ints(args.flat),
            ints(args.tiered),
            args.sites,
            console,
            sweep=ints(args.sweep),
            params=args.params,
            rounds=args.rounds,
            compression=args.compression,
            per_proc=args.per_proc,
            case_limit=args.case_limit,
            connect_limit=args.connect_limit,
            tmp=args.tmp,
            on_row=save,
        )
    Console(width=240).print(table_md(rows))
    for t in targets(rows):
        Console().print(f"{'MET' if t['met'] else 'NOT MET'}: {t['target']}: {t['measured']}")
    Console().print(f"load average now: {_loadavg()} on {os.cpu_count()} CPUs")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report(rows, "python bench/scale_tiers.py " + " ".join(argv or sys.argv[1:])))
    if args.plot:
        plot(rows, args.plot, f"Flat vs tiered FedAvg rounds ({args.params} params, training off, mTLS)")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
