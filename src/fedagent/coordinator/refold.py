"""Updates of the round in flight (or of the buffer being filled) read back from the
round journal, for the round machine's :class:`~fedagent.protocols.rounds.Refold` and
the buffer machine's :class:`~fedagent.protocols.fedbuff.Refold`.

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
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import topics
from fedagent.protocols.chunking import Reassembler
from fedagent.protocols.codec import Envelope, Limits, decode
from fedagent.protocols.messages import AsyncUpdate, Update, body_of
from fedagent.protocols.streaming import STREAM_KIND, StreamIntake, UpdatePart
from fedagent.security.signing import CHUNK_KIND

log = logging.getLogger("fedagent.coordinator")

Frames = Iterable[tuple[str, bytes]]
#: An update asked for by (sender, round or task, the stream's transfer id or None for a
#: whole update, the model version a whole asynchronous update was trained from or None).
Wanted = tuple[str, int, str | None, int | None]


def _frames_of(frames: Frames, rounds: Mapping[str, set[int]], limits: Limits) -> Iterator[tuple[str, Envelope]]:
    """(sender, envelope) of the journaled frames of the senders in ``rounds``, for one
    of the rounds (tasks) asked of that sender."""
    for topic, data in frames:
        try:
            sender = topics.parse(topic)[1]
        except ValueError:
            continue
        if sender not in rounds:
            continue
        try:
            env = decode(data, limits, views=True)
        except CodecError as exc:
            log.error("round journal: a frame of %s does not decode (%s); skipped", sender, exc)
            continue
        if env.sender == sender and env.round in rounds[sender]:
            yield sender, env


def _rounds(wanted: Iterable[Wanted]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for sender, round_, _tid, _base in wanted:
        out.setdefault(sender, set()).add(round_)
    return out


def _whole_message(env: Envelope, model_limits: Limits) -> tuple[int | None, Mapping[str, np.ndarray]] | None:
    """(base version or None, tensors) of a whole update's envelope, None for another kind."""
    if env.kind == Update.kind:
        msg = body_of(env.kind, env.body, model_limits)
        assert isinstance(msg, Update)
        return None, msg.weights
    if env.kind == AsyncUpdate.kind:
        amsg = body_of(env.kind, env.body, model_limits)
        assert isinstance(amsg, AsyncUpdate)
        return amsg.base_version, amsg.delta
    return None


def held_whole_updates(frames: Frames, wanted: Iterable[Wanted], limits: Limits) -> set[Wanted]:
    """The updates of ``wanted`` the journal holds every frame of (a whole update: one
    frame of its kind, or its chunks; its base version is checked when it is read)."""
    wanted = set(wanted)
    streams = {(s, r, t): w for w in wanted for s, r, t, _b in [w] if t is not None}
    wholes = {(s, r): [w for w in wanted if w[0] == s and w[1] == r and w[2] is None] for s, r, t, _b in wanted}
    seen: dict[tuple[str, int, str], set[int]] = {}
    need: dict[tuple[str, int, str], int] = {}
    found: set[Wanted] = set()
    for sender, env in _frames_of(frames, _rounds(wanted), limits):
        if env.kind in (Update.kind, AsyncUpdate.kind):
            found.update(wholes.get((sender, env.round), ()))
            continue
        if env.kind not in (STREAM_KIND, CHUNK_KIND):
            continue
        body = env.body
        if not isinstance(body, dict):
            continue
        tid = str(body.get("tid"))
        if env.kind == STREAM_KIND and (sender, env.round, tid) not in streams:
            continue
        if env.kind == CHUNK_KIND and not wholes.get((sender, env.round)):
            continue
        key = (sender, env.round, tid)
        i, n = body.get("i"), body.get("n")
        if type(i) is int and type(n) is int:
            seen.setdefault(key, set()).add(i)
            need[key] = n
    for (sender, round_, tid), idx in seen.items():
        if len(idx) == need[(sender, round_, tid)] and idx == set(range(need[(sender, round_, tid)])):
            w = streams.get((sender, round_, tid))
            found.update([w] if w is not None else wholes.get((sender, round_), ()))
    return found


def held_whole(frames: Frames, wanted: Mapping[str, str | None], round_: int, limits: Limits) -> set[str]:
    """The senders of ``wanted`` whose update (the stream ``wanted[sender]``, or with None
    a whole update) of ``round_`` the journal holds every frame of."""
    return {w[0] for w in held_whole_updates(frames, [(s, round_, t, None) for s, t in wanted.items()], limits)}


