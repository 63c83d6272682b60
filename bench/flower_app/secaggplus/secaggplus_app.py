"""Flower's SecAgg+ on fedagent's secure-aggregation benchmark shape: FedAvg under
``SecAggPlusWorkflow`` (server) and ``secaggplus_mod`` (client), 10 SuperNodes,
training off (each client returns the arrays it was sent, with weight 1), the tensors of
bench/env.py. The protocol parameters come from the run config (bench/flower.py sets
them from fedagent's SecAggParams; see ``secaggplus_config`` there for what maps).

Each round is timed from the strategy's ``configure_fit`` (the start of SecAgg+'s setup
stage) to the end of its ``aggregate_fit`` (after the unmasking stage), on
``time.monotonic`` so that bench/flower.py can match the round's span to the bytes its
relay counted. The unmasked mean is checked against what the clients sent (the model
clipped to the clipping range) within the quantisation step; a wrong sum stops the run.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow


def model_weights(params: int, seed: int = 0, tensors: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    return [rng.standard_normal(n, dtype=np.float32) for n in sizes]


class Echo(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}


client_app = ClientApp(client_fn=lambda context: Echo().to_client(), mods=[secaggplus_mod])


class TimedFedAvg(FedAvg):
    def __init__(self, out: str, expected: list[np.ndarray], tolerance: float, n: int, **kw) -> None:
        super().__init__(**kw)
        self.out = out
        self.expected = expected
        self.tolerance = tolerance
        self.n = n
        self.started: dict[int, float] = {}
        self.times: list[float] = []
        self.spans: list[tuple[float, float]] = []

    def configure_fit(self, server_round, parameters, client_manager):
        self.started[server_round] = time.monotonic()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        if failures or len(results) != self.n:
            raise RuntimeError(f"round {server_round}: {len(results)} results of {self.n}, {len(failures)} failures")
        # Under SecAgg+ every result carries the unmasked mean already (the workflow
        # sets it); FedAvg's weighted mean of ten equal copies is that mean again.
        out = super().aggregate_fit(server_round, results, failures)
        end = time.monotonic()
        mean = parameters_to_ndarrays(results[0][1].parameters)
        err = max(float(np.abs(m - e).max()) for m, e in zip(mean, self.expected, strict=True))
        if err > self.tolerance:
            raise RuntimeError(f"round {server_round}: unmasked mean off by {err:.3g} (tolerance {self.tolerance:.3g})")
        self.times.append(end - self.started[server_round])
        self.spans.append((self.started[server_round], end))
        # replaced whole, so that bench/flower.py never reads a half-written file
        with open(self.out + ".tmp", "w") as f:
            json.dump({"times": self.times, "spans": self.spans, "max_error": err}, f)
        os.replace(self.out + ".tmp", self.out)
        return out


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["clients"])
    clip = float(cfg["clip"])
    qrange = int(cfg["quantization-range"])
    weights = model_weights(int(cfg["params"]))
    # What the clients send, as the unmasked mean must give it back: clipped, then
    # quantised by stochastic rounding (error below one step per coordinate).
    expected = [np.clip(w, -clip, clip) for w in weights]
    strategy = TimedFedAvg(
        str(cfg["out"]),
        expected,
        tolerance=2 * clip / qrange * 2,
        n=n,
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=n,
        min_available_clients=n,
        min_evaluate_clients=0,
        initial_parameters=ndarrays_to_parameters(weights),
    )
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(cfg["rounds"])), strategy=strategy)
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(
            num_shares=int(cfg["num-shares"]),
            reconstruction_threshold=int(cfg["threshold"]),
            max_weight=1.0,
            clipping_range=clip,
            quantization_range=qrange,
            modulus_range=int(cfg["modulus-range"]),
        )
    )
    workflow(grid, legacy)
