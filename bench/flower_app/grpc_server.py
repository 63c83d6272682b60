"""Flower's gRPC deployment (``start_server``), FedAvg, fit only, timing each round.

A round is timed from ``configure_fit`` (the server is about to send the model) to
the end of ``aggregate_fit`` (the weighted mean exists): the same span fedagent's
benchmark times. Round times go to ``--out`` as JSON.

    python grpc_server.py --port P --clients 10 --params 11200000 --rounds 6 --out times.json
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
from flwr.common import ndarrays_to_parameters  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

from common import model_weights  # noqa: E402

MAX_MESSAGE = 1 << 30


class TimedFedAvg(FedAvg):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started: dict[int, float] = {}
        self.times: list[float] = []

    def configure_fit(self, server_round, parameters, client_manager):
        self.started[server_round] = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        if failures or len(results) != self.min_fit_clients:
            raise RuntimeError(f"round {server_round}: {len(results)} results, {len(failures)} failures")
        self.times.append(time.perf_counter() - self.started[server_round])
        print(f"flower round {server_round}: {self.times[-1]:.3f} s", flush=True)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"),
                    help="serve over TLS with these PEM files")
    a = ap.parse_args()
    certificates = None
    if a.tls:
        certificates = tuple(open(p, "rb").read() for p in a.tls)
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=a.clients,
                           min_available_clients=a.clients, min_evaluate_clients=0,
                           initial_parameters=ndarrays_to_parameters(model_weights(a.params)))
    fl.server.start_server(server_address=f"127.0.0.1:{a.port}",
                           config=fl.server.ServerConfig(num_rounds=a.rounds),
                           strategy=strategy, grpc_max_message_length=MAX_MESSAGE,
                           certificates=certificates)
    with open(a.out, "w") as f:
        json.dump({"flwr": fl.__version__ if hasattr(fl, "__version__") else "?",
                   "times": strategy.times}, f)


if __name__ == "__main__":
    main()
