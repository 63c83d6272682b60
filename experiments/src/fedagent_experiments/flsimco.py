"""``fedagent experiment flsimco``: FLSimCo (Gu et al.; shared/seeds/001) through the real
coordinator (the road-side unit) and real agent processes (the vehicles).

Every vehicle is its own ``fedagent agent`` process with its own certificate: it starts,
joins, takes part in ``stay`` rounds (``[rounds] leave_after``) and exits, announcing
with its last update that it is leaving so the RSU does not select it again. The RSU
runs each round with the ``coverage`` vehicles in range (``min_agents`` =
``expected_agents`` = ``coverage``); the driver here only plays traffic: when a vehicle
starts its last round, the next one of a fixed schedule approaches (its process starts)
and is in range from the next round on. The schedule (speeds from eq. 1,
data shard, how long each stays) is drawn once from ``seed``, so the three strategies
see the same vehicles in the same rounds and differ only in aggregation:

* ``blur``       eq. 11, weights Σ L − L_n from the blur levels the vehicles report;
* ``fedavg``     sample-count weights (baseline 1);
* ``drop_above`` FedAvg without the models of vehicles above ``threshold`` km/h (baseline 2).

Outputs (in ``out``): ``report.md`` with the table, ``loss.png`` (training loss per round),
``knn.png`` (kNN accuracy of the global encoder per round), ``weights.png`` (eq. 11 weight
against speed) and ``results.json``.
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedagent.errors import FedagentError
from fedagent.extras import require_installed
from fedagent.local.federation import Federation, Proc
from fedagent.protocols.mobility import sample_speeds, truncated_gaussian_moments
from fedagent.storage import history
from fedagent.tasks.flsimco import DEFAULT_CAMERA, DEFAULT_MOBILITY
from fedagent_experiments import EXTRAS, NEEDS

require_installed(NEEDS, EXTRAS, "the FLSimCo experiment")

STRATEGIES = ("blur", "fedavg", "drop_above")
LABELS = {
    "blur": "FLSimCo (eq. 11, blur-weighted)",
    "fedavg": "FedAvg (baseline 1)",
    "drop_above": "drop > threshold (baseline 2)",
}


@dataclass(frozen=True)
class Setup:
    rounds: int = 10
    coverage: int = 4  # vehicles in range of the RSU in every round
    stay: int = 2  # rounds a vehicle stays in range
    shards: int = 10  # data shards (a vehicle drives with shard i % shards)
    alpha: float = 1.0  # Dirichlet label skew; 0 = IID
    threshold: float = 100.0  # km/h: baseline 2 drops models above it
    local_epochs: int = 2
    lr: float = 0.05
    batch_size: int = 64
    seed: int = 0
    round_timeout: float = 600.0  # generous: on busy cores a vehicle's round can take minutes
    mobility: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MOBILITY))

    def schedule(self) -> list[dict[str, Any]]:
        """Enough vehicles for ``rounds`` rounds: id, speed (eq. 1), shard, rounds it stays.
        The first ``coverage`` vehicles stay 1..``stay`` rounds so departures are staggered."""
        m = self.mobility
        need = self.coverage + math.ceil(self.rounds * self.coverage / self.stay) + self.coverage
        speeds = sample_speeds(need, m["mu"], m["sigma"], m["v_min"], m["v_max"], np.random.default_rng(self.seed))
        out = []
        for i in range(need):
            stay = 1 + i % self.stay if i < self.coverage else self.stay
            out.append(
                {
                    "id": f"vehicle-{i + 1:03d}",
                    "speed": round(float(speeds[i]), 2),
                    "shard": i % self.shards,
                    "stay": stay,
                }
            )
        return out


def _vehicle_options(setup: Setup, v: dict[str, Any]) -> dict[str, Any]:
    return {"shard": v["shard"], "shards": setup.shards, "alpha": setup.alpha, "seed": setup.seed, "speed": v["speed"]}


def run_strategy(
    setup: Setup,
    strategy: str,
    work: Path,
    progress: Callable[[int, str], None] | None = None,
    time_limit: float = 1800.0,
) -> dict[str, Any]:
    """One federation under ``strategy``; returns the coordinator's round records and the
    vehicles' evaluations of each global model version."""
    fed = Federation(
        work,
        agents=0,
        rounds=setup.rounds,
        alpha=setup.alpha,
        round_timeout=setup.round_timeout,
        federation=f"rsu-{strategy.replace('_', '-')}-{secrets.token_hex(2)}",
    )
    rounds = {
        "rounds": setup.rounds,
        "min_agents": setup.coverage,
        "expected_agents": setup.coverage,
        "min_updates": 1,
        "round_timeout": setup.round_timeout,
        "local_epochs": setup.local_epochs,
        "lr": setup.lr,
        "batch_size": setup.batch_size,
        "seed": setup.seed,
        "lr_schedule": "cosine",
        "aggregation": strategy,
        # Plain FedAvg's server step, as results/flsimco was measured (before server
        # momentum became the default): the paper's comparison is of aggregations alone.
        "server_momentum": 0.0,
    }
    if strategy == "drop_above":
        rounds.update(weight_key="speed", drop_above=setup.threshold)
    schedule = setup.schedule()
    started = time.monotonic()
    arrivals: list[dict[str, Any]] = []
    try:
        fed.prepare()
        # Uncompressed updates, as when results/flsimco was measured (before int8 became
        # the default): a rerun reproduces those figures.
        fed.write_coordinator("flsimco", {"seed": setup.seed, "speed": 0.0}, rounds, {"compression": "none"})
        fed.spawn("coordinator")
        queue = list(schedule)
        vehicles: dict[str, Proc] = {}
        stays = {v["id"]: v["stay"] for v in schedule}
        rounds_in: dict[str, int] = {}
        seen_round = 0

        def drive_in() -> None:
            if not queue:
                raise FedagentError("the vehicle schedule ran out before the last round")
            v = queue.pop(0)
            vehicles[v["id"]] = fed.add_agent(
                v["id"], "flsimco", _vehicle_options(setup, v), {"leave_after": v["stay"]}
            )
            arrivals.append({**v, "at": round(time.monotonic() - started, 2)})

        for _ in range(setup.coverage):
            drive_in()
        while True:
            st = fed.status("coordinator")
            if st is not None:
                if progress is not None:
                    progress(
                        st["completed_rounds"], f"{strategy}: round {st['round']}, {len(vehicles)} vehicles running"
                    )
                if st["phase"] == "done":
                    break
                if st["phase"] == "training" and st["round"] > seen_round:
                    if st["round"] != seen_round + 1:
                        raise FedagentError(f"{strategy}: the driver missed round {seen_round + 1}")
                    seen_round = st["round"]
                    # A vehicle in its last round is replaced now, not when it has left:
                    # the newcomer starts (tens of seconds on busy cores) while this round
                    # trains, and the RSU, which never selects into a running round and
                    # waits for ``coverage`` vehicles, takes it from the next round on.
                    for vid in st["selected"]:
                        rounds_in[vid] = rounds_in.get(vid, 0) + 1
                        if rounds_in[vid] == stays[vid] and seen_round < setup.rounds:
                            drive_in()
            coord = next(p for p in fed.procs if p.name == "coordinator")
            if coord.popen.poll() is not None:
                raise FedagentError(f"the RSU (coordinator) exited; log: {coord.log}")
            for vid, proc in list(vehicles.items()):
                code = proc.popen.poll()
                if code is None:
                    continue
                if code != 0:
                    tail = proc.log.read_text(errors="replace")[-1500:]
                    raise FedagentError(f"{vid} exited with code {code}:\n{tail}")
                del vehicles[vid]  # left the coverage
            if time.monotonic() - started > time_limit:
                raise FedagentError(f"{strategy}: not finished after {time_limit:.0f}s; logs in {work / 'logs'}")
            time.sleep(0.2)
        seconds = time.monotonic() - started
        hist = work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        records = history.read_records(hist)
        evals: dict[int, float] = {}
        heldout: dict[int, float] = {}
        updates: dict[int, dict[str, float]] = {}  # round -> vehicle -> its uploaded model's loss
        lefts: list[dict[str, Any]] = []
        for vid in fed.agent_ids:
            h = work / "state" / vid / "agent" / fed.fed / "history.jsonl"
            for r in history.read_records(h):
                if r["event"] == "global_eval":
                    # Every vehicle evaluates on the same held-out images with the same
                    # augmentation seed, so any one of them speaks for the model version.
                    if "knn_accuracy" in r["metrics"]:
                        evals[int(r["model_version"])] = float(r["metrics"]["knn_accuracy"])
                    if "simco_loss" in r["metrics"]:
                        heldout[int(r["model_version"])] = float(r["metrics"]["simco_loss"])
                elif r["event"] == "update" and "loss" in r["metrics"]:
                    updates.setdefault(int(r["round"]), {})[vid] = float(r["metrics"]["loss"])
                elif r["event"] == "left":
                    lefts.append({"vehicle": vid, **r})
        return {
            "strategy": strategy,
            "seconds": seconds,
            "records": records,
            "evals": evals,
            "heldout": heldout,
            "updates": updates,
            "left": lefts,
            "arrivals": arrivals,
            "final_weights": fed.final_weights()[0],
        }
    finally:
        fed.close()


