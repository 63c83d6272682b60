"""The search machine and its messages, as pure code: a query's life as a trace."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols import search as S
from fedagent.protocols.codec import Limits, encode_weights
from fedagent.protocols.messages import PublicVectors, PublicVectorsRequest, SearchAnswer, SearchQuery, body_of


def test_all_peers_answer_before_the_deadline():
    m = S.SearchMachine()
    cmds = m.handle(S.Start("q1", ("b", "c"), 2, 5.0), now=100.0)
    assert [c for c in cmds if isinstance(c, S.SendQuery)] == [S.SendQuery("q1", "b", 2), S.SendQuery("q1", "c", 2)]
    assert S.RequestWakeup(105.0) in cmds
    assert m.handle(S.AnswerReceived("q1", "b", (("b1", 0.9), ("b2", 0.1))), 101.0) == []
    (done,) = m.handle(S.AnswerReceived("q1", "c", (("c1", 0.5),)), 102.0)
    assert isinstance(done, S.Completed) and not done.timed_out
    assert [(h.site, h.doc_id, h.score) for h in done.hits] == [("b", "b1", 0.9), ("c", "c1", 0.5)]
    assert done.answered == ("b", "c") and done.silent == () and m.queries == {}


def test_a_silent_peer_is_named_at_the_deadline_and_late_answers_are_ignored():
    m = S.SearchMachine()
    m.handle(S.Start("q1", ("b", "c"), 3, 2.0), now=0.0)
    m.handle(S.AnswerReceived("q1", "b", (("b1", 0.3),)), 1.0)
    assert m.handle(S.Wakeup(), 1.5) == [S.RequestWakeup(2.0)]
    done = m.handle(S.Wakeup(), 2.0)[0]
    assert done.timed_out and done.answered == ("b",) and done.silent == ("c",)
    assert [h.doc_id for h in done.hits] == ["b1"]
    late = m.handle(S.AnswerReceived("q1", "c", (("c1", 0.99),)), 2.5)
    assert late == [S.Ignored("q1", "c", "unknown or finished query")]


def test_an_answer_after_the_deadline_completes_without_it():
    m = S.SearchMachine()
    m.handle(S.Start("q", ("b",), 1, 1.0), now=0.0)
    cmds = m.handle(S.AnswerReceived("q", "b", (("x", 0.5),)), 1.0)
    done = next(c for c in cmds if isinstance(c, S.Completed))
    assert done.silent == ("b",) and done.hits == ()


def test_unasked_duplicate_oversized_and_refusing_answers():
    m = S.SearchMachine()
    m.handle(S.Start("q", ("b", "c", "d"), 1, 10.0), now=0.0)
    assert m.handle(S.AnswerReceived("q", "x", ()), 1.0) == [S.Ignored("q", "x", "not asked")]
    assert m.handle(S.AnswerReceived("q", "b", (("1", 0.2), ("2", 0.1))), 1.0) == []  # k=1: refused
    assert m.handle(S.AnswerReceived("q", "b", (("1", 0.2),)), 1.0) == [S.Ignored("q", "b", "duplicate answer")]
    assert m.handle(S.AnswerReceived("q", "c", (), error="space"), 1.0) == []
    done = m.handle(S.AnswerReceived("q", "d", (("d1", 0.4),)), 1.0)[0]
    assert done.answered == ("d",) and dict(done.failed) == {"b": "answered 2 hits for k=1", "c": "space"}


def test_several_queries_each_complete_once_and_no_peers_completes_at_once():
    m = S.SearchMachine()
    (done,) = m.handle(S.Start("empty", (), 3, 1.0), now=0.0)
    assert done.answered == () and not done.timed_out
    m.handle(S.Start("a", ("b",), 1, 1.0), now=0.0)
    m.handle(S.Start("b", ("b",), 1, 5.0), now=0.0)
    first = m.handle(S.Wakeup(), 1.0)
    assert [c.query_id for c in first if isinstance(c, S.Completed)] == ["a"] and S.RequestWakeup(5.0) in first
    with pytest.raises(S.SearchError):
        m.handle(S.Start("b", ("c",), 1, 1.0), now=1.0)
    for bad in (S.Start("x", ("b",), 0, 1.0), S.Start("x", ("b", "b"), 1, 1.0), S.Start("x", ("b",), 1, 0.0)):
        with pytest.raises(S.SearchError):
            m.handle(bad, now=1.0)


def test_top_k_ranks_by_cosine_and_checks_the_vector():
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    hits = S.top_k(np.array([2.0, 0.1]), vectors, ["x", "y", "xy", "zero"], 2)
    assert [d for d, _ in hits] == ["x", "xy"] and hits[0][1] == pytest.approx(2 / np.hypot(2, 0.1))
    assert S.check_vector(np.ones(2, np.float32), 2).dtype == np.float64
    for bad, reason in (
        (np.ones(3, np.float32), "dimension"),
        (np.ones((1, 2), np.float32), "shape"),
        (np.ones(2, np.int32), "dtype"),
        (np.array([np.nan, 1.0]), "finite"),
    ):
        with pytest.raises(S.SearchError) as e:
            S.check_vector(bad, 2)
        assert e.value.reason == reason


def test_search_messages_round_trip_and_refuse_bad_bodies():
    q = SearchQuery("abc", 5, "joint:xyz", np.arange(4, dtype=np.float32))
    back = body_of("search_query", q.to_body(), Limits())
    assert back.query_id == "abc" and back.k == 5 and np.array_equal(back.vector, q.vector)
    a = SearchAnswer("abc", ("doc 1", "doc 2"), (0.5, 0.25))
    assert body_of("search_answer", a.to_body(), Limits()) == a
    big = {**q.to_body(), "vector": encode_weights({"q": np.zeros(S.MAX_DIM + 1, np.float32)})}
    bad_bodies = [
        ("search_query", {**q.to_body(), "k": 0}),
        ("search_query", {**q.to_body(), "extra": 1}),
        ("search_query", big),
        ("search_query", {**q.to_body(), "vector": encode_weights({"q": np.zeros((2, 2), np.float32)})}),
        ("search_answer", {**a.to_body(), "scores": [0.5]}),
        ("search_answer", {**a.to_body(), "scores": [float("nan"), 0.1]}),
        ("search_answer", {**a.to_body(), "doc_ids": ["x" * 201, "y"]}),
        ("search_answer", {**a.to_body(), "error": "space"}),
    ]
    for kind, body in bad_bodies:
        with pytest.raises(CodecError):
            body_of(kind, body, Limits())


# ---- the public-vector exchange of a mapped federation ------------------------------
def test_exchange_sorts_peers_into_current_train_failed_and_silent():
    m = S.ExchangeMachine(rows=40)
    cmds = m.handle(
        S.ExchangeStart("x1", (("b", ""), ("c", "mapped:c1"), ("d", "mapped:d1"), ("e", ""), ("f", "")), 5.0), now=10.0
    )
    assert [c for c in cmds if isinstance(c, S.SendVectorsRequest)] == [
        S.SendVectorsRequest("x1", "b", ""),
        S.SendVectorsRequest("x1", "c", "mapped:c1"),
        S.SendVectorsRequest("x1", "d", "mapped:d1"),
        S.SendVectorsRequest("x1", "e", ""),
        S.SendVectorsRequest("x1", "f", ""),
    ]
    assert S.RequestWakeup(15.0) in cmds
    assert m.handle(S.VectorsReceived("x1", "b", "mapped:b1", 40), 11.0) == []  # new vectors: train
    assert m.handle(S.VectorsReceived("x1", "c", "mapped:c1", 0), 11.0) == []  # mapper still right
    assert m.handle(S.VectorsReceived("x1", "d", "mapped:d2", 0), 11.0) == []  # changed, but no vectors
    assert m.handle(S.VectorsReceived("x1", "e", "mapped:e1", 39), 11.0) == []  # wrong row count
    assert m.handle(S.VectorsReceived("x1", "z", "mapped:z", 40), 11.0) == [S.Ignored("x1", "z", "not asked")]
    assert m.handle(S.VectorsReceived("x1", "b", "mapped:b1", 40), 11.0) == [S.Ignored("x1", "b", "duplicate answer")]
    (done,) = m.handle(S.Wakeup(), 15.0)
    assert isinstance(done, S.Exchanged) and done.timed_out
    assert done.train == (("b", "mapped:b1"),) and done.current == (("c", "mapped:c1"),)
    assert [p for p, _ in done.failed] == ["d", "e"] and done.silent == ("f",) and m.pending == {}
    assert m.handle(S.VectorsReceived("x1", "f", "mapped:f", 40), 16.0) == [
        S.Ignored("x1", "f", "unknown or finished exchange")
    ]


def test_exchange_completes_when_all_answered_and_refuses_bad_starts():
    m = S.ExchangeMachine(rows=3)
    m.handle(S.ExchangeStart("x1", (("b", ""),), 5.0), 0.0)
    (done,) = m.handle(S.VectorsReceived("x1", "b", "", 0, error="public"), 1.0)
    assert done.failed == (("b", "public"),) and not done.timed_out
    (empty,) = m.handle(S.ExchangeStart("x2", (), 5.0), 0.0)
    assert isinstance(empty, S.Exchanged) and empty.train == () and m.pending == {}
    for bad in (S.ExchangeStart("x3", (("b", ""), ("b", "")), 5.0), S.ExchangeStart("x3", (("b", ""),), 0.0)):
        with pytest.raises(S.SearchError):
            m.handle(bad, 0.0)
    with pytest.raises(S.SearchError):
        S.ExchangeMachine(rows=0)


def test_public_vector_messages_round_trip_and_refuse_oversized_bodies():
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    back = body_of("public_vectors", PublicVectors("r1", "mapped:a", v).to_body(), Limits())
    assert back.space == "mapped:a" and np.array_equal(back.vectors, v)
    assert body_of("public_vectors", PublicVectors("r1", "mapped:a").to_body(), Limits()).vectors is None
    req = PublicVectorsRequest("r1", "d" * 32, "mapped:a")
    assert body_of("public_vectors_request", req.to_body(), Limits()) == req
    good = PublicVectors("r1", "mapped:a", v).to_body()
    bad_bodies = [
        {**good, "shape": [S.MAX_PUBLIC_DOCS + 1, 4]},  # over the bound, before decoding
        {**good, "shape": [3, S.MAX_DIM + 1]},
        {**good, "shape": [4, 4]},  # declared shape is not the data's
        {**good, "shape": [3, 4], "vectors": encode_weights({"p": v.astype(np.float64)})},
        {**good, "error": "public"},  # an error with vectors
        {**good, "text": "a query"},
        {**req.to_body(), "public": "x" * 65},
    ]
    for body in bad_bodies:
        kind = "public_vectors_request" if "public" in body else "public_vectors"
        with pytest.raises(CodecError):
            body_of(kind, body, Limits())
