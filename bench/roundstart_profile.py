"""Profiling harness (not a section): where the coordinator's time goes from deciding a
round to its RoundStart's last frame handed to the transport.

Each stage of :meth:`~fedagent.node.messaging.Messenger.send` for a RoundStart as the
daemon sends it (``stable``; the model whole, or as its int8 step) is timed on its own,
then the whole send through a transport that keeps nothing, with what the send allocates
at its peak (tracemalloc); then the round machine's part: making the int8 step, opening a
round, and the turnover from a round's last update to the next StartRound (mean, server
step with momentum, int8 step). ``--broker`` sends the whole model through a real
Mosquitto with mutual TLS to ten ``mosquitto_sub`` connections and reports when the
first frame reached the transport against the last PUBACK, for each publish window.

Figures are shares of the whole send: the median of ``--times`` wall times, or with
``--cpu`` the minimum of CPU times (threads included), which other work on a shared
machine disturbs far less. Compare stages with each other, and builds with each other
in the same run (``PYTHONPATH=<other checkout>/src`` runs another build's code), not with
absolute targets. ``--profile`` adds cProfile's top functions.

    .venv/bin/python -m bench.roundstart_profile [--params 1.1e6] [--times 15] [--cpu] [--profile] [--broker]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.env import COORDINATOR, FEDERATION, model_weights
from fedagent.node.messaging import Messenger
from fedagent.node.transport import TlsFiles
from fedagent.protocols import topics
from fedagent.protocols.chunking import LazyChunks, chunk_size
from fedagent.protocols.codec import Envelope, encode, encode_segments
from fedagent.protocols.downlink import quantize_step
from fedagent.protocols.messages import RoundStart, TrainConfig
from fedagent.protocols.rounds import AgentOnline, RoundConfig, RoundMachine, StartRound, UpdateReceived
from fedagent.security import pki
from fedagent.security.signing import CHUNK_KIND, Identity, sign, signing_digest

AGENTS = tuple(f"agent-{i}" for i in range(1, 11))


class _Discard:
    """A transport that acknowledges every publish at once and keeps nothing."""

    async def publish(self, topic: str, data: bytes, **_kw: Any) -> None:
        return None


#: What each figure is: the median of wall times (default), or with ``--cpu`` the minimum
#: of the process's CPU times (threads included), which other work on the machine
#: disturbs far less.
CLOCK = {"clock": time.perf_counter, "pick": statistics.median}


def _median(f: Callable[[], Any], times: int) -> float:
    clock = CLOCK["clock"]
    samples = []
    for _ in range(times):
        t0 = clock()
        f()
        samples.append(clock() - t0)
    return CLOCK["pick"](samples)


def _stages(messenger: Messenger, start: RoundStart, times: int) -> dict[str, float]:
    """Seconds (median) of each stage of one send, done by hand as Messenger.send does."""
    out: dict[str, float] = {}
    out["envelope (to_body, checks)"] = _median(lambda: messenger.envelope(start, start.round), times)
    env = messenger.envelope(start, start.round)
    out["encode segments"] = _median(lambda: encode_segments(env), times)
    segments = encode_segments(env)
    size = len(segments)
    if size <= messenger.max_chunk:
        # One frame (signed, not chunked): what is left is signing and encoding it.
        out["sign (digest + Ed25519)"] = _median(lambda: sign(env, messenger.identity), times)
        signed = sign(env, messenger.identity)
        out["frame encode (msgpack)"] = _median(lambda: encode(signed), times)
        return out
    chunk = chunk_size(size, messenger.max_chunk)
    out["SHA-256 of the payload (LazyChunks)"] = _median(
        lambda: LazyChunks(segments, max_chunk=chunk, transfer_id="t-1"), times
    )
    bodies = LazyChunks(segments, max_chunk=chunk, transfer_id="t-1")
    n = len(bodies)
    out["chunk bodies (views, copies at joins)"] = _median(lambda: [bodies[i] for i in range(n)], times)
    made = [bodies[i] for i in range(n)]

    def envelopes() -> list[Envelope]:
        return [
            Envelope(CHUNK_KIND, FEDERATION, COORDINATOR, start.round, 1 + i, messenger.clock(), made[i])
            for i in range(n)
        ]

    out["chunk envelopes (checks)"] = _median(envelopes, times)
    envs = envelopes()
    ident = messenger.identity
    out["signing digests"] = _median(lambda: [signing_digest(e) for e in envs], times)
    out["sign (digest + Ed25519)"] = _median(lambda: [sign(e, ident) for e in envs], times)
    signed = [sign(e, ident) for e in envs]
    out["frame encode (msgpack, copies the data)"] = _median(lambda: [encode(e) for e in signed], times)
    out[f"(for scale: one SHA-256 pass over {size / 1e6:.1f} MB)"] = _median(
        lambda: hashlib.sha256(memoryview(bytes(size))).digest(), 3
    )
    return out


def _whole_send(messenger: Messenger, start: RoundStart, times: int) -> float:
    topic = topics.broadcast(FEDERATION, "round_start")

    async def run() -> list[float]:
        samples = []
        for _ in range(times + 1):
            t0 = clock()
            await messenger.send(topic, start, round_=start.round, stable=True)
            samples.append(clock() - t0)
        return samples[1:]  # the first starts the worker threads

    clock = CLOCK["clock"]
    return CLOCK["pick"](asyncio.run(run()))


def _open_round(weights: dict, times: int) -> float:
    """The round machine from the last agent's presence to its StartRound (selection and
    the round's FedAvg sums)."""

    def once() -> None:
        m = RoundMachine(RoundConfig(min_agents=len(AGENTS), expected_agents=len(AGENTS), rounds=5), weights)
        for a in AGENTS[:-1]:
            m.handle(AgentOnline(a, 1), 0.0)
        t0 = clock()
        cmds = m.handle(AgentOnline(AGENTS[-1], 1), 0.0)
        samples.append(clock() - t0)
        assert any(isinstance(c, StartRound) for c in cmds)

    clock = CLOCK["clock"]
    samples: list[float] = []
    for _ in range(times):
        once()
    return CLOCK["pick"](samples)


