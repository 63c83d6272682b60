"""A Flower gRPC client (``start_client``) with training off: fit returns the
parameters it received, as fedagent's benchmark agents do."""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore")

import flwr as fl  # noqa: E402

MAX_MESSAGE = 1 << 30


class EchoClient(fl.client.NumPyClient):
    def get_parameters(self, config):
        return []

    def fit(self, parameters, config):
        return parameters, 1, {}

    def evaluate(self, parameters, config):
        return 0.0, 1, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ca", help="trust this CA and use TLS")
    a = ap.parse_args()
    root = open(a.ca, "rb").read() if a.ca else None
    fl.client.start_client(server_address=f"127.0.0.1:{a.port}", client=EchoClient().to_client(),
                           grpc_max_message_length=MAX_MESSAGE, root_certificates=root,
                           insecure=root is None)


if __name__ == "__main__":
    main()
