"""End-to-end authenticity: every frame signed with the sender's
Ed25519 TLS key, bound to its CA certificate; tampered, relayed, replayed, stale,
unsigned and foreign-signed frames are refused, named and counted by reason."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from fedagent.errors import ConfigError
from fedagent.node.messaging import Messenger
from fedagent.node.metrics import NodeMetrics
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, decode, encode
from fedagent.protocols.messages import Update
from fedagent.security.signing import AuthError, Identity, ReplayGuard, sign

FED = "testfed"


def ident(pki, name: str, *, foreign: bool = False) -> Identity:
    t = pki.tls(name, foreign=foreign)
    return Identity.load(t.cert, t.key, pki.ca)


def env(sender: str = "agent-a", seq: int = 10, ts: float | None = None, **kw) -> Envelope:
    return Envelope(
        kind=kw.pop("kind", "update"),
        federation=FED,
        sender=sender,
        round=kw.pop("round", 3),
        seq=seq,
        ts=time.time() if ts is None else ts,
        body=kw.pop("body", {"x": 1}),
    )


def reason(verifier, e: Envelope) -> str:
    with pytest.raises(AuthError) as info:
        verifier.check(e)
    return info.value.reason


def test_signed_frame_verifies_and_every_field_is_covered(pki) -> None:
    a = ident(pki, "agent-a")
    v = ident(pki, "coord").verifier()
    good = sign(env(), a)
    assert v.check(decode(encode(good))) == "agent"
    # Any field changed after signing breaks the signature (each on a fresh seq).
    for i, change in enumerate(({"round": 4}, {"ts": good.ts + 1}, {"body": {"x": 2}}, {"kind": "model"})):
        forged = dataclasses.replace(sign(env(seq=100 + i), a), **change)
        assert reason(v, forged) == "signature", change
    forged = dataclasses.replace(sign(env(seq=200), a), seq=201)
    assert reason(v, forged) == "signature"


def test_unsigned_foreign_relayed_and_expired_frames_are_refused(pki) -> None:
    v = ident(pki, "coord").verifier()
    assert reason(v, env()) == "unsigned"
    # A certificate from another federation's CA, even with the right name.
    assert reason(v, sign(env(), ident(pki, "agent-a", foreign=True))) == "certificate"
    # agent-b re-sends agent-a's frame in its own name: the certificate names agent-a.
    relayed = dataclasses.replace(sign(env(seq=11), ident(pki, "agent-a")), sender="agent-b")
    assert reason(v, relayed) == "certificate"
    # agent-b signs a frame claiming to be agent-a (its certificate is agent-b's).
    b = ident(pki, "agent-b")
    claimed = sign(env(sender="agent-b", seq=12), b)
    assert reason(v, dataclasses.replace(claimed, sender="agent-a")) == "certificate"
    old = ident(pki, "agent-old")
    assert reason(v, sign(env(sender="agent-old"), old)) == "certificate"


def test_a_member_of_another_federation_of_the_same_ca_is_refused(tmp_path) -> None:
    """One CA may issue for several federations sharing a broker: the certificate names
    its federation, and a frame for any other federation is refused."""
    from fedagent.security import pki as pk

    ca = tmp_path / "ca"  # a CA of its own: the shared one stays single-federation
    pk.create_ca(ca, FED)
    coord = pk.issue(ca, ca, "coord", "coordinator")
    v = Identity.load(*coord, ca / pk.CA_CERT).verifier()
    o = Identity.load(*pk.issue(ca, ca, "agent-of-fed-2", "agent", federation="fed-2"), ca / pk.CA_CERT)
    e = dataclasses.replace(env(sender="agent-of-fed-2", seq=30))
    with pytest.raises(AuthError, match="member of federation 'fed-2', not of 'testfed'") as info:
        v.check(sign(e, o))
    assert info.value.reason == "certificate"
    # Its own federation's frames verify.
    assert v.check(sign(dataclasses.replace(e, federation="fed-2", seq=31), o)) == "agent"


def test_replays_and_stale_timestamps_are_refused(pki) -> None:
    a = ident(pki, "agent-a")
    v = ident(pki, "coord").verifier(max_skew=60, window=8)
    first = sign(env(seq=1000), a)
    v.check(first)
    assert reason(v, first) == "replay"
    # Out of order inside the window is fine (several brokers/topics), once.
    v.check(sign(env(seq=1010), a))
    v.check(sign(env(seq=1005), a))
    assert reason(v, sign(env(seq=1005), a)) == "replay"
    assert reason(v, sign(env(seq=1001), a)) == "replay"  # below 1010 - 8
    assert reason(v, sign(env(seq=2000, ts=time.time() - 120), a)) == "stale"
    assert reason(v, sign(env(seq=2001, ts=time.time() + 120), a)) == "stale"
    # Presence is retained and its Last Will signed long before delivery: no freshness.
    p = sign(env(seq=1, ts=time.time() - 10_000, kind="presence"), a)
    assert v.check(p) == "agent" and v.check(p) == "agent"


def test_replay_guard_memory_is_bounded() -> None:
    g = ReplayGuard(window=16, max_skew=10)
    for s in range(10_000):
        g.check("x", s, 0.0, 0.0)
    assert len(g._seen["x"]) <= 17


def _restarted(saves: list[dict[str, list[int]]], keep: int) -> ReplayGuard:
    """A guard restored from what was saved, as the replay journal restores one."""
    g = ReplayGuard(window=4096, max_skew=10, keep=keep)
    for numbers in saves:
        g.merge(numbers)
    return g


def _refused(g: ReplayGuard, sender: str, seq: int) -> bool:
    try:
        g.check(sender, seq, 0.0, 0.0)
    except AuthError as exc:
        return exc.reason == "replay"
    return False


def test_a_held_number_is_refused_here_but_never_saved_unless_released() -> None:
    """A frame whose acknowledgement waits for its journal record: its number is held.
    Pass: this process refuses a second copy at once; no save (append or compaction)
    holds the number, so a guard restored from the saves takes the broker's redelivery
    while it still refuses everything saved; a released number is saved with the next."""
    g = ReplayGuard(window=4096, max_skew=10, keep=8)
    g.track = True
    g.check("a", 10, 0.0, 0.0)
    g.check("a", 11, 0.0, 0.0)
    g.hold("a", 11)
    g.check("a", 12, 0.0, 0.0)
    g.check("a", 13, 0.0, 0.0)
    g.hold("a", 13)
    assert _refused(g, "a", 11) and _refused(g, "a", 13)
    appended = g.take_fresh()
    assert appended == {"a": [10, 12]} and g.tops() == {"a": [10, 12]}
    g.release("a", 13)  # its record is durable: the frame is taken
    assert g.dirty
    released = g.take_fresh()
    assert released == {"a": [10, 13]}  # (10: the one below 11, again)
    for saves in ([appended, released], [g.tops()]):  # appends, or one compaction
        again = _restarted(saves, keep=8)
        assert [_refused(again, "a", s) for s in (10, 12, 13)] == [True, True, True]
        assert not _refused(again, "a", 11)  # the redelivery of the frame never taken
    g.release("a", 99)  # a number not held: nothing to do
    assert g.take_fresh() == {}


def test_a_withdrawn_number_is_taken_again_here_and_saved_only_once_released() -> None:
    """A held number whose frame was not taken after all (its acknowledgement withheld)
    is withdrawn: the broker delivers the frame again to this same process. Pass: the
    next copy is accepted, the number stays out of every save until that copy is
    released, then is saved once, and a further copy is refused."""
    g = ReplayGuard(window=4096, max_skew=10, keep=8)
    g.track = True
    g.check("a", 10, 0.0, 0.0)
    g.check("a", 11, 0.0, 0.0)
    g.hold("a", 11)
    g.withdraw("a", 11)
    assert g.take_fresh() == {"a": [10]} and g.tops() == {"a": [10]}
    g.check("a", 11, 0.0, 0.0)  # the redelivery: taken
    g.hold("a", 11)
    assert _refused(g, "a", 11) and g.tops() == {"a": [10]} and g.take_fresh() == {}
    g.release("a", 11)
    assert g.take_fresh() == {"a": [11]} and g.tops() == {"a": [10, 11]}  # once among the kept
    assert _refused(g, "a", 11) and _refused(_restarted([g.tops()], keep=8), "a", 11)


def test_numbers_saved_after_a_held_one_do_not_make_it_a_replay_after_a_restart() -> None:
    """A restart refuses every number below the smallest one kept of a sender, so the
    numbers accepted after a held one must not be saved alone. Pass: the redelivery is
    taken after a restart whether the held number was the sender's first, or the oldest
    of the kept ones; with ``keep`` newer numbers accepted since, it is refused (a
    restart refuses anything that old, saved or not), and the held set stays bounded."""
    g = ReplayGuard(window=4096, max_skew=10, keep=4)
    g.track = True
    g.check("a", 100, 0.0, 0.0)  # the sender's first frame here
    g.hold("a", 100)
    assert g.tops() == {"a": [99]}  # (a compaction now: whatever came before stays refused)
    g.check("a", 101, 0.0, 0.0)  # a heartbeat after it, say
    first = g.take_fresh()
    assert first == {"a": [99, 101]}
    again = _restarted([first], keep=4)
    assert not _refused(again, "a", 100) and _refused(again, "a", 101)

    g.check("a", 102, 0.0, 0.0)
    g.check("a", 103, 0.0, 0.0)  # kept: 100 (held) 101 102 103
    for saves in ([first, g.take_fresh()], [g.tops()]):
        again = _restarted(saves, keep=4)
        assert not _refused(again, "a", 100)
        assert all(_refused(again, "a", s) for s in (101, 102, 103))

    g.check("a", 104, 0.0, 0.0)  # four newer than 100 now
    assert g.tops() == {"a": [101, 102, 103, 104]} and not g._held
    assert _refused(_restarted([g.tops()], keep=4), "a", 100)


def test_ecdsa_node_key_is_refused_with_advice(pki, tmp_path) -> None:
    # A broker certificate is ECDSA: using it as a node identity says what to do.
    from fedagent.security import pki as pki_mod

    crt, key = pki_mod.issue(pki.ca_dir, tmp_path, "old-style", "broker")
    with pytest.raises(ConfigError, match="Ed25519.*fedagent ca issue"):
        Identity.load(crt, key, pki.ca)


def test_tampered_replayed_and_relayed_frames_over_the_broker(broker, peer, arun) -> None:
    """The broker path: a member's frame altered, replayed or relayed by another member
    never reaches the protocol; each refusal is counted by reason in Prometheus."""
    topic = topics.direct(FED, "agent-a", "coord", "update")
    b_topic = topics.direct(FED, "agent-b", "coord", "update")
    weights = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    metrics = NodeMetrics("coordinator", "coord", FED)

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
            peer(broker, "agent-b") as b,
        ):
            recv = Messenger(
                federation=FED,
                node_id="coord",
                transport=c.transport,
                identity=ident(broker.pki, "coord"),
                metrics=metrics,
            )
            send = Messenger(
                federation=FED, node_id="agent-a", transport=a.transport, identity=ident(broker.pki, "agent-a")
            )
            frame = send.frame(Update(1, 0, 10, {}, weights))
            await a.transport.publish(topic, frame)
            inc = await asyncio.wait_for(got.get(), 10)
            np.testing.assert_array_equal(inc.message.weights["w"], weights["w"])
            assert inc.role == "agent"  # from the certificate: what the daemons check
            await a.transport.publish(topic, frame)  # replay
            tampered = bytearray(frame)
            at = tampered.find(weights["w"].tobytes())
            tampered[at + 5] ^= 0x40  # one bit of one weight
            await a.transport.publish(topic, bytes(tampered))
            relayed = dataclasses.replace(decode(frame), sender="agent-b", seq=decode(frame).seq + 1)
            await b.transport.publish(b_topic, encode(relayed))  # relayed by agent-b
            await send.send(topic, Update(2, 0, 10, {}, weights))  # the next honest one
            inc = await asyncio.wait_for(got.get(), 10)
            assert inc.message.round == 2 and got.empty()
            assert dict(recv.rejected) == {"replay": 1, "signature": 1, "certificate": 1}

    arun(main(), timeout=60)
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    for r in ("replay", "signature", "certificate"):
        assert f'reason="{r}"' in text


def test_round_binding_refuses_a_body_of_another_round(pki) -> None:
    """The messenger derives the envelope round from the message and refuses mixing."""
    m = Messenger(federation=FED, node_id="agent-a", transport=None, identity=ident(pki, "agent-a"))
    with pytest.raises(ValueError, match="round"):
        m.frame(Update(2, 0, 1, {}, {}), round_=3)
    assert decode(m.frame(Update(5, 0, 1, {}, {}))).round == 5


def test_receiver_refuses_a_signed_envelope_whose_body_names_another_round(pki, caplog) -> None:
    a = ident(pki, "agent-a")
    recv = Messenger(federation=FED, node_id="coord", transport=None, identity=ident(pki, "coord"))
    body = Update(2, 0, 1, {}, {"w": np.zeros(2, np.float32)}).to_body()
    frame = encode(sign(env(round=3, body=body), a))
    got = []

    async def deliver(inc):
        got.append(inc)

    with caplog.at_level("WARNING", logger="fedagent.node.messaging"):
        asyncio.run(recv.receive(topics.direct(FED, "agent-a", "coord", "update"), frame, deliver))
    assert got == [] and dict(recv.rejected) == {"round": 1}
    assert "rejected message from agent-a: round" in caplog.text
