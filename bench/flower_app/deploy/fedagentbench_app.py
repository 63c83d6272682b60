"""Flower's current deployment mode (SuperLink + SuperNodes + ``flwr run``) on
fedagent's benchmark shape: FedAvg, training off (each ClientApp returns the arrays
it was sent), the same tensors as bench/env.py. Each round is timed from
``configure_train`` to the end of ``aggregate_train``; the times go to the file named
by the run config ``out``."""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg


def model_weights(params: int, seed: int = 0, tensors: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    return [rng.standard_normal(n, dtype=np.float32) for n in sizes]


client_app = ClientApp()


@client_app.train()
def echo(msg: Message, context: Context) -> Message:
    content = RecordDict({"arrays": msg.content["arrays"],
                          "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, reply_to=msg)


class TimedFedAvg(FedAvg):
    def __init__(self, out: str, **kw) -> None:
        super().__init__(**kw)
        self.out = out
        self.started: dict[int, float] = {}
        self.times: list[float] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.started[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        out = super().aggregate_train(server_round, replies)
        ok = sum(1 for r in replies if not r.has_error())
        if ok != self.min_train_nodes:
            raise RuntimeError(f"round {server_round}: {ok} replies of {self.min_train_nodes}")
        self.times.append(time.perf_counter() - self.started[server_round])
        # replaced whole, so that bench/flower.py never reads a half-written file
        with open(self.out + ".tmp", "w") as f:
            json.dump({"times": self.times}, f)
        os.replace(self.out + ".tmp", self.out)
        return out


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["clients"])
    strategy = TimedFedAvg(str(cfg["out"]), fraction_train=1.0, fraction_evaluate=0.0,
                           min_train_nodes=n, min_available_nodes=n, min_evaluate_nodes=0)
    arrays = ArrayRecord(model_weights(int(cfg["params"])))
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(cfg["rounds"]))
