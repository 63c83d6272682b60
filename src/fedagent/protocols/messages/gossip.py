"""The messages of gossip mode: a model handed to a peer, and the peer's answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedagent.protocols import fields as F

Weights = dict[str, np.ndarray]

MAX_EXCHANGE_ID = 64


@dataclass(frozen=True, slots=True)
class GossipModel(F.WireMessage):
    """Agent → agent (gossip mode): the sender's exchanged parameters, with the push-sum
    ``mass`` they carry and their ``age`` (local steps); ``returned`` when the receiver
    sends back mass it had to evict (see :mod:`fedagent.protocols.gossip`)."""

    kind: ClassVar[str] = "gossip_model"
    WIRE: ClassVar[F.Body] = F.Body(
        "gossip_model",
        F.Field("exchange_id", F.Text(min_len=1, max_len=MAX_EXCHANGE_ID)),
        F.Field("period", F.Count()),
        F.Field("mass", F.Number(finite=True, above=0)),
        F.Field("age", F.Number(finite=True, at_least=0)),
        F.Field("returned", F.Flag()),
        F.Field("weights", F.Tensors()),
    )
    exchange_id: str
    period: int
    mass: float
    age: float
    returned: bool
    weights: Weights = field(repr=False)


@dataclass(frozen=True, slots=True)
class GossipAck(F.WireMessage):
    """Agent → agent (gossip mode): the receiver took custody of a model, or refused it
    (then the sender takes the model's mass back)."""

    kind: ClassVar[str] = "gossip_ack"
    WIRE: ClassVar[F.Body] = F.Body(
        "gossip_ack",
        F.Field("exchange_id", F.Text(min_len=1, max_len=MAX_EXCHANGE_ID)),
        F.Field("accepted", F.Flag()),
        F.Field("reason", F.Text(max_len=200), default=""),
    )
    exchange_id: str
    accepted: bool
    reason: str = ""
