"""Flower's server step, for bench/tests/test_bench_tta.py to set beside fedagent's (runs in
bench/.venv-flower): a few rounds of three clients' random replies, each aggregated by
Flower's ``FedAvg`` (the weighted mean) and by its ``FedAvgM`` with the server momentum
and learning rate read from stdin as JSON (``{"seed", "momentum", "lr", "rounds"}``).
Prints JSON: the initial model and, per round, the mean and FedAvgM's next model.

The strategies are called as their ServerApp calls them after each training round
(``aggregate_train``), outside a run, so the identity a Message needs is set by hand.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM
from flwr.supercore.task_identity import TaskIdentity

SHAPES = {"conv.weight": (4, 3), "conv.bias": (5,)}
CLIENTS = 3


def main() -> None:
    spec = json.load(sys.stdin)
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    rng = np.random.default_rng(spec["seed"])
    model = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    fedavgm = FedAvgM(server_momentum=spec["momentum"], server_learning_rate=spec["lr"])
    fedavgm.current_arrays = ArrayRecord({k: Array(v.copy()) for k, v in model.items()})
    out = {"initial": {k: v.tolist() for k, v in model.items()}, "rounds": []}
    for r in range(1, spec["rounds"] + 1):
        replies = []
        for c in range(CLIENTS):
            trained = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()}
            content = RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in trained.items()}),
                    "metrics": MetricRecord({"num-examples": int(rng.integers(5, 50))}),
                }
            )
            replies.append(Message(content, dst_node_id=c + 1, message_type="train"))
        mean, _ = FedAvg().aggregate_train(r, replies)
        nxt, _ = fedavgm.aggregate_train(r, replies)
        model = {k: nxt[k].numpy() for k in model}
        out["rounds"].append(
            {"mean": {k: mean[k].numpy().tolist() for k in model}, "model": {k: v.tolist() for k, v in model.items()}}
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
