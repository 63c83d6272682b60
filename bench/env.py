"""The shared set-up: a throw-away federation CA and one Mosquitto with mutual TLS.

Every broker benchmark (fedagent's transport and the raw C clients) runs through the
same :class:`BenchBroker`, so their ratio compares clients, not brokers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedagent.mosquitto import EmbeddedBroker
from fedagent.node.transport import TlsFiles
from fedagent.security import pki

FEDERATION = "bench"
COORDINATOR = "coord"
# Above one whole 11.2M-parameter model (44.8 MB + envelope), so the C-client baseline
# can move each model as one MQTT message: the fastest the broker allows.
BROKER_MAX_PACKET = 64 * 2**20


@dataclass
class BenchBroker:
    """A broker for ``agents`` agent identities and the coordinator ``coord``.

    Started here unless ``external`` is given: an already running broker for federation
    ``bench`` (the test suite passes its Mosquitto fixture), whose CA is ``ca_dir``; then
    only missing certificates are issued into ``certs``, and stopping leaves it running.
    """

    work: Path
    agents: int
    external: EmbeddedBroker | None = None
    ca_dir: Path | None = None
    certs: Path | None = None

    def __post_init__(self) -> None:
        self.ca_dir = self.ca_dir or self.work / "ca"
        self.certs = self.certs or self.work / "certs"
        self.agent_ids = [f"agent-{i}" for i in range(1, self.agents + 1)]
        self.broker: EmbeddedBroker | None = self.external

    def start(self) -> BenchBroker:
        if not (self.ca_dir / pki.CA_CERT).exists():
            pki.create_ca(self.ca_dir, FEDERATION)
        for name, role in [(COORDINATOR, "coordinator")] + [(a, "agent") for a in self.agent_ids]:
            if not (self.certs / f"{name}.crt").exists():
                pki.issue(self.ca_dir, self.certs, name, role)
        if self.external is not None:
            return self
        self.broker = EmbeddedBroker(
            self.work / "broker",
            federations=[FEDERATION],
            coordinators=[COORDINATOR],
            ca_dir=self.ca_dir,
            max_packet_size=BROKER_MAX_PACKET,
        )
        self.broker.start()
        return self

    def stop(self) -> None:
        if self.broker is not None and self.external is None:
            self.broker.stop()

    def tls(self, name: str) -> TlsFiles:
        return TlsFiles(ca=self.ca_dir / pki.CA_CERT, cert=self.certs / f"{name}.crt", key=self.certs / f"{name}.key")

    @property
    def uri(self) -> str:
        return self.broker.uri

    def __enter__(self) -> BenchBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def model_weights(params: int, seed: int = 0, tensors: int = 16) -> dict[str, np.ndarray]:
    """``params`` float32 parameters in ``tensors`` named tensors (a stand-in for a
    model's state dict: 11.2M is ResNet-18's size)."""
    rng = np.random.default_rng(seed)
    sizes = [params // tensors] * tensors
    sizes[-1] += params - sum(sizes)
    return {f"layer{i:02d}.weight": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}


def bench_broker(ctx, work: Path, agents: int) -> BenchBroker:
    """The broker a section runs on: ``ctx.broker(agents)`` when the caller supplies one
    (the test suite's fixture), else a private one under ``work``."""
    if ctx.broker is not None:
        return ctx.broker(agents)
    return BenchBroker(work, agents)


def model_sizes(ctx) -> list[int]:
    """The parameter counts a section runs: ``--params`` if given, else 11.2M and 1.1M
    (only 1.1M with ``--quick``)."""
    if ctx.sizes:
        return list(ctx.sizes)
    return [1_100_000] if ctx.quick else [11_200_000, 1_100_000]


#: A typical edge model, where a round's fixed costs dominate: the round section adds it
#: to its sizes (its own target, 1.5x the C clients' round).
EDGE_PARAMS = 100_000


def round_sizes(ctx) -> list[int]:
    """The round section's sizes: ``--params`` if given, else :func:`model_sizes` and the
    0.1M edge model."""
    if ctx.sizes:
        return list(ctx.sizes)
    return [*model_sizes(ctx), EDGE_PARAMS]


def round_target(params: int) -> float:
    """The round's target against the C clients: 1.2x, 1.5x for models of the edge size
    or smaller, where fixed costs dominate."""
    return 1.5 if params <= EDGE_PARAMS else 1.2


def mb(params: int) -> str:
    return f"{params / 1e6:.1f}M params = {params * 4 / 1e6:.1f} MB"
