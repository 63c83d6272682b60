"""One peer of the gossip benchmark in a process of its own, as a gossip agent runs.

It connects with fedagent's Transport and Messenger (its own certificate, mutual TLS,
signed frames), subscribes to its inbox, prints ``ready`` and then obeys its parent,
one line at a time on stdin:

``go R``
    send the model to the peer as :class:`GossipModel` ``xR-<id>``, and wait until
    the peer's model of exchange ``R`` has arrived (validated here with
    ``check_update``, which answers it with a :class:`GossipAck`) and the peer's ack of
    our own model has come back; then print ``done R CPU`` (CPU seconds this process
    spent from ``go`` to there).
``quit``
    disconnect and exit.

    python -m bench.gossip_peer --uri mqtts://127.0.0.1:PORT --id agent-1 --peer agent-2 \
        --certs DIR --ca CA --params 1100000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from bench.env import FEDERATION, model_weights
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import TlsFiles, Transport
from fedagent.protocols import topics
from fedagent.protocols.aggregation import check_update
from fedagent.protocols.messages import GossipAck, GossipModel
from fedagent.security.signing import Identity


class Peer:
    """The message path of ``agent/gossip.py`` between two agents (send a model, validate
    the one received and acknowledge it), without training and merging."""

    def __init__(self, uri: str, tls: TlsFiles, name: str, peer: str, weights, chunk: int, keepalive: int) -> None:
        self.name = name
        self.peer = peer
        self.weights = weights
        self.transport = Transport(
            uri=uri, tls=tls, keepalive=keepalive, subscriptions=[topics.inbox(FEDERATION, name)]
        )
        self.messenger = Messenger(
            federation=FEDERATION,
            node_id=name,
            transport=self.transport,
            identity=Identity.load(tls.cert, tls.key, tls.ca),
            max_chunk_bytes=chunk,
        )
        self.exchange = ""  # the peer's model we wait for
        self.ours = ""  # the id of our model whose ack we wait for
        # The peer's models that came before we were told to wait for them: the parent
        # tells both peers "go" one after the other, and under load the peer told first
        # can send its model before this one has read its own "go". Forgetting such a
        # model left this peer waiting for one that had come already.
        self.early: set[str] = set()
        self.got_model = asyncio.Event()
        self.got_ack = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _deliver(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, GossipModel):
            check_update(self.weights, msg.weights)
            if msg.exchange_id == self.exchange:
                self.got_model.set()
            else:
                self.early.add(msg.exchange_id)
            await self.messenger.send(
                topics.direct(FEDERATION, self.name, inc.sender, "gossip_ack"), GossipAck(msg.exchange_id, True)
            )
        elif isinstance(msg, GossipAck) and msg.exchange_id == self.ours and msg.accepted:
            self.got_ack.set()

    async def start(self) -> None:
        ready = asyncio.Event()
        self.task = asyncio.create_task(
            self.transport.run(lambda t, p: self.messenger.receive(t, p, self._deliver), ready)
        )
        await asyncio.wait_for(ready.wait(), 60)

    async def exchange_once(self, r: int) -> None:
        """Send our model of exchange ``r`` and wait for the peer's and for its ack."""
        self.ours, self.exchange = f"x{r}-{self.name}", f"x{r}-{self.peer}"
        # Checked and switched with no await in between: a model delivered from here on
        # finds the new ``exchange``, one delivered before is in ``early``.
        if self.exchange in self.early:
            self.early.discard(self.exchange)
            self.got_model.set()
        else:
            self.got_model.clear()
        self.got_ack.clear()  # our model is not sent yet: its ack cannot be early
        await self.messenger.send(
            topics.direct(FEDERATION, self.name, self.peer, "gossip"),
            GossipModel(self.ours, r, 0.5, 10.0, False, self.weights),
            stable=True,  # as agent/gossip.py sends models
        )
        await asyncio.wait_for(asyncio.gather(self.got_model.wait(), self.got_ack.wait()), 300)

    async def stop(self) -> None:
        await self.transport.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class Trace:
    """Timestamps (``time.time()``: the peers' clocks are one machine's) of what one peer
    does during an exchange: each frame published and acknowledged, each frame received,
    each message decoded and delivered. Written as JSON lines by ``bench/gossip_trace.py``."""

    def __init__(self, peer: Peer) -> None:
        import fedagent.node.messaging as messaging

        self.events: list[tuple[float, str, str, int]] = []
        note = self.note
        publish = peer.transport.publish

        async def traced_publish(topic: str, payload: bytes, **kw):
            note("publish", topic, len(payload))
            try:
                return await publish(topic, payload, **kw)
            finally:
                note("puback", topic, len(payload))

        peer.transport.publish = traced_publish  # type: ignore[method-assign]
        receive = peer.messenger.receive

        async def traced_receive(topic: str, payload: bytes, deliver, **kw):
            note("frame", topic, len(payload))
            return await receive(topic, payload, deliver, **kw)

        peer.messenger.receive = traced_receive  # type: ignore[method-assign]
        deliver = peer._deliver

        async def traced_deliver(inc: Incoming):
            note("deliver", inc.message.kind, inc.nbytes)
            await deliver(inc)
            note("handled", inc.message.kind, inc.nbytes)

        peer._deliver = traced_deliver  # type: ignore[method-assign]
        decode = messaging.decode

        def traced_decode(data, limits, **kw):
            n = len(data)
            if n > 2**20:
                note("decode", "start", n)
            try:
                return decode(data, limits, **kw)
            finally:
                if n > 2**20:
                    note("decode", "end", n)

        messaging.decode = traced_decode  # type: ignore[assignment]

    def note(self, what: str, detail: str, nbytes: int) -> None:
        self.events.append((time.time(), what, detail, nbytes))


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


async def main(args: argparse.Namespace) -> None:
    import json

    tls = TlsFiles(ca=args.ca, cert=args.certs / f"{args.id}.crt", key=args.certs / f"{args.id}.key")
    peer = Peer(args.uri, tls, args.id, args.peer, model_weights(args.params), args.chunk, args.keepalive)
    trace = Trace(peer) if args.trace else None
    prof = None
    if args.profile is not None:
        import cProfile

        prof = cProfile.Profile()
    await peer.start()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    try:
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                break
            if line[0] != "go" or len(line) != 2:
                raise SystemExit(f"gossip_peer: unknown command {line!r}")
            r = int(line[1])
            if prof is not None:
                prof.enable()
            c0 = time.process_time()
            if trace is not None:
                trace.events.clear()
                trace.note("go", str(r), 0)
            await peer.exchange_once(r)
            cpu = time.process_time() - c0
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            if trace is not None:
                trace.note("done", str(r), 0)
                lines = "".join(json.dumps([args.id, r, *ev]) + "\n" for ev in trace.events)
                await asyncio.to_thread(_append, args.trace, lines)
            out.write(f"done {r} {cpu:.6f}\n")
            out.flush()
    finally:
        await peer.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--uri", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--certs", type=Path, required=True)
    ap.add_argument("--ca", type=Path, required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--chunk", type=int, default=4 * 2**20)
    ap.add_argument("--keepalive", type=int, default=30)
    ap.add_argument("--trace", type=Path, default=None, help="append each exchange's timestamps here (JSON lines)")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile of this process's exchanges, written here")
    asyncio.run(main(ap.parse_args()))
