"""Vocabulary consensus: the pure merge machine and its two messages (gFedNTM stage 1)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedagent.errors import CodecError
from fedagent.protocols import vocab as V
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.messages import VocabOffer, Vocabulary, body_of

LIMITS = Limits()


def offer(sender: str, counts: dict[str, int]) -> V.OfferReceived:
    return V.OfferReceived(sender, tuple(counts), tuple(counts.values()))


# ---- merge --------------------------------------------------------------------------
def test_merge_is_the_union_with_summed_counts_in_frequency_then_term_order():
    merged = V.merge_vocabularies([{"topic": 3, "model": 1}, {"model": 5, "neural": 3}, {"zeta": 1}])
    assert merged == [("model", 6), ("neural", 3), ("topic", 3), ("zeta", 1)]


def test_min_count_and_max_size_keep_the_most_frequent_terms():
    offers = [{"a": 1, "b": 2, "c": 9}, {"b": 1, "d": 1}]
    assert V.merge_vocabularies(offers, min_count=2) == [("c", 9), ("b", 3)]
    assert V.merge_vocabularies(offers, max_size=3) == [("c", 9), ("b", 3), ("a", 1)]
    assert V.merge_vocabularies(offers, min_count=2, max_size=1) == [("c", 9)]


@given(
    st.lists(
        st.dictionaries(st.sampled_from([f"t{i}" for i in range(30)]), st.integers(1, 50), max_size=20),
        min_size=1,
        max_size=6,
    ),
    st.randoms(),
)
def test_merge_does_not_depend_on_arrival_order(offers, rnd):
    expected = V.merge_vocabularies(offers)
    shuffled = list(offers)
    rnd.shuffle(shuffled)
    assert V.merge_vocabularies(shuffled) == expected
    assert sum(c for _, c in expected) == sum(sum(o.values()) for o in offers)


# ---- machine ------------------------------------------------------------------------
def test_merges_once_every_expected_agent_has_offered():
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=3, deadline=30))
    assert m.start(0.0) == [V.RequestWakeup(30.0)]
    assert m.handle(offer("a", {"x": 1, "y": 2}), 1.0) == []
    assert m.handle(offer("b", {"y": 1}), 2.0) == []
    (agreed,) = m.handle(offer("c", {"z": 4}), 3.0)
    assert isinstance(agreed, V.Agreed)
    assert agreed.terms == ("z", "y", "x") and agreed.counts == (4, 3, 1)
    assert agreed.contributors == ("a", "b", "c")
    assert agreed.digest == V.vocabulary_digest(("z", "y", "x"))
    assert m.phase is V.VocabPhase.AGREED
    # Agreed once: a straggler is refused by name, the result does not change.
    (late,) = m.handle(offer("d", {"w": 1}), 4.0)
    assert late == V.OfferRejected("d", "late", "vocabulary already agreed")
    assert m.handle(V.Wakeup(), 40.0) == []


def test_deadline_merges_with_a_quorum_and_waits_without_one():
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=4, min_agents=2, deadline=10))
    m.start(100.0)
    m.handle(offer("a", {"x": 1}), 101.0)
    assert m.handle(V.Wakeup(), 110.0) == []  # one offer: below the quorum, keep waiting
    (agreed,) = m.handle(offer("b", {"x": 2}), 120.0)  # quorum reached after the deadline
    assert agreed.terms == ("x",) and agreed.counts == (3,) and agreed.contributors == ("a", "b")


def test_wakeup_before_the_deadline_does_not_merge_early():
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=3, min_agents=1, deadline=10))
    m.start(0.0)
    m.handle(offer("a", {"x": 1}), 1.0)
    assert m.handle(V.Wakeup(), 9.99) == []
    assert isinstance(m.handle(V.Wakeup(), 10.0)[0], V.Agreed)


def test_duplicate_unexpected_and_malformed_offers_are_refused_naming_the_sender():
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=2), allowed={"a", "b"})
    m.start(0.0)
    assert m.handle(offer("a", {"x": 1}), 1.0) == []
    assert m.handle(offer("a", {"x": 1}), 1.5)[0].reason == "duplicate"
    assert m.handle(offer("eve", {"x": 1}), 2.0)[0] == V.OfferRejected(
        "eve", "unexpected", "eve is not an expected agent"
    )
    bad = [
        V.OfferReceived("b", ("x", "y"), (1,)),  # counts missing
        V.OfferReceived("b", ("x", "x"), (1, 1)),  # duplicate term
        V.OfferReceived("b", ("x",), (0,)),  # zero count
        V.OfferReceived("b", ("x",), (True,)),  # a bool is no count
        V.OfferReceived("b", ("",), (1,)),  # empty term
        V.OfferReceived("b", ("a\nb",), (1,)),  # control character
        V.OfferReceived("b", ("x" * 201,), (1,)),
    ]  # too long
    reasons = [m.handle(ev, 3.0)[0] for ev in bad]
    assert all(isinstance(r, V.OfferRejected) and r.sender == "b" for r in reasons)
    assert [r.reason for r in reasons] == ["shape", "duplicate-term", "count", "count", "term", "term", "term"]
    # None of them counted: b's valid offer still completes the merge.
    (agreed,) = m.handle(offer("b", {"y": 2}), 4.0)
    assert agreed.terms == ("y", "x")


def test_an_offer_above_max_terms_is_refused():
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=1, max_terms=5))
    m.start(0.0)
    (r,) = m.handle(offer("a", {f"t{i}": 1 for i in range(6)}), 1.0)
    assert r.reason == "size"


def test_config_refuses_impossible_settings():
    for kw in (
        {"min_agents": 0},
        {"expected_agents": 2, "min_agents": 3},
        {"deadline": 0},
        {"min_count": 0},
        {"max_size": -1},
        {"max_terms": V.MAX_TERMS + 1},
    ):
        with pytest.raises(ValueError):
            V.VocabConfig(**kw)


# ---- messages -----------------------------------------------------------------------
def roundtrip(msg):
    env = Envelope(kind=msg.kind, federation="fed", sender="agent-a", round=0, seq=1, ts=1.0, body=msg.to_body())
    back = decode(encode(env), LIMITS)
    return body_of(back.kind, back.body, LIMITS)


def test_offer_and_vocabulary_roundtrip_through_the_codec():
    o = VocabOffer(("neural", "topic"), (4, 2))
    assert roundtrip(o) == o
    v = Vocabulary(("neural", "topic"), (9, 3), ("agent-a", "agent-b"), V.vocabulary_digest(("neural", "topic")))
    assert roundtrip(v) == v


def test_an_offer_carries_only_terms_and_counts():
    with pytest.raises(CodecError, match="exactly the fields"):
        VocabOffer.from_body({"terms": ["a"], "counts": [1], "documents": ["a secret text"]}, LIMITS)


@pytest.mark.parametrize(
    "body",
    [
        {"terms": ["a", "b"], "counts": [1]},
        {"terms": ["a"], "counts": [-1]},
        {"terms": ["a"], "counts": [1.5]},
        {"terms": [1], "counts": [1]},
        {"terms": "a", "counts": [1]},
        {"terms": ["a", "a"], "counts": [1, 1]},
        {"terms": ["a"] * 100_001, "counts": [1] * 100_001},
        {"terms": ["a"]},
    ],
)
def test_bad_offers_are_codec_errors(body):
    with pytest.raises(CodecError):
        VocabOffer.from_body(body, LIMITS)


def test_a_vocabulary_whose_digest_lies_is_refused():
    body = {
        "terms": ["a", "b"],
        "counts": [2, 1],
        "contributors": ["agent-a"],
        "digest": V.vocabulary_digest(["b", "a"]),
    }
    with pytest.raises(CodecError, match="digest"):
        Vocabulary.from_body(body, LIMITS)
    with pytest.raises(CodecError, match="invalid node id"):
        Vocabulary.from_body({**body, "digest": V.vocabulary_digest(["a", "b"]), "contributors": ["a/#"]}, LIMITS)


def test_random_offers_merge_to_the_sum_of_their_counts():
    rnd = random.Random(3)
    agents = [f"agent-{i}" for i in range(7)]
    counts = {a: {f"term{rnd.randrange(400)}": rnd.randint(1, 9) for _ in range(120)} for a in agents}
    m = V.VocabularyMerge(V.VocabConfig(expected_agents=len(agents), min_count=3, max_size=150))
    m.start(0.0)
    out = []
    for a in agents:
        out += m.handle(offer(a, counts[a]), 1.0)
    (agreed,) = out
    expected = V.merge_vocabularies(counts.values(), min_count=3, max_size=150)
    assert list(zip(agreed.terms, agreed.counts)) == expected
    assert len(agreed.terms) == 150
    assert agreed.dropped_terms == len({t for c in counts.values() for t in c}) - 150
