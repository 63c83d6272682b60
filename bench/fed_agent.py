"""One benchmark agent process: fedagent's real transport and messenger, training off.

It answers every RoundStart with an Update carrying the weights it received, so a
round costs exactly what fedagent's framework costs: envelope encode/decode and
validation, chunking with SHA-256, MQTT 5 over mutual TLS, reassembly. A RoundStart
whose TrainConfig asks for streamed updates (the daemons' default) is answered as the
agent daemon does, with a stream compressed as it says (``int8`` by default: deltas to
the received model); the update is then the received weights plus 0.001 everywhere,
made once per model size, so the deltas are not all zero. A RoundStart with
a secure-aggregation setup is answered through the SecAgg stages instead (keys, sealed
shares, an update of 0.001 in every coordinate masked, shares at unmasking).

    python -m bench.fed_agent --uri mqtts://127.0.0.1:PORT --id agent-1 --certs DIR --ca CA

With ``FEDAGENT_BENCH_PROFILE=DIR`` in its environment (``bench/round_profile.py`` sets it)
the agent appends one line per answered round to ``DIR/<id>.jsonl``: its CPU seconds
(threads included) when the round start's first frame came, when the round start was
decoded and when its update's last frame was acknowledged; with
``FEDAGENT_BENCH_CPROFILE=1`` as well, it runs under cProfile with worker-thread calls
made inline (so the profile sees them) and writes ``DIR/<id>.prof`` when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np

from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.runtime import keep_freed_memory
from fedagent.node.transport import TlsFiles, Transport
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, encode
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.downlink import READS
from fedagent.protocols.messages import Presence, RoundStart, Update
from fedagent.protocols.participant import DeltaReceiver
from fedagent.protocols.secagg import (
    SecAggAgent,
    SecAggError,
    SecAggMasked,
    SecAggRoster,
    SecAggShareBox,
    SecAggStart,
    SecAggSurvivors,
    SecAggUnmask,
    layout_size,
)
from fedagent.security.signing import AuthError, Identity, sign, sign_statement

BENCH_DELTA = 0.001  # what every benchmark agent's secure update adds to each coordinate


def presence(fed: str, identity: Identity, online: bool) -> bytes:
    # Signed like every frame: the coordinator's messenger refuses unsigned presence.
    return encode(
        sign(
            Envelope(
                kind="presence",
                federation=fed,
                sender=identity.name,
                round=0,
                seq=time.time_ns() // 1000,
                ts=time.time(),
                body=Presence(online=online, role="agent", downlinks=READS if online else ()).to_body(),
            ),
            identity,
        )
    )


async def main(args: argparse.Namespace) -> None:
    fed, me = args.federation, args.id
    # As the agent daemon does: glibc keeps the model-sized buffers of each round for
    # the next instead of mapping fresh pages (zeroed by the kernel) every time.
    keep_freed_memory()
    tls = TlsFiles(ca=args.ca, cert=args.certs / f"{me}.crt", key=args.certs / f"{me}.key")
    identity = Identity.load(tls.cert, tls.key, tls.ca)
    transport = Transport(
        uri=args.uri,
        tls=tls,
        will=(topics.presence(fed, me), presence(fed, identity, False)),
        subscriptions=[
            topics.broadcast(fed, "round_start"),
            topics.broadcast(fed, "secagg_start"),
            topics.inbox(fed, me),
        ],
        session_expiry=0,
        keepalive=args.keepalive,
    )
    messenger = Messenger(
        federation=fed, node_id=me, transport=transport, identity=identity, max_chunk_bytes=args.chunk
    )

    def verify(name: str, data: bytes, cert: bytes, sig: bytes) -> None:
        try:
            messenger.verifier.check_statement(name, data, cert, sig)
        except AuthError as exc:
            raise SecAggError(str(exc)) from None

    secagg = SecAggAgent(me, sign=lambda data: sign_statement(identity, data), verify=verify)

    async def to_coordinator(msgs) -> None:
        for m in msgs:
            # (as the agent daemon does: a masked vector is never changed once made)
            await messenger.send(
                topics.direct(fed, me, args.coordinator, m.kind), m, round_=m.round, stable=isinstance(m, SecAggMasked)
            )

    delta = np.zeros(0)
    trained: dict[str, np.ndarray] = {}  # the streamed update (received weights + BENCH_DELTA)
    compressor = Compressor()
    steps = DeltaReceiver()  # round starts with the model as an int8 step, as the agent daemon
    held: tuple[int, dict[str, np.ndarray]] | None = None  # the model of the last round start
    profile_dir = os.environ.get("FEDAGENT_BENCH_PROFILE")
    marks: dict[str, float] = {}  # CPU seconds at this round's steps (FEDAGENT_BENCH_PROFILE)

    def mark(step: str, round_: int | None = None) -> None:
        if profile_dir is None:
            return
        if step not in marks:  # (a CPU clock is a system call: once per step, not per frame)
            marks[step] = time.process_time()
        if round_ is not None:
            with open(Path(profile_dir) / f"{me}.jsonl", "a") as f:
                f.write(json.dumps({"round": round_, **marks}) + "\n")
            marks.clear()

    async def deliver(inc: Incoming) -> None:
        nonlocal delta, trained, compressor, held
        got_at = time.time()
        msg = inc.message
        if isinstance(msg, RoundStart):
            mark("decoded")
            resolved, why = steps.resolve(msg, held)
            if resolved is None:
                raise RuntimeError(f"round {msg.round}: cannot rebuild the model: {why}")
            msg = resolved
            assert msg.weights is not None
            held = (msg.model_version, msg.weights)
        if isinstance(msg, (SecAggRoster, SecAggShareBox, SecAggSurvivors, SecAggUnmask)):
            await to_coordinator(await asyncio.to_thread(secagg.on_message, msg))
            if isinstance(msg, SecAggRoster):
                # As the agent daemon does: the mask sum is drawn while the shares make
                # their round trip (messages are handled one at a time, so the share box
                # waits for it).
                # (keys ahead: the roster comes before the model; the update has the
                # size of the last one)
                await asyncio.to_thread(secagg.prepare, delta.size or None)
            return
        if isinstance(msg, SecAggStart):
            await to_coordinator(secagg.on_round_start(msg.round, msg.selected, msg.setup))
            return
        if isinstance(msg, RoundStart) and msg.selects(me) and msg.secagg is not None:
            await to_coordinator(secagg.on_round_start(msg.round, msg.selected, msg.secagg))
            size = layout_size(msg.weights)
            if delta.size != size:
                # Training is off: the update is given, made once (as the plain round's
                # agent sends back the weights it received, computing nothing).
                delta = np.full(size, BENCH_DELTA)
            await to_coordinator(
                await asyncio.to_thread(
                    lambda: secagg.on_trained(
                        msg.round,
                        delta,
                        base_version=msg.model_version,
                        num_samples=1,
                        metrics={},
                    )
                )
            )
            return
        if isinstance(msg, RoundStart) and msg.selects(me):
            # Two timestamps for the benchmark's per-phase split (a few bytes).
            stamps = {"bench_got_at": got_at, "bench_send_at": time.time()}
            topic = topics.direct(fed, me, args.coordinator, "update")
            if msg.train.stream:
                shapes = {k: v.shape for k, v in msg.weights.items()}
                if {k: v.shape for k, v in trained.items()} != shapes:
                    # Training is off: the update is given, made once per model (not timed
                    # as part of any round but the first, as training is not).
                    trained = {k: (v + np.float32(BENCH_DELTA)).astype(v.dtype) for k, v in msg.weights.items()}
                if compressor.config.mode != msg.train.compression:
                    compressor = Compressor(CompressionConfig(msg.train.compression, msg.train.topk_ratio))
                stamps["bench_send_at"] = time.time()
                update = Update(
                    round=msg.round, base_version=msg.model_version, num_samples=1, metrics=stamps, weights=trained
                )
                await messenger.send_update(topic, update, base=msg.weights, compressor=compressor)
                mark("sent", msg.round)
                return
            update = Update(
                round=msg.round, base_version=msg.model_version, num_samples=1, metrics=stamps, weights=msg.weights
            )
            # stable: the weights are the received model's read-only arrays.
            await messenger.send(topic, update, round_=msg.round, stable=True)
            mark("sent", msg.round)

    async def on_payload(topic: str, payload: bytes) -> None:
        if topic.endswith("/round_start"):
            mark("first_frame")
        await messenger.receive(topic, payload, deliver)

    async def on_connect() -> None:
        await transport.publish(topics.presence(fed, me), presence(fed, identity, True), retain=True)

    transport.on_connect = on_connect
    runner = asyncio.create_task(transport.run(on_payload))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    parent = os.getppid()

    async def orphaned() -> None:
        # A benchmark killed hard must not leave its agents behind.
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        stop.set()

    watcher = asyncio.create_task(orphaned())
    done, _ = await asyncio.wait({runner, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if runner in done:
        runner.result()
        return
    await transport.close((topics.presence(fed, me), presence(fed, identity, False)))
    runner.cancel()
    try:
        await runner
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--uri", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--federation", default="bench")
    ap.add_argument("--coordinator", default="coord")
    ap.add_argument("--certs", type=Path, required=True)
    ap.add_argument("--ca", type=Path, required=True)
    ap.add_argument("--chunk", type=int, default=4 * 2**20)
    ap.add_argument("--keepalive", type=int, default=30)
    logging.basicConfig(level=logging.WARNING)
    if os.environ.get("FEDAGENT_BENCH_PROFILE") and os.environ.get("FEDAGENT_BENCH_CPROFILE"):
        import cProfile

        async def inline(func, /, *a, **kw):
            return func(*a, **kw)

        # cProfile sees only the thread it was enabled in.
        asyncio.to_thread = inline  # type: ignore[assignment]
        prof = cProfile.Profile(time.process_time)  # CPU, not wall: the machine is shared
        args = ap.parse_args()
        prof.enable()
        try:
            asyncio.run(main(args))
        finally:
            prof.disable()
            prof.dump_stats(Path(os.environ["FEDAGENT_BENCH_PROFILE"]) / f"{args.id}.prof")
    else:
        asyncio.run(main(ap.parse_args()))
