"""The offline text corpora (gensim's bundled data) and their splits across agents."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.errors import ConfigError
from fedagent.tasks import text_data as td


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDAGENT_CACHE", str(tmp_path / "cache"))


def test_tokenize_lowercases_keeps_letters_and_drops_stop_words():
    assert td.tokenize("The Quick-brown fox's 3 jumps, over 2020 a DOG!") == ["quick", "brown", "fox", "jumps", "dog"]
    assert td.tokenize("The fox", stop_words=False) == ["the", "fox"]
    assert td.tokenize("x " + "a" * 21 + " ok") == ["ok"]  # 1 and 21 letters are not words


def test_wiki_slice_strips_markup_and_is_cached(tmp_path):
    arts = td.wiki_articles(limit=3)
    assert [a.title for a in arts] == ["Anarchism", "Autism", "Albedo"]
    words = set(arts[0].tokens)
    assert {"anarchism", "political", "philosophy"} <= words
    # Markup and stop words are gone: no template braces, link brackets, refs or "the".
    assert not any(ch in w for w in words for ch in "{}[]|<>=")
    assert "ref" not in words and "the" not in words and "http" not in words
    cached = list((tmp_path / "cache").glob("wiki-*.json"))
    assert len(cached) == 1
    assert td.wiki_articles(limit=3) == arts


ROFF = r""".\\" Copyright (C) 1992 someone <a@b.c>
.TH open 2 2023-02-05 "Linux man-pages 6.03"
.SH NAME
open, openat \- open and possibly create a \fIfile\fP
.SH SYNOPSIS
.nf
.BI "int open(const char *" pathname ", int " flags );
.fi
.PP
The call \fBopen\fR(2) returns a file\(emdescriptor; see
.BR openat (2).
.in +4n
"""


def test_roff_text_keeps_the_words_and_drops_markup():
    text = td.roff_text(ROFF)
    tokens = td.tokenize(text)
    assert tokens[:6] == ["name", "open", "openat", "open", "possibly", "create"]
    assert "pathname" in tokens and "descriptor" in tokens and "openat" in tokens
    # no comment (copyright), no header request, no escape letters left glued to words
    assert not {"copyright", "someone", "th", "fb", "fi", "fr", "fp", "em", "nf", "pp"} & set(tokens)
    assert "filedescriptor" not in tokens and "fbopen" not in tokens


@pytest.mark.procs
def test_manpages_are_the_packages_pages_with_text_and_cached(tmp_path):
    pages = td.manpages(limit=40)
    assert len(pages) == 40 and len({p.title for p in pages}) == 40
    assert all(len(p.tokens) >= td.MIN_ARTICLE_TOKENS for p in pages)
    assert all(p.title.endswith(")") and "(" in p.title for p in pages)
    assert list((tmp_path / "cache").glob("manpages-*.json"))
    assert td.manpages(limit=40) == pages
    every = td.manpages()
    assert len(every) >= 1000  # a corpus of at least a thousand documents
    by_title = {p.title: p for p in every}
    assert {"open", "file", "descriptor", "flags"} <= set(by_title["open(2)"].tokens)
    assert len({p.tokens for p in every}) == len(every)  # a page installed twice counts once


MDOC = r""".\" Copyright (c) 1980 The Regents
.Dd March 30, 2020
.Dt OPEN 2
.Sh NAME
.Nm open , openat
.Nd open or create a file for reading
.Sh DESCRIPTION
The file name specified by
.Fa path
is opened as
.Xr chmod 2
says.
.Bl -tag -width indent
.It Dv O_CREAT
create file if it does not exist
.El
"""


def test_mdoc_text_keeps_the_arguments_of_its_text_macros_only_when_asked():
    _, requests = td.MANPAGE_CORPORA["freebsd"]
    tokens = td.tokenize(td.roff_text(MDOC, requests))
    assert tokens[:5] == ["name", "open", "openat", "open", "create"]
    assert {"path", "chmod", "creat", "exist"} <= set(tokens)
    assert not {"copyright", "regents", "dd", "dt", "march", "bl", "tag", "width", "el"} & set(tokens)
    # the man(7) reading of the same source keeps only its plain lines
    plain = td.tokenize(td.roff_text(MDOC))
    assert "openat" not in plain and "path" not in plain and "specified" in plain


@pytest.mark.procs
def test_the_freebsd_pages_are_a_public_corpus_disjoint_from_the_private_one():
    linux = td.manpages()
    freebsd = td.manpages(corpus="freebsd")
    assert len(freebsd) >= 1000
    assert all(p.title.endswith("freebsd)") for p in freebsd)
    assert not {p.tokens for p in freebsd} & {p.tokens for p in linux}
    assert {"open", "file", "descriptor"} <= set(next(p for p in freebsd if p.title == "open(2freebsd)").tokens)
    digest, docs = td.public_corpus("freebsd-manpages", 300)
    assert docs == [list(p.tokens) for p in freebsd[:300]]
    assert td.public_corpus("freebsd-manpages", 300)[0] == digest != td.public_corpus("freebsd-manpages", 299)[0]
    news_digest, posts = td.public_corpus("newsgroups", 200)
    assert len(posts) == 200 and news_digest != digest
    with pytest.raises(ConfigError, match="has 200 documents, 201 asked for"):
        td.public_corpus("newsgroups", 201)
    with pytest.raises(ConfigError, match="unknown public corpus"):
        td.public_corpus("slack", 10)


@pytest.mark.procs
def test_word2vec_and_doc2vec_read_the_manpages_corpus():
    from fedagent.tasks.base import load_task

    w2v = load_task("word2vec", {"corpus": "manpages", "limit": 60, "shards": 2, "shard": 0, "split": "random"})
    d2v = load_task("doc2vec", {"corpus": "manpages", "limit": 60})
    assert 0 < w2v.num_samples() and "descriptor" in w2v.term_counts()
    assert len(d2v.search_ids()) == 60 and d2v.search_ids()[0].endswith(")")


def _synthetic(n_docs: int = 40, seed: int = 0) -> list[list[str]]:
    """Two obvious topics (sport / chemistry) with varied lengths, equal in total (so the
    size-balanced topic split has no reason to move a document)."""
    rng = np.random.default_rng(seed)
    sport = ["goal", "match", "team", "league", "player", "coach", "season"]
    chem = ["atom", "molecule", "bond", "electron", "acid", "reaction", "ion"]
    docs = []
    for i in range(n_docs):
        words = sport if i % 2 == 0 else chem
        docs.append(list(rng.choice(words, size=20 + 17 * ((i // 2) % 10))) + ["common", "shared"])
    return docs


@pytest.mark.parametrize("how", td.SPLITS)
def test_every_split_is_a_partition_and_deterministic(how):
    docs = _synthetic()
    s = td.split_articles(docs, 4, how, seed=3)
    flat = sorted(i for shard in s.shards for i in shard)
    assert flat == list(range(len(docs)))
    assert all(len(shard) > 0 for shard in s.shards)
    assert td.split_articles(docs, 4, how, seed=3) == s


def test_random_split_balances_tokens_and_imbalanced_reaches_about_one_to_four():
    docs = _synthetic(200)
    lengths = [len(d) for d in docs]
    bal = td.split_articles(docs, 5, "random", seed=1).sizes(lengths)
    assert max(bal) / min(bal) < 1.1
    imb = td.split_articles(docs, 5, "imbalanced", seed=1).sizes(lengths)
    assert 3.0 < max(imb) / min(imb) < 5.0
    assert td.split_articles(docs, 5, "random", seed=2) != td.split_articles(docs, 5, "random", seed=1)


def test_topic_split_recovers_the_two_topics():
    docs = _synthetic()
    s = td.split_articles(docs, 2, "topic", seed=0)
    for shard in s.shards:
        parities = {i % 2 for i in shard}
        assert len(parities) == 1  # each agent holds one topic only
    assert {
        frozenset(t[:3])
        <= (
            set(["goal", "match", "team", "league", "player", "coach", "season"])
            | set(["atom", "molecule", "bond", "electron", "acid", "reaction", "ion"])
        )
        for t in s.topic_terms
    } == {True}
    # Fewer topics than agents: agents t, t+topics, ... share topic t.
    s4 = td.split_articles(docs, 4, "topic", seed=0, topics=2)
    assert s4.topic_of_shard == (0, 1, 0, 1)
    for a in range(4):
        assert len({i % 2 for i in s4.shards[a]}) == 1
    assert {i % 2 for i in s4.shards[0]} == {i % 2 for i in s4.shards[2]}


def test_split_refuses_bad_requests():
    docs = _synthetic(6)
    with pytest.raises(ConfigError):
        td.split_articles(docs, 7, "random")
    with pytest.raises(ConfigError):
        td.split_articles(docs, 2, "alphabetical")
    with pytest.raises(ConfigError):
        td.split_articles(docs, 2, "topic", topics=3)


def test_merge_term_counts_sums_filters_and_orders():
    a = {"x": 3, "y": 1, "z": 2}
    b = {"y": 4, "w": 1}
    assert td.merge_term_counts([a, b]) == [("y", 5), ("x", 3), ("z", 2), ("w", 1)]
    assert td.merge_term_counts([b, a], min_count=2, max_size=2) == [("y", 5), ("x", 3)]
    assert td.term_counts([["a", "b"], ["a"]]) == {"a": 2, "b": 1}


def test_newsgroups_sample_read_without_unpickling():
    posts = td.newsgroups()
    assert len(posts) == 200
    assert {p.group for p in posts} == set(td.NEWSGROUPS)
    assert sum(p.group == "sci.space" for p in posts) == 100
    assert all(p.body and not p.body.startswith(("Path:", "Xref:")) for p in posts)


def test_evaluation_sets_load():
    ws, sl, an = td.wordsim353(), td.simlex999(), td.analogies()
    assert len(ws) == 353 and ("tiger", "cat", 7.35) in ws
    assert len(sl) == 999 and ("smart", "intelligent", 9.2) in sl
    assert len(an) == 14 and an["capital-common-countries"][0] == ("athens", "greece", "baghdad", "iraq")
    assert sum(map(len, an.values())) == 19544
