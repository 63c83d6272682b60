"""Flower's gRPC server (``start_server``) of the time-to-accuracy benchmark: FedAvg with
Flower's defaults except that all 10 clients train every round (``min_fit_clients`` and
``min_available_clients``, as fedagent's ``min_updates``/``expected_agents``). Flower's
default federated evaluation (every client, every round) gives the held-out accuracy.

Per round, ``--out`` (JSON, rewritten each round) gets the wall-clock time the round
started (``configure_fit``), the time its global model existed (end of ``aggregate_fit``)
and that model's accuracy. Once a model reaches ``--target`` the remaining rounds select
no clients, so the run ends right after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import flwr as fl  # noqa: E402
import tta_model as m  # noqa: E402
from flwr.common import ndarrays_to_parameters  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

MAX_MESSAGE = 1 << 30


def weighted_accuracy(results):
    n = sum(k for k, _ in results)
    return {"accuracy": sum(k * r["accuracy"] for k, r in results) / n}


class TimedFedAvg(FedAvg):
    def __init__(self, out: str, target: float, **kw) -> None:
        super().__init__(**kw)
        self.out, self.target = out, target
        self.rounds: list[dict] = []
        self.reached = False

    def _dump(self) -> None:
        with open(self.out + ".tmp", "w") as f:
            json.dump({"rounds": self.rounds}, f)
        os.replace(self.out + ".tmp", self.out)

    def configure_fit(self, server_round, parameters, client_manager):
        if self.reached:
            return []
        # sample() waits until all clients are connected: the round starts after it
        instructions = super().configure_fit(server_round, parameters, client_manager)
        self.rounds.append({"round": server_round, "start": time.time()})
        return instructions

    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        if failures or len(results) != self.min_fit_clients:
            raise RuntimeError(f"round {server_round}: {len(results)} results, {len(failures)} failures")
        self.rounds[-1]["end"] = time.time()
        return out

    def configure_evaluate(self, server_round, parameters, client_manager):
        if self.reached:
            return []
        return super().configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):
        loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        acc = float(metrics["accuracy"])
        self.rounds[-1].update(accuracy=acc, evaluated=time.time())
        print(f"flower round {server_round}: accuracy {acc:.4f}", flush=True)
        self.reached = acc >= self.target
        self._dump()
        return loss, metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=m.CLIENTS)
    ap.add_argument("--rounds", type=int, required=True, help="at most this many rounds")
    ap.add_argument("--target", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=m.SEED, help="the initial model's seed")
    a = ap.parse_args()
    init = [v.numpy().copy() for v in m.build_model(a.seed).state_dict().values()]
    strategy = TimedFedAvg(
        a.out,
        a.target,
        min_fit_clients=a.clients,
        min_available_clients=a.clients,
        on_fit_config_fn=lambda r: {"server_round": r},
        evaluate_metrics_aggregation_fn=weighted_accuracy,
        initial_parameters=ndarrays_to_parameters(init),
    )
    fl.server.start_server(
        server_address=f"127.0.0.1:{a.port}",
        config=fl.server.ServerConfig(num_rounds=a.rounds),
        strategy=strategy,
        grpc_max_message_length=MAX_MESSAGE,
    )


if __name__ == "__main__":
    main()
