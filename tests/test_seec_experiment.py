"""Pure helpers of the SEEC experiment's live mapped-search row (no network)."""

from __future__ import annotations

from fedagent.experiments.seec import others_top_k, query_text


def test_query_text_cuts_long_articles_at_a_word_boundary():
    tokens = ["alpha", "beta", "gamma", "delta"]
    assert query_text(tokens, 100) == ("alpha beta gamma delta", False)
    text, cut = query_text(tokens, 13)  # "alpha beta ga|mma ..." -> the last whole word goes
    assert cut and text == "alpha beta"
    assert query_text(tokens, len("alpha beta gamma delta")) == ("alpha beta gamma delta", False)


def test_others_top_k_drops_the_searched_article_and_keeps_the_merge_order():
    row_of = {"A": 0, "B": 1, "C": 2, "D": 3}
    hits = [{"site": "agent-1", "doc_id": d, "score": s} for d, s in (("B", 0.9), ("A", 0.8), ("D", 0.5), ("C", 0.1))]
    assert others_top_k(hits, row_of, 0, 2) == [1, 3]
    # Not found among the hits (its vector was inferred afresh): the first k others count.
    assert others_top_k(hits, row_of, 3, 3) == [1, 0, 2]
