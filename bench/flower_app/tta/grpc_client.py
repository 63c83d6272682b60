"""A Flower gRPC client (``start_client``) of the time-to-accuracy benchmark: trains the
shared CNN on its shard, evaluates the global model on the held-out set.

    python grpc_client.py --port P --data tta-data.npz --shard 3
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import data  # noqa: E402
import flwr as fl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tta_model as m  # noqa: E402

MAX_MESSAGE = 1 << 30


class CnnClient(fl.client.NumPyClient):
    def __init__(self, shard: int, path: str) -> None:
        self.shard = shard
        self.x, self.y, self.xte, self.yte = data.load(path, shard)
        self.model = m.build_model()
        self.keys = list(self.model.state_dict())

    def _load(self, arrays: list[np.ndarray]) -> None:
        self.model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(self.keys, arrays, strict=True)})

    def get_parameters(self, config):
        return [v.detach().numpy().copy() for v in self.model.state_dict().values()]

    def fit(self, parameters, config):
        self._load(parameters)
        seed = int(config.get("server_round", 0)) * 1000 + self.shard
        metrics = m.train(self.model, self.x, self.y, epochs=m.LOCAL_EPOCHS, lr=m.LR, batch_size=m.BATCH, seed=seed)
        return self.get_parameters({}), len(self.y), metrics

    def evaluate(self, parameters, config):
        self._load(parameters)
        metrics = m.evaluate(self.model, self.xte, self.yte)
        return metrics["test_loss"], len(self.yte), {"accuracy": metrics["accuracy"]}


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--shard", type=int, required=True)
    a = ap.parse_args()
    fl.client.start_client(
        server_address=f"127.0.0.1:{a.port}",
        client=CnnClient(a.shard, a.data).to_client(),
        grpc_max_message_length=MAX_MESSAGE,
        insecure=True,
    )


if __name__ == "__main__":
    main()
