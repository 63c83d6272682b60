"""Asynchronous against synchronous FedAvg where the agents are unequal: time and bytes
to the target accuracy, and the final accuracy.

The time-to-accuracy workload (bench/tta.py: its CNN, the digits data split over the
agents by Dirichlet(0.5), 2 local epochs, batch 32, lr 0.05) with:

* ``AGENTS`` agent daemons and a coordinator over Mosquitto with mutual TLS, every
  connection through a counting relay (bench/relay.py);
* ``SLOW`` of them five times slower (``fedagent.tasks.slowed``: each training waits
  four times as long as it took, without using the CPU, as a slower device would);
* ``FLAKY`` of them behind a link that is cut for ``LINK_DOWN`` s every
  ``LINK_UP + LINK_DOWN`` s (``fedagent.local.linkcut.Link``: the broker connection
  drops and reconnections are refused until it is healed), the two out of phase;
* each mode with fedagent's defaults otherwise: ``mode = "fedavg"`` (rounds of every
  online agent, server momentum 0.7, int8 updates and broadcast), ``ROUNDS`` rounds, and
  ``mode = "async"`` (``[async]`` defaults: buffers of 5, no server momentum) for as
  long as the rounds took.

Time to accuracy runs from the first round's start (the first task, asynchronously) to
the moment the first global model at or above ``TARGET`` held-out accuracy exists. A
model's accuracy is the agents' own evaluation of it on the fixed held-out quarter (every
agent scores the models it receives; asynchronously an agent scores the newest one when
it is free, so a model published while every agent was busy has no score and the target
counts from the next scored one: never in async's favour). The final accuracy is that of
the last model each run has when the rounds' time is up, scored here. Bytes: both
relays, to the target model.

Rows, per repetition (``ctx.repeats``, one pair of runs each: every ratio is from one
run of each mode, on the same machine at the same time): async's time to the target
against sync's (goal ≤ 0.5x), its bytes to the target, and its final accuracy (goal:
within 0.01). ``--quick``: 4 agents, one slow and one flaky, 6 rounds' worth, target 0.9.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.flower_app.tta import tta_model
from bench.registry import Context, Row, section
from bench.relay import Relay
from bench.tta import ROOT, Run, _cpu
from fedagent.config.settings import AsyncSettings
from fedagent.local.federation import Federation
from fedagent.local.linkcut import Link
from fedagent.storage import history

TARGET = 0.95
AGENTS = 10
SLOW = 3
SLOWDOWN = 5.0
FLAKY = 2
LINK_UP, LINK_DOWN = 20.0, 10.0
ROUNDS = 20  # sync rounds; async publishes as many models as make the same number of updates
TASK = "bench.tta_task:make"


@dataclass(frozen=True)
class Setup:
    agents: int = AGENTS
    slow: int = SLOW
    flaky: int = FLAKY
    rounds: int = ROUNDS
    target: float = TARGET
    seed: int = tta_model.SEED
    link_up: float = LINK_UP
    link_down: float = LINK_DOWN
    timeout: float = 1800.0

    def slow_ids(self) -> list[str]:
        return [f"agent-{i}" for i in range(self.agents - self.slow + 1, self.agents + 1)]

    def flaky_ids(self) -> list[str]:
        first = self.agents - self.slow - self.flaky + 1
        return [f"agent-{i}" for i in range(first, first + self.flaky)]


QUICK = Setup(agents=4, slow=1, flaky=1, rounds=6, target=0.9, link_up=8.0, link_down=4.0, timeout=900.0)


@dataclass
class Measured:
    """One run: the arithmetic of bench/tta.py's Run, and what async adds."""

    run: Run
    mode: str
    updates: int = 0
    models: int = 0
    final_accuracy: float = float("nan")
    scored: int = 0
    cuts: int = 0
    staleness: dict[str, Any] = field(default_factory=dict)
    by_agent: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        r = self.run
        reached = r.reached()
        return {
            "mode": self.mode,
            "time_to_target_s": r.time_to_target if reached else None,
            "bytes_to_target": r.bytes_to_target,
            "models_to_target": reached["round"] if reached else None,
            "models": self.models,
            "scored_models": self.scored,
            "updates": self.updates,
            "final_accuracy": self.final_accuracy,
            "link_cuts": self.cuts,
            "staleness": self.staleness,
            "updates_by_agent": self.by_agent,
            "cpu_s": r.cpu,
        }


class Flaky:
    """Cuts and heals a link on a schedule (``offset`` s late), in a thread of its own."""

    def __init__(self, link: Link, up: float, down: float, offset: float) -> None:
        self.link, self.up, self.down, self.offset = link, up, down, offset
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(self.offset):
            return
        while not self._stop.wait(self.up):
            self.link.cut()
            if self._stop.wait(self.down):
                return
            self.link.heal()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.link.close()


