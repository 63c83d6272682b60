"""Bytes saved and accuracy cost of each update compression on the built-in digits task.

What runs: the in-memory harness with real training — the real round machine, real
torch training of every agent on its non-IID shard of scikit-learn's digits (Dirichlet
α = 0.3), and each update through the real wire path (the agent's ``Compressor`` with
its top-k residual, the stream payload, 256 KiB chunks, the coordinator's
``StreamIntake`` folding it into the round's sums) — without the broker, whose cost is
not what this measures. Same seeds for every mode. Run: ``python bench/compression.py``.

``python bench/compression.py --cpu`` measures instead what compression costs in CPU
time (``time.process_time``, one thread) per update at 1.1M and 11.2M parameters: the
agent's side (the delta, quantisation, the stream payload with its SHA-256) and the
coordinator's (the stream intake with its SHA-256, dequantisation, the fold into the
round's sum), for ``none`` and ``int8``. TLS and the broker are not in it: they handle
the bytes, a quarter as many with int8.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fedagent.protocols.aggregation import WeightedMean
from fedagent.protocols.codec import Envelope
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.downlink import rebuild
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import AgentOnline, RoundAggregated, RoundConfig, RoundMachine, StartRound
from fedagent.protocols.streaming import (
    HEAD_KIND,
    StreamIntake,
    UpdatePart,
    encode_stream,
    head_body,
    iter_stream_chunks,
)
from fedagent.tasks.base import get_weights, set_weights
from fedagent.tasks.digits import make as make_digits

FED = "bench"
MODES = [("none", 1.0), ("fp16", 1.0), ("int8", 1.0), ("topk", 0.1), ("topk", 0.01)]


def federation(
    mode: str,
    ratio: float,
    agents: int,
    rounds: int,
    alpha: float,
    seed: int,
    epochs: int = 1,
    *,
    task: str = "digits",
    downlink: bool = False,
) -> dict:
    """``task``: "digits" (the demo's model) or "tta" (the time-to-accuracy CNN of
    bench/tta_task.py). ``downlink``: also send the model as int8 steps
    (``RoundConfig(downlink="int8")``, what the daemons do by default with int8 updates),
    checking that what the agents rebuild is the machine's own model."""
    torch.manual_seed(seed)
    make = make_digits
    if task == "tta":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench.tta_task import make as make_tta

        make = make_tta
    tasks = [make({"shard": i, "shards": agents, "alpha": alpha, "seed": seed}) for i in range(agents)]
    models = [t.build_model() for t in tasks]
    global_w = get_weights(models[0])
    model_bytes = sum(v.nbytes for v in global_w.values())
    train = TrainConfig(epochs=epochs, lr=0.05, batch_size=32)
    m = RoundMachine(
        RoundConfig(
            rounds=rounds,
            min_agents=agents,
            expected_agents=agents,
            train=train,
            downlink="int8" if downlink else "none",
        ),
        global_w,
    )
    names = [f"a{i}" for i in range(agents)]
    cmds = []
    for i, a in enumerate(names):
        cmds += m.handle(AgentOnline(a, tasks[i].num_samples()), 0.0)
    comps = [Compressor(CompressionConfig(mode, ratio)) for _ in names]
    intake = StreamIntake(FED, max_transfer_bytes=2**28, max_pending_bytes=2**24, timeout=60)
    sent = 0
    updates = 0
    final = None
    seq = 0
    evaluator = tasks[0]
    model = evaluator.build_model()
    by_round: list[float] = []
    sent_global: dict[str, np.ndarray] | None = None
    while True:
        start = next((c for c in cmds if isinstance(c, StartRound)), None)
        agg = [c for c in cmds if isinstance(c, RoundAggregated)]
        if agg:
            set_weights(model, agg[-1].weights)
            by_round.append(float(evaluator.evaluate(model)["accuracy"]))
        if agg and agg[-1].final:
            final = agg[-1].weights
            break
        assert start is not None, cmds
        if downlink:
            # What every agent holds: the first model whole, then rebuilt from each int8
            # step (the machine's own model is the same, to the bit).
            sent_global = start.weights if start.delta is None else rebuild(sent_global or {}, start.delta)
            for k, w in sent_global.items():
                np.testing.assert_array_equal(w, start.weights[k])
        cmds = []
        for i, a in enumerate(names):
            set_weights(models[i], start.weights)
            metrics = tasks[i].fit(
                models[i],
                epochs=train.epochs,
                lr=start.train.lr,
                batch_size=train.batch_size,
                seed=seed * 1000 + start.round * 10 + i,
            )
            tensors = comps[i].encode(get_weights(models[i]), start.weights)
            seq += 1
            head = Envelope(
                kind=HEAD_KIND,
                federation=FED,
                sender=a,
                round=start.round,
                seq=seq,
                ts=time.time(),
                body=head_body(start.round, start.model_version, tasks[i].num_samples(), metrics, False, tensors),
            )
            payload = encode_stream(head, tensors)
            sent += len(payload)
            updates += 1
            for body in iter_stream_chunks(payload, max_chunk=256 * 1024, transfer_id=f"t{seq}"):
                for ev in intake.feed(a, body, 0.0):
                    cmds += m.handle(ev, 1.0)
    set_weights(model, final)
    acc = evaluator.evaluate(model)["accuracy"]
    return {
        "seed": seed,
        "accuracy_by_round": by_round,
        "mode": mode if mode != "topk" else f"topk {ratio:g}",
        "accuracy": acc,
        "bytes_per_update": sent / updates,
        "model_bytes": model_bytes,
        "rounds": rounds,
    }


