"""Time to accuracy: the same CNN trained on the same non-IID digits shards to the same
held-out accuracy by fedagent and by Flower.

* the model, the training loop and the evaluation: bench/flower_app/tta/tta_model.py
  (imported by fedagent's task bench/tta_task.py and by the Flower apps);
* the data: fedagent's digits set, its fixed 25 % held-out split (the same on every
  node) and its Dirichlet(alpha = 0.5, seed 0) split of the rest over 10 nodes, written
  once to an .npz that the Flower clients read;
* 10 nodes, 2 local epochs, batch 32, SGD lr 0.05 with momentum 0.9, all nodes train
  every round, the initial model from seed 0;
* each framework otherwise as it runs by default: fedagent = a coordinator and 10 agent
  processes over Mosquitto with mutual TLS, updates streamed and compressed by default
  (``int8`` deltas, the model broadcast as int8 steps); Flower 1.42 = its deployment
  (SuperLink + SuperNodes + ``flwr run``) over HTTPS (the SuperLink's certificate from
  our CA, verified by the SuperNodes and the CLI), with its default federated evaluation
  of every round's model on every client;
* the server's algorithm, apart from the system: FedAvgM with fedagent's default server
  momentum (0.7) and server learning rate (1) on both sides (Flower's ``FedAvgM``
  strategy), and plain FedAvg on both sides (fedagent with ``server_momentum = 0``,
  Flower's default strategy); and each framework's default (fedagent's FedAvgM against
  Flower's FedAvg);
* the accuracy of a global model is its accuracy on the held-out set, evaluated by the
  nodes (in fedagent every agent evaluates each global model it receives, its default;
  in Flower every client does in the evaluate phase of each round);
* time to accuracy runs from the start of round 1 to the moment the first global model
  at or above the target exists (its round's aggregation ends); the total adds the
  start-up (from launching the processes: PKI and broker too for fedagent);
* bytes: a counting relay (bench/relay.py) in front of the server side carries every
  node's connection (fedagent: agents and coordinator to Mosquitto; Flower: SuperNodes
  to the SuperLink), up to the target round.

Target: 0.95 held-out accuracy (see docs/benchmarks.md for why). Rows, each a time row
and a bytes row (ratio < 1: fedagent is faster or moves less): fedagent against Flower
with the same algorithm, FedAvgM and FedAvg (goal <= 0.6x), and fedagent's defaults
against Flower's; then each other update compression setting's time to accuracy
(``none`` first) against fedagent with its default (the same run's rounds and final
accuracy go in the notes).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.flower import (
    APP,
    FLWR_VERSION,
    TLS,
    VENV,
    deployment_dirs,
    flower_python,
    server_tls,
    spawn_flwr_run,
    spawn_superlink,
    spawn_supernodes,
)
from bench.flower_app.tta import tta_model
from bench.procs import ProcessTree
from bench.registry import Context, Row, section
from bench.relay import Relay
from fedagent.config import RoundsConfig
from fedagent.protocols.compression import DEFAULT_MODE
from fedagent.protocols.serveropt import DEFAULT_MOMENTUM
from fedagent.storage import history

ROOT = Path(__file__).resolve().parent.parent
TTA_APP = APP / "tta"
TORCH = "2.13.0"  # the pinned CPU build scripts/bootstrap.sh installs for fedagent
TARGET = 0.95
MAX_ROUNDS = 40  # a run that has not reached the target by then failed
FINAL_ROUNDS = 20  # fedagent runs go on to this round at least: the final accuracy per compression
#: fedagent's default server momentum and server learning rate (``[rounds]
#: server_momentum`` and ``server_lr``), which Flower's FedAvgM run is given
MOMENTUM = DEFAULT_MOMENTUM
SERVER_LR = RoundsConfig().server_lr
# Each run against fedagent's default run (DEFAULT_MODE): every other setting, none first.
COMPRESSIONS = tuple(c for c in ("none", "fp16", "int8", "topk") if c != DEFAULT_MODE)


@dataclass
class Run:
    """One training run: per round its start, the time its global model existed and
    that model's held-out accuracy (wall-clock seconds since the epoch)."""

    framework: str
    launched: float
    rounds: list[dict] = field(default_factory=list)
    bytes_up: int = 0  # node -> server side, up to the end of the run
    bytes_down: int = 0
    bytes_to_target: int = 0  # both ways, up to the end of the target round
    agent_bytes_to_target: int = 0  # the same on the nodes' links only (fedagent: not the coordinator's)
    target: float = TARGET
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by process kind, whole run

    def reached(self) -> dict | None:
        for r in self.rounds:
            if r.get("accuracy") is not None and r["accuracy"] >= self.target:
                return r
        return None

    @property
    def rounds_to_target(self) -> int:
        r = self.reached()
        if r is None:
            raise RuntimeError(f"{self.framework} did not reach {self.target} in {len(self.rounds)} rounds")
        return r["round"]

    @property
    def time_to_target(self) -> float:
        r = self.reached()
        if r is None:
            raise RuntimeError(f"{self.framework} did not reach {self.target} in {len(self.rounds)} rounds")
        return r["end"] - self.rounds[0]["start"]

    @property
    def total_to_target(self) -> float:
        return self.time_to_target + self.rounds[0]["start"] - self.launched

    @property
    def final_accuracy(self) -> float:
        """The accuracy after round FINAL_ROUNDS (or the last round run, if fewer)."""
        scored = [r["accuracy"] for r in self.rounds[:FINAL_ROUNDS] if r.get("accuracy") is not None]
        return scored[-1]

    def summary(self) -> dict:
        return {
            "framework": self.framework,
            "rounds_to_target": self.rounds_to_target,
            "time_to_target_s": self.time_to_target,
            "total_to_target_s": self.total_to_target,
            "bytes_to_target": self.bytes_to_target,
            "node_link_bytes_to_target": self.agent_bytes_to_target,
            "rounds_run": len(self.rounds),
            "final_accuracy": self.final_accuracy,
            "cpu_s": self.cpu,
        }


