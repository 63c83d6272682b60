"""Quality measures for word and document vectors: pure functions on numpy arrays.

* :func:`similarity_benchmark` -- Spearman's rank correlation between human similarity
  judgements (wordsim353, simlex999) and the cosine similarity of the model's vectors,
  over the pairs whose two words the model knows; the coverage (pairs used / pairs in the
  set) is reported with it, because a model that knows fewer words is scored on an
  easier or harder subset and the two numbers only mean something together.
* :func:`neighbour_overlap` -- the gossip-learning thesis's ``w2v_sim`` (its eq. 3.5):
  for every evaluation word, the ``n`` nearest words by cosine under the model and under
  a reference model; the score is the number of words the two lists share, summed over
  the evaluation words. The thesis writes the summand as ``sim(w_tw)`` over the shared
  words without defining it further; its reported values (65 for 23 words and 8
  neighbours, i.e. at most 184) only make sense as counts, so each shared word counts 1.
  The thesis's reference was Google News vectors; here the reference is a centralized
  model trained on the same data, which is what "quality against centralized training"
  asks for. Both models rank over the same candidate words (their common vocabulary).
* :func:`analogy_accuracy` -- Mikolov's analogies (``a : b :: c : ?``, questions-words):
  the answer is the word whose vector is most cosine-similar to ``b - a + c`` (unit
  vectors, "3CosAdd"), the three question words excluded; accuracy over the questions
  whose four words the model knows, reported with that coverage.
* :func:`sim_k` -- SEEC's overlap (Sec. V-A-3): for a document d, the top-k most similar
  documents under the centralized model (``d_c^k``) and under the federated one
  (``d_f^k``); ``sim_k = |d_c^k ∩ d_f^k| / k``, averaged over the query documents. The
  query document itself is left out of its own neighbour list (it is trivially its own
  nearest neighbour under both models and would add 1/k to every score);
  ``include_self=True`` keeps it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedagent.extras import require

# The thesis's evaluation words (Sec. 4.1), chosen for the topics of its nodes.
THESIS_EVAL_WORDS: tuple[str, ...] = (
    "five",
    "war",
    "work",
    "year",
    "people",
    "location",
    "october",
    "state",
    "science",
    "rights",
    "history",
    "money",
    "bank",
    "man",
    "woman",
    "growth",
    "spring",
    "life",
    "hard",
    "culture",
    "medium",
    "family",
    "alien",
)
THESIS_NEIGHBOURS = 8  # "eight of the nearest context words" per evaluation word


class WordVectors:
    """Terms and their vectors (row ``i`` belongs to ``terms[i]``)."""

    __slots__ = ("index", "terms", "vectors")

    def __init__(self, terms: Sequence[str], vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[0] != len(terms):
            raise ValueError(f"{len(terms)} terms but vectors of shape {vectors.shape}")
        self.terms = tuple(terms)
        self.vectors = vectors
        self.index = {t: i for i, t in enumerate(self.terms)}
        if len(self.index) != len(self.terms):
            raise ValueError("terms must be unique")

    def __contains__(self, term: str) -> bool:
        return term in self.index

    def restrict(self, terms: Iterable[str]) -> WordVectors:
        """The same vectors for ``terms`` only, in that order (all must be known)."""
        terms = list(terms)
        return WordVectors(terms, self.vectors[[self.index[t] for t in terms]])


def normalize_rows(m: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    # An all-zero row (a word never trained) has no direction: it stays zero and so has
    # cosine 0 with everything instead of producing NaN.
    return np.divide(m, norms, out=np.zeros_like(m, dtype=np.float64), where=norms > 0)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


# ---- word similarity benchmarks -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SimilarityScore:
    rho: float  # Spearman correlation over the covered pairs (nan if fewer than 3)
    pairs_used: int
    pairs_total: int

    @property
    def coverage(self) -> float:
        return self.pairs_used / self.pairs_total if self.pairs_total else 0.0


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho with average ranks for ties (scipy); nan for fewer than 3 points
    or a constant side."""
    stats = require("scipy.stats", "text", "word-similarity scoring")
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(xs) != len(ys):
        raise ValueError("x and y differ in length")
    if len(xs) < 3 or np.all(xs == xs[0]) or np.all(ys == ys[0]):
        return float("nan")
    return float(stats.spearmanr(xs, ys).statistic)