def cpu_cost(params: int, mode: str, repeats: int = 5, chunk: int = 4 * 2**20) -> dict[str, float]:
    """Median CPU seconds per update on each side for ``mode`` (see the module's doc)."""
    import hashlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.env import model_weights

    base = model_weights(params)
    rng = np.random.default_rng(1)
    trained = {k: v + rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in base.items()}
    agent, coord, sizes = [], [], []
    for r in range(repeats):
        t0 = time.process_time()
        tensors = Compressor(CompressionConfig(mode)).encode(trained, base)
        head = Envelope(
            kind=HEAD_KIND,
            federation=FED,
            sender="a",
            round=1,
            seq=r + 1,
            ts=time.time(),
            body=head_body(1, 0, 1, {}, False, tensors),
        )
        payload = encode_stream(head, tensors)
        digest = hashlib.sha256(payload).digest()
        bodies = list(iter_stream_chunks(payload, max_chunk=chunk, transfer_id=f"t{r}", digest=digest))
        t1 = time.process_time()
        intake = StreamIntake(FED, max_transfer_bytes=2**30, max_pending_bytes=2**26, timeout=60)
        acc = WeightedMean(base)
        for body in bodies:
            for ev in intake.feed("a", body, 0.0):
                if isinstance(ev, UpdatePart):
                    acc.fold(ev.name, ev.start, ev.values, ev.indices, 1.0, delta=ev.delta)
        acc.count_in(1.0)
        t2 = time.process_time()
        agent.append(t1 - t0)
        coord.append(t2 - t1)
        sizes.append(len(payload))
        del tensors, payload, bodies
    return {
        "params": params,
        "mode": mode,
        "agent_cpu_s": float(np.median(agent)),
        "coordinator_cpu_s": float(np.median(coord)),
        "payload_bytes": sizes[0],
    }


def cpu_main(sizes: list[int], repeats: int) -> list[dict]:
    rows = [cpu_cost(n, mode, repeats) for n in sizes for mode in ("none", "int8")]
    table = Table(title=f"CPU per update, median of {repeats} (time.process_time, one thread)")
    for col in ("params", "compression", "payload", "agent CPU", "coordinator CPU (intake + fold)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['params'] / 1e6:.1f}M",
            r["mode"],
            f"{r['payload_bytes'] / 1e6:.1f} MB",
            f"{1e3 * r['agent_cpu_s']:.1f} ms",
            f"{1e3 * r['coordinator_cpu_s']:.1f} ms",
        )
    Console().print(table)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--seeds", type=int, default=2, help="repeat with this many seeds; mean accuracy")
    ap.add_argument("--epochs", type=int, default=1, help="local epochs a round (the demo: 2)")
    ap.add_argument("--modes", nargs="+", help="only these (none, fp16, int8, topk0.1, topk0.01)")
    ap.add_argument("--task", choices=("digits", "tta"), default="digits", help="tta: the 1.1M-parameter CNN")
    ap.add_argument("--downlink", action="store_true", help="also send the global model as int8 deltas")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu", action="store_true", help="CPU cost per update of none and int8 (no training)")
    ap.add_argument("--params", type=float, nargs="+", default=[1.1e6, 11.2e6], help="--cpu: model sizes")
    ap.add_argument("--repeats", type=int, default=5, help="--cpu: updates per size and mode")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cpu:
        rows = cpu_main([int(n) for n in args.params], args.repeats)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return rows
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        modes = [(m, r) for m, r in MODES if not args.modes or (m if m != "topk" else f"topk{r:g}") in args.modes]
        task = progress.add_task("federations", total=len(modes) * args.seeds)
        for mode, ratio in modes:
            runs = []
            for s in range(args.seeds):
                runs.append(
                    federation(
                        mode,
                        ratio,
                        args.agents,
                        args.rounds,
                        args.alpha,
                        seed=s,
                        epochs=args.epochs,
                        task=args.task,
                        downlink=args.downlink,
                    )
                )
                progress.advance(task)
            rows.append(
                {
                    **{k: v for k, v in runs[0].items() if k not in ("seed", "accuracy_by_round")},
                    "accuracy": float(np.mean([r["accuracy"] for r in runs])),
                    "accuracies": [r["accuracy"] for r in runs],
                    "runs": runs,
                }
            )
    base = rows[0]
    table = Table(
        title=f"Update compression on digits ({args.agents} agents, {args.rounds} rounds, "
        f"{args.epochs} local epoch(s), α = {args.alpha}, mean of {args.seeds} seeds; in-memory harness, real training)"
    )
    for col in ("compression", "bytes / update", "saved vs none", "accuracy", "accuracy cost (points)"):
        table.add_column(col, justify="right")
    for r in rows:
        r["saved"] = 1 - r["bytes_per_update"] / base["bytes_per_update"]
        r["accuracy_cost"] = 100 * (base["accuracy"] - r["accuracy"])
        table.add_row(
            r["mode"],
            f"{r['bytes_per_update']:,.0f}",
            f"{100 * r['saved']:.1f}%",
            f"{r['accuracy']:.4f}",
            f"{r['accuracy_cost']:+.2f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