# -- data ---------------------------------------------------------------------------
def write_data(path: Path, seed: int = tta_model.SEED) -> Path:
    """fedagent's digits split for ``seed``, as arrays the Flower side reads:
    ``x_test``/``y_test`` and ``x_i``/``y_i`` for shard i (the same shards fedagent's
    agents build with that seed)."""
    import numpy as np

    from fedagent.tasks import digits

    x, y = digits.load_digits_arrays()
    (xtr, ytr), (xte, yte) = digits.train_test_split(x, y, seed=seed)
    parts = digits.dirichlet_split(ytr, tta_model.CLIENTS, tta_model.ALPHA, seed=seed)
    arrays = {"x_test": xte, "y_test": yte}
    for i, idx in enumerate(parts):
        arrays[f"x_{i}"], arrays[f"y_{i}"] = xtr[idx], ytr[idx]
    np.savez(path, **arrays)
    return path


# -- fedagent -----------------------------------------------------------------------
def _history(path: Path) -> list[dict]:
    # (with its rotated files; a line being written is not JSON yet and is skipped)
    return history.read_records(path)


def _cpu(pid: int | None) -> float:
    """utime + stime of a live process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fedagent_label(compression: str | None = None, rounds_options: dict | None = None) -> str:
    """fedagent's run as the table names it: its server algorithm and its compression."""
    momentum = (rounds_options or {}).get("server_momentum")
    if momentum is None:
        algo = f"FedAvgM, momentum {MOMENTUM} (its default)"
    elif momentum == 0:
        algo = "FedAvg (server_momentum = 0)"
    else:
        algo = f"FedAvgM, momentum {momentum}"
    return f"fedagent, {algo}, compression {compression or f'{DEFAULT_MODE} (its default)'}"


