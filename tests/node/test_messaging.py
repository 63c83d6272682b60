"""Envelopes over a real broker: a model larger than the broker's packet limit is
chunked and reassembled; garbage and spoofed senders are refused."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fedfixtures import ident

from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, encode
from fedagent.protocols.messages import Presence, Update
from fedagent.security.signing import sign

FED = "testfed"


def test_model_above_max_packet_size_is_chunked_and_reassembled(broker_factory, peer, arun):
    small_broker = broker_factory(max_packet_size=2 * 2**20)
    rng = np.random.default_rng(0)
    weights = {
        "big": rng.normal(size=(1500, 1000)).astype(np.float32),  # 6 MB
        "bias": rng.normal(size=1000).astype(np.float32),
    }
    topic = topics.direct(FED, "agent-a", "coord", "update")

    async def main():
        got: asyncio.Queue = asyncio.Queue()
        async with (
            peer(
                small_broker,
                "coord",
                subscriptions=[topics.inbox(FED, "coord")],
                handler=lambda t, p: recv.receive(t, p, got.put),
            ) as c,
            peer(small_broker, "agent-a") as a,
        ):
            recv = Messenger(
                federation=FED,
                node_id="coord",
                transport=c.transport,
                max_chunk_bytes=2**20,
                identity=ident(small_broker.pki, "coord"),
            )
            send = Messenger(
                federation=FED,
                node_id="agent-a",
                transport=a.transport,
                max_chunk_bytes=2**20,
                identity=ident(small_broker.pki, "agent-a"),
            )
            nbytes = await send.send(topic, Update(1, 0, 100, {"loss": 0.5}, weights), round_=1)
            assert nbytes > 6_000_000
            inc = await asyncio.wait_for(got.get(), 30)
            assert inc.sender == "agent-a" and isinstance(inc.message, Update)
            for k, v in weights.items():
                np.testing.assert_array_equal(inc.message.weights[k], v)
            assert recv.reassembler.pending_bytes == 0 and not recv.rejected

    arun(main(), timeout=60)


def test_garbage_and_spoofed_envelopes_are_rejected_and_counted(broker, peer, arun):
    topic = topics.direct(FED, "agent-a", "coord", "update")

    async def main():
        got: asyncio.Queue = asyncio.Queue()
        async with (
            peer(
                broker,
                "coord",
                subscriptions=[topics.inbox(FED, "coord")],
                handler=lambda t, p: recv.receive(t, p, got.put),
            ) as c,
            peer(broker, "agent-a") as a,
        ):
            recv = Messenger(
                federation=FED, node_id="coord", transport=c.transport, identity=ident(broker.pki, "coord")
            )
            await a.transport.publish(topic, b"\xdd\x7f\xff\xff\xff")  # lying array32 header
            spoof = Presence(online=True, role="agent")
            await a.transport.publish(
                topic,
                encode(
                    Envelope(
                        kind="presence", federation=FED, sender="agent-b", round=0, seq=1, ts=0.0, body=spoof.to_body()
                    )
                ),
            )
            await a.transport.publish(
                topic, encode(Envelope(kind="bogus", federation=FED, sender="agent-a", round=0, seq=2, ts=0.0, body={}))
            )
            me = ident(broker.pki, "agent-a")
            await a.transport.publish(
                topic,
                encode(
                    sign(
                        Envelope(
                            kind="bogus", federation=FED, sender="agent-a", round=0, seq=3, ts=time.time(), body={}
                        ),
                        me,
                    )
                ),
            )
            real = Messenger(federation=FED, node_id="agent-a", transport=a.transport, identity=me)
            await real.send(topic, spoof)
            inc = await asyncio.wait_for(got.get(), 10)
            # QoS 1 keeps order on one connection: the four bad ones came first.
            assert inc.sender == "agent-a" and isinstance(inc.message, Presence)
            assert dict(recv.rejected) == {"codec": 1, "spoofed": 1, "unsigned": 1, "schema": 1}
            assert got.empty()

    arun(main(), timeout=60)
