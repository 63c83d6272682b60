"""A gossip exchange through Mosquitto with mutual TLS, against the raw C clients.

fedagent's exchange: two agents (each its own fedagent Transport + Messenger, mutual
TLS, signed frames) send each other a :class:`GossipModel` of the whole model at the
same time, on the direct topics gossip agents use; each validates the model it gets
and answers with a :class:`GossipAck`. The exchange ends when both models and both
acks have arrived. This is the message path of ``agent/gossip.py`` (what the gossip
daemon sends and checks), without its training and merging.

The C clients' exchange, through the same broker: two ``mosquitto_sub`` (one per
receiving agent, already subscribed) and two ``mosquitto_pub`` of the same encoded
model at once, QoS 1; it ends when both subscribers have their message. Other agent
identities are used for it so the fedagent agents, still connected, never see its bytes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.env import FEDERATION, BenchBroker, bench_broker, mb, model_sizes, model_weights
from bench.registry import Context, Row, section, summary
from bench.round import KEEPALIVE, CClients, children_cpu, chunk_bytes
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import Transport
from fedagent.protocols import topics
from fedagent.protocols.aggregation import check_update
from fedagent.protocols.messages import GossipAck, GossipModel
from fedagent.signing import Identity

PAIR = ("agent-1", "agent-2")
C_PAIR = ("agent-3", "agent-4")


class _Peer:
    def __init__(self, bb: BenchBroker, name: str, weights) -> None:
        tls = bb.tls(name)
        self.name = name
        self.weights = weights
        self.transport = Transport(
            uri=bb.uri,
            tls=tls,
            keepalive=KEEPALIVE,
            subscriptions=[topics.inbox(FEDERATION, name)],
        )
        self.messenger = Messenger(
            federation=FEDERATION,
            node_id=name,
            transport=self.transport,
            identity=Identity.load(tls.cert, tls.key, tls.ca),
            max_chunk_bytes=chunk_bytes(),
        )
        self.got_model = asyncio.Event()
        self.got_ack = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _deliver(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, GossipModel):
            check_update(self.weights, msg.weights)
            self.got_model.set()
            await self.messenger.send(
                topics.direct(FEDERATION, self.name, inc.sender, "gossip_ack"), GossipAck(msg.exchange_id, True)
            )
        elif isinstance(msg, GossipAck):
            self.got_ack.set()

    async def start(self) -> None:
        ready = asyncio.Event()
        self.task = asyncio.create_task(
            self.transport.run(lambda t, p: self.messenger.receive(t, p, self._deliver), ready)
        )
        await asyncio.wait_for(ready.wait(), 60)

    async def stop(self) -> None:
        await self.transport.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def _fed_exchanges(bb: BenchBroker, params: int, repeats: int) -> list[tuple[float, float]]:
    """(seconds, CPU seconds of both peers) of each exchange."""
    weights = model_weights(params)
    a, b = _Peer(bb, PAIR[0], weights), _Peer(bb, PAIR[1], weights)
    await a.start()
    await b.start()
    times = []
    try:
        for r in range(repeats):
            for p in (a, b):
                p.got_model.clear()
                p.got_ack.clear()
            c0 = time.process_time()  # both peers run in this process
            t0 = time.perf_counter()
            await asyncio.gather(
                a.messenger.send(
                    topics.direct(FEDERATION, a.name, b.name, "gossip"),
                    GossipModel(f"x{r}a", r, 0.5, 10.0, False, weights),
                ),
                b.messenger.send(
                    topics.direct(FEDERATION, b.name, a.name, "gossip"),
                    GossipModel(f"x{r}b", r, 0.5, 10.0, False, weights),
                ),
            )
            await asyncio.wait_for(
                asyncio.gather(a.got_model.wait(), b.got_model.wait(), a.got_ack.wait(), b.got_ack.wait()), 300
            )
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        await a.stop()
        await b.stop()
    return times


def _c_exchange(cc: CClients, payload: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of the four C clients) of one exchange."""
    import subprocess

    c0 = children_cpu()
    x, y = C_PAIR
    subs = cc._subs([y], topics.inbox(FEDERATION, cc.c(y)), 2) + cc._subs([x], topics.inbox(FEDERATION, cc.c(x)), 2)
    t0 = time.perf_counter()
    pubs = [
        subprocess.Popen(
            [
                "mosquitto_pub",
                *cc._common(s, tx=True),
                "-t",
                topics.direct(FEDERATION, cc.c(s, tx=True), cc.c(d), "gossip"),
                "-f",
                str(payload),
            ]
        )
        for s, d in ((x, y), (y, x))
    ]
    cc._collect(subs, payload.stat().st_size, 1)
    took = time.perf_counter() - t0
    for p in pubs:
        if p.wait(timeout=300) != 0:
            raise RuntimeError(f"mosquitto_pub exited {p.returncode}")
    return took, children_cpu() - c0


@section("gossip", rows=lambda ctx: 3 * len(model_sizes(ctx)))
def gossip_exchange(ctx: Context) -> list[Row]:
    rows = []
    with bench_broker(ctx, ctx.work / "gossip", 4) as bb:
        cc = CClients(bb, ctx.work / "gossip")
        for params in model_sizes(ctx):
            weights = model_weights(params)
            payload = ctx.work / f"gossip-{params}.bin"
            m = Messenger(
                federation=FEDERATION,
                node_id=C_PAIR[0],
                transport=None,
                identity=Identity.load(bb.tls(C_PAIR[0]).cert, bb.tls(C_PAIR[0]).key, bb.tls(C_PAIR[0]).ca),
            )
            payload.write_bytes(m.frame(GossipModel("c", 0, 0.5, 10.0, False, weights)))
            del m
            ours, theirs, our_cpu, their_cpu = [], [], [], []
            # Alternate, so both see the same load.
            for _ in range(ctx.repeats):
                ((t, c),) = asyncio.run(_fed_exchanges(bb, params, 1))
                ct, cc_cpu = _c_exchange(cc, payload)
                ours.append(t)
                our_cpu.append(c)
                theirs.append(ct)
                their_cpu.append(cc_cpu)
                ctx.log(
                    f"gossip {mb(params)}: fedagent {t:.2f} s (CPU {c:.2f} s), C clients {ct:.2f} s (CPU {cc_cpu:.2f} s)"
                )
            (om, ox), (tm, tx) = summary(ours), summary(theirs)
            subject = f"gossip exchange, 2 agents, both ways + acks, TLS, {mb(params)}"
            rows.append(
                Row(
                    "gossip",
                    f"{subject} (median)",
                    om,
                    "mosquitto_pub/sub of the same bytes both ways (median)",
                    tm,
                    note=f"target <= 1.2x; max {ox:.2f} s vs {tx:.2f} s; n={len(ours)}",
                )
            )
            rows.append(
                Row("gossip", f"{subject} (max)", ox, "mosquitto_pub/sub of the same bytes both ways (max)", tx)
            )
            rows.append(
                Row(
                    "gossip",
                    f"CPU of both fedagent peers per exchange, {mb(params)} (median)",
                    summary(our_cpu)[0],
                    "CPU of the four mosquitto_pub/sub processes (median)",
                    summary(their_cpu)[0],
                    note="client side only; both fedagent peers share one process (one GIL), the C clients are four",
                )
            )
    return rows
