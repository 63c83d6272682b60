"""The gossip benchmark's peer (``bench/gossip_peer.py``) without a broker: its
messenger's sends are caught here and the peer's messages are handed to it directly."""

from __future__ import annotations

import asyncio
import time

from bench.env import FEDERATION, model_weights
from bench.gossip_peer import Peer
from fedagent.node.messaging import Incoming
from fedagent.node.transport import TlsFiles
from fedagent.protocols.codec import Envelope
from fedagent.protocols.messages import GossipAck, GossipModel
from fedagent.security import pki

ME, OTHER = "agent-1", "agent-2"


def _from_other(msg: GossipModel | GossipAck) -> Incoming:
    env = Envelope(kind=msg.kind, federation=FEDERATION, sender=OTHER, round=0, seq=1, ts=time.time(), body={})
    return Incoming(topic="t", sender=OTHER, envelope=env, message=msg, nbytes=1)


def test_a_model_that_comes_before_go_is_not_lost(tmp_path):
    """The parent tells the two peer processes "go" one after the other; under load the
    other peer's model can arrive before this one has read its own "go". The exchange
    must still end once our model is acknowledged, not wait for a model it already has."""
    ca = pki.create_ca(tmp_path / "ca", FEDERATION)
    cert, key = pki.issue(tmp_path / "ca", tmp_path / "certs", ME, "agent")
    weights = model_weights(64)
    peer = Peer("mqtts://127.0.0.1:1", TlsFiles(ca=ca, cert=cert, key=key), ME, OTHER, weights, 2**20, 30)
    sent: list[object] = []
    acking: list[asyncio.Task] = []

    async def send(topic: str, msg, **kw) -> int:
        sent.append(msg)
        if isinstance(msg, GossipModel):  # the other peer acknowledges our model, later
            acking.append(asyncio.create_task(peer._deliver(_from_other(GossipAck(msg.exchange_id, True)))))
        return 1

    peer.messenger.send = send  # type: ignore[method-assign]

    async def run() -> None:
        for r in range(2):
            # The other's model of exchange r before our "go r".
            await peer._deliver(_from_other(GossipModel(f"x{r}-{OTHER}", r, 0.5, 10.0, False, weights)))
            await asyncio.wait_for(peer.exchange_once(r), 5)

    asyncio.run(run())
    acks = [m.exchange_id for m in sent if isinstance(m, GossipAck)]
    ours = [m.exchange_id for m in sent if isinstance(m, GossipModel)]
    assert acks == [f"x0-{OTHER}", f"x1-{OTHER}"] and ours == [f"x0-{ME}", f"x1-{ME}"]
    assert not peer.early  # each early model was taken by its exchange
