"""Profiling harness (not a section): one fedagent transport sends a model to another
through the benchmark broker, N times, and prints the throughput and the CPU time
both ends used (process time, which other load on the machine disturbs far less than
wall time).

    .venv/bin/python -m bench.pipe [--params 11.2e6] [--times 5] [--chunk BYTES] [--profile FILE]

Both ends run in this process (so ``--profile`` writes one cProfile of sender and
receiver together); ``py-spy record -p PID`` works on it as well.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import tempfile
import time
from pathlib import Path

from bench.env import COORDINATOR, FEDERATION, BenchBroker, model_weights
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import Transport
from fedagent.protocols import topics
from fedagent.protocols.messages import Update
from fedagent.security.signing import Identity


async def pipe(bb: BenchBroker, params: int, times: int, chunk: int, window: int | None) -> list[float]:
    weights = model_weights(params)
    got: asyncio.Queue[Update] = asyncio.Queue()
    rx = Transport(
        uri=bb.uri,
        tls=bb.tls(COORDINATOR),
        keepalive=30,
        subscriptions=[topics.inbox(FEDERATION, COORDINATOR)],
        session_expiry=0,
    )
    tx = Transport(uri=bb.uri, tls=bb.tls("agent-1"), keepalive=30, session_expiry=0)
    extra = {} if window is None else {"publish_window": window}
    rt, tt = bb.tls(COORDINATOR), bb.tls("agent-1")
    mrx = Messenger(
        federation=FEDERATION,
        node_id=COORDINATOR,
        transport=rx,
        max_chunk_bytes=chunk,
        identity=Identity.load(rt.cert, rt.key, rt.ca),
    )
    mtx = Messenger(
        federation=FEDERATION,
        node_id="agent-1",
        transport=tx,
        max_chunk_bytes=chunk,
        identity=Identity.load(tt.cert, tt.key, tt.ca),
        **extra,
    )

    async def deliver(inc: Incoming) -> None:
        got.put_nowait(inc.message)

    async def on_rx(topic: str, payload: bytes) -> None:
        await mrx.receive(topic, payload, deliver)

    async def ignore(topic: str, payload: bytes) -> None:
        pass

    r1, r2 = asyncio.Event(), asyncio.Event()
    t_rx = asyncio.create_task(rx.run(on_rx, r1))
    t_tx = asyncio.create_task(tx.run(ignore, r2))
    await asyncio.wait_for(asyncio.gather(r1.wait(), r2.wait()), 30)
    out, cpu = [], []
    topic = topics.direct(FEDERATION, "agent-1", COORDINATOR, "update")
    for i in range(times):
        t0 = time.perf_counter()
        c0 = time.process_time()
        await mtx.send(
            topic, Update(round=i + 1, base_version=0, num_samples=1, metrics={}, weights=weights), round_=i + 1
        )
        t1 = time.perf_counter()
        await asyncio.wait_for(got.get(), 120)
        out.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        print(f"  {i + 1}: sent (PUBACKs) {t1 - t0:.3f} s, received {out[-1]:.3f} s, CPU {cpu[-1]:.3f} s", flush=True)
    await tx.close()
    await rx.close()
    for t in (t_rx, t_tx):
        t.cancel()
    await asyncio.gather(t_rx, t_tx, return_exceptions=True)
    return out, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=11.2e6)
    ap.add_argument("--times", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4 * 2**20)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--window", type=int, help="chunks awaiting PUBACK at once (Messenger.publish_window)")
    ap.add_argument("--read-size", type=int, help="largest socket read (transport.patches.READ_SIZE)")
    a = ap.parse_args()
    if a.read_size is not None:
        from fedagent.node.transport import patches

        patches.READ_SIZE = a.read_size
    with tempfile.TemporaryDirectory(prefix="fedagent-pipe-") as tmp, BenchBroker(Path(tmp), 1) as bb:
        prof = cProfile.Profile() if a.profile else None
        if prof:
            prof.enable()
        times, cpu = asyncio.run(pipe(bb, int(a.params), a.times, a.chunk, a.window))
        if prof:
            prof.disable()
            prof.dump_stats(a.profile)
    mbytes = int(a.params) * 4 / 1e6
    best = min(times)
    print(
        f"{mbytes:.1f} MB: best {best:.3f} s ({mbytes / best:.0f} MB/s), median "
        f"{sorted(times)[len(times) // 2]:.3f} s; CPU of both ends: median "
        f"{sorted(cpu)[len(cpu) // 2]:.3f} s, min {min(cpu):.3f} s; chunk {a.chunk}"
    )


if __name__ == "__main__":
    main()
