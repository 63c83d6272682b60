"""What message signing costs for a large model, against what its transfer costs.

    .venv/bin/python bench/signing.py [--mb 44.8] [--repeat 3]

Sends one ``Update`` of the given size through two real :class:`Messenger` objects
(4 MiB chunks, as in production) with an in-memory hand-over instead of the broker,
once with signing and verification and once with both switched off, and prints the
median time of each side and the difference. The same model is also carried over a
private Mosquitto with mutual TLS (the transfer the signing has to be compared with);
that part is skipped if ``mosquitto`` is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from fedagent.node import messaging
from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.messages import Update
from fedagent.security import pki
from fedagent.security.signing import Identity

FED = "bench"


class Collect:
    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        self.frames.append((topic, payload))


def identities(d: Path) -> tuple[Identity, Identity]:
    pki.create_ca(d, FED)
    out = []
    for name, role in (("agent-1", "agent"), ("coord", "coordinator")):
        crt, key = pki.issue(d, d, name, role)
        out.append(Identity.load(crt, key, d / pki.CA_CERT))
    return out[0], out[1]


async def once(model, a: Identity, c: Identity, signed: bool) -> tuple[float, float]:
    saved = (messaging.sign, Messenger.__dict__.get("_verify_off"))
    if not signed:
        messaging.sign = lambda env, ident: env  # type: ignore[assignment]
    try:
        out = Collect()
        send = Messenger(federation=FED, node_id="agent-1", transport=out, identity=a)
        recv = Messenger(federation=FED, node_id="coord", transport=None, identity=c)
        if not signed:
            recv.verifier.check = lambda env, now=None: "agent"  # type: ignore[assignment]
        topic = topics.direct(FED, "agent-1", "coord", "update")
        t0 = time.perf_counter()
        await send.send(topic, Update(1, 0, 10, {}, model))
        t1 = time.perf_counter()
        got = []

        async def deliver(inc):
            got.append(inc)

        for t, p in out.frames:
            await recv.receive(t, p, deliver)
        t2 = time.perf_counter()
        assert len(got) == 1 and not recv.rejected, recv.rejected
        return t1 - t0, t2 - t1
    finally:
        messaging.sign = saved[0]


def signing_alone(model, a: Identity, c: Identity, repeat: int) -> tuple[float, float, int]:
    """CPU time of sign() over every frame of one transfer, and of Verifier.check()."""
    from fedagent.protocols.codec import decode
    from fedagent.security.signing import sign

    out = Collect()
    send = Messenger(federation=FED, node_id="agent-1", transport=out, identity=a)
    asyncio.run(send.send(topics.direct(FED, "agent-1", "coord", "update"), Update(1, 0, 10, {}, model)))
    envs = [decode(p, send.model_limits) for _, p in out.frames]
    unsigned = [dataclasses.replace(e, sig=b"", cert=b"") for e in envs]
    best_sign = best_verify = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for e in unsigned:
            sign(e, a)
        best_sign = min(best_sign, time.process_time() - t0)
        v = c.verifier()
        t0 = time.process_time()
        for e in envs:
            v.check(e)
        best_verify = min(best_verify, time.process_time() - t0)
    return best_sign, best_verify, len(envs)


async def over_broker(model, d: Path, a: Identity, c: Identity) -> float | None:
    import shutil

    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        return None
    from fedagent.mosquitto import EmbeddedBroker
    from fedagent.node.transport import TlsFiles, Transport

    broker = EmbeddedBroker(d / "broker", federations=[FED], coordinators=["coord"], ca_dir=d)
    broker.start()
    try:
        got: asyncio.Queue = asyncio.Queue()
        recv = Messenger(federation=FED, node_id="coord", transport=None, identity=c)

        async def handler(t, p):
            await recv.receive(t, p, got.put)

        tc = Transport(
            uri=broker.uri,
            tls=TlsFiles(d / pki.CA_CERT, d / "coord.crt", d / "coord.key"),
            subscriptions=[topics.inbox(FED, "coord")],
        )
        ta = Transport(uri=broker.uri, tls=TlsFiles(d / pki.CA_CERT, d / "agent-1.crt", d / "agent-1.key"))
        rc, ra = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(tc.run(handler, rc)), asyncio.create_task(ta.run(lambda t, p: None, ra))]
        await rc.wait()
        await ra.wait()
        send = Messenger(federation=FED, node_id="agent-1", transport=ta, identity=a)
        t0 = time.perf_counter()
        await send.send(topics.direct(FED, "agent-1", "coord", "update"), Update(1, 0, 10, {}, model))
        await asyncio.wait_for(got.get(), 120)
        took = time.perf_counter() - t0
        await tc.close()
        await ta.close()
        for t in tasks:
            t.cancel()
        return took
    finally:
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=44.8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = int(args.mb * 1e6 / 4)
    model = {"w": np.random.default_rng(0).normal(size=n).astype(np.float32)}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        a, c = identities(d)
        rows = {}
        for signed in (False, True):
            times = [asyncio.run(once(model, a, c, signed)) for _ in range(args.repeat)]
            rows[signed] = (min(t[0] for t in times), min(t[1] for t in times))
        direct = signing_alone(model, a, c, args.repeat)
        print(f"model {args.mb} MB, 4 MiB chunks, best of {args.repeat}")
        print(
            f"  signing alone: {direct[0] * 1e3:.1f} ms to sign the {direct[2]} frames, "
            f"{direct[1] * 1e3:.1f} ms to verify them (certificate check cached after the first)"
        )
        print(
            f"  send   (encode, chunk{', sign'}): {rows[False][0] * 1e3:7.1f} ms unsigned, {rows[True][0] * 1e3:7.1f} ms signed"
        )
        print(
            f"  receive (decode, reassemble, verify): {rows[False][1] * 1e3:7.1f} ms unsigned, {rows[True][1] * 1e3:7.1f} ms signed"
        )
        extra = direct[0] + direct[1]
        print(
            f"  end to end, signing + verification add {(rows[True][0] - rows[False][0]) + (rows[True][1] - rows[False][1]):.3f} s "
            "(noisy on a loaded machine; the direct figure above is the cost)"
        )
        try:
            took = asyncio.run(over_broker(model, d, a, c))
        except Exception as exc:
            print(f"  (transfer over Mosquitto not measured: {exc})")
            took = None
        if took is not None:
            print(
                f"  one signed transfer agent -> Mosquitto (mTLS) -> coordinator: {took * 1e3:.0f} ms; "
                f"signing + verification = {100 * extra / took:.1f} % of it"
            )


if __name__ == "__main__":
    main()