async def _through_broker(work: Path, weights: dict, times: int, windows: list[int], chunk: int) -> None:
    """The whole model's RoundStart sent through a real Mosquitto with mutual TLS to ten
    subscribed connections (``mosquitto_sub``, as the C-client baseline's): when the
    first frame reaches the transport and when the last PUBACK came, for each publish
    window, as shares of the time to the last PUBACK."""
    import shutil
    import subprocess

    from bench.env import BenchBroker
    from bench.round import proc_cpu
    from fedagent.node.transport import Transport

    if shutil.which("mosquitto_sub") is None:
        raise SystemExit("--broker needs mosquitto_sub (apt-get install mosquitto-clients)")
    topic = topics.broadcast(FEDERATION, "round_start")
    with BenchBroker(work / "bench", len(AGENTS)) as bb:
        subs = []
        for a in bb.agent_ids:
            tls = bb.tls(a)
            subs.append(
                subprocess.Popen(
                    ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(bb.broker.port), "-V", "mqttv5", "-q", "1"]
                    + ["--cafile", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key), "-t", topic]
                    + ["-F", "%l"],
                    stdout=subprocess.DEVNULL,
                )
            )
        transport = Transport(uri=bb.uri, tls=bb.tls(COORDINATOR), subscriptions=[], session_expiry=0, keepalive=30)
        ready = asyncio.Event()

        async def ignore(topic: str, payload: bytes) -> None:
            return None

        runner = asyncio.create_task(transport.run(ignore, ready))
        try:
            await asyncio.wait_for(ready.wait(), 30)
            await asyncio.sleep(1.0)  # the subscribers connect
            tls = bb.tls(COORDINATOR)
            messenger = Messenger(
                federation=FEDERATION,
                node_id=COORDINATOR,
                transport=transport,
                identity=Identity.load(tls.cert, tls.key, tls.ca),
                max_chunk_bytes=chunk,
            )
            first: list[float] = []
            publish = transport.publish

            async def timed(*a: Any, **kw: Any) -> None:
                if not first:
                    first.append(time.perf_counter())
                await publish(*a, **kw)

            # When the first frame reaches the transport (this messenger's own publishes).
            transport.publish = timed  # type: ignore[method-assign]
            print(f"through Mosquitto (TLS) to {len(AGENTS)} subscribers, median of {times} (interleaved):")
            # The floor this transport and broker allow: the same bytes as one message.
            raw = encode(messenger.envelope(RoundStart(1, 0, AGENTS, 600, TrainConfig(stream=False), weights), 1))
            kinds = ["one message", *(f"window {w}" for w in windows)]
            took: dict[str, list[float]] = {k: [] for k in kinds}
            to_first: dict[str, list[float]] = {k: [] for k in kinds}
            broker_cpu: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(times + 1):
                for k, kind in enumerate(kinds):
                    first.clear()
                    b0 = proc_cpu([bb.broker.pid])
                    t0 = time.perf_counter()
                    if k == 0:
                        await publish(topic, raw, qos=1, timeout=60)
                        first.append(t0)
                    else:
                        messenger.publish_window = windows[k - 1]
                        start = RoundStart(r + 1, r, AGENTS, 600, TrainConfig(stream=False), weights)
                        await messenger.send(topic, start, round_=r + 1, stable=True)
                    t1 = time.perf_counter()
                    await asyncio.sleep(0.3)  # the broker's fan-out of this one is over
                    if r:  # the first warms the connections up
                        took[kind].append(t1 - t0)
                        to_first[kind].append(first[0] - t0)
                        broker_cpu[kind].append(proc_cpu([bb.broker.pid]) - b0)
            base = statistics.median(took[kinds[0]])
            for kind in kinds:
                t = statistics.median(took[kind])
                print(
                    f"  {kind:12s} last PUBACK {t / base:4.2f} of one message's ({t * 1e3:6.1f} ms); first frame "
                    f"after {statistics.median(to_first[kind]) / t:4.2f} of it; broker CPU "
                    f"{statistics.median(broker_cpu[kind]) * 1e3:5.0f} ms"
                )
        finally:
            await transport.close()
            runner.cancel()
            for p in subs:
                p.terminate()
                p.wait()


