"""A gossip exchange through Mosquitto with mutual TLS, against the raw C clients.

fedagent's exchange: two agents, each a process of its own as gossip agents are
(``bench/gossip_peer.py``: its own Transport + Messenger, mutual TLS, signed frames),
started once per model size and told when to go over a pipe (one exchange first that
is not counted), send each other a :class:`GossipModel` of the whole model at the
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
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

from bench.env import FEDERATION, BenchBroker, bench_broker, mb, model_sizes, model_weights
from bench.gossip_peer import Peer
from bench.registry import Context, Row, section, summary
from bench.round import KEEPALIVE, ROOT, CClients, children_cpu, chunk_bytes
from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.messages import GossipModel
from fedagent.security.signing import Identity

PAIR = ("agent-1", "agent-2")
C_PAIR = ("agent-3", "agent-4")


#: How the two fedagent peers run: "processes" (the default: each in a process of its
#: own, as gossip agents do) or "one-process" (both in this process, one event loop and
#: one GIL: the arrangement before 2026-11-25, kept to show the difference).
ARRANGEMENT_ENV = "FEDAGENT_BENCH_GOSSIP_PEERS"


def arrangement() -> str:
    value = os.environ.get(ARRANGEMENT_ENV, "processes")
    if value not in ("processes", "one-process"):
        raise ValueError(f"{ARRANGEMENT_ENV} must be 'processes' or 'one-process', not {value!r}")
    return value


def _name(p: subprocess.Popen) -> str:
    """The agent a peer process is (its ``--id``), for messages about it."""
    args = cast(list[str], p.args)  # the list given to Popen below
    return args[args.index("--id") + 1]


class _PeerProcesses:
    """The two peers as child processes (``bench/gossip_peer.py``), driven over their
    stdin/stdout: each says ``ready`` once subscribed, and ``done R CPU`` once it holds
    the other's model and the other's ack of its own."""

    def __init__(
        self,
        bb: BenchBroker,
        params: int,
        trace: Path | None = None,
        pair: tuple[str, str] = PAIR,
        profile: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        env = dict(os.environ, **(env or {}))
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.gossip_peer",
                    "--uri",
                    bb.uri,
                    "--id",
                    me,
                    "--peer",
                    other,
                    "--certs",
                    str(bb.certs),
                    "--ca",
                    str(bb.tls(me).ca),
                    "--params",
                    str(params),
                    "--chunk",
                    str(chunk_bytes()),
                    "--keepalive",
                    str(KEEPALIVE),
                    *(["--trace", str(trace)] if trace is not None else []),
                    *(["--profile", f"{profile}.{me}"] if profile is not None else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )
            for me, other in (pair, pair[::-1])
        ]
        for p in self.procs:
            self._expect(p, "ready")

    @staticmethod
    def _expect(p: subprocess.Popen, what: str) -> list[str]:
        line = p.stdout.readline().split()
        if not line or line[0] != what:
            p.kill()
            raise RuntimeError(f"gossip peer {_name(p)} said {line!r} instead of {what!r} (exit {p.poll()})")
        return line

    def exchange(self, r: int) -> tuple[float, float]:
        """(seconds, CPU seconds of both peers) of exchange ``r``."""
        t0 = time.perf_counter()
        for p in self.procs:
            p.stdin.write(f"go {r}\n")
            p.stdin.flush()
        cpu = 0.0
        for p in self.procs:
            _, got, c = self._expect(p, "done")
            if int(got) != r:
                raise RuntimeError(f"gossip peer {_name(p)} finished exchange {got}, not {r}")
            cpu += float(c)
        return time.perf_counter() - t0, cpu

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class _OneProcess:
    """Both peers in this process, connected afresh for each exchange (the arrangement
    before 2026-11-25), with one exchange first that is not counted."""

    def __init__(self, bb: BenchBroker, params: int) -> None:
        self.bb, self.params = bb, params

    def exchange(self, r: int) -> tuple[float, float]:
        return asyncio.run(_one_process_exchanges(self.bb, self.params, 2))[-1]

    def stop(self) -> None:
        pass


def _fed_peers(bb: BenchBroker, params: int) -> _PeerProcesses | _OneProcess:
    """The fedagent side, ready for ``exchange(r)``: (seconds, CPU seconds of both peers).
    Peer processes stay up for all of a size's exchanges, as gossip agents do, after one
    exchange that is not counted (the first in a fresh process pays for code paths and
    threads used for the first time)."""
    if arrangement() == "one-process":
        return _OneProcess(bb, params)
    peers = _PeerProcesses(bb, params)
    try:
        peers.exchange(0)
    except BaseException:
        peers.stop()
        raise
    return peers


async def _one_process_exchanges(bb: BenchBroker, params: int, repeats: int) -> list[tuple[float, float]]:
    weights = model_weights(params)
    a, b = (Peer(bb.uri, bb.tls(me), me, other, weights, chunk_bytes(), KEEPALIVE) for me, other in (PAIR, PAIR[::-1]))
    await a.start()
    await b.start()
    times = []
    try:
        for r in range(repeats):
            c0 = time.process_time()  # both peers run in this process
            t0 = time.perf_counter()
            await asyncio.gather(a.exchange_once(r), b.exchange_once(r))
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        await a.stop()
        await b.stop()
    return times


def _c_exchange(cc: CClients, payload: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of the four C clients) of one exchange."""
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
            peers = _fed_peers(bb, params)
            try:
                for r in range(ctx.repeats):
                    t, c = peers.exchange(r + 1)
                    ct, cc_cpu = _c_exchange(cc, payload)
                    ours.append(t)
                    our_cpu.append(c)
                    theirs.append(ct)
                    their_cpu.append(cc_cpu)
                    ctx.log(
                        f"gossip {mb(params)}: fedagent {t:.2f} s (CPU {c:.2f} s), "
                        f"C clients {ct:.2f} s (CPU {cc_cpu:.2f} s)"
                    )
            finally:
                peers.stop()
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
                    note=f"client side only; fedagent peers: {arrangement()}; the C clients are four processes",
                )
            )
    return rows
