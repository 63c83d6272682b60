"""Does a server-side optimizer cut the rounds to 95 % on the time-to-accuracy task?

An in-process replay of fedagent's tta federation (bench/tta.py): the same CNN
(bench/flower_app/tta/tta_model.py), the same digits task per seed (held-out quarter,
Dirichlet(0.5) split over 10 nodes, initial weights), 2 local epochs, lr 0.05, batch 32,
every node every round with the round number as its training seed (as the agents do),
the sample-weighted mean of the trained models, then a server step:

* ``fedavg``            x <- x + delta                          (delta = mean - x)
* ``lr=S``              x <- x + S * delta                      ([rounds] server_lr)
* ``m=B``               v <- B v + delta;        x <- x + v     (FedAvgM, Hsu et al. 2019)
* ``mn=B``              v <- B v + (1-B) delta;  x <- x + v     (the same, 1-B normalised)
* ``adam``              FedAdam (Reddi et al. 2021): m <- b1 m + (1-b1) delta,
                        v <- b2 v + (1-b2) delta^2, x <- x + eta m / (sqrt(v) + tau)
* ``...+int8``          the nodes' models go through int8 compression first

The global model is scored on the held-out set after every round; 20 rounds, more (up to
30) if 95 % is not reached by then. Rounds and accuracies only: times do not matter.

    nice -n 10 .venv/bin/python bench/studies/tta/server_opt_study.py [--seeds 0 1 2 3 4] [--settings ...]

``--daemons DIR --json results/tta/server_opt_daemons.json`` runs the settings the
coordinator has (fedavg, lr=S, m=B) through the daemons instead (bench/tta.py's
federation; about a minute a run on an idle machine).

Writes results/tta/server_opt_study.json (every run's accuracy per round; runs already
there are skipped) and prints the summary table of results/tta/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import tta_task  # noqa: E402
from bench.flower_app.tta import tta_model  # noqa: E402

TARGET = 0.95
ROUNDS = 20
MAX_ROUNDS = 30
SETTINGS = ["fedavg", "lr=1.5", "lr=2", "m=0.5", "m=0.7", "m=0.9", "mn=0.9", "adam"]


class ServerOpt:
    """The server step of one setting, over float64 flat vectors."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.state: dict[str, np.ndarray] = {}

    def step(self, x: np.ndarray, delta: np.ndarray) -> np.ndarray:
        s = self.setting.split("+")[0]
        if s == "fedavg":
            return x + delta
        kind, _, val = s.partition("=")
        if kind == "lr":
            return x + float(val) * delta
        if kind in ("m", "mn"):
            beta = float(val)
            v = self.state.get("v", np.zeros_like(x))
            v = beta * v + ((1 - beta) if kind == "mn" else 1.0) * delta
            self.state["v"] = v
            return x + v
        if kind == "adam":
            b1, b2, eta, tau = 0.9, 0.99, float(val or 0.01), 1e-3
            m = b1 * self.state.get("m", np.zeros_like(x)) + (1 - b1) * delta
            v = b2 * self.state.get("v", np.zeros_like(x)) + (1 - b2) * delta * delta
            self.state["m"], self.state["v"] = m, v
            return x + eta * m / (np.sqrt(v) + tau)
        raise ValueError(f"unknown setting {self.setting!r}")


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()]).double().numpy()


def load(model: torch.nn.Module, x: np.ndarray) -> None:
    sd, pos = model.state_dict(), 0
    for name, t in sd.items():
        n = t.numel()
        sd[name] = torch.from_numpy(x[pos : pos + n].astype(np.float32)).reshape(t.shape)
        pos += n
    model.load_state_dict(sd)


def int8_roundtrip(model: torch.nn.Module, base: torch.nn.Module) -> None:
    """fedagent's int8 update compression (per-tensor delta to the round's global model,
    protocols/compression.py) applied to one node's trained model."""
    from fedagent.protocols.compression import quantize_int8

    ref = base.state_dict()
    out = {}
    for k, w in model.state_dict().items():
        b = ref[k].numpy()
        q, scale = quantize_int8(w.numpy().astype(np.float32) - b)
        out[k] = torch.from_numpy(b + q.astype(np.float32) * np.float32(scale))
    model.load_state_dict(out)


