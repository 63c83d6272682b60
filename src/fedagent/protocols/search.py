"""Cross-site semantic search (SEEC Sec. IV, ``GlobalSearch_i``), as pure code.

The asking agent vectorises the query text itself; only the vector travels (mapped into
each peer's vector space first when the federation uses vector-space mapping; in a
joint-learning federation every site shares the model, so one vector serves all). Each
peer ranks its own documents by cosine similarity to the vector and answers with its
top-k (document id, score); the asker merges all answers into one top-k list.

:class:`SearchMachine` keeps the asker's side: which peers a query went to, which have
answered, and a deadline after which the query completes with the answers it has and
names the peers that stayed silent. ``handle(event, now) -> list[Command]`` like the
other machines: time is passed in, nothing here touches a clock or a socket. Several
queries may be in flight; each completes exactly once.

:func:`top_k` and :func:`check_vector` are the responder's side: ranking, and the
checks made on a received vector before any arithmetic (dimension, dtype, finiteness).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_K = 100
MAX_DIM = 4096
MAX_DOC_ID = 200
MAX_PEERS = 1000
MAX_TIMEOUT = 600.0


class SearchError(ValueError):
    """A query or an answer that cannot be accepted; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True, order=True)
class Hit:
    """One document of one site; ordered so that ``sorted`` puts the best first."""

    neg_score: float
    site: str
    doc_id: str

    @property
    def score(self) -> float:
        return -self.neg_score


def check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise SearchError("k", f"k must be an integer in 1..{MAX_K}, got {k!r}")
    return k


def check_vector(vector: np.ndarray, dim: int) -> np.ndarray:
    """The received query vector as float64, if it is 1-D of this site's dimension and
    finite; else :class:`SearchError`."""
    if not isinstance(vector, np.ndarray) or vector.ndim != 1:
        raise SearchError("shape", "the query vector must be one-dimensional")
    if vector.shape[0] != dim:
        raise SearchError("dimension", f"query vector has {vector.shape[0]} dimensions, this site's space has {dim}")
    if vector.dtype.kind != "f":
        raise SearchError("dtype", f"query vector must be floating point, not {vector.dtype}")
    out = vector.astype(np.float64)
    if not np.all(np.isfinite(out)):
        raise SearchError("finite", "query vector has NaN or infinite entries")
    return out


def top_k(query: np.ndarray, vectors: np.ndarray, doc_ids: Sequence[str], k: int) -> list[tuple[str, float]]:
    """The ``k`` documents most cosine-similar to ``query`` (best first; ties by id)."""
    if vectors.ndim != 2 or vectors.shape[0] != len(doc_ids) or vectors.shape[1] != query.shape[0]:
        raise SearchError("index", "document vectors do not match the ids or the query")
    if not len(doc_ids):
        return []
    qn = float(np.linalg.norm(query))
    norms = np.linalg.norm(vectors, axis=1)
    denom = norms * qn
    sims = np.divide(vectors @ query, denom, out=np.zeros(len(doc_ids)), where=denom > 0)
    order = sorted(range(len(doc_ids)), key=lambda i: (-float(sims[i]), doc_ids[i]))[:k]
    return [(doc_ids[i], float(sims[i])) for i in order]


def merge(answers: Iterable[tuple[str, Sequence[tuple[str, float]]]], k: int) -> list[Hit]:
    """One top-k list from the sites' answers (best first; ties by site, then id)."""
    hits = [Hit(-float(score), site, doc) for site, rows in answers for doc, score in rows]
    return sorted(hits)[:k]


# ---- the asker's machine -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    query_id: str
    peers: tuple[str, ...]
    k: int
    timeout: float


@dataclass(frozen=True, slots=True)
class AnswerReceived:
    query_id: str
    sender: str
    hits: tuple[tuple[str, float], ...]
    error: str = ""


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


SearchEvent = Start | AnswerReceived | Wakeup


@dataclass(frozen=True, slots=True)
class SendQuery:
    query_id: str
    peer: str
    k: int


@dataclass(frozen=True, slots=True)
class Completed:
    query_id: str
    hits: tuple[Hit, ...]
    answered: tuple[str, ...]
    silent: tuple[str, ...]          # asked, no answer by the deadline
    failed: tuple[tuple[str, str], ...]   # answered with an error: (peer, error)
    timed_out: bool