def run_fedagent(
    work: Path,
    log,
    *,
    compression: str | None = None,
    rounds: int = MAX_ROUNDS,
    min_rounds: int = FINAL_ROUNDS,
    target: float = TARGET,
    stop_at_target: bool = False,
    timeout: float = 900.0,
    agents: int = tta_model.CLIENTS,
    seed: int = tta_model.SEED,
    task: str = "bench.tta_task:make",
    rounds_options: dict | None = None,
) -> Run:
    """A coordinator and ``agents`` agent daemons (fedagent.local.federation), every connection through a
    counting relay to the federation's Mosquitto; ``compression`` goes to the
    coordinator's ``[transfer]`` (``None`` writes nothing: the default). ``seed``: the
    digits task's seed (its held-out set, its split and the initial weights; the
    comparison with Flower uses the shared one, tta_model.SEED). ``task``: the benchmark's
    CNN by default; ``"digits"`` is the demo's own model on the same data (the accuracy
    studies run it as a second workload). ``rounds_options``: more ``[rounds]`` keys for
    the coordinator (e.g. ``server_momentum``; none: the defaults)."""
    from fedagent.local import federation

    assert (federation.LOCAL_EPOCHS, federation.LR, federation.BATCH, federation.SEED) == (
        tta_model.LOCAL_EPOCHS,
        tta_model.LR,
        tta_model.BATCH,
        tta_model.SEED,
    ), "fedagent's federation settings and the shared model's must be the same"
    name = compression or "default"
    if rounds_options:
        name += "-" + "-".join(f"{k}{v}" for k, v in sorted(rounds_options.items()))
    d = work / f"fedagent-{name}" if seed == tta_model.SEED else work / f"fedagent-{name}-seed{seed}"
    if task != "bench.tta_task:make":
        d = d.with_name(f"{d.name}-{task.replace(':', '-')}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), old_path) if p
    )  # the daemons import bench.tta_task
    launched = time.time()
    fed = federation.Federation(
        d,
        agents=agents,
        rounds=rounds,
        alpha=tta_model.ALPHA,
        task=task,
        task_options={"alpha": tta_model.ALPHA, "seed": seed},
        agent_broker_by_mdns=False,
        round_timeout=600.0,  # as Flower, which waits for every client without a deadline
        rounds_options=rounds_options,
    )
    relays: dict[str, Relay] = {}
    try:
        fed.prepare()
        assert fed.broker is not None
        uri = fed.broker.uri
        # One relay for the coordinator's connection, one for the agents': the agents'
        # links are what Flower's clients' links compare to.
        relays = {"coordinator": Relay(fed.broker.port), "agents": Relay(fed.broker.port)}
        for stem in ["coordinator", *fed.agent_ids]:
            relay = relays["coordinator" if stem == "coordinator" else "agents"]
            cfg = fed.config_path(stem)
            text = cfg.read_text().replace(uri, f"mqtts://127.0.0.1:{relay.port}")
            if stem == "coordinator" and compression is not None:
                text += f'\n[transfer]\ncompression = "{compression}"\n'
            cfg.write_text(text)
        fed.start_all()
        coord_hist = d / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        agent_hist = d / "state" / "agent-1" / "agent" / fed.fed / "history.jsonl"
        run = Run(fedagent_label(compression, rounds_options), launched, target=target)
        deadline = time.monotonic() + timeout
        while True:
            fed.check_alive()
            acc = {
                e["model_version"]: e["metrics"]["accuracy"]
                for e in _history(agent_hist)
                if e.get("event") == "global_eval"
            }
            run.rounds = [
                {
                    "round": e["round"],
                    "start": e["time"] - e["seconds"],
                    "end": e["time"],
                    "accuracy": acc.get(e["model_version"]),
                    "participants": len(e["participants"]),
                }
                for e in _history(coord_hist)
                if e.get("event") == "round"
            ]
            if stop_at_target and run.reached() is not None:
                break
            scored = all(r["accuracy"] is not None for r in run.rounds)
            if scored and len(run.rounds) >= min(min_rounds, rounds) and run.reached() is not None:
                break  # the target reached, and the rounds for the final accuracy run
            if scored and len(run.rounds) >= rounds:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run.framework}: {len(run.rounds)} of {rounds} rounds in {timeout:.0f} s")
            time.sleep(0.2)
        short = [r["round"] for r in run.rounds if r["participants"] != agents]
        if short:
            raise RuntimeError(f"{run.framework}: rounds {short} did not aggregate all {agents} agents")
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
        return run
    finally:
        fed.close()
        for r in relays.values():
            r.close()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


# -- Flower ---------------------------------------------------------------------------
def flower_torch_python(log) -> Path:
    """bench/.venv-flower with torch added (the same pinned CPU build as fedagent's)."""
    py = flower_python(log)
    stamp = VENV / f".torch-{TORCH}"
    if not stamp.exists():
        log(f"installing torch=={TORCH} into {VENV} (once)")
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}"], check=True)
        stamp.touch()
    return py


def _flower_result(out: Path, framework: str, launched: float, relay: Relay, target: float) -> Run:
    rounds = json.loads(out.read_text())["rounds"] if out.exists() else []
    run = Run(framework, launched, [r for r in rounds if "end" in r], target=target)
    run.bytes_up, run.bytes_down = relay.up, relay.down
    reached = run.reached()
    if reached is not None:
        run.bytes_to_target = run.agent_bytes_to_target = relay.bytes_at(reached["end"])
    return run


#: Flower's server algorithms in the section: its default, plain FedAvg, and FedAvgM with
#: fedagent's default server momentum and server learning rate (``flwr.serverapp.strategy.
#: FedAvgM``; the same update rule as fedagent's, see docs/benchmarks.md).
FEDAVG = "fedavg"
FEDAVGM = "fedavgm"


