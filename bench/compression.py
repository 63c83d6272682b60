"""Bytes saved and accuracy cost of each update compression on the built-in digits task.

What runs: the in-memory harness with real training — the real round machine, real
torch training of every agent on its non-IID shard of scikit-learn's digits (Dirichlet
α = 0.3), and each update through the real wire path (the agent's ``Compressor`` with
its top-k residual, the stream payload, 256 KiB chunks, the coordinator's
``StreamIntake`` folding it into the round's sums) — without the broker, whose cost is
not what this measures. Same seeds for every mode. Run: ``python bench/compression.py``.
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

from fedagent.protocols.codec import Envelope
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import AgentOnline, RoundAggregated, RoundConfig, RoundMachine, StartRound
from fedagent.protocols.streaming import HEAD_KIND, StreamIntake, encode_stream, head_body, iter_stream_chunks
from fedagent.tasks.base import get_weights, set_weights
from fedagent.tasks.digits import make as make_digits

FED = "bench"
MODES = [("none", 1.0), ("fp16", 1.0), ("int8", 1.0), ("topk", 0.1), ("topk", 0.01)]


def federation(mode: str, ratio: float, agents: int, rounds: int, alpha: float, seed: int) -> dict:
    torch.manual_seed(seed)
    tasks = [make_digits({"shard": i, "shards": agents, "alpha": alpha, "seed": seed}) for i in range(agents)]
    models = [t.build_model() for t in tasks]
    global_w = get_weights(models[0])
    model_bytes = sum(v.nbytes for v in global_w.values())
    train = TrainConfig(epochs=1, lr=0.05, batch_size=32)
    m = RoundMachine(RoundConfig(rounds=rounds, min_agents=agents, expected_agents=agents, train=train), global_w)
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
    while True:
        start = next((c for c in cmds if isinstance(c, StartRound)), None)
        agg = [c for c in cmds if isinstance(c, RoundAggregated)]
        if agg and agg[-1].final:
            final = agg[-1].weights
            break
        assert start is not None, cmds
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
    evaluator = tasks[0]
    model = evaluator.build_model()
    set_weights(model, final)
    acc = evaluator.evaluate(model)["accuracy"]
    return {
        "mode": mode if mode != "topk" else f"topk {ratio:g}",
        "accuracy": acc,
        "bytes_per_update": sent / updates,
        "model_bytes": model_bytes,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--seeds", type=int, default=2, help="repeat with this many seeds; mean accuracy")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("federations", total=len(MODES) * args.seeds)
        for mode, ratio in MODES:
            runs = []
            for s in range(args.seeds):
                runs.append(federation(mode, ratio, args.agents, args.rounds, args.alpha, seed=s))
                progress.advance(task)
            rows.append(
                {
                    **runs[0],
                    "accuracy": float(np.mean([r["accuracy"] for r in runs])),
                    "accuracies": [r["accuracy"] for r in runs],
                }
            )
    base = rows[0]
    table = Table(
        title=f"Update compression on digits ({args.agents} agents, {args.rounds} rounds, "
        f"α = {args.alpha}, mean of {args.seeds} seeds; in-memory harness, real training)"
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
