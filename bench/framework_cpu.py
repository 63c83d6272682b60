"""Profiling harness (not a section): the CPU fedagent's own layers spend on one round's
messages, without MQTT or TLS.

The coordinator's messenger sends a RoundStart (stable, as the daemon does), an agent's
messenger receives its frames and sends the model back as an Update, the coordinator's
receives that, checks it and folds it into a FedAvg mean; frames are handed over in
memory. Each step is timed with ``time.process_time`` (threads included) and the
minimum over ``--times`` rounds is printed: what a round costs fedagent's framework on
each side (encode, sign, hash, chunk; decode, verify, reassemble, validate, average),
to compare builds on a machine shared with other work.

    .venv/bin/python -m bench.framework_cpu [--params 11.2e6] [--times 7]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.env import COORDINATOR, FEDERATION, model_weights
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import TlsFiles
from fedagent.protocols import topics
from fedagent.protocols.aggregation import WeightedMean, check_update
from fedagent.protocols.messages import RoundStart, TrainConfig, Update
from fedagent.security import pki
from fedagent.security.signing import Identity

AGENT = "agent-1"


class _Capture:
    """A transport that keeps what is published."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, data: bytes, **_kw) -> None:
        self.frames.append((topic, data))


async def one_round(coord: Messenger, agent: Messenger, weights, r: int) -> dict[str, float]:
    times: dict[str, float] = {}
    got: list = []

    async def deliver(inc: Incoming) -> None:
        got.append(inc.message)

    def timed(name: str, t0: float) -> None:
        times[name] = time.process_time() - t0

    start = RoundStart(r, r - 1, (AGENT,), 600, TrainConfig(), weights)
    t0 = time.process_time()
    await coord.send(topics.broadcast(FEDERATION, "round_start"), start, round_=r, stable=True)
    timed("coordinator send", t0)
    t0 = time.process_time()
    for topic, frame in coord.transport.frames:
        await agent.receive(topic, frame, deliver)
    timed("agent receive", t0)
    coord.transport.frames.clear()
    msg = got.pop()
    update = Update(round=r, base_version=r - 1, num_samples=1, metrics={}, weights=msg.weights)
    t0 = time.process_time()
    await agent.send(topics.direct(FEDERATION, AGENT, COORDINATOR, "update"), update, round_=r, stable=True)
    timed("agent send", t0)
    t0 = time.process_time()
    for topic, frame in agent.transport.frames:
        await coord.receive(topic, frame, deliver)
    timed("coordinator receive", t0)
    agent.transport.frames.clear()
    u = got.pop()
    t0 = time.process_time()
    acc = WeightedMean(weights)
    check_update(weights, u.weights)
    acc.add(u.weights, u.num_samples)
    acc.result()
    timed("coordinator check + fold + mean", t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=11.2e6)
    ap.add_argument("--times", type=int, default=7)
    args = ap.parse_args()
    weights = model_weights(int(args.params))
    with tempfile.TemporaryDirectory(prefix="fedagent-fwcpu-") as tmp:
        work = Path(tmp)
        pki.create_ca(work / "ca", FEDERATION)
        nodes = {}
        for name, role in ((COORDINATOR, "coordinator"), (AGENT, "agent")):
            pki.issue(work / "ca", work / "certs", name, role)
            tls = TlsFiles(
                ca=work / "ca" / pki.CA_CERT, cert=work / "certs" / f"{name}.crt", key=work / "certs" / f"{name}.key"
            )
            nodes[name] = Messenger(
                federation=FEDERATION,
                node_id=name,
                transport=_Capture(),
                identity=Identity.load(tls.cert, tls.key, tls.ca),
            )
        best: dict[str, float] = {}
        for r in range(1, args.times + 1):
            for k, v in asyncio.run(one_round(nodes[COORDINATOR], nodes[AGENT], weights, r)).items():
                best[k] = min(best.get(k, float("inf")), v)
    print(f"{args.params / 1e6:.1f}M params, CPU ms per step (minimum of {args.times} rounds):")
    for k, v in best.items():
        print(f"  {k:32s} {v * 1e3:7.1f}")


if __name__ == "__main__":
    main()
