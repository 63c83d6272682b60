"""Updates of the round in flight read back from the round journal, for the round
machine's :class:`~fedagent.protocols.rounds.Refold`.

The machine folds a streamed update as it arrives and keeps nothing of it; when an
update must be folded again (scaled down to the norm bound) or taken back out (it failed
after its first parts were folded), the journal (:mod:`fedagent.storage.roundjournal`)
still holds every frame of it, written before the frame was acknowledged. This module
turns those frames back into the parts the machine saw, in the same order: a stream's
chunks through a :class:`~fedagent.protocols.streaming.StreamIntake` of its own, a
whole update (one frame, or chunks reassembled) tensor by tensor. The frames were
checked when they came (certificate, signature, freshness) and the journal is this
node's own state, validated as it is read; here they are decoded under the same limits.
One pass over the journal serves every update asked for, one frame in memory at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import topics
from fedagent.protocols.chunking import Reassembler
from fedagent.protocols.codec import Envelope, Limits, decode
from fedagent.protocols.messages import Update, body_of
from fedagent.protocols.streaming import STREAM_KIND, StreamIntake, UpdatePart
from fedagent.security.signing import CHUNK_KIND

log = logging.getLogger("fedagent.coordinator")

Frames = Iterable[tuple[str, bytes]]


def _frames_of(
    frames: Frames, wanted: Mapping[str, str | None], round_: int, limits: Limits
) -> Iterator[tuple[str, Envelope]]:
    """(sender, envelope) of the journaled frames of ``wanted`` senders in ``round_``."""
    for topic, data in frames:
        try:
            sender = topics.parse(topic)[1]
        except ValueError:
            continue
        if sender not in wanted:
            continue
        try:
            env = decode(data, limits, views=True)
        except CodecError as exc:
            log.error("round journal: a frame of %s does not decode (%s); skipped", sender, exc)
            continue
        if env.sender == sender and env.round == round_:
            yield sender, env


def held_whole(frames: Frames, wanted: Mapping[str, str | None], round_: int, limits: Limits) -> set[str]:
    """The senders of ``wanted`` whose update (the stream ``wanted[sender]``, or with None
    a whole update) the journal holds every frame of."""
    seen: dict[tuple[str, str], set[int]] = {}
    need: dict[tuple[str, str], int] = {}
    whole: set[str] = set()
    for sender, env in _frames_of(frames, wanted, round_, limits):
        tid = wanted[sender]
        if env.kind == Update.kind and tid is None:
            whole.add(sender)
            continue
        if env.kind not in (STREAM_KIND, CHUNK_KIND) or (env.kind == STREAM_KIND) != (tid is not None):
            continue
        body = env.body
        if not isinstance(body, dict) or (tid is not None and body.get("tid") != tid):
            continue
        key = (sender, str(body.get("tid")))
        i, n = body.get("i"), body.get("n")
        if type(i) is int and type(n) is int:
            seen.setdefault(key, set()).add(i)
            need[key] = n
    for key, idx in seen.items():
        if len(idx) == need[key] and idx == set(range(need[key])):
            whole.add(key[0])
    return whole


def _tensor_parts(sender: str, weights: Mapping[str, np.ndarray]) -> Iterator[UpdatePart]:
    for name, arr in weights.items():
        yield UpdatePart(sender, "", name, 0, np.asarray(arr).reshape(-1))


def replay_parts(
    frames: Frames,
    wanted: Mapping[str, str | None],
    round_: int,
    *,
    federation: str,
    wire_limits: Limits,
    model_limits: Limits,
) -> Iterator[tuple[str, UpdatePart]]:
    """(sender, part) of each ``wanted`` update, in the order the machine folded them."""
    intakes: dict[str, StreamIntake] = {}
    reassemblers: dict[str, Reassembler] = {}
    cap = model_limits.max_message_bytes
    for sender, env in _frames_of(frames, wanted, round_, wire_limits):
        tid = wanted[sender]
        try:
            if tid is not None:
                if env.kind != STREAM_KIND:
                    continue
                it = intakes.get(sender)
                if it is None:
                    it = intakes[sender] = StreamIntake(
                        federation, max_transfer_bytes=cap, max_pending_bytes=cap, timeout=float("inf")
                    )
                for ev in it.feed(sender, env.body, time.monotonic()):
                    if isinstance(ev, UpdatePart) and ev.tid == tid:
                        yield sender, ev
                continue
            if env.kind == CHUNK_KIND:
                ra = reassemblers.get(sender)
                if ra is None:
                    ra = reassemblers[sender] = Reassembler(cap, cap, float("inf"))
                whole = ra.feed(sender, env.body, time.monotonic())
                if whole is None:
                    continue
                env = decode(whole, model_limits, views=True)
            if env.kind != Update.kind:
                continue
            msg = body_of(env.kind, env.body, model_limits)
            assert isinstance(msg, Update)
            yield from ((sender, p) for p in _tensor_parts(sender, msg.weights))
        except CodecError as exc:
            log.error("round journal: the update of %s cannot be read back (%s)", sender, exc)