def _round_turnover(weights: dict, times: int, profile: bool, work: Path) -> float:
    """The round machine with the daemons' defaults (int8 downlink, server momentum with
    its velocity in a file, as the coordinator keeps it): from the last update of a
    round to the next round's StartRound (the mean, the server step, the int8 step of
    the next model, the next round's sums)."""
    from fedagent.coordinator.velocity import FileVelocity

    cfg = RoundConfig(
        min_agents=len(AGENTS), expected_agents=len(AGENTS), rounds=10_000, downlink="int8", server_momentum=0.7
    )
    store = FileVelocity(work / "velocity")
    store.open(0, weights)
    m = RoundMachine(cfg, dict(weights), velocity_store=store)
    for a in AGENTS:
        m.handle(AgentOnline(a, 1), 0.0)
    update = {k: v + 0.001 for k, v in weights.items()}
    clock = CLOCK["clock"]
    samples = []
    prof = cProfile.Profile() if profile else None
    for _ in range(times + 1):
        for a in AGENTS[:-1]:
            m.handle(UpdateReceived(a, m.round, m.model_version, 1, update, {}), 0.0)
        if prof is not None:
            prof.enable()
        t0 = clock()
        cmds = m.handle(UpdateReceived(AGENTS[-1], m.round, m.model_version, 1, update, {}), 0.0)
        samples.append(clock() - t0)
        if prof is not None:
            prof.disable()
        assert any(isinstance(c, StartRound) for c in cmds), cmds
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return CLOCK["pick"](samples[1:])