def similarity_benchmark(
    pairs: Sequence[tuple[str, str, float]], vectors: WordVectors, *, lowercase: bool = True
) -> SimilarityScore:
    """Spearman correlation of human scores with model cosines over the known pairs."""
    human, model = [], []
    for w1, w2, score in pairs:
        if lowercase:
            w1, w2 = w1.lower(), w2.lower()
        if w1 in vectors and w2 in vectors:
            human.append(score)
            model.append(cosine(vectors.vectors[vectors.index[w1]], vectors.vectors[vectors.index[w2]]))
    return SimilarityScore(rho=spearman(human, model), pairs_used=len(human), pairs_total=len(pairs))


# ---- nearest neighbours ------------------------------------------------------------------
def nearest(
    matrix: np.ndarray,
    queries: np.ndarray | Sequence[int],
    n: int,
    *,
    query_vectors: np.ndarray | None = None,
    include_self: bool = False,
) -> np.ndarray:
    """Row indices of the ``n`` rows of ``matrix`` most cosine-similar to each query.

    ``queries`` are row indices of ``matrix``; their own row is excluded unless
    ``include_self``. With ``query_vectors`` the queries are those vectors instead
    (nothing is excluded). Ties are broken by the lower row index, so the result is
    deterministic."""
    unit = normalize_rows(np.asarray(matrix, dtype=np.float64))
    rows = np.asarray(queries, dtype=np.int64)
    q = (
        normalize_rows(np.atleast_2d(np.asarray(query_vectors, dtype=np.float64)))
        if query_vectors is not None
        else unit[rows]
    )
    sims = q @ unit.T
    if query_vectors is None and not include_self:
        sims[np.arange(len(rows)), rows] = -np.inf
    n = min(n, unit.shape[0] - (0 if include_self or query_vectors is not None else 1))
    # Stable sort of -sims keeps equal scores in row order.
    return np.argsort(-sims, axis=1, kind="stable")[:, :n]


@dataclass(frozen=True, slots=True)
class OverlapScore:
    total: int  # the thesis's w2v_sim: shared neighbours summed over words
    per_word: Mapping[str, int]
    words_used: int
    n: int

    @property
    def fraction(self) -> float:
        """``total`` over its maximum (words used × n)."""
        return self.total / (self.words_used * self.n) if self.words_used else 0.0


def neighbour_overlap(
    model: WordVectors, reference: WordVectors, words: Sequence[str] = THESIS_EVAL_WORDS, n: int = THESIS_NEIGHBOURS
) -> OverlapScore:
    """The thesis's ``w2v_sim`` of ``model`` against ``reference`` (module docstring)."""
    common = [t for t in model.terms if t in reference]
    m, r = model.restrict(common), reference.restrict(common)
    used = [w for w in words if w in m]
    if not used:
        return OverlapScore(total=0, per_word={}, words_used=0, n=n)
    rows = [m.index[w] for w in used]
    nm, nr = nearest(m.vectors, rows, n), nearest(r.vectors, rows, n)
    per_word = {w: len(set(a.tolist()) & set(b.tolist())) for w, a, b in zip(used, nm, nr)}
    return OverlapScore(total=sum(per_word.values()), per_word=per_word, words_used=len(used), n=n)


def neighbours_of(vectors: WordVectors, word: str, n: int = THESIS_NEIGHBOURS) -> list[str]:
    """The ``n`` nearest words to ``word`` (the thesis's tables of context words)."""
    return [vectors.terms[i] for i in nearest(vectors.vectors, [vectors.index[word]], n)[0]]


