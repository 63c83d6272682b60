"""The typed messages of the fedagent protocol, carried in an :class:`Envelope` body.

Each message is a frozen dataclass validated on construction, and declares its body
field by field (:mod:`fedagent.protocols.fields`): ``to_body`` gives the msgpack-native
body; ``from_body`` validates a decoded body field by field and raises
:class:`~fedagent.errors.CodecError` on anything unexpected. Which class decodes a body
is decided by the receiver's protocol state and the envelope ``kind``, through the fixed
table ``KINDS`` — never by looking up a name sent by the peer.

The messages are grouped by concern: :mod:`.control` (presence, heartbeat, model check),
:mod:`.rounds` (FedAvg), :mod:`.fedbuff` (asynchronous buffered FedAvg), :mod:`.gossip`, :mod:`.vocabulary`, :mod:`.syncopt`,
:mod:`.search`; the secure-aggregation messages are :mod:`fedagent.protocols.secagg`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedagent.errors import CodecError
from fedagent.protocols.codec import Limits
from fedagent.protocols.fields import MAX_METRICS
from fedagent.protocols.messages.control import MODES, ROLES, Heartbeat, ModelCheck, Presence
from fedagent.protocols.messages.fedbuff import AsyncModel, AsyncTask, AsyncUpdate
from fedagent.protocols.messages.gossip import MAX_EXCHANGE_ID, GossipAck, GossipModel
from fedagent.protocols.messages.rounds import (
    MAX_LOCAL_STEPS,
    Evaluation,
    GlobalModel,
    ModelRequest,
    RoundResult,
    RoundStart,
    TrainConfig,
    Update,
)
from fedagent.protocols.messages.search import (
    MAX_QUERY_ID,
    PublicVectors,
    PublicVectorsRequest,
    SearchAnswer,
    SearchQuery,
)
from fedagent.protocols.messages.syncopt import SyncGradient, SyncStep, SyncValidation
from fedagent.protocols.messages.vocabulary import (
    MAX_DIGEST,
    MAX_TERM_CHARS,
    MAX_VOCAB_TERMS,
    VocabDigest,
    VocabOffer,
    Vocabulary,
)
from fedagent.protocols.secagg import MESSAGES as SECAGG_MESSAGES
from fedagent.protocols.secagg import SecAggMessage

__all__ = [
    "KINDS",
    "MAX_DIGEST",
    "MAX_EXCHANGE_ID",
    "MAX_LOCAL_STEPS",
    "MAX_METRICS",
    "MAX_QUERY_ID",
    "MAX_TERM_CHARS",
    "MAX_VOCAB_TERMS",
    "MODES",
    "ROLES",
    "AsyncModel",
    "AsyncTask",
    "AsyncUpdate",
    "Evaluation",
    "GlobalModel",
    "GossipAck",
    "GossipModel",
    "Heartbeat",
    "Limits",
    "Message",
    "ModelCheck",
    "ModelRequest",
    "Presence",
    "PublicVectors",
    "PublicVectorsRequest",
    "RoundResult",
    "RoundStart",
    "SearchAnswer",
    "SearchQuery",
    "SyncGradient",
    "SyncStep",
    "SyncValidation",
    "TrainConfig",
    "Update",
    "VocabDigest",
    "VocabOffer",
    "Vocabulary",
    "body_of",
]

Message = (
    Presence
    | ModelCheck
    | RoundStart
    | Update
    | RoundResult
    | GlobalModel
    | Evaluation
    | ModelRequest
    | GossipModel
    | GossipAck
    | VocabOffer
    | Vocabulary
    | SyncStep
    | SyncGradient
    | SyncValidation
    | VocabDigest
    | SearchQuery
    | SearchAnswer
    | PublicVectorsRequest
    | PublicVectors
    | Heartbeat
    | AsyncTask
    | AsyncModel
    | AsyncUpdate
    | SecAggMessage
)

# The fixed table from an envelope kind to the class that validates its body.
KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        Presence,
        Heartbeat,
        ModelCheck,
        RoundStart,
        Update,
        RoundResult,
        GlobalModel,
        Evaluation,
        ModelRequest,
        GossipModel,
        GossipAck,
        VocabOffer,
        Vocabulary,
        SyncStep,
        SyncGradient,
        SyncValidation,
        VocabDigest,
        SearchQuery,
        SearchAnswer,
        PublicVectorsRequest,
        PublicVectors,
        AsyncTask,
        AsyncModel,
        AsyncUpdate,
        *SECAGG_MESSAGES,
    )
}


def body_of(kind: str, body: Mapping[str, Any], limits: Limits) -> Message:
    cls = KINDS.get(kind)
    if cls is None:
        raise CodecError(f"unknown message kind {kind!r}")
    return cls.from_body(body, limits)
