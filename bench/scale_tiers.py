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
connected. :func:`fits` fits the curves (hub CPU against sites and agents, a site
aggregator's CPU against its agents, a broker's CPU against its connections) and
:func:`report` writes the table, the targets and the projection to 100,000 and 1,000,000
agents with the arithmetic.

Run: ``python bench/scale_tiers.py [--flat 1000,3000] [--tiered 1000,3000,10000]
[--sites 10] [--sweep 2,5] [--rounds 3] [--json FILE] [--plot FILE.png] [--report
FILE.md]``; ``--from FILE.json`` redraws the plot and the report from a saved run. Every
case stops by itself (``--case-limit`` for connecting and again for the rounds); a case
that fails ends the sweep of its mode.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

# Run as a script (python bench/NAME.py), the checkout's root is not on the path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import ProcessTree  # noqa: E402
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
        t_connect = time.monotonic()
        await asyncio.wait_for(children.start(workdir, shares, common, connect_limit), connect_limit)
        connect_s = time.monotonic() - t_connect
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
        "errors": len(children.errors),
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


def _flat(workdir: Path, n: int, params: int, rounds: int, compression: str, procs: int, progress, limit) -> dict:
    r = run_federation(
        workdir,
        agents=n,
        params=params,
        rounds=rounds,
        compression=compression,
        progress=progress,
        timeout=limit,
        connect_limit=limit,
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
    tmp: Path | None = None,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Flat cases, the smallest tiered case over ``sites`` sites, ``sweep_agents``
    (default: that case's agents) over each number of sites in ``sweep``, then the larger
    tiered cases, the largest last. A failed or incomplete case ends the cases of its kind
    (flat, tiered, the sweep): larger ones would only take longer."""
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
                    row = _flat(Path(d), n, params, rounds, compression, procs, progress, case_limit)
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
                        connect_limit=case_limit,
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
        if row.get("failed") or row["rounds"] < rounds:
            console.log(f"{label}: {row['rounds']}/{rounds} rounds: no larger {kind} case")
            stopped.add(kind)
    return rows


# ---- fits, targets, projection -------------------------------------------------------------
def _linear(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = a + b·x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def _quadratic0(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = b·x + c·x² (no constant: a broker without connections relays nothing)."""
    if len(set(xs)) < 2:
        return None
    x = np.asarray(xs, float)
    (b, c), *_ = np.linalg.lstsq(np.stack([x, x * x], axis=1), np.asarray(ys, float), rcond=None)
    return float(b), float(c)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("round_median_s") is not None and r.get("hub_cpu_per_round_s") is not None]


def fits(rows: list[dict]) -> dict[str, Any]:
    ok = _ok(rows)
    tiered = [r for r in ok if r["mode"] == "tiered"]
    flat = [r for r in ok if r["mode"] == "flat"]
    out: dict[str, Any] = {}
    out["hub_vs_sites"] = _linear([r["sites"] for r in tiered], [r["hub_cpu_per_round_s"] for r in tiered])
    most = max((r["sites"] for r in tiered), default=0)
    at_most = [r for r in tiered if r["sites"] == most]
    out["hub_vs_agents_tiered"] = _linear([r["agents"] for r in at_most], [r["hub_cpu_per_round_s"] for r in at_most])
    out["hub_vs_agents_flat"] = _linear([r["agents"] for r in flat], [r["hub_cpu_per_round_s"] for r in flat])
    pts = [
        (r["agents"] / r["sites"], v)
        for r in tiered
        for v in r["aggregators_cpu_per_round_s"].values()
        if v is not None
    ]
    out["aggregator_vs_agents"] = _linear([p[0] for p in pts], [p[1] for p in pts])
    bpts = [
        (r["agents"] / r["sites"] + 1, v)
        for r in tiered
        for k, v in r["brokers_cpu_per_round_s"].items()
        if k != "hub" and v is not None
    ] + [(r["agents"] + 1, r["brokers_cpu_per_round_s"]["broker"]) for r in flat]
    out["broker_vs_connections"] = _quadratic0([p[0] for p in bpts], [p[1] for p in bpts])
    out["hub_broker_vs_sites"] = _linear(
        [r["sites"] for r in tiered], [r["brokers_cpu_per_round_s"]["hub"] for r in tiered]
    )
    mem = [(r["agents"] / r["sites"], v) for r in tiered for k, v in r["peak_rss_mb"].items() if k.startswith("site-")]
    out["aggregator_rss_vs_agents"] = _linear([p[0] for p in mem], [p[1] for p in mem])
    bmem = [
        (r["agents"] / r["sites"] + 1, v)
        for r in tiered
        for k, v in r["peak_rss_mb"].items()
        if k.startswith("broker-site-")
    ] + [(r["agents"] + 1, r["peak_rss_mb"]["broker-broker"]) for r in flat]
    out["broker_rss_vs_connections"] = _linear([p[0] for p in bmem], [p[1] for p in bmem])
    sw = [(r["agents"] / r["sites"], r["swarm_cpu_per_agent_ms"]) for r in tiered] + [
        (r["agents"], r["swarm_cpu_per_agent_ms"]) for r in flat
    ]
    out["swarm_per_agent_vs_cohort"] = _linear([p[0] for p in sw], [p[1] for p in sw])
    out["hub_peak_rss_mb"] = max((r["peak_rss_mb"].get(HUB, 0) for r in tiered), default=None)
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The two targets, against the largest tiered case and the largest flat one."""
    ok = _ok(rows)
    tiered = [r for r in ok if r["mode"] == "tiered"]
    flat = [r for r in ok if r["mode"] == "flat"]
    out = []
    if tiered and flat:
        t = max(tiered, key=lambda r: (r["agents"], r["sites"]))
        f = max(flat, key=lambda r: r["agents"])
        ratio = t["hub_cpu_per_round_s"] / f["hub_cpu_per_round_s"] if f["hub_cpu_per_round_s"] else math.nan
        out.append(
            {
                "target": f"hub CPU per round at {t['agents']:,} tiered ≤ 1/10 of the flat coordinator's at "
                f"{f['agents']:,}",
                "measured": f"{t['hub_cpu_per_round_s']:.3f} s / {f['hub_cpu_per_round_s']:.3f} s = {ratio:.3f}",
                "met": bool(ratio <= 0.1),
            }
        )
    if tiered:
        t = max(tiered, key=lambda r: (r["agents"], r["sites"]))
        share = t.get("swarm_cpu_share") or 0.0
        others = t["total_cpu_per_round_s"] - t["swarm_cpu_per_round_s"]
        biggest = max(
            [
                t["hub_cpu_per_round_s"],
                *t["aggregators_cpu_per_round_s"].values(),
                *t["brokers_cpu_per_round_s"].values(),
            ]
        )
        out.append(
            {
                "target": f"a {t['agents']:,}-agent round is bounded by the agents' own CPU",
                "measured": f"swarm {t['swarm_cpu_per_round_s']:.1f} s of {t['total_cpu_per_round_s']:.1f} s CPU "
                f"per round ({100 * share:.0f}%; every other process together {others:.1f} s, the "
                f"largest {biggest:.1f} s); {_f(t.get('cores_busy'))} of {os.cpu_count()} cores busy over the round",
                "met": share > 0.5,
            }
        )
    return out


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def table_md(rows: list[dict]) -> str:
    head = (
        "| case | swarm procs | rounds | median / max round | hub CPU / round | site aggregator CPU / round "
        "(median / max) | hub broker CPU / round | site broker CPU / round (median / max) | swarm CPU / round | "
        "swarm share of CPU | cores busy | connect |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        case = f"flat {r['agents']:,}" if r["mode"] == "flat" else f"tiered {r['agents']:,} / {r['sites']} sites"
        if r.get("round_median_s") is None or r.get("hub_cpu_per_round_s") is None:
            why = r.get("failed") or f"{r.get('errors', 0)} errors, {r.get('error_sample')}"
            lines.append(f"| {case} | {r.get('procs', '–')} | {r.get('rounds', 0)} | failed: {why[:120]} |")
            continue
        lines.append(
            f"| {case} | {r['procs']} | {r['rounds']} | {r['round_median_s']:.2f} / {r['round_max_s']:.2f} s | "
            f"{_f(r['hub_cpu_per_round_s'])} s | "
            + (
                f"{_f(r['aggregator_cpu_per_round_median_s'])} / {_f(r['aggregator_cpu_per_round_max_s'])} s"
                if r["mode"] == "tiered"
                else "–"
            )
            + f" | {_f(r['hub_broker_cpu_per_round_s'])} s | "
            + (
                f"{_f(r['site_broker_cpu_per_round_median_s'])} / {_f(r['site_broker_cpu_per_round_max_s'])} s"
                if r["mode"] == "tiered"
                else "–"
            )
            + f" | {_f(r['swarm_cpu_per_round_s'])} s | {_f(r.get('swarm_cpu_share'), '{:.0%}')} | "
            f"{_f(r.get('cores_busy'))} | {r['connect_s']:.0f} s |"
        )
    return "\n".join(lines)


def rss_md(rows: list[dict]) -> str:
    kinds = ["hub coordinator", "site aggregator", "hub broker", "site broker", "swarm process"]
    lines = [
        "| case | " + " | ".join(f"{k} peak RSS" for k in kinds) + " | all processes |",
        "|---|" + "---:|" * (len(kinds) + 1),
    ]
    for r in _ok(rows):
        case = f"flat {r['agents']:,}" if r["mode"] == "flat" else f"tiered {r['agents']:,} / {r['sites']} sites"
        by = r["peak_rss_by_kind_mb"]
        cells = []
        for k in kinds:
            v = by.get(k)
            if v is None:
                cells.append("–")
            elif v["count"] == 1:
                cells.append(f"{v['max']:.0f} MiB")
            else:
                cells.append(f"{v['median']:.0f} / {v['max']:.0f} MiB (×{v['count']})")
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {r['peak_rss_total_mb'] / 1024:.2f} GiB |")
    return (
        "\n".join(lines) + "\n\n(median / max over the processes of a kind; flat: the coordinator is the hub's column)"
    )


def projection(fit: dict[str, Any], site_agents: int = 1000, fan_in: int | None = None) -> str:
    """What 100,000 and 1,000,000 agents would need, from the fitted constants, with the
    arithmetic: sites of ``site_agents`` agents, at most ``fan_in`` members per
    coordinator above the sites (regions between the hub and the sites beyond that).
    ``fan_in`` None: as many members as keep a tier above the sites within a site
    aggregator's CPU per round, so that no tier above paces the round."""
    hub, agg, brk = fit.get("hub_vs_sites"), fit.get("aggregator_vs_agents"), fit.get("broker_vs_connections")
    amem, bmem = fit.get("aggregator_rss_vs_agents"), fit.get("broker_rss_vs_connections")
    if not (hub and agg and brk and amem and bmem):
        return "(not enough measured cases to fit the curves)"
    a_h, b_h = hub
    a_s, b_s = agg
    b_b, c_b = brk
    a_m, b_m = amem
    a_bm, b_bm = bmem
    lines = []
    n_s = site_agents
    site_cpu = a_s + b_s * n_s
    if fan_in is None:
        fan_in = max(2, int((site_cpu - a_h) / b_h)) if b_h > 0 else 10**6
        lines.append(
            f"Members per coordinator above the sites: at most ({site_cpu:.2f} s − {a_h:.3f} s) / "
            f"{b_h * 1000:.2f} ms = {fan_in:,}, the number whose CPU per round equals a site aggregator's at "
            f"{n_s:,} agents ({a_s:.3f} s + {b_s * 1000:.3f} ms × {n_s:,} = {site_cpu:.2f} s).\n"
        )
    broker_cpu = b_b * (n_s + 1) + c_b * (n_s + 1) ** 2
    site_mem = a_m + b_m * n_s
    broker_mem = a_bm + b_bm * (n_s + 1)
    for total in (100_000, 1_000_000):
        sites = total // n_s
        lines.append(f"**{total:,} agents**, sites of {n_s:,} agents: S = {total:,} / {n_s:,} = {sites:,} sites.")
        lines.append(
            f"- per site: aggregator CPU per round {a_s:.3f} s + {b_s * 1000:.3f} ms × {n_s:,} = {site_cpu:.2f} s; "
            f"its Mosquitto {b_b * 1000:.4f} ms × {n_s + 1:,} + {c_b * 1e6:.5f} µs × {n_s + 1:,}² = {broker_cpu:.2f} s; "
            f"memory {a_m:.0f} MiB + {b_m * 1024:.1f} KiB × {n_s:,} = {site_mem:.0f} MiB (aggregator) + "
            f"{a_bm:.1f} MiB + {b_bm * 1024:.1f} KiB × {n_s + 1:,} = {broker_mem:.0f} MiB (broker)"
        )
        if sites <= fan_in:
            hub_cpu = a_h + b_h * sites
            lines.append(
                f"- two tiers: {sites:,} site brokers + 1 hub broker ({sites + 1:,} Mosquittos); the hub's CPU per "
                f"round {a_h:.3f} s + {b_h * 1000:.2f} ms × {sites:,} = {hub_cpu:.2f} s; the hub broker holds "
                f"{sites:,} connections"
            )
        else:
            regions = math.ceil(sites / fan_in)
            per_region = math.ceil(sites / regions)
            region_cpu = a_h + b_h * per_region
            hub_cpu = a_h + b_h * regions
            lines.append(
                f"- {sites:,} members at one hub would cost {a_h:.3f} s + {b_h * 1000:.2f} ms × {sites:,} = "
                f"{a_h + b_h * sites:.2f} s a round; with at most {fan_in} members per coordinator: three tiers, "
                f"{regions} regions of {per_region} sites (⌈{sites:,} / {fan_in}⌉ = {regions}); a region aggregator "
                f"{a_h:.3f} s + {b_h * 1000:.2f} ms × {per_region} = {region_cpu:.2f} s a round, the hub {a_h:.3f} s + "
                f"{b_h * 1000:.2f} ms × {regions} = {hub_cpu:.2f} s; Mosquittos: {sites:,} site + {regions} region + "
                f"1 hub = {sites + regions + 1:,}"
            )
        total_mem = sites * (site_mem + broker_mem) / 1024
        lines.append(
            f"- memory over the sites: {sites:,} × ({site_mem:.0f} + {broker_mem:.0f}) MiB = {total_mem:,.0f} GiB "
            f"(one site per machine: {site_mem + broker_mem:.0f} MiB each); the hub "
            f"{_f(fit.get('hub_peak_rss_mb'), '{:.0f}')} MiB as measured (its members' updates are one model each)"
        )
        lines.append("")
    return "\n".join(lines)


def fits_md(fit: dict[str, Any]) -> str:
    def lin(name: str, what: str, x: str, unit_b: str, scale_b: float) -> str:
        v = fit.get(name)
        if not v:
            return f"- {what}: not enough points"
        a, b = v
        return f"- {what}: {a:.3f} s + {b * scale_b:.4g} {unit_b} × {x}"

    lines = [
        lin("hub_vs_sites", "hub coordinator CPU per round against sites S (tiered)", "S", "ms", 1000),
        lin(
            "hub_vs_agents_tiered",
            "hub coordinator CPU per round against agents N (tiered, most sites)",
            "N",
            "ms",
            1000,
        ),
        lin("hub_vs_agents_flat", "flat coordinator CPU per round against agents N", "N", "ms", 1000),
        lin("aggregator_vs_agents", "site aggregator CPU per round against its agents n", "n", "ms", 1000),
        lin("hub_broker_vs_sites", "hub broker CPU per round against sites S", "S", "ms", 1000),
    ]
    q = fit.get("broker_vs_connections")
    lines.append(
        f"- Mosquitto CPU per round against its connections c (site brokers and the flat broker): "
        f"{q[0] * 1000:.4f} ms × c + {q[1] * 1e6:.5f} µs × c²"
        if q
        else "- broker: not enough points"
    )
    m = fit.get("aggregator_rss_vs_agents")
    if m:
        lines.append(f"- site aggregator peak RSS against its agents n: {m[0]:.0f} MiB + {m[1] * 1024:.1f} KiB × n")
    m = fit.get("broker_rss_vs_connections")
    if m:
        lines.append(f"- Mosquitto peak RSS against its connections c: {m[0]:.1f} MiB + {m[1] * 1024:.1f} KiB × c")
    m = fit.get("swarm_per_agent_vs_cohort")
    if m:
        lines.append(
            f"- swarm CPU per agent and round against the agents of its coordinator n: {m[0]:.2f} ms + "
            f"{m[1] * 1000:.3f} µs × n (every round start and result carries the cohort's ids)"
        )
    return "\n".join(lines)


def report(rows: list[dict], command: str = "") -> str:
    fit = fits(rows)
    ok = _ok(rows)
    loads = [x for r in rows for x in (r.get("loadavg_before") or [])[:1] + (r.get("loadavg_after") or [])[:1]]
    parts = [
        "# Flat vs tiered: how cost grows over site aggregators",
        "",
        "Set-up: `bench/scale_tiers.py` (its module text says what runs and how each figure is read).",
        "",
        f"Cases: {len(ok)} measured of {len(rows)}; load average (1 min) at the cases' starts and ends: "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} on {os.cpu_count()} CPUs.",
        "",
    ]
    if command:
        parts += ["```", command, "```", ""]
    parts += [
        "![round time and hub CPU per round against agents, flat vs tiered; peak RSS](scale-tiers.png)",
        "",
        "## Round and CPU per round",
        "",
        table_md(rows),
        "",
        "## Peak RSS",
        "",
        rss_md(rows),
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in targets(rows)],
        "",
        "## Fitted curves",
        "",
        fits_md(fit),
        "",
        "## Projection (on paper, from the fits)",
        "",
        projection(fit),
    ]
    return "\n".join(parts) + "\n"


