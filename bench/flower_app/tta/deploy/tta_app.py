"""Flower's deployment mode (SuperLink + SuperNodes + ``flwr run``) in the
time-to-accuracy benchmark: the shared CNN (tta_model.py and data.py are copied next to
this file by bench/tta.py) with Flower's defaults except that all 10 nodes train every
round; Flower's default federated evaluation (every node, every round) gives the
held-out accuracy. Each SuperNode's ``partition-id`` (node config) is its shard.

The run config's ``strategy`` picks the server's algorithm: ``fedavg`` (Flower's
default, plain FedAvg) or ``fedavgm`` (Flower's FedAvgM with ``server-momentum`` and
``server-lr``, the setting fedagent's coordinator has by default); ``seed`` the initial
model's.

The run config's ``out`` gets, per round, the wall-clock start (``configure_train``),
the time the global model existed (end of ``aggregate_train``) and its accuracy. Once a
model reaches ``target`` the remaining rounds select no nodes.
"""

from __future__ import annotations

import json
import os
import time

import data
import torch
import tta_model as m
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedAvgM

client_app = ClientApp()


def _model(msg: Message) -> torch.nn.Module:
    torch.set_num_threads(1)
    model = m.build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    shard = int(context.node_config["partition-id"])
    x, y, _, _ = data.load(str(context.run_config["data"]), shard)
    model = _model(msg)
    # The seed fedagent's agents train with (the round number): every shard is shuffled
    # in the same order on both sides, so a like-for-like pair differs in the system only.
    seed = int(msg.content["config"]["server-round"])
    metrics = m.train(model, x, y, epochs=m.LOCAL_EPOCHS, lr=m.LR, batch_size=m.BATCH, seed=seed)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"loss": metrics["loss"], "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, xte, yte = data.load(str(context.run_config["data"]), None)
    metrics = m.evaluate(_model(msg), xte, yte)
    content = RecordDict({"metrics": MetricRecord({**metrics, "num-examples": len(yte)})})
    return Message(content=content, reply_to=msg)


class Timed:
    """Times each round of the strategy it is mixed into (FedAvg or FedAvgM, whose
    ``aggregate_train`` applies the server step after FedAvg's mean)."""

    def __init__(self, out: str, target: float, **kw) -> None:
        super().__init__(**kw)
        self.out, self.target = out, target
        self.rounds: list[dict] = []
        self.reached = False

    def _dump(self) -> None:
        with open(self.out + ".tmp", "w") as f:
            json.dump({"rounds": self.rounds}, f)
        os.replace(self.out + ".tmp", self.out)

    def configure_train(self, server_round, arrays, config, grid):
        if self.reached:
            return []
        # sampling waits until all nodes are connected: the round starts after it
        messages = super().configure_train(server_round, arrays, config, grid)
        self.rounds.append({"round": server_round, "start": time.time()})
        return messages

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        if self.reached:
            return None, None
        out = super().aggregate_train(server_round, replies)
        ok = sum(1 for r in replies if not r.has_error())
        if ok != self.min_train_nodes:
            raise RuntimeError(f"round {server_round}: {ok} replies of {self.min_train_nodes}")
        self.rounds[-1]["end"] = time.time()
        return out

    def configure_evaluate(self, server_round, arrays, config, grid):
        if self.reached:
            return []
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        if self.reached:
            return None
        metrics = super().aggregate_evaluate(server_round, replies)
        acc = float(metrics["accuracy"])
        self.rounds[-1].update(accuracy=acc, evaluated=time.time())
        self.reached = acc >= self.target
        self._dump()
        return metrics


class TimedFedAvg(Timed, FedAvg):
    pass


class TimedFedAvgM(Timed, FedAvgM):
    pass


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["clients"])
    common = {"min_train_nodes": n, "min_available_nodes": n}
    if cfg["strategy"] == "fedavgm":
        strategy = TimedFedAvgM(
            str(cfg["out"]),
            float(cfg["target"]),
            server_momentum=float(cfg["server-momentum"]),
            server_learning_rate=float(cfg["server-lr"]),
            **common,
        )
    elif cfg["strategy"] == "fedavg":
        strategy = TimedFedAvg(str(cfg["out"]), float(cfg["target"]), **common)
    else:
        raise ValueError(f"unknown strategy {cfg['strategy']!r}")
    init = ArrayRecord(m.build_model(int(cfg["seed"])).state_dict())
    strategy.start(grid=grid, initial_arrays=init, num_rounds=int(cfg["rounds"]))
