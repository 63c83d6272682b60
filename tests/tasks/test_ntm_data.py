"""Corpora for the topic-model tasks: the Sec. 4.1 generator, bags of words, the
newsgroups sample read without unpickling, SBERT embeddings (slow)."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.errors import ConfigError
from fedagent.tasks import ntm_data
from fedagent.tasks.ntm_data import TopicStructure, bow_from_tokens, synthetic_node, true_topics

GEN = {
    "vocab_size": 200,
    "true_topics_": 20,
    "shared_topics": 5,
    "eta": 0.05,
    "alpha": None,
    "docs": 60,
    "val_docs": 12,
    "doc_length": (150, 250),
    "process": "lda",
    "data_seed": 7,
}


def test_topic_structure_shared_and_private_blocks():
    st = TopicStructure(n_topics=50, shared=10, nodes=5)
    assert st.private == 8
    blocks = [set(st.node_topics(n).tolist()) for n in range(5)]
    shared = set(range(10))
    for n, b in enumerate(blocks):
        assert shared <= b and len(b) == 18
        for m in range(n + 1, 5):
            assert blocks[n] & blocks[m] == shared  # private blocks are disjoint
    assert set().union(*blocks) == set(range(50))
    with pytest.raises(ConfigError):
        TopicStructure(n_topics=50, shared=12, nodes=5)  # 38 private topics over 5 nodes


@pytest.mark.parametrize("process", ["prodlda", "lda"])
def test_generator_shapes_support_and_lengths(process):
    nodes = 3
    st = TopicStructure(GEN["true_topics_"], GEN["shared_topics"], nodes)
    for n in range(nodes):
        node = synthetic_node(n, nodes, **{**GEN, "process": process})
        assert node.train.shape == (60, 200) and node.val.shape == (12, 200)
        assert node.train_theta.shape == (60, 20)
        lengths = np.asarray(node.train.sum(axis=1)).ravel()
        assert lengths.min() >= 150 and lengths.max() <= 250
        own = st.node_topics(n)
        other = np.setdiff1d(np.arange(20), own)
        assert np.allclose(node.train_theta.sum(1), 1.0)
        assert np.all(node.train_theta[:, other] == 0)
        assert np.all(node.train_theta[:, own] > 0)


def test_alpha_defaults_to_fifty_over_k():
    # Dirichlet(alpha) over m topics: E[theta_k^2] = (alpha + 1) / (m (m alpha + 1))
    gen = {**GEN, "docs": 4000, "val_docs": 0, "true_topics_": 50, "shared_topics": 10, "doc_length": (2, 2)}
    theta = synthetic_node(0, 5, **gen).train_theta[:, TopicStructure(50, 10, 5).node_topics(0)]
    m, alpha = theta.shape[1], 50 / 50
    assert np.mean(theta**2) == pytest.approx((alpha + 1) / (m * (m * alpha + 1)), rel=0.05)


def test_true_topics_are_dirichlet_eta_rows_shared_by_every_node():
    beta = true_topics(200, 20, 0.05, 7)
    assert beta.shape == (20, 200) and np.allclose(beta.sum(1), 1.0)
    # Small eta: sparse topics (a few terms carry most of the mass).
    top = np.sort(beta, axis=1)[:, ::-1][:, :20].sum(1)
    assert np.all(top > 0.7)
    # Shared-topic words show up at every node; a node's private words mostly only there.
    nodes = [synthetic_node(n, 3, **GEN).train for n in range(3)]
    shared_word = int(np.argmax(beta[0]))
    assert all(m[:, shared_word].sum() > 0 for m in nodes)
    st = TopicStructure(20, 5, 3)
    private0 = st.node_topics(0)[5:]
    word = int(np.argmax(beta[private0[0]]))
    assert nodes[0][:, word].sum() > 5 * max(nodes[1][:, word].sum(), nodes[2][:, word].sum(), 1)


def test_generator_is_deterministic_per_node():
    a = synthetic_node.__wrapped__(1, 3, **GEN)
    b = synthetic_node.__wrapped__(1, 3, **GEN)
    assert (a.train != b.train).nnz == 0
    c = synthetic_node.__wrapped__(1, 3, **{**GEN, "data_seed": 8})
    assert (a.train != c.train).nnz > 0


def test_bow_from_tokens():
    docs = [["a", "b", "a"], ["c"], []]
    m, terms = bow_from_tokens(docs)
    assert terms == ["a", "b", "c"]
    assert m.toarray().tolist() == [[2, 1, 0], [0, 0, 1], [0, 0, 0]]
    m2, terms2 = bow_from_tokens(docs, ["c", "a"])
    assert terms2 == ["c", "a"] and m2.toarray().tolist() == [[0, 2], [1, 0], [0, 0]]


def test_newsgroups_sample_is_split_by_group_without_unpickling():
    posts = ntm_data.load_newsgroups()
    groups = sorted({g for g, _ in posts})
    assert groups == ["alt.atheism", "sci.space"]
    assert len(posts) == 200
    c0 = ntm_data.newsgroups_corpus({}, shard=0, shards=2, contextual=False)
    c1 = ntm_data.newsgroups_corpus({}, shard=1, shards=2, contextual=False)
    assert c0.train.shape[0] + c0.val.shape[0] == 100
    assert c1.train.shape[0] + c1.val.shape[0] == 100
    assert "space" in c1.terms[:10] and "god" in c0.terms[:20]
    assert "edu" not in c0.terms and "the" not in c0.terms


def test_projection_embedding_is_deterministic_and_normalised():
    m, _ = bow_from_tokens([["a", "b"], ["b", "c", "c"]])
    e1, e2 = ntm_data.projection_embedding(m), ntm_data.projection_embedding(m)
    assert e1.shape == (2, ntm_data.PROJECTION_SIZE)
    assert np.array_equal(e1, e2) and np.allclose(np.linalg.norm(e1, axis=1), 1.0)


@pytest.mark.slow
def test_sbert_embeddings_offline_put_related_texts_closer():
    emb = ntm_data.sbert_embed(
        ["the space shuttle launched into orbit", "NASA rocket launch to orbit", "faith in god and religion"]
    )
    assert emb.shape == (3, 384)
    assert float(emb[0] @ emb[1]) > float(emb[0] @ emb[2]) + 0.2
