"""Coordinator-free vocabulary consensus (gossip mode): the pure machine, N agents in
memory with shuffled delivery, and the defined failures."""

from __future__ import annotations

import random

import pytest

from fedagent.protocols import gossip_vocab as gv
from fedagent.protocols.codec import Limits
from fedagent.protocols.messages import VocabDigest, body_of
from fedagent.protocols.vocab import merge_vocabularies, vocabulary_digest

OFFERS = {
    "a1": {"river": 4, "bank": 3, "money": 1},
    "a2": {"bank": 5, "loan": 2},
    "a3": {"river": 1, "boat": 7, "loan": 1},
}


def machine(node: str, n: int = 3, offers=OFFERS, deadline: float = 10.0, **kw) -> gv.VocabConsensus:
    own = offers[node]
    return gv.VocabConsensus(
        node, gv.ConsensusConfig(expected_agents=n, deadline=deadline, **kw), tuple(own), tuple(own.values())
    )


def run(
    machines: dict[str, gv.VocabConsensus], seed: int, *, drop_from: set[str] = frozenset(), now: float = 0.0
) -> dict[str, list]:
    """Start every machine, announce every live peer to every machine, deliver the
    resulting messages in random order until quiet; returns each machine's commands."""
    rng = random.Random(seed)
    out: dict[str, list] = {n: [] for n in machines}
    pending: list[tuple[str, str, object]] = []  # (receiver, sender, command)

    def emit(node: str, cmds: list) -> None:
        out[node] += cmds
        for c in cmds:
            if isinstance(c, (gv.SendOffer, gv.SendDigest)) and c.peer in machines and node not in drop_from:
                pending.append((c.peer, node, c))

    for n, m in machines.items():
        emit(n, m.start(now))
    for n, m in machines.items():
        for p in machines:
            if p != n and p not in drop_from:
                emit(n, m.handle(gv.PeerUp(p), now))
    while pending:
        receiver, sender, c = pending.pop(rng.randrange(len(pending)))
        if isinstance(c, gv.SendOffer):
            own = machines[sender]._offers[sender]
            ev = gv.OfferReceived(sender, *own)
        else:
            ev = gv.DigestReceived(sender, c.digest, c.contributors)
        emit(receiver, machines[receiver].handle(ev, now))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_three_agents_derive_and_confirm_the_same_vocabulary_whatever_the_order(seed):
    ms = {n: machine(n, min_count=2) for n in OFFERS}
    out = run(ms, seed)
    expected = merge_vocabularies(OFFERS.values(), min_count=2)
    for n, m in ms.items():
        agreed = [c for c in out[n] if isinstance(c, gv.Agreed)]
        assert len(agreed) == 1, (n, out[n])
        a = agreed[0]
        assert list(zip(a.terms, a.counts)) == expected
        assert a.contributors == ("a1", "a2", "a3")
        assert a.digest == vocabulary_digest(a.terms)
        assert a.dropped_terms == 1  # "money": 1 < min_count
        assert m.phase is gv.Phase.AGREED


def test_a_missing_peer_fails_at_the_deadline_naming_it():
    ms = {n: machine(n, members=("a1", "a2", "a3")) for n in ("a1", "a2")}
    out = run(ms, 0)
    assert not any(isinstance(c, gv.Agreed) for cmds in out.values() for c in cmds)
    for n, m in ms.items():
        other = "a2" if n == "a1" else "a1"
        assert m.handle(gv.Wakeup(), 9.9) == [gv.RequestWakeup(10.0), gv.SendOffer(other)]  # not yet: re-send
        (failed,) = m.handle(gv.Wakeup(), 10.0)
        assert isinstance(failed, gv.Failed) and failed.reason == "missing-offers"
        assert failed.missing == ("a3",) and "a3" in failed.detail
        assert m.status()["error"].startswith("missing-offers")
        # Failure is final: a late offer does not revive it.
        assert m.handle(gv.OfferReceived("a3", ("x",), (1,)), 11.0) == [
            gv.OfferRejected("a3", "late", "vocabulary already failed without a3")
        ]


def test_a_peer_that_offers_but_never_confirms_is_unconfirmed():
    ms = {n: machine(n) for n in OFFERS}
    run(ms, 1, drop_from={"a3"})  # a3 hears everything, sends nothing
    m, m2 = ms["a1"], ms["a2"]
    assert m.phase is gv.Phase.COLLECTING
    o3 = gv.OfferReceived("a3", tuple(OFFERS["a3"]), tuple(OFFERS["a3"].values()))
    m.handle(o3, 1.0)
    assert m.phase is gv.Phase.CONFIRMING
    for c in m2.handle(o3, 1.0):  # a2 confirms to a1, a3 stays silent
        if isinstance(c, gv.SendDigest) and c.peer == "a1":
            assert m.handle(gv.DigestReceived("a2", c.digest, c.contributors), 1.0) == []
    assert m.status()["confirmed"] == ["a2"]
    (failed,) = m.handle(gv.Wakeup(), 10.0)
    assert failed.reason == "unconfirmed" and failed.missing == ("a3",)