def flower_label(strategy: str, tls: bool = True) -> str:
    algo = f"FedAvgM, momentum {MOMENTUM}, server lr {SERVER_LR:g}" if strategy == FEDAVGM else "FedAvg (its default)"
    return f"Flower {FLWR_VERSION} deployment{', TLS' if tls else ''}, {algo}"


def run_flower_deployment(
    py: Path,
    work: Path,
    data: Path,
    log,
    *,
    strategy: str = FEDAVG,
    tls: TLS | None = None,
    target: float = TARGET,
    rounds: int = MAX_ROUNDS,
    timeout: float = 3600.0,
    clients: int = tta_model.CLIENTS,
    seed: int = tta_model.SEED,
) -> Run:
    """One SuperLink, ``clients`` SuperNodes (``partition-id`` = shard) reaching it through
    the relay, the app submitted with ``flwr run`` (straight to the SuperLink); with TLS
    when ``tls`` is given (the relay carries it untouched). ``strategy``: :data:`FEDAVG`
    or :data:`FEDAVGM`; ``seed``: the initial model's (``data`` must be written with the
    same seed)."""
    tag = f"tta-{strategy}"
    app, link, env = deployment_dirs(py, work, TTA_APP / "deploy", tag, tls)
    for f in ("tta_model.py", "data.py"):
        shutil.copy(TTA_APP / f, app / f)
    out = work / f"flower-deploy-{tag}.json"
    out.unlink(missing_ok=True)
    env.pop("PYTHONPATH", None)
    framework = flower_label(strategy, tls is not None)
    launched = time.time()
    with open(work / f"flower-deploy-{tag}.log", "wb") as logf, ProcessTree() as tree:
        spawn_superlink(tree, py, link, logf, env, work, tls=tls)
        with Relay(link) as relay:
            spawn_supernodes(tree, py, relay.port, clients, logf, env, work, partitions=True, tls=tls)
            cfg = (
                f'rounds={rounds} clients={clients} target={target} data="{data}" out="{out}" '
                f'strategy="{strategy}" server-momentum={MOMENTUM} server-lr={SERVER_LR} seed={seed}'
            )
            run = spawn_flwr_run(tree, py, app, cfg, logf, env, work)
            deadline = time.monotonic() + timeout
            seen = 0
            # ``flwr run --stream`` returns when the run ends; its result file says how far it got.
            while run.poll() is None:
                tree.sweep()
                result = _flower_result(out, framework, launched, relay, target)
                if len(result.rounds) > seen:
                    seen = len(result.rounds)
                    last = result.rounds[-1]
                    log(f"{framework}: round {seen}, accuracy {last.get('accuracy', float('nan')):.4f}")
                if result.reached() is not None:
                    return result
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{framework}: {len(result.rounds)} rounds in {timeout:.0f} s")
                time.sleep(0.5)
            result = _flower_result(out, framework, launched, relay, target)
            if result.reached() is None:
                raise RuntimeError(f"flwr run ended (exit {run.returncode}) before the target; see {logf.name}")
            return result


# -- the section ----------------------------------------------------------------------
def _seed() -> int:
    """FEDAGENT_TTA_SEED: another seed of the data split and initial model for both
    frameworks (default the benchmark's, tta_model.SEED); only the like-for-like FedAvgM
    pair runs with another seed."""
    return int(os.environ.get("FEDAGENT_TTA_SEED", tta_model.SEED))


def _full(ctx: Context) -> bool:
    return not ctx.quick and _seed() == tta_model.SEED


def _expected_rows(ctx: Context) -> int:
    # time and bytes of each pair: FedAvgM like for like (always); FedAvg like for like
    # and defaults against defaults, and one row per compression setting, unless --quick
    # or another seed
    return 6 + len(COMPRESSIONS) if _full(ctx) else 2


def _note(run: Run) -> str:
    return (
        f"rounds to {run.target}: {run.rounds_to_target}; total incl. start-up {run.total_to_target:.1f} s; "
        f"{run.bytes_to_target / 1e6:.0f} MB moved"
    )


#: what each pair of runs compares (the first words of a row's note)
LIKE_FOR_LIKE = "like for like (same algorithm)"
DEFAULTS = "defaults against defaults"


def _row(subject: Run, baseline: Run, what: str, target: str = "") -> Row:
    value, base = (
        (subject.bytes_to_target, baseline.bytes_to_target)
        if what == "bytes"
        else (subject.time_to_target, baseline.time_to_target)
    )
    return Row(
        "tta",
        f"{subject.framework}: {'bytes' if what == 'bytes' else 'time'} to {subject.target:.0%} accuracy",
        value,
        f"{baseline.framework}",
        base,
        unit="B" if what == "bytes" else "s",
        note=f"{target}{'; ' if target else ''}{_note(subject)} vs {_note(baseline)}",
        extra={"subject": subject.summary(), "baseline": baseline.summary()},
    )


