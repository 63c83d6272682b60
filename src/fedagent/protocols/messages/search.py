"""The messages of cross-site search (SEEC): a query vector and its answer, and the
exchange of public-document vectors that maps one site's space onto another's (see
:mod:`fedagent.protocols.search`). A query's text, a document or a private vector never
travels."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits, decode_weights, encode_weights
from fedagent.protocols.messages.vocabulary import MAX_DIGEST
from fedagent.protocols.search import MAX_DIM, MAX_DOC_ID, MAX_K, MAX_PUBLIC_DOCS

MAX_QUERY_ID = 64
MAX_ERROR = 200

_ID = F.Text(min_len=1, max_len=MAX_QUERY_ID, printable=True)


def _query_id(value: Any, what: str, key: str = "query_id") -> str:
    return F.text(value, what, key, min_len=1, max_len=MAX_QUERY_ID, printable=True)


@dataclass(frozen=True, slots=True)
class _QueryVector(F.Kind):
    """One tensor named ``q``, decoded under a budget of its own: a query is one vector,
    and a peer cannot make this site allocate more."""

    costly: ClassVar[bool] = True

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> np.ndarray:
        if not isinstance(value, dict) or set(value) != {"q"}:
            raise F.refuse(msg, key, "must hold one tensor named q")
        return decode_weights(value, Limits(max_tensor_bytes=8 * MAX_DIM, max_map_len=1))["q"]

    def write(self, value: Any) -> Any:
        return encode_weights({"q": value})


@dataclass(frozen=True, slots=True)
class SearchQuery(F.WireMessage):
    """Agent → agent: rank your documents against ``vector`` (already in the receiver's
    vector space) and answer with your top ``k``. ``space`` names that space (the
    common vocabulary's digest in a joint-learning federation), so a receiver whose
    model differs refuses instead of answering nonsense. Never the query's text."""

    kind: ClassVar[str] = "search_query"
    WIRE: ClassVar[F.Body] = F.Body(
        "search_query",
        F.Field("query_id", _ID),
        F.Field("k", F.Count(low=1)),
        F.Field("space", F.Text(max_len=MAX_DIGEST)),
        F.Field("vector", _QueryVector()),
        exact=True,
    )
    query_id: str
    k: int
    space: str
    vector: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        _query_id(self.query_id, "search_query")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise CodecError(f"search_query: k must be an integer in 1..{MAX_K}")
        if not isinstance(self.space, str) or len(self.space) > MAX_DIGEST:
            raise CodecError("search_query: space must be a string of at most 64 characters")
        v = self.vector
        if not isinstance(v, np.ndarray) or v.ndim != 1 or not 0 < v.shape[0] <= MAX_DIM or v.dtype.kind != "f":
            raise CodecError(f"search_query: vector must be a 1-D float array of 1..{MAX_DIM} entries")


@dataclass(frozen=True, slots=True)
class SearchAnswer(F.WireMessage):
    """Agent → agent: the answerer's top documents for ``query_id``, best first, as
    (document id, cosine score); or an ``error`` code and no hits."""

    kind: ClassVar[str] = "search_answer"
    WIRE: ClassVar[F.Body] = F.Body(
        "search_answer",
        F.Field("query_id", _ID),
        F.Field("doc_ids", F.Items(MAX_K)),
        F.Field("scores", F.Items(MAX_K, F.Number(finite=True))),
        F.Field("error", F.Text(max_len=MAX_ERROR)),
    )
    query_id: str
    doc_ids: tuple[str, ...]
    scores: tuple[float, ...]
    error: str = ""

    def __post_init__(self) -> None:
        _query_id(self.query_id, "search_answer")
        if len(self.doc_ids) != len(self.scores) or len(self.doc_ids) > MAX_K:
            raise CodecError(f"search_answer: at most {MAX_K} hits, one score per document")
        for d in self.doc_ids:
            if not isinstance(d, str) or not 0 < len(d) <= MAX_DOC_ID or not d.isprintable():
                raise CodecError(f"search_answer: document ids are printable strings of 1..{MAX_DOC_ID} characters")
        for x in self.scores:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise CodecError("search_answer: scores must be finite numbers")
        if not isinstance(self.error, str) or len(self.error) > MAX_ERROR or (self.error and self.doc_ids):
            raise CodecError(f"search_answer: an error of at most {MAX_ERROR} characters, and then no hits")


@dataclass(frozen=True, slots=True)
class PublicVectorsRequest(F.WireMessage):
    """Agent → agent (mapped search): send me your vectors of the public corpus
    ``public`` (a digest naming the agreed public documents), unless your space is still
    ``have_space`` (then an answer without vectors confirms the mapper is current)."""

    kind: ClassVar[str] = "public_vectors_request"
    WIRE: ClassVar[F.Body] = F.Body(
        "public_vectors_request",
        F.Field("request_id", _ID),
        F.Field("public", F.Text(max_len=MAX_DIGEST)),
        F.Field("have_space", F.Text(max_len=MAX_DIGEST)),
        exact=True,
    )
    request_id: str
    public: str
    have_space: str = ""

    def __post_init__(self) -> None:
        _query_id(self.request_id, "public_vectors_request", "request_id")
        for name, v in (("public", self.public), ("have_space", self.have_space)):
            if not isinstance(v, str) or len(v) > MAX_DIGEST:
                raise CodecError(f"public_vectors_request: {name} must be a string of at most {MAX_DIGEST} characters")


@dataclass(frozen=True, slots=True)
class PublicVectors(F.WireMessage):
    """Agent → agent (mapped search): the sender's vectors of the public documents
    (one row each, in the request's order) in its space ``space``; no rows when the
    asker's mapper is for this space already; or an ``error`` code. Never private data.

    On the wire the vectors' ``shape`` travels beside them, and bounds their decoding."""

    kind: ClassVar[str] = "public_vectors"
    WIRE: ClassVar[F.Body] = F.Body(
        "public_vectors",
        F.Field("request_id", _ID),
        F.Field("space", F.Text(max_len=MAX_DIGEST)),
        F.Field("error", F.Text(max_len=MAX_ERROR)),
        exact=True,
        hooked=("shape", "vectors"),
    )
    request_id: str
    space: str
    vectors: np.ndarray | None = field(default=None, repr=False)
    error: str = ""

    def __post_init__(self) -> None:
        _query_id(self.request_id, "public_vectors", "request_id")
        if not isinstance(self.space, str) or len(self.space) > MAX_DIGEST:
            raise CodecError(f"public_vectors: space must be a string of at most {MAX_DIGEST} characters")
        v = self.vectors
        if v is not None and (
            not isinstance(v, np.ndarray)
            or v.ndim != 2
            or v.dtype != np.float32
            or not 0 < v.shape[0] <= MAX_PUBLIC_DOCS
            or not 0 < v.shape[1] <= MAX_DIM
        ):
            raise CodecError(f"public_vectors: vectors must be float32 of at most {MAX_PUBLIC_DOCS} x {MAX_DIM}")
        if not isinstance(self.error, str) or len(self.error) > MAX_ERROR or (self.error and v is not None):
            raise CodecError(f"public_vectors: an error of at most {MAX_ERROR} characters, and then no vectors")

    def to_body(self) -> dict[str, Any]:
        body = self.WIRE.write(self)
        body["shape"] = list(self.vectors.shape) if self.vectors is not None else [0, 0]
        body["vectors"] = encode_weights({"p": self.vectors}) if self.vectors is not None else {}
        return body

    @classmethod
    def from_body(cls, body: Any, limits: Limits = F.DEFAULT_LIMITS) -> PublicVectors:
        w = "public_vectors"
        fields = cls.WIRE.read(body, limits)
        shape = body["shape"]
        if not isinstance(shape, list) or len(shape) != 2 or not all(type(x) is int for x in shape):
            raise F.refuse(w, "shape", "must be two integers")
        n, d = shape
        raw = body["vectors"]
        if not isinstance(raw, dict):
            raise F.refuse(w, "vectors", "must be a map")
        vectors = None
        if (n, d) != (0, 0) or raw:
            # The declared shape is checked against the bounds first and then bounds the
            # decode exactly, so a peer cannot make this site allocate more than that.
            if not (0 < n <= MAX_PUBLIC_DOCS and 0 < d <= MAX_DIM):
                raise F.refuse(w, "shape", f"must be at most {MAX_PUBLIC_DOCS} x {MAX_DIM}")
            small = Limits(max_tensor_bytes=4 * n * d, max_map_len=1)
            vectors = decode_weights(raw, small, expect={"p": ("float32", (n, d))})["p"]
        return cls(**fields, vectors=vectors)