def _records(path: Path) -> list[dict]:
    return history.read_records(path)


def run_mode(work: Path, mode: str, setup: Setup, log, duration: float | None = None) -> Measured:
    """One federation of ``setup`` in ``mode``: ``"fedavg"`` for ``setup.rounds`` rounds,
    ``"async"`` for ``duration`` seconds from its first task (or as many models as make
    the rounds' updates)."""
    d = work / f"{mode}-seed{setup.seed}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old_path) if p)  # the daemons import bench
    # Asynchronously, as many models as make the sync run's updates with the default
    # buffer, or (``duration``) until the time is up.
    versions = max(1, setup.rounds * setup.agents // AsyncSettings().buffer_size)
    if duration is not None:
        versions = 1_000_000
    fed = Federation(
        d,
        agents=setup.agents,
        rounds=setup.rounds,
        alpha=tta_model.ALPHA,
        task=TASK,
        task_options={"alpha": tta_model.ALPHA, "seed": setup.seed},
        agent_broker_by_mdns=False,
        round_timeout=600.0,
        mode=mode,
        fedbuff={"versions": versions},
        slow_agents={a: SLOWDOWN for a in setup.slow_ids()},
    )
    relays: dict[str, Relay] = {}
    flaky: list[Flaky] = []
    launched = time.time()
    try:
        fed.prepare()
        assert fed.broker is not None
        relays = {"coordinator": Relay(fed.broker.port), "agents": Relay(fed.broker.port)}
        links: dict[str, Link] = {a: Link(relays["agents"].port) for a in setup.flaky_ids()}
        uri = fed.broker.uri
        for stem in ["coordinator", *fed.agent_ids]:
            port = (
                relays["coordinator"].port
                if stem == "coordinator"
                else links[stem].port
                if stem in links
                else relays["agents"].port
            )
            cfg = fed.config_path(stem)
            cfg.write_text(cfg.read_text().replace(uri, f"mqtts://127.0.0.1:{port}"))
        fed.start_all()
        period = setup.link_up + setup.link_down
        flaky = [
            Flaky(ln, setup.link_up, setup.link_down, offset=i * period / max(1, len(links)))
            for i, ln in enumerate(links.values())
        ]
        coord_hist = d / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        run = Run(f"fedagent {mode}", launched, target=setup.target)
        deadline = time.monotonic() + setup.timeout
        total = setup.rounds if mode == "fedavg" else versions
        models: list[dict] = []
        final: dict | None = None
        while True:
            fed.check_alive()
            records = _records(coord_hist)
            models = [e for e in records if e.get("event") == "round"]
            if len(models) >= total:
                break
            started = next((e["time"] for e in records if e.get("event") == "training_started"), None)
            if duration is not None and started is not None and time.time() - started >= duration:
                final = fed.final_weights()[0]  # the model the time is up with
                records = _records(coord_hist)
                models = [e for e in records if e.get("event") == "round" and e["time"] <= started + duration]
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"fedagent {mode}: {len(models)} of {total} models in {setup.timeout:.0f} s")
            time.sleep(0.5)
        for f in flaky:
            f.stop()
        flaky = []
        acc: dict[int, float] = {}
        for a in fed.agent_ids:
            for e in _records(d / "state" / a / "agent" / fed.fed / "history.jsonl"):
                if e.get("event") == "global_eval":
                    acc.setdefault(int(e["model_version"]), float(e["metrics"]["accuracy"]))
        started = next((e["time"] for e in records if e.get("event") == "training_started"), None)
        run.rounds = []
        for i, e in enumerate(models):
            start = (e["time"] - e["seconds"]) if mode == "fedavg" else (models[i - 1]["time"] if i else started)
            run.rounds.append(
                {
                    "round": e["model_version"],
                    "start": start,
                    "end": e["time"],
                    "accuracy": acc.get(int(e["model_version"])),
                    "participants": len(e["participants"]),
                }
            )
        run.cpu = {
            "coordinator": _cpu(fed.proc("coordinator").popen.pid),
            "agents": sum(_cpu(fed.proc(a).popen.pid) for a in fed.agent_ids),
            "broker": _cpu(fed.broker.pid),
        }
        run.bytes_up = sum(r.up for r in relays.values())
        run.bytes_down = sum(r.down for r in relays.values())
        reached = run.reached()
        if reached is not None:
            run.bytes_to_target = sum(r.bytes_at(reached["end"]) for r in relays.values())
            run.agent_bytes_to_target = relays["agents"].bytes_at(reached["end"])
        m = Measured(run, mode, models=len(models), scored=sum(1 for r in run.rounds if r["accuracy"] is not None))
        m.cuts = sum(ln.cuts for ln in links.values())
        stale: list[int] = []
        for e in models:
            if mode == "async":
                for u in e.get("updates", []):
                    m.by_agent[u["agent"]] = m.by_agent.get(u["agent"], 0) + 1
                    stale.append(int(u["staleness"]))
            else:
                for a in e["participants"]:
                    m.by_agent[a] = m.by_agent.get(a, 0) + 1
        m.updates = sum(m.by_agent.values())
        if stale:
            s = sorted(stale)
            m.staleness = {"median": s[len(s) // 2], "p90": s[(9 * len(s)) // 10], "max": s[-1]}
        m.final_accuracy = _score(final if final is not None else fed.final_weights()[0], setup.seed)
        log(
            f"fedagent {mode}: {len(models)} models from {m.updates} updates; "
            + (
                f"{setup.target} at model {reached['round']}, {run.time_to_target:.1f} s, "
                f"{run.bytes_to_target / 1e6:.0f} MB; "
                if reached
                else f"{setup.target} not reached; "
            )
            + f"final accuracy {m.final_accuracy:.4f}"
        )
        return m
    finally:
        for f in flaky:
            f.stop()
        fed.close()
        for r in relays.values():
            r.close()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def _score(weights: dict, seed: int) -> float:
    """The held-out accuracy of ``weights`` (the benchmark's CNN, its fixed held-out set)."""
    from bench.tta_task import make
    from fedagent.tasks.base import set_weights

    task = make({"seed": seed})
    model = task.build_model()
    set_weights(model, weights)
    return float(task.evaluate(model)["accuracy"])


def compare(work: Path, setup: Setup, log, repeat: int = 0) -> tuple[Measured, Measured]:
    """One run of each mode, sync first (async runs for as long as its rounds took); the
    pair of one repetition."""
    sync = run_mode(work / f"run{repeat}", "fedavg", setup, log)
    rounds = sync.run.rounds
    asyn = run_mode(work / f"run{repeat}", "async", setup, log, duration=rounds[-1]["end"] - rounds[0]["start"])
    return sync, asyn


def rows_of(sync: Measured, asyn: Measured, repeat: int) -> list[Row]:
    def note(m: Measured) -> str:
        r = m.run.reached()
        where = f"model {r['round']}" if r else "not reached"
        return (
            f"{m.mode}: target at {where}, {m.models} models from {m.updates} updates, final "
            f"{m.final_accuracy:.4f}" + (f", staleness {m.staleness}" if m.staleness else "")
        )

    extra = {"sync": sync.summary(), "async": asyn.summary()}
    both = f"{note(asyn)}; {note(sync)}"
    out = []
    if sync.run.reached() and asyn.run.reached():
        out += [
            Row(
                "async",
                f"async FedAvg: time to {sync.run.target:.0%} accuracy (run {repeat + 1})",
                asyn.run.time_to_target,
                "sync FedAvg (rounds)",
                sync.run.time_to_target,
                note=f"goal <= 0.5x; {both}",
                extra=extra,
            ),
            Row(
                "async",
                f"async FedAvg: bytes to {sync.run.target:.0%} accuracy (run {repeat + 1})",
                asyn.run.bytes_to_target,
                "sync FedAvg (rounds)",
                sync.run.bytes_to_target,
                unit="B",
                note=both,
                extra=extra,
            ),
        ]
    out.append(
        Row(
            "async",
            f"async FedAvg: final accuracy in the rounds' time (run {repeat + 1})",
            asyn.final_accuracy,
            "sync FedAvg (rounds)",
            sync.final_accuracy,
            unit="accuracy",
            note=f"goal: within 0.01; {both}",
            extra=extra,
        )
    )
    return out


def _setup(ctx: Context) -> Setup:
    return QUICK if ctx.quick else Setup()


def _repeats(ctx: Context) -> int:
    return min(ctx.repeats, 3)


@section("async", rows=lambda ctx: 3 * _repeats(ctx))
def fedbuff(ctx: Context) -> list[Row]:
    work = ctx.work / "async"
    work.mkdir(parents=True, exist_ok=True)
    setup = _setup(ctx)
    rows: list[Row] = []
    pairs = []
    for i in range(_repeats(ctx)):
        sync, asyn = compare(work, setup, ctx.log, i)
        pairs.append({"sync": sync.summary(), "async": asyn.summary(), "setup": asdict(setup)})
        (work / "runs.json").write_text(json.dumps(pairs, indent=1, default=str))
        rows += rows_of(sync, asyn, i)
    return rows


# -- FLSimCo's vehicles, asynchronously -------------------------------------------------
FLSIMCO_REPORT = ROOT / "results" / "flsimco" / "results.json"


def run_flsimco_async(work: Path, log, rounds: int | None = None, timeout: float = 3600.0) -> dict[str, Any]:
    """FLSimCo's vehicle workload (fedagent_experiments.flsimco: the same schedule of
    vehicles, speeds, shards and stays, blur-weighted aggregation, SimCo on blurred
    digits) in ``mode = "async"``: ``coverage`` vehicles in range at a time, each leaving
    (its process stopped, as out of coverage) once ``stay`` of its updates are in models,
    buffers of ``coverage`` updates, as many models as the report's rounds; the rest as the
    report was measured (plain server step, uncompressed updates). Returns the final
    model's held-out SimCo loss and kNN accuracy, the wall time and the models."""
    import dataclasses

    from fedagent_experiments import flsimco as F

    setup = F.Setup() if rounds is None else dataclasses.replace(F.Setup(), rounds=rounds)
    fed = Federation(work, agents=0, rounds=setup.rounds, alpha=setup.alpha, federation="rsu-async")
    schedule = setup.schedule()
    started = time.monotonic()
    try:
        fed.prepare()
        rounds_table = {
            "min_agents": setup.coverage,
            "expected_agents": setup.coverage,
            "local_epochs": setup.local_epochs,
            "lr": setup.lr,
            "batch_size": setup.batch_size,
            "seed": setup.seed,
            "lr_schedule": "cosine",
            "aggregation": "blur",
            "server_momentum": 0.0,
        }
        fed.write_coordinator(
            "flsimco",
            {"seed": setup.seed, "speed": 0.0},
            rounds_table,
            {"compression": "none"},
            mode="async",
            fedbuff={"buffer_size": setup.coverage, "versions": setup.rounds, "max_staleness": 10_000},
        )
        fed.spawn("coordinator")
        queue = list(schedule)
        in_range: dict[str, Any] = {}
        stays = {v["id"]: v["stay"] for v in schedule}

        def drive_in() -> None:
            v = queue.pop(0)
            options = {"shard": v["shard"], "shards": setup.shards, "alpha": setup.alpha, "seed": setup.seed}
            in_range[v["id"]] = fed.add_agent(v["id"], "flsimco", {**options, "speed": v["speed"]}, mode="async")

        for _ in range(setup.coverage):
            drive_in()
        while True:
            st = fed.status("coordinator")
            if st is not None and st["phase"] == "done":
                break
            for vid in list(in_range):
                taken = ((st or {}).get("agents") or {}).get(vid, {}).get("accepted", 0)
                if taken >= stays[vid]:
                    # Out of coverage: whatever it was training goes with it.
                    fed.stop(in_range.pop(vid))
                    if queue:
                        drive_in()
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"FLSimCo async: not finished after {timeout:.0f} s")
            time.sleep(0.5)
        seconds = time.monotonic() - started
        hist = work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        models = [r for r in history.read_records(hist) if r.get("event") == "round"]
        final = F.final_eval(fed.final_weights()[0], setup)
        out = {
            "rounds": setup.rounds,
            "models": len(models),
            "updates": sum(len(r["updates"]) for r in models),
            "staleness_max": max((u["staleness"] for r in models for u in r["updates"]), default=0),
            "seconds": seconds,
            "final_heldout_loss": final["simco_loss"],
            "final_knn": final["knn_accuracy"],
            "vehicles": len(schedule) - len(queue),
        }
        log(
            f"FLSimCo async: {out['models']} models from {out['updates']} updates of {out['vehicles']} vehicles in "
            f"{seconds:.0f} s; held-out loss {out['final_heldout_loss']:.4f}, kNN {out['final_knn']:.3f}"
        )
        return out
    finally:
        fed.close()


@section("async_flsimco", rows=lambda ctx: 2)
def flsimco_async(ctx: Context) -> list[Row]:
    """Against the synchronous report's blur-weighted run (results/flsimco: another run,
    another day; the ratio says how the two compare, not two halves of one run)."""
    report = json.loads(FLSIMCO_REPORT.read_text())["summary"]["blur"]
    work = ctx.work / "async-flsimco"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    got = run_flsimco_async(work, ctx.log, rounds=4 if ctx.quick else None)
    note = (
        f"{got['models']} models from {got['updates']} updates of {got['vehicles']} vehicles, staleness up to "
        f"{got['staleness_max']}; the report: {report['rounds']} rounds, {report['models_aggregated']} models"
    )
    extra = {"async": got, "report": report}
    return [
        Row(
            "async_flsimco",
            "FLSimCo vehicles, async: wall time",
            got["seconds"],
            "results/flsimco (rounds, blur)",
            report["seconds"],
            note=note,
            extra=extra,
        ),
        Row(
            "async_flsimco",
            "FLSimCo vehicles, async: final kNN accuracy",
            got["final_knn"],
            "results/flsimco (rounds, blur)",
            report["final_knn"],
            unit="accuracy",
            note=f"held-out SimCo loss {got['final_heldout_loss']:.4f} vs {report['final_heldout_loss']:.4f}; {note}",
            extra=extra,
        ),
    ]