def _pair(subject: Run, baseline: Run, kind: str, goal: str = "") -> list[Row]:
    """A time row and a bytes row of ``subject`` against ``baseline``; ``kind`` says
    which comparison it is (:data:`LIKE_FOR_LIKE` or :data:`DEFAULTS`)."""
    return [
        _row(subject, baseline, "time", f"{kind}{'; ' + goal if goal else ''}"),
        _row(subject, baseline, "bytes", kind),
    ]


def save_runs(runs: list[Run], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) | {"summary": r.summary()} for r in runs], indent=1))


@section("tta", rows=_expected_rows)
def tta(ctx: Context) -> list[Row]:
    """fedagent and Flower 1.42 (deployment, TLS) with the same server algorithm: FedAvgM
    at fedagent's default momentum (both with --quick), plain FedAvg (fedagent with
    ``server_momentum = 0``); each framework's defaults against each other (fedagent's
    FedAvgM, Flower's FedAvg); then fedagent's other compression settings against its
    default. A Flower run that fails or does not reach the target is reported as not
    measured and its rows are missing (bench/run.py exits 1)."""
    py = flower_torch_python(ctx.log)
    work = ctx.work / "tta"
    work.mkdir(parents=True, exist_ok=True)
    seed = _seed()
    data = write_data(work / "tta-data.npz", seed)
    tls = server_tls(work / "flower-pki")
    runs: list[Run] = []

    def measure(fn, *args, **kw) -> Run:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = fn(*args, **kw)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # Every process of the run that was reaped (all but the ones Flower's SuperExec
        # detaches), from start-up to the end of the run (fedagent: FINAL_ROUNDS rounds).
        run.cpu["all processes"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        runs.append(run)
        save_runs(runs, work / "runs.json")
        if run.reached() is None:
            raise RuntimeError(
                f"{run.framework} did not reach {run.target} in {len(run.rounds)} rounds "
                f"(accuracy after round {FINAL_ROUNDS}: {run.final_accuracy:.4f})"
            )
        ctx.log(
            f"{run.framework}: {run.target} in round {run.rounds_to_target}, {run.time_to_target:.1f} s "
            f"({run.total_to_target:.1f} s incl. start-up), {run.bytes_to_target / 1e6:.0f} MB"
        )
        return run

    def flower_run(strategy: str) -> Run | None:
        try:
            return measure(run_flower_deployment, py, work, data, ctx.log, strategy=strategy, tls=tls, seed=seed)
        except (RuntimeError, subprocess.SubprocessError, OSError, TimeoutError) as exc:
            ctx.log(f"{flower_label(strategy)} did not reach the target: {exc}")
            ctx.shared.setdefault("failures", []).append(f"tta: {flower_label(strategy)}: {exc}")
            return None

    def done(rows: list[Row]) -> list[Row]:
        # Every run's rounds (times, accuracy), for results/tta's plot: in results.json.
        if rows:
            rows[0].extra["runs"] = [asdict(r) for r in runs]
        return rows

    rows: list[Row] = []
    ours = measure(run_fedagent, work, ctx.log, seed=seed)
    flower_m = flower_run(FEDAVGM)
    if flower_m is not None:
        rows += _pair(ours, flower_m, LIKE_FOR_LIKE, "goal <= 0.6x")
    if not _full(ctx):
        ctx.log(
            f"{'--quick' if ctx.quick else f'seed {seed}'}: only the FedAvgM pair; plain FedAvg, "
            "Flower's default and the compression settings skipped"
        )
        return done(rows)
    plain = measure(run_fedagent, work, ctx.log, rounds_options={"server_momentum": 0})
    flower_plain = flower_run(FEDAVG)
    if flower_plain is not None:
        rows += _pair(plain, flower_plain, LIKE_FOR_LIKE, "goal <= 0.6x")
        rows += _pair(ours, flower_plain, DEFAULTS)
    for comp in COMPRESSIONS:
        try:
            run = measure(run_fedagent, work, ctx.log, compression=comp)
        except RuntimeError as exc:  # e.g. a compression that costs too much accuracy
            ctx.log(str(exc))
            ctx.shared.setdefault("failures", []).append(f"tta: compression {comp}: {exc}")
            continue
        rows.append(
            _row(
                run,
                ours,
                "time",
                f"final accuracy (round {FINAL_ROUNDS}) {run.final_accuracy:.4f} vs {ours.final_accuracy:.4f}",
            )
        )
    return done(rows)