def test_agents_that_merged_different_sets_detect_the_mismatch():
    # Four agents but expected_agents = 3: a1 merges {a1, a2, a3}, a4 merges {a1, a2, a4}.
    offers = {**OFFERS, "a4": {"zebra": 9}}
    m1, m4 = machine("a1", offers=offers), machine("a4", offers=offers)
    m1.start(0.0)
    m4.start(0.0)
    for src in ("a2", "a3"):
        m1.handle(gv.OfferReceived(src, tuple(offers[src]), tuple(offers[src].values())), 0.0)
    for src in ("a1", "a2"):
        m4.handle(gv.OfferReceived(src, tuple(offers[src]), tuple(offers[src].values())), 0.0)
    d4 = m4.candidate
    out = m1.handle(gv.DigestReceived("a4", d4.digest, d4.contributors), 0.0)
    assert out == []  # a4 is not among a1's contributors
    d1 = m1.candidate
    (failed,) = m4.handle(gv.DigestReceived("a1", d1.digest, d1.contributors), 0.0)
    assert failed.reason == "mismatch" and failed.missing == ("a1",)


def test_repeated_offers_are_idempotent_and_changed_ones_refused():
    m = machine("a1")
    m.start(0.0)
    o2 = gv.OfferReceived("a2", tuple(OFFERS["a2"]), tuple(OFFERS["a2"].values()))
    assert m.handle(o2, 0.0) == [] and m.handle(o2, 0.1) == []
    (rej,) = m.handle(gv.OfferReceived("a2", ("bank",), (6,)), 0.2)
    assert rej.reason == "changed"
    (rej,) = m.handle(gv.OfferReceived("a3", ("bad term",), (0,)), 0.3)
    assert rej.reason == "count"
    assert m.offers == ("a1", "a2")


def test_an_agreed_machine_still_serves_a_restarted_peer():
    ms = {n: machine(n) for n in OFFERS}
    run(ms, 2)
    cmds = ms["a1"].handle(gv.PeerUp("a2"), 50.0)
    a = ms["a1"].result
    assert cmds == [gv.SendOffer("a2"), gv.SendDigest("a2", a.digest, a.contributors, True)]
    # A peer still confirming asks again (agreed=False) and is answered; answers are not.
    assert ms["a1"].handle(gv.DigestReceived("a2", a.digest, a.contributors), 51.0) == [
        gv.SendDigest("a2", a.digest, a.contributors, True)
    ]
    assert ms["a1"].handle(gv.DigestReceived("a2", a.digest, a.contributors, True), 51.0) == []
    resumed = gv.VocabConsensus.resumed("a1", ms["a1"].config, tuple(OFFERS["a1"]), tuple(OFFERS["a1"].values()), a)
    assert resumed.phase is gv.Phase.AGREED and resumed.start(0.0) == []


def test_vocab_digest_message_round_trips_and_refuses_bad_ids():
    msg = VocabDigest("ab" * 16, ("a1", "a2"))
    assert body_of("vocab_digest", msg.to_body(), Limits()) == msg
    with pytest.raises(Exception):
        body_of("vocab_digest", {"digest": "x", "contributors": ["a/#"]}, Limits())
    with pytest.raises(ValueError):
        gv.ConsensusConfig(expected_agents=2, members=("a1",))


@pytest.mark.parametrize("seed", range(4))
def test_lost_offers_and_digests_are_re_sent_until_everyone_agrees(seed):
    """Half of all messages are lost (a peer seen on mDNS before it subscribed, a broker
    hiccup); the periodic re-sends still bring every agent to the same vocabulary."""
    rng = random.Random(seed)
    ms = {n: machine(n, deadline=100.0) for n in OFFERS}
    pending: list[tuple[str, str, object]] = []

    def emit(node, cmds):
        for c in cmds:
            if isinstance(c, (gv.SendOffer, gv.SendDigest)) and rng.random() < 0.5:
                pending.append((c.peer, node, c))

    for n, m in ms.items():
        emit(n, m.start(0.0))
        for p in ms:
            if p != n:
                emit(n, m.handle(gv.PeerUp(p), 0.0))
    now = 0.0
    while now < 90.0 and not all(m.phase is gv.Phase.AGREED for m in ms.values()):
        while pending:
            receiver, sender, c = pending.pop(rng.randrange(len(pending)))
            ev = (
                gv.OfferReceived(sender, *ms[sender]._offers[sender])
                if isinstance(c, gv.SendOffer)
                else gv.DigestReceived(sender, c.digest, c.contributors, c.agreed)
            )
            emit(receiver, ms[receiver].handle(ev, now))
        now += 2.0
        for n, m in ms.items():
            emit(n, m.handle(gv.Wakeup(), now))
    assert all(m.phase is gv.Phase.AGREED for m in ms.values()), {n: m.status() for n, m in ms.items()}
    assert len({m.result.digest for m in ms.values()}) == 1


def test_gossip_settings_validate_the_vocabulary_keys_and_the_linear_schedule():
    from fedagent.config import GossipSettings
    from fedagent.errors import ConfigError

    s = GossipSettings(vocab_agents=3, vocab_members=["a1", "a2", "a3"], vocab_min_count=5)
    cfg = s.consensus_config()
    assert cfg.expected_agents == 3 and cfg.members == ("a1", "a2", "a3") and cfg.min_count == 5
    for bad in (
        {"vocab_agents": -1},
        {"vocab_agents": 2, "vocab_members": ["a1"]},
        {"vocab_agents": 2, "vocab_timeout": 0},
    ):
        with pytest.raises(ConfigError):
            GossipSettings(**bad)
    lin = GossipSettings(lr=0.5, periods=10, lr_schedule="linear")
    assert lin.lr_at(0) == 0.5 and lin.lr_at(5) == pytest.approx(0.25) and lin.lr_at(10) == pytest.approx(0.5e-4)