def _send_peak(messenger: Messenger, start: RoundStart, model_bytes: int) -> float:
    """What one send allocates at its peak (tracemalloc, numpy included), in models."""
    import tracemalloc

    topic = topics.broadcast(FEDERATION, "round_start")

    async def once() -> None:
        await messenger.send(topic, start, round_=start.round, stable=True)

    asyncio.run(once())  # imports, worker threads
    tracemalloc.start()
    try:
        asyncio.run(once())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / model_bytes


def _print(title: str, stages: dict[str, float], whole: float) -> None:
    what = "minimum CPU" if CLOCK["pick"] is min else "median"
    print(f"{title}: whole send {whole * 1e3:.1f} ms ({what}) = 1.00")
    for k, v in stages.items():
        print(f"  {k:44s} {v / whole:5.2f}   ({v * 1e3:6.2f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.1e6)
    ap.add_argument("--times", type=int, default=15)
    ap.add_argument("--chunk", type=int, default=4 * 2**20, help="max_chunk_bytes (the bench's default)")
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of the whole send")
    ap.add_argument("--broker", action="store_true", help="also send through a real Mosquitto (TLS) to 10 subscribers")
    ap.add_argument("--windows", default="1,2,4", help="publish windows tried with --broker")
    ap.add_argument("--cpu", action="store_true", help="the minimum of CPU times instead of the median of wall times")
    args = ap.parse_args()
    if args.cpu:
        CLOCK.update(clock=time.process_time, pick=min)
    weights = model_weights(int(args.params))
    with tempfile.TemporaryDirectory(prefix="fedagent-rsprof-") as tmp:
        work = Path(tmp)
        pki.create_ca(work / "ca", FEDERATION)
        pki.issue(work / "ca", work / "certs", COORDINATOR, "coordinator")
        tls = TlsFiles(
            ca=work / "ca" / pki.CA_CERT,
            cert=work / "certs" / f"{COORDINATOR}.crt",
            key=work / "certs" / f"{COORDINATOR}.key",
        )
        messenger = Messenger(
            federation=FEDERATION,
            node_id=COORDINATOR,
            transport=_Discard(),
            identity=Identity.load(tls.cert, tls.key, tls.ca),
            max_chunk_bytes=args.chunk,
        )
        whole_start = RoundStart(2, 1, AGENTS, 600, TrainConfig(stream=False), weights)
        t_step = _median(lambda: quantize_step(weights, dict(weights), base_version=0), args.times)
        _, delta = quantize_step(weights, dict(weights), base_version=0)
        step_start = RoundStart(2, 1, AGENTS, 600, TrainConfig(), None, delta=delta)
        print(f"{args.params / 1e6:.1f}M params, chunks of at most {args.chunk} bytes, {args.times} runs each")
        for title, start in (("whole float32 model", whole_start), ("int8 step", step_start)):
            whole = _whole_send(messenger, start, args.times)
            _print(title, _stages(messenger, start, args.times), whole)
            model_bytes = sum(w.nbytes for w in weights.values())
            print(f"  allocated at the send's peak: {_send_peak(messenger, start, model_bytes):.2f} of the model")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                _whole_send(messenger, start, 3)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        whole = _whole_send(messenger, whole_start, args.times)
        print(f"  int8 step made from the model (quantize_step)  {t_step / whole:5.2f} of the whole model's send")
        print(f"  round machine: round opened (sums allocated)   {_open_round(weights, args.times) / whole:5.2f}")
        turnover = _round_turnover(weights, args.times, args.profile, work)
        print(f"  round machine: last update -> next StartRound  {turnover / whole:5.2f}   (int8 downlink, momentum)")
        if args.broker:
            windows = [int(w) for w in args.windows.split(",")]
            asyncio.run(_through_broker(work, weights, args.times, windows, args.chunk))


if __name__ == "__main__":
    main()