@dataclass(frozen=True, slots=True)
class Ignored:
    query_id: str
    sender: str
    reason: str


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


SearchCommand = SendQuery | Completed | Ignored | RequestWakeup


@dataclass
class _Query:
    peers: tuple[str, ...]
    k: int
    deadline: float
    answers: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class SearchMachine:
    """The asker's queries in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.queries: dict[str, _Query] = {}

    def handle(self, event: SearchEvent, now: float) -> list[SearchCommand]:
        if isinstance(event, Start):
            return self._start(event, now)
        if isinstance(event, AnswerReceived):
            return self._answer(event, now)
        if isinstance(event, Wakeup):
            return self._expire(now)
        raise TypeError(f"not a search event: {event!r}")

    def _start(self, ev: Start, now: float) -> list[SearchCommand]:
        check_k(ev.k)
        if ev.query_id in self.queries:
            raise SearchError("duplicate", f"query {ev.query_id} is already in flight")
        if len(ev.peers) > MAX_PEERS or len(set(ev.peers)) != len(ev.peers):
            raise SearchError("peers", f"at most {MAX_PEERS} distinct peers")
        if not (math.isfinite(ev.timeout) and 0 < ev.timeout <= MAX_TIMEOUT):
            raise SearchError("timeout", f"the timeout must be in (0, {MAX_TIMEOUT}] seconds")
        q = _Query(ev.peers, ev.k, now + ev.timeout)
        self.queries[ev.query_id] = q
        if not ev.peers:
            return [self._complete(ev.query_id, timed_out=False)]
        return [*(SendQuery(ev.query_id, p, ev.k) for p in ev.peers), RequestWakeup(q.deadline)]

    def _answer(self, ev: AnswerReceived, now: float) -> list[SearchCommand]:
        q = self.queries.get(ev.query_id)
        if q is None:
            return [Ignored(ev.query_id, ev.sender, "unknown or finished query")]
        if ev.sender not in q.peers:
            return [Ignored(ev.query_id, ev.sender, "not asked")]
        if ev.sender in q.answers or ev.sender in q.errors:
            return [Ignored(ev.query_id, ev.sender, "duplicate answer")]
        if now >= q.deadline:
            # The wake-up may still be queued behind this answer: the deadline decides.
            return [*self._expire(now), Ignored(ev.query_id, ev.sender, "after the deadline")]
        if ev.error:
            q.errors[ev.sender] = ev.error
        elif len(ev.hits) > q.k:
            q.errors[ev.sender] = f"answered {len(ev.hits)} hits for k={q.k}"
        elif not all(math.isfinite(s) and -1.0001 <= s <= 1.0001 for _, s in ev.hits):
            q.errors[ev.sender] = "scores outside [-1, 1]"
        else:
            q.answers[ev.sender] = ev.hits
        if len(q.answers) + len(q.errors) == len(q.peers):
            return [self._complete(ev.query_id, timed_out=False)]
        return []

    def _expire(self, now: float) -> list[SearchCommand]:
        out: list[SearchCommand] = []
        for qid in [qid for qid, q in self.queries.items() if now >= q.deadline]:
            out.append(self._complete(qid, timed_out=True))
        if self.queries:
            out.append(RequestWakeup(min(q.deadline for q in self.queries.values())))
        return out

    def _complete(self, qid: str, *, timed_out: bool) -> Completed:
        q = self.queries.pop(qid)
        answered = tuple(p for p in q.peers if p in q.answers)
        silent = tuple(p for p in q.peers if p not in q.answers and p not in q.errors)
        return Completed(qid, tuple(merge(((p, q.answers[p]) for p in answered), q.k)), answered, silent,
                         tuple((p, q.errors[p]) for p in q.peers if p in q.errors), timed_out)


__all__ = ["MAX_K", "MAX_DIM", "MAX_DOC_ID", "SearchError", "Hit", "check_k", "check_vector", "top_k", "merge",
           "Start", "AnswerReceived", "Wakeup", "SendQuery", "Completed", "Ignored", "RequestWakeup",
           "SearchMachine"]