# ---- analogies ----------------------------------------------------------------------------
def analogy_accuracy(
    vectors: WordVectors, questions: Sequence[tuple[str, str, str, str]], *, batch: int = 512
) -> SimilarityScore:
    """3CosAdd accuracy (module docstring); ``rho`` holds the accuracy (nan if no question
    is covered)."""
    unit = normalize_rows(vectors.vectors)
    idx = vectors.index
    covered = [
        (idx[a], idx[b], idx[c], idx[d]) for a, b, c, d in questions if a in idx and b in idx and c in idx and d in idx
    ]
    if not covered:
        return SimilarityScore(rho=float("nan"), pairs_used=0, pairs_total=len(questions))
    q = np.array(covered)
    correct = 0
    for start in range(0, len(q), batch):
        part = q[start : start + batch]
        target = unit[part[:, 1]] - unit[part[:, 0]] + unit[part[:, 2]]
        sims = target @ unit.T
        rows = np.arange(len(part))
        for col in range(3):
            sims[rows, part[:, col]] = -np.inf
        correct += int(np.sum(np.argmax(sims, axis=1) == part[:, 3]))
    return SimilarityScore(rho=correct / len(q), pairs_used=len(q), pairs_total=len(questions))


# ---- SEEC sim_k ----------------------------------------------------------------------------
def overlap_at_k(central: Sequence[Sequence[Hashable]], federated: Sequence[Sequence[Hashable]], k: int) -> float:
    """Mean of ``|top-k central ∩ top-k federated| / k`` over queries, from neighbour lists
    (e.g. the merged answers of a cross-site search). Lists longer than ``k`` are cut."""
    if k < 1:
        raise ValueError("k must be at least 1")
    if len(central) != len(federated):
        raise ValueError(f"{len(central)} central but {len(federated)} federated neighbour lists")
    if not central:
        raise ValueError("no queries")
    return float(np.mean([len(set(c[:k]) & set(f[:k])) / k for c, f in zip(central, federated)]))


def sim_k(
    central_vectors: np.ndarray,
    federated_vectors: np.ndarray,
    k: int = 10,
    queries: Sequence[int] | None = None,
    *,
    include_self: bool = False,
) -> float:
    """SEEC's sim_k when both models vectorise the same documents (row i = document i)."""
    central_vectors = np.asarray(central_vectors)
    federated_vectors = np.asarray(federated_vectors)
    if central_vectors.shape[0] != federated_vectors.shape[0]:
        raise ValueError("both models must vectorise the same documents (same number of rows)")
    rows = np.arange(central_vectors.shape[0]) if queries is None else np.asarray(queries)
    c = nearest(central_vectors, rows, k, include_self=include_self)
    f = nearest(federated_vectors, rows, k, include_self=include_self)
    return overlap_at_k(c.tolist(), f.tolist(), k)


# ---- neighbour overlap against several reference models ----------------------------------
def consensus_neighbours(
    refs: Sequence[WordVectors], words: Sequence[str] = THESIS_EVAL_WORDS, n: int = THESIS_NEIGHBOURS
) -> dict[str, set[str]]:
    """The ``n`` nearest words of each of ``words`` by cosine similarity *averaged over*
    ``refs`` (terms all of them know): the neighbours several equally good models agree
    on, a steadier reference than any one of them."""
    if not refs:
        raise ValueError("at least one reference model is needed")
    common = [t for t in refs[0].terms if all(t in r for r in refs[1:])]
    index = {t: i for i, t in enumerate(common)}
    units = [normalize_rows(np.asarray(r.restrict(common).vectors, dtype=np.float64)) for r in refs]
    out: dict[str, set[str]] = {}
    for w in words:
        if w not in index:
            continue
        i = index[w]
        sims = np.mean([u @ u[i] for u in units], axis=0)
        sims[i] = -np.inf
        out[w] = {common[j] for j in np.argsort(-sims, kind="stable")[: min(n, len(common) - 1)]}
    return out


def overlap_with_neighbours(model: WordVectors, neighbours: Mapping[str, set[str]]) -> int:
    """Shared neighbours of ``model`` with given neighbour sets (each word's set size is its n)."""
    total = 0
    for w, ref in neighbours.items():
        if w in model:
            total += len(set(neighbours_of(model, w, len(ref))) & ref)
    return total