def _tensor_parts(sender: str, weights: Mapping[str, np.ndarray]) -> Iterator[UpdatePart]:
    for name, arr in weights.items():
        yield UpdatePart(sender, "", name, 0, np.asarray(arr).reshape(-1))


def replay_updates(
    frames: Frames,
    wanted: Iterable[Wanted],
    *,
    federation: str,
    wire_limits: Limits,
    model_limits: Limits,
) -> Iterator[tuple[Wanted, UpdatePart]]:
    """(update, part) of each ``wanted`` update, in the order the machine folded them. A
    whole update is read once: the first of its (sender, round) whose base version is
    the one asked for (an agent sends the same update again after a broken transfer)."""
    wanted = set(wanted)
    streams = {(w[0], w[1], w[2]): w for w in wanted if w[2] is not None}
    wholes = {(w[0], w[1]): w for w in wanted if w[2] is None}
    done: set[Wanted] = set()
    intakes: dict[str, StreamIntake] = {}
    reassemblers: dict[str, Reassembler] = {}
    cap = model_limits.max_message_bytes
    for sender, env in _frames_of(frames, _rounds(wanted), wire_limits):
        try:
            if env.kind == STREAM_KIND:
                if not any(k[0] == sender and k[1] == env.round for k in streams):
                    continue
                it = intakes.get(sender)
                if it is None:
                    it = intakes[sender] = StreamIntake(
                        federation, max_transfer_bytes=cap, max_pending_bytes=cap, timeout=float("inf")
                    )
                for ev in it.feed(sender, env.body, time.monotonic()):
                    if isinstance(ev, UpdatePart):
                        w = streams.get((sender, env.round, ev.tid))
                        if w is not None:
                            yield w, ev
                continue
            whole_w = wholes.get((sender, env.round))
            if whole_w is None or whole_w in done:
                continue
            if env.kind == CHUNK_KIND:
                ra = reassemblers.get(sender)
                if ra is None:
                    ra = reassemblers[sender] = Reassembler(cap, cap, float("inf"))
                whole = ra.feed(sender, env.body, time.monotonic())
                if whole is None:
                    continue
                env = decode(whole, model_limits, views=True)
            read = _whole_message(env, model_limits)
            if read is None or (whole_w[3] is not None and read[0] != whole_w[3]):
                continue
            done.add(whole_w)
            yield from ((whole_w, p) for p in _tensor_parts(sender, read[1]))
        except CodecError as exc:
            log.error("round journal: the update of %s cannot be read back (%s)", sender, exc)


def replay_parts(
    frames: Frames,
    wanted: Mapping[str, str | None],
    round_: int,
    *,
    federation: str,
    wire_limits: Limits,
    model_limits: Limits,
) -> Iterator[tuple[str, UpdatePart]]:
    """(sender, part) of each ``wanted`` update of ``round_``, in the order the machine
    folded them."""
    for w, part in replay_updates(
        frames,
        [(s, round_, t, None) for s, t in wanted.items()],
        federation=federation,
        wire_limits=wire_limits,
        model_limits=model_limits,
    ):
        yield w[0], part


def read_back_round(
    frames_of: Callable[[], Frames],
    wanted: Mapping[str, str | None],
    counted: Iterable[str],
    round_: int,
    into: Callable[[str, UpdatePart], None],
    *,
    federation: str,
    wire_limits: Limits,
    model_limits: Limits,
) -> frozenset[str]:
    """A round machine's :class:`~fedagent.protocols.rounds.events.Refold` carried out:
    the ``wanted`` updates of ``round_`` read back from the journal (``frames_of()``, read
    twice) part by part into ``into`` (the machine's ``refold``). Returns the ``counted``
    senders whose update the journal does not hold whole: they are not replayed (the
    machine refuses them); those only to be taken out are replayed as far as they go."""
    counted = set(counted)
    whole = held_whole(frames_of(), wanted, round_, wire_limits) if counted else set()
    missing = frozenset(s for s in counted if s not in whole)
    replay = {s: t for s, t in wanted.items() if s not in missing}
    if replay:
        for sender, part in replay_parts(
            frames_of(), replay, round_, federation=federation, wire_limits=wire_limits, model_limits=model_limits
        ):
            into(sender, part)
    return missing