# ---- plot ----------------------------------------------------------------------------------
def plot(rows: list[dict], out: Path, title: str = "") -> None:
    """Round time and hub CPU per round against agents (flat vs tiered), the CPU per round
    of each kind of process, and every kind of process's peak RSS."""
    from fedagent.extras import require

    require("matplotlib", "report", "the plot of bench/scale_tiers.py")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(rows)
    flat = sorted((r for r in ok if r["mode"] == "flat"), key=lambda r: r["agents"])
    most = max((r["sites"] for r in ok if r["mode"] == "tiered"), default=0)
    tiered = sorted((r for r in ok if r["mode"] == "tiered" and r["sites"] == most), key=lambda r: r["agents"])
    sweep = [r for r in ok if r["mode"] == "tiered" and r["sites"] != most]
    fig, ((ax_t, ax_h), (ax_c, ax_m)) = plt.subplots(2, 2, figsize=(13, 9.5))
    for rs, label, color, m in (
        (flat, "flat (one broker)", "tab:red", "o"),
        (tiered, f"tiered ({most} sites)", "tab:blue", "s"),
    ):
        n = [r["agents"] for r in rs]
        ax_t.plot(n, [r["round_median_s"] for r in rs], marker=m, color=color, label=f"{label}, median")
        ax_t.plot(n, [r["round_max_s"] for r in rs], marker=m, ls="none", alpha=0.4, color=color, label=f"{label}, max")
        ax_h.plot(n, [r["hub_cpu_per_round_s"] for r in rs], marker=m, color=color, label=f"{label}: top coordinator")
    for r in sweep:
        ax_t.plot([r["agents"]], [r["round_median_s"]], marker="^", color="tab:green", ls="none")
        ax_t.annotate(f"{r['sites']} sites", (r["agents"], r["round_median_s"]), fontsize=7)
        ax_h.plot([r["agents"]], [r["hub_cpu_per_round_s"]], marker="^", color="tab:green", ls="none")
        ax_h.annotate(f"{r['sites']} sites", (r["agents"], r["hub_cpu_per_round_s"]), fontsize=7)
    if tiered:
        ax_h.plot(
            [r["agents"] for r in tiered],
            [r["aggregator_cpu_per_round_max_s"] for r in tiered],
            marker="s",
            ls="--",
            color="tab:cyan",
            label="tiered: busiest site aggregator",
        )
    if flat:
        goal = flat[-1]["hub_cpu_per_round_s"] / 10
        ax_h.axhline(goal, color="grey", ls=":", lw=1)
        ax_h.text(
            ax_h.get_xlim()[0] if ok else 1, goal * 1.05, f"target: 1/10 of flat at {flat[-1]['agents']:,}", fontsize=7
        )
    # CPU per round by kind of process, stacked, one bar per case
    cases = flat + sorted([*tiered, *sweep], key=lambda r: (r["agents"], r["sites"]))
    labels = [
        f"flat\n{r['agents']:,}" if r["mode"] == "flat" else f"{r['sites']} sites\n{r['agents']:,}" for r in cases
    ]
    parts = [
        ("top coordinator", "tab:red", lambda r: r["hub_cpu_per_round_s"]),
        ("site aggregators", "tab:cyan", lambda r: sum(v for v in r["aggregators_cpu_per_round_s"].values() if v)),
        ("Mosquittos", "tab:purple", lambda r: sum(v for v in r["brokers_cpu_per_round_s"].values() if v)),
        ("swarm (the agents)", "tab:green", lambda r: r["swarm_cpu_per_round_s"]),
    ]
    bottom = np.zeros(len(cases))
    x = np.arange(len(cases))
    for name, color, get in parts:
        vals = np.array([get(r) or 0.0 for r in cases])
        ax_c.bar(x, vals, bottom=bottom, color=color, label=name)
        bottom += vals
    ax_c.set_xticks(x, labels, fontsize=7)
    kinds = ["hub coordinator", "site aggregator", "hub broker", "site broker", "swarm process"]
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        vals = [r["peak_rss_by_kind_mb"].get(kind, {}).get("max", 0.0) for r in cases]
        ax_m.bar(x + (k - len(kinds) / 2 + 0.5) * width, vals, width, label=kind + " (max)")
    ax_m.set_xticks(x, labels, fontsize=7)
    for ax in (ax_t, ax_h):
        ax.set_xscale("log")
        ax.set_xlabel("agents")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds per round")
    ax_t.set_title("Round time (hub round)")
    ax_h.set_yscale("log")
    ax_h.set_ylabel("CPU seconds per round")
    ax_h.set_title("CPU per round: the top coordinator (flat: the only one)")
    ax_c.set_ylabel("CPU seconds per round")
    ax_c.set_title("CPU per round by kind of process")
    ax_m.set_ylabel("MiB (VmHWM)")
    ax_m.set_title("Peak RSS, the largest process of each kind")
    for ax in (ax_t, ax_h, ax_c, ax_m):
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


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
    ap.add_argument("--case-limit", type=float, default=900.0, help="seconds for connecting, and again for the rounds")
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
