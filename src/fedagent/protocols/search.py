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
MAX_PUBLIC_DOCS = 20_000
SPACES = ("joint", "mapped")
# Public corpora a mapped federation can learn its mappers from (fedagent.tasks.text_data).
PUBLIC_CORPORA = ("newsgroups", "freebsd-manpages")


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
    silent: tuple[str, ...]  # asked, no answer by the deadline
    failed: tuple[tuple[str, str], ...]  # answered with an error: (peer, error)
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
        return Completed(
            qid,
            tuple(merge(((p, q.answers[p]) for p in answered), q.k)),
            answered,
            silent,
            tuple((p, q.errors[p]) for p in q.peers if p in q.errors),
            timed_out,
        )


# ---- the asker's public-vector exchange (mapped federations, SEEC Algorithm 2) ----------
# In a "mapped" federation every site keeps its own model, so a query vector means
# nothing to a peer until it is mapped into the peer's space. The mapper from this
# site's space to peer j's is trained on the public corpus's vectors of both sites;
# a peer's vectors are asked for before each search, naming the space this site holds
# a mapper for, so a peer whose model has not changed answers with its space alone.
@dataclass(frozen=True, slots=True)
class ExchangeStart:
    request_id: str
    have: tuple[tuple[str, str], ...]  # (peer, space this site holds a mapper for, or "")
    timeout: float


@dataclass(frozen=True, slots=True)
class VectorsReceived:
    request_id: str
    sender: str
    space: str
    rows: int  # 0: no vectors sent (the peer says the asker's mapper is current)
    error: str = ""


@dataclass(frozen=True, slots=True)
class SendVectorsRequest:
    request_id: str
    peer: str
    have_space: str


@dataclass(frozen=True, slots=True)
class Exchanged:
    request_id: str
    current: tuple[tuple[str, str], ...]  # (peer, space): the held mapper is still right
    train: tuple[tuple[str, str], ...]  # (peer, space): new vectors arrived, train a mapper
    silent: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    timed_out: bool


ExchangeCommand = SendVectorsRequest | Exchanged | Ignored | RequestWakeup


@dataclass
class _Exchange:
    have: dict[str, str]
    deadline: float
    rows: int
    current: dict[str, str] = field(default_factory=dict)
    train: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class ExchangeMachine:
    """Which peers were asked for public vectors, which answered and how; completes each
    exchange once, when all answered or at its deadline. ``rows`` is the number of
    public documents a peer's vectors must have."""

    def __init__(self, rows: int) -> None:
        if not 0 < rows <= MAX_PUBLIC_DOCS:
            raise SearchError("public", f"the public corpus must have 1..{MAX_PUBLIC_DOCS} documents")
        self.rows = rows
        self.pending: dict[str, _Exchange] = {}

    def handle(self, event: ExchangeStart | VectorsReceived | Wakeup, now: float) -> list[ExchangeCommand]:
        if isinstance(event, ExchangeStart):
            return self._start(event, now)
        if isinstance(event, VectorsReceived):
            return self._received(event, now)
        if isinstance(event, Wakeup):
            return self._expire(now)
        raise TypeError(f"not an exchange event: {event!r}")

    def _start(self, ev: ExchangeStart, now: float) -> list[ExchangeCommand]:
        peers = [p for p, _ in ev.have]
        if ev.request_id in self.pending:
            raise SearchError("duplicate", f"exchange {ev.request_id} is already in flight")
        if len(peers) > MAX_PEERS or len(set(peers)) != len(peers):
            raise SearchError("peers", f"at most {MAX_PEERS} distinct peers")
        if not (math.isfinite(ev.timeout) and 0 < ev.timeout <= MAX_TIMEOUT):
            raise SearchError("timeout", f"the timeout must be in (0, {MAX_TIMEOUT}] seconds")
        x = _Exchange(dict(ev.have), now + ev.timeout, self.rows)
        self.pending[ev.request_id] = x
        if not peers:
            return [self._complete(ev.request_id, timed_out=False)]
        return [*(SendVectorsRequest(ev.request_id, p, s) for p, s in ev.have), RequestWakeup(x.deadline)]

    def _received(self, ev: VectorsReceived, now: float) -> list[ExchangeCommand]:
        x = self.pending.get(ev.request_id)
        if x is None:
            return [Ignored(ev.request_id, ev.sender, "unknown or finished exchange")]
        if ev.sender not in x.have:
            return [Ignored(ev.request_id, ev.sender, "not asked")]
        if ev.sender in x.current or ev.sender in x.train or ev.sender in x.errors:
            return [Ignored(ev.request_id, ev.sender, "duplicate answer")]
        if now >= x.deadline:
            return [*self._expire(now), Ignored(ev.request_id, ev.sender, "after the deadline")]
        have = x.have[ev.sender]
        if ev.error:
            x.errors[ev.sender] = ev.error
        elif not ev.space:
            x.errors[ev.sender] = "no space named"
        elif ev.rows == 0:
            if have and ev.space == have:
                x.current[ev.sender] = ev.space
            else:
                x.errors[ev.sender] = "no vectors for a space this site has no mapper for"
        elif ev.rows != x.rows:
            x.errors[ev.sender] = f"{ev.rows} public vectors, {x.rows} expected"
        else:
            x.train[ev.sender] = ev.space
        if len(x.current) + len(x.train) + len(x.errors) == len(x.have):
            return [self._complete(ev.request_id, timed_out=False)]
        return []

    def _expire(self, now: float) -> list[ExchangeCommand]:
        out: list[ExchangeCommand] = [
            self._complete(r, timed_out=True) for r in [r for r, x in self.pending.items() if now >= x.deadline]
        ]
        if self.pending:
            out.append(RequestWakeup(min(x.deadline for x in self.pending.values())))
        return out

    def _complete(self, rid: str, *, timed_out: bool) -> Exchanged:
        x = self.pending.pop(rid)
        silent = tuple(p for p in x.have if p not in x.current and p not in x.train and p not in x.errors)
        return Exchanged(
            rid, tuple(x.current.items()), tuple(x.train.items()), silent, tuple(x.errors.items()), timed_out
        )


__all__ = [
    "MAX_DIM",
    "MAX_DOC_ID",
    "MAX_K",
    "MAX_PUBLIC_DOCS",
    "SPACES",
    "AnswerReceived",
    "Completed",
    "ExchangeMachine",
    "ExchangeStart",
    "Exchanged",
    "Hit",
    "Ignored",
    "RequestWakeup",
    "SearchError",
    "SearchMachine",
    "SendQuery",
    "SendVectorsRequest",
    "Start",
    "VectorsReceived",
    "Wakeup",
    "check_k",
    "check_vector",
    "merge",
    "top_k",
]