def run(seed: int, setting: str) -> dict:
    shards = [
        tta_task.make({"shard": i, "shards": tta_model.CLIENTS, "alpha": tta_model.ALPHA, "seed": seed})
        for i in range(tta_model.CLIENTS)
    ]
    weights = np.array([s.num_samples() for s in shards], np.float64)
    weights /= weights.sum()
    glob = shards[0].build_model()
    node = shards[0].build_model()
    x = flat(glob)
    opt = ServerOpt(setting)
    accs: list[float] = []
    reached = None
    for rnd in range(1, MAX_ROUNDS + 1):
        mean = np.zeros_like(x)
        for w, task in zip(weights, shards, strict=True):
            load(node, x)
            task.fit(node, epochs=tta_model.LOCAL_EPOCHS, lr=tta_model.LR, batch_size=tta_model.BATCH, seed=rnd)
            if setting.endswith("+int8"):
                int8_roundtrip(node, glob)
            mean += w * flat(node)
        x = opt.step(x, mean - x)
        load(glob, x)
        acc = shards[0].evaluate(glob)["accuracy"]
        accs.append(acc)
        if reached is None and acc >= TARGET:
            reached = rnd
        if rnd >= ROUNDS and reached is not None:
            break
    return {
        "seed": seed,
        "setting": setting,
        "rounds_to_target": reached,
        "accuracy": accs,
        "final_accuracy": accs[ROUNDS - 1],
    }


def rounds_options(setting: str) -> dict:
    """The coordinator's [rounds] keys of a setting (the daemons have lr and momentum)."""
    kind, _, val = setting.partition("=")
    if setting == "fedavg":
        return {}
    if kind == "lr":
        return {"server_lr": float(val)}
    if kind == "m":
        return {"server_momentum": float(val)}
    raise SystemExit(f"{setting}: not a setting of the daemons")


def run_daemons(seed: int, setting: str, work: Path) -> dict:
    """The same through bench/tta.py's federation (coordinator, 10 agent daemons,
    Mosquitto, mutual TLS)."""
    from bench.tta import run_fedagent

    run = run_fedagent(
        work, print, seed=seed, rounds=MAX_ROUNDS, min_rounds=ROUNDS, rounds_options=rounds_options(setting)
    )
    reached = run.reached()
    return {
        "seed": seed,
        "setting": setting,
        "rounds_to_target": reached["round"] if reached else None,
        "accuracy": [r["accuracy"] for r in run.rounds],
        "final_accuracy": run.final_accuracy,
        "time_to_target_s": run.time_to_target if reached else None,
        "total_to_target_s": run.total_to_target if reached else None,
        "cpu_s": run.cpu,
    }


def table(results: list[dict], settings: list[str]) -> None:
    print(
        "| setting | rounds to 95 %, seeds "
        + ", ".join(str(s) for s in sorted({r["seed"] for r in results}))
        + " | mean | min-max | accuracy after 20 rounds, mean (min-max) | accuracy, mean of rounds 16-20 |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for s in settings:
        rs = sorted((r for r in results if r["setting"] == s), key=lambda r: r["seed"])
        if not rs:
            continue
        rt = [r["rounds_to_target"] if r["rounds_to_target"] is not None else MAX_ROUNDS + 1 for r in rs]
        fa = [r["final_accuracy"] for r in rs]
        late = [statistics.mean(r["accuracy"][15:20]) for r in rs]
        print(
            f"| {s} | {', '.join(str(r['rounds_to_target']) for r in rs)} | {statistics.mean(rt):.1f} |"
            f" {min(rt)}-{max(rt)} | {statistics.mean(fa):.4f} ({min(fa):.4f}-{max(fa):.4f}) |"
            f" {statistics.mean(late):.4f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--settings", nargs="+", default=SETTINGS)
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "tta" / "server_opt_study.json")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--daemons", type=Path, help="run through the daemons (bench/tta.py) in this work directory")
    ap.add_argument(
        "--merge", type=Path, nargs="*", default=[], help="more runs (from a parallel run's --json) for the table"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    if not args.table_only:
        for setting in args.settings:
            for seed in args.seeds:
                if any(r["seed"] == seed and r["setting"] == setting for r in results):
                    continue
                t0 = time.process_time()
                r = run(seed, setting) if args.daemons is None else run_daemons(seed, setting, args.daemons.resolve())
                results.append(r)
                args.json.write_text(json.dumps(results, indent=1))
                print(
                    seed,
                    setting,
                    r["rounds_to_target"],
                    f"{r['final_accuracy']:.4f}",
                    f"{time.process_time() - t0:.1f} CPU-s",
                    *(
                        [f"{r['time_to_target_s']:.2f} s to the target"]
                        if r.get("time_to_target_s") is not None
                        else []
                    ),
                    flush=True,
                )
    for extra in args.merge:
        have = {(r["seed"], r["setting"]) for r in results}
        results += [r for r in json.loads(extra.read_text()) if (r["seed"], r["setting"]) not in have]
    table(results, list(dict.fromkeys([*args.settings, *SETTINGS, *(r["setting"] for r in results)])))


if __name__ == "__main__":
    main()