def final_eval(weights, setup: Setup) -> dict[str, float]:
    """kNN accuracy and held-out SimCo loss of ``weights`` (None: the untrained encoder)."""
    from fedagent.tasks.base import load_task, set_weights

    task = load_task("flsimco", {"seed": setup.seed, "speed": 0.0})
    model = task.build_model()
    if weights is not None:
        set_weights(model, weights)
    return task.evaluate(model)


def _series_stats(values: list[float]) -> tuple[float, float, float]:
    """Last value, mean of the second half, variance of the round-to-round change."""
    if not values:
        return math.nan, math.nan, math.nan
    diffs = [b - a for a, b in itertools.pairwise(values)]
    half = values[len(values) // 2 :]
    return values[-1], statistics.fmean(half), statistics.pvariance(diffs) if len(diffs) > 1 else math.nan


def loss_series(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Per round: ``train`` the mean loss of the models the vehicles uploaded (all of them,
    dropped ones included: each trained from the same global model), ``aggregated`` the
    mean over the models that entered the aggregate, and ``heldout`` the SimCo loss of the
    global model after the round on the fixed held-out batches."""
    rounds = [r for r in result["records"] if r["event"] == "round"]
    train, agg, held = [], [], []
    for r in rounds:
        by_vehicle = result["updates"].get(int(r["round"]), {})
        if by_vehicle:
            train.append((r["round"], statistics.fmean(by_vehicle.values())))
            kept = [v for a, v in by_vehicle.items() if a in r["participants"]]
            if kept:
                agg.append((r["round"], statistics.fmean(kept)))
        h = result["heldout"].get(int(r["model_version"]))
        if h is not None:
            held.append((r["round"], h))
    return {"train": train, "aggregated": agg, "heldout": held}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    rounds = [r for r in result["records"] if r["event"] == "round"]
    series = loss_series(result)
    train_last, train_half, train_var = _series_stats([v for _, v in series["train"]])
    held_last, held_half, held_var = _series_stats([v for _, v in series["heldout"]])
    return {
        "rounds": len(rounds),
        "abandoned": sum(1 for r in result["records"] if r["event"] == "abandoned"),
        "final_loss": train_last,
        "mean_loss_second_half": train_half,
        "var_round_to_round": train_var,
        "heldout_rounds": len(series["heldout"]),
        "final_heldout_loss": held_last,
        "mean_heldout_second_half": held_half,
        "var_heldout_round_to_round": held_var,
        "models_aggregated": sum(len(r["participants"]) for r in rounds),
        "models_dropped": sum(len(r.get("dropped") or {}) for r in rounds),
        "seconds": result["seconds"],
    }


COLLAPSE_FRACTION = 0.97


def collapse_check(summary: dict[str, Any], baseline: dict[str, float]) -> list[str]:
    """Why a strategy's encoder counts as collapsed (empty: it does not). An encoder that
    cannot tell images apart has a SimCo loss of log(M) (uniform softmax over M = batch
    size candidates); one whose features are worse than random ones falls below the
    untrained encoder's kNN accuracy."""
    from fedagent.tasks.flsimco import EVAL_BATCH

    bound = COLLAPSE_FRACTION * math.log(EVAL_BATCH)
    why = []
    if not summary["final_heldout_loss"] < bound:
        why.append(
            f"held-out loss {summary['final_heldout_loss']:.3f} >= {COLLAPSE_FRACTION} log {EVAL_BATCH} = {bound:.3f}"
        )
    if not summary["final_knn"] > baseline["knn_accuracy"]:
        why.append(f"kNN accuracy {summary['final_knn']:.3f} <= untrained encoder's {baseline['knn_accuracy']:.3f}")
    return why


def write_flsimco_report(
    setup: Setup, results: dict[str, dict[str, Any]], out: Path, baseline: dict[str, float]
) -> Path:
    """``results[strategy]`` is :func:`run_strategy`'s answer plus ``final`` (the final
    global model's :func:`final_eval`); ``baseline`` is the untrained encoder's."""
    from fedagent.local.report import _plot
    from fedagent.tasks.flsimco import EVAL_BATCH

    out.mkdir(parents=True, exist_ok=True)
    for r in results.values():
        # The last global model is evaluated here rather than taken from the vehicles:
        # the ones in range may shut down before they get round to it.
        last = max((x["model_version"] for x in r["records"] if x["event"] == "round"), default=0)
        r["heldout"] = {**r["heldout"], last: r["final"]["simco_loss"], 0: baseline["simco_loss"]}
        r["evals"] = {**r["evals"], last: r["final"]["knn_accuracy"], 0: baseline["knn_accuracy"]}
    summary = {s: summarize(r) for s, r in results.items()}
    for s, r in results.items():
        summary[s]["final_knn"] = r["final"]["knn_accuracy"]
        summary[s]["collapsed"] = collapse_check(summary[s], baseline)
    held_series, train_series, knn_series = {}, {}, {}
    for s, r in results.items():
        ls = loss_series(r)
        held_series[LABELS[s]] = (
            [0] + [x for x, _ in ls["heldout"]],
            [baseline["simco_loss"]] + [v for _, v in ls["heldout"]],
        )
        train_series[LABELS[s]] = ([x for x, _ in ls["train"]], [v for _, v in ls["train"]])
        ev = sorted(r["evals"].items())
        knn_series[LABELS[s]] = ([v for v, _ in ev], [a for _, a in ev])
    log_m = math.log(EVAL_BATCH)
    held_series[f"log {EVAL_BATCH} (no discrimination)"] = ([0, setup.rounds], [log_m, log_m])
    knn_series["untrained encoder"] = ([0, setup.rounds], [baseline["knn_accuracy"]] * 2)
    _plot(
        out / "loss.png",
        "SimCo loss of the global model after each round (fixed held-out batches)",
        "round",
        held_series,
        "dual-temperature loss",
    )
    _plot(
        out / "train_loss.png",
        "SimCo loss of the models the vehicles uploaded (last local epoch)",
        "round",
        train_series,
        "dual-temperature loss",
    )
    _plot(
        out / "knn.png",
        "kNN accuracy (k=10) of the global encoder, clean held-out digits",
        "global model version (= rounds aggregated)",
        knn_series,
        "kNN accuracy",
    )
    if "blur" in results:
        xs, ys = [], []
        speeds = {a["id"]: a["speed"] for a in results["blur"]["arrivals"]}
        for x in results["blur"]["records"]:
            if x["event"] == "round":
                for vid, w in (x.get("agg_weights") or {}).items():
                    xs.append(speeds.get(vid, math.nan))
                    ys.append(w)
        _plot(
            out / "weights.png",
            "eq. 11: a vehicle's aggregation weight against its speed",
            "speed (km/h)",
            {"weight in its round": (xs, ys)},
            "normalised weight",
            kind="scatter",
        )
    mean, var = truncated_gaussian_moments(**setup.mobility)
    speeds_all = [a["speed"] for a in next(iter(results.values()))["arrivals"]]
    above = sum(1 for v in speeds_all if v > setup.threshold)
    lines = [
        "# FLSimCo on fedagent: blur-weighted aggregation against FedAvg and dropping blurred models",
        "",
        f"Scale: {setup.rounds} rounds, {setup.coverage} vehicles in range of the RSU per round, each vehicle "
        f"stays {setup.stay} rounds (a separate `fedagent agent` process that joins, trains and leaves), "
        f"{len(speeds_all)} vehicle visits per strategy; UCI digits upsampled to 16x16, "
        f"{setup.shards} shards split "
        + ("IID" if setup.alpha == 0 else f"by Dirichlet alpha={setup.alpha}")
        + f"; SimCo (tau_alpha=0.1, tau_beta=1.0) on a small ResNet, {setup.local_epochs} local epochs, "
        f"batch {setup.batch_size}, SGD lr {setup.lr} with cosine decay over the rounds.",
        "",
        f"Mobility (eq. 1): truncated Gaussian mu={setup.mobility['mu']}, sigma={setup.mobility['sigma']}, "
        f"[{setup.mobility['v_min']}, {setup.mobility['v_max']}] km/h (mean {mean:.1f}, sd {math.sqrt(var):.1f}); "
        f"blur (eq. 2) H s / Q = {DEFAULT_CAMERA['exposure'] * DEFAULT_CAMERA['focal'] / DEFAULT_CAMERA['pixel']:.3f} "
        f"px per km/h. {above} of {len(speeds_all)} visits were above {setup.threshold:g} km/h. "
        "The same vehicle schedule (speeds, shards, stays) is used for all three strategies.",
        "",
        "Losses: *held-out* is the SimCo loss of the global model after the round on the same "
        f"{len(range(0, 450 - EVAL_BATCH + 1, EVAL_BATCH))} clean held-out batches of {EVAL_BATCH} with the same "
        "augmentation draws for every model (what the aggregation produced, compared like for like); "
        "*uploaded* is the mean loss of the vehicles' own models in their last local epoch (every vehicle "
        "of the round, including models baseline 2 then dropped). Variances are of the round-to-round change.",
        "",
        "| strategy | rounds | held-out loss, final | held-out, 2nd-half mean | held-out, var of change | "
        "uploaded loss, final | uploaded, 2nd-half mean | uploaded, var of change | final kNN acc. | "
        "models aggregated | models dropped | wall time | collapsed? |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results:
        m = summary[s]
        lines.append(
            f"| {LABELS[s]} | {m['rounds']} | {m['final_heldout_loss']:.4f} | {m['mean_heldout_second_half']:.4f} | "
            f"{m['var_heldout_round_to_round']:.5f} | {m['final_loss']:.4f} | {m['mean_loss_second_half']:.4f} | "
            f"{m['var_round_to_round']:.5f} | {m['final_knn']:.3f} | {m['models_aggregated']} | "
            f"{m['models_dropped']} | {m['seconds']:.0f} s | {'**yes**' if m['collapsed'] else 'no'} |"
        )
    lines += [
        "",
        f"Untrained encoder (same seed): held-out loss {baseline['simco_loss']:.4f}, kNN accuracy "
        f"{baseline['knn_accuracy']:.3f}; log {EVAL_BATCH} = {log_m:.4f}.",
        "",
    ]
    lines += [
        "## Collapse check",
        "",
        f"A strategy counts as collapsed if its final global model's held-out loss is at least "
        f"{COLLAPSE_FRACTION} log {EVAL_BATCH} = {COLLAPSE_FRACTION * log_m:.3f} (it cannot tell images "
        "apart) or its kNN accuracy is not above the untrained encoder's.",
        "",
    ]
    for s in results:
        why = summary[s]["collapsed"]
        lines.append(f"- {LABELS[s]}: " + ("**collapsed**: " + "; ".join(why) if why else "not collapsed"))
    lines += [""]
    lines += _verdict(summary)
    lines += ["", "![held-out loss](loss.png)", "", "![uploaded loss](train_loss.png)", "", "![kNN](knn.png)", ""]
    if "blur" in results:
        lines += ["![weights](weights.png)", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "setup": {**setup.__dict__},
                "baseline": baseline,
                "summary": summary,
                "rounds": {
                    s: [x for x in r["records"] if x["event"] in ("round", "abandoned")] for s, r in results.items()
                },
                "uploaded_loss": {s: r["updates"] for s, r in results.items()},
                "heldout_loss": {s: r["heldout"] for s, r in results.items()},
                "evals": {s: r["evals"] for s, r in results.items()},
            },
            indent=1,
            default=str,
        )
    )
    return out / "report.md"


def _verdict(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The paper's claim (Fig. 5), checked on these numbers and stated either way: on the
    held-out loss of the global model (the aggregate itself) and on the uploaded loss."""
    if not {"blur", "fedavg", "drop_above"} <= set(summary):
        return []
    b, f, d = summary["blur"], summary["fedavg"], summary["drop_above"]
    checks = []
    for name, half, var in (
        ("held-out", "mean_heldout_second_half", "var_heldout_round_to_round"),
        ("uploaded", "mean_loss_second_half", "var_round_to_round"),
    ):
        checks += [
            (
                f"{name} loss: blur-weighted lower than FedAvg (2nd-half mean {b[half]:.4f} vs {f[half]:.4f})",
                b[half] < f[half],
            ),
            (
                f"{name} loss: blur-weighted steadier than FedAvg (variance of change {b[var]:.5f} vs {f[var]:.5f})",
                b[var] < f[var],
            ),
            (
                f"{name} loss: dropping blurred models worst (2nd-half mean {d[half]:.4f} vs "
                f"max of the others {max(b[half], f[half]):.4f})",
                d[half] > max(b[half], f[half]),
            ),
        ]
    out = ["## Does the paper's ordering hold here?", ""]
    out += [f"- {text}: **{'yes' if ok else 'no'}**" for text, ok in checks]
    if any(summary[s].get("collapsed") for s in ("blur", "fedavg", "drop_above")):
        out += ["", "**At least one strategy collapsed (see above): its ranking means nothing.**"]
    out += [
        "",
        "The differences are between runs with the same vehicles, data and seeds; run-to-run "
        "noise (floating-point order, which vehicle's update arrives first) is not measured by a "
        "single run, so small gaps should not be over-read.",
    ]
    return out


def run_experiment(
    out: Path, setup: Setup, strategies: tuple[str, ...] = STRATEGIES, keep: bool = False, console=None
) -> Path:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    console = console or Console()
    work = Path(tempfile.mkdtemp(prefix="fedagent-flsimco-"))
    results: dict[str, dict[str, Any]] = {}
    console.print(
        f"[bold]FLSimCo[/]: {len(strategies)} strategies x {setup.rounds} rounds, {setup.coverage} "
        f"vehicles per round, each staying {setup.stay}; work dir {work}"
    )
    try:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console) as bar:
            for s in strategies:
                task = bar.add_task(s, total=setup.rounds)

                def advance(done: int, desc: str, t: TaskID = task) -> None:
                    bar.update(t, completed=done, description=desc)

                res = run_strategy(setup, s, work / s, progress=advance)
                bar.update(task, completed=setup.rounds, description=f"{s}: done in {res['seconds']:.0f}s")
                res["final"] = final_eval(res.pop("final_weights"), setup)
                results[s] = res
        report = write_flsimco_report(setup, results, out, final_eval(None, setup))
        console.print(report.read_text().split("\n## ")[0])
        console.print(f"report: [green]{report}[/]")
        return report
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
