"""Vocabulary consensus, as pure code (gFedNTM stage 1; reused by Word2Vec/Doc2Vec).

Every agent sends the terms of its corpus with their counts, never a document. The
coordinator waits until every expected agent has offered its vocabulary, or until a
deadline once a quorum has, then merges them into one common vocabulary:

* the union of all terms, each with the sum of its counts over the agents (the
  paper's "weighted frequencies reflecting their overall presence across all nodes");
* optionally only terms whose merged count is at least ``min_count``, and at most the
  ``max_size`` most frequent ones;
* in a deterministic order: descending merged count, ties broken by the term itself,
  so every run on the same inputs gives the same term indices whatever the order in
  which offers arrived.

``VocabularyMerge.handle(event, now) -> list[Command]`` like the round machine: time
is passed in, nothing here touches a clock, a socket or a thread. Counts are added to
one running table as offers arrive (the coordinator never keeps N vocabularies).

Invariants: one offer per agent (a redelivered or repeated offer is refused, naming
the sender), only from agents the caller lets in (``allowed``), only while collecting;
the vocabulary is agreed at most once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

MAX_TERMS = 100_000  # terms in one offer or in the agreed vocabulary (codec's array limit)
MAX_TERM_CHARS = 200  # one term
MAX_COUNT = 2**53 - 1  # counts stay exact in a float64 and in msgpack


class VocabError(ValueError):
    """A vocabulary that cannot be accepted; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_term(term: object) -> str:
    if not isinstance(term, str) or not 0 < len(term) <= MAX_TERM_CHARS:
        raise VocabError("term", f"a term must be a string of 1..{MAX_TERM_CHARS} characters")
    if not term.isprintable() or term != term.strip():
        raise VocabError("term", f"term {term[:40]!r} has control characters or surrounding whitespace")
    return term


def check_counts(terms: Iterable[object], counts: Iterable[object], *, max_terms: int = MAX_TERMS) -> None:
    """Raise :class:`VocabError` unless ``terms``/``counts`` are a valid offer: as many
    counts as terms, at most ``max_terms``, unique well-formed terms, positive integer
    counts."""
    terms, counts = list(terms), list(counts)
    if len(terms) != len(counts):
        raise VocabError("shape", f"{len(terms)} terms but {len(counts)} counts")
    if len(terms) > max_terms:
        raise VocabError("size", f"{len(terms)} terms, at most {max_terms} allowed")
    seen: set[str] = set()
    for term, c in zip(terms, counts):
        t = check_term(term)
        if t in seen:
            raise VocabError("duplicate-term", f"term {t[:40]!r} appears twice")
        seen.add(t)
        if isinstance(c, bool) or not isinstance(c, int) or not 0 < c <= MAX_COUNT:
            raise VocabError("count", f"count of {t[:40]!r} must be a positive integer, got {c!r}")


def merge_vocabularies(
    offers: Iterable[Mapping[str, int]], *, min_count: int = 1, max_size: int = 0
) -> list[tuple[str, int]]:
    """Union with summed counts, filtered and ordered as the module docstring says."""
    total: dict[str, int] = {}
    for offer in offers:
        for t, c in offer.items():
            total[t] = total.get(t, 0) + c
    return finalize(total, min_count=min_count, max_size=max_size)


def finalize(total: Mapping[str, int], *, min_count: int = 1, max_size: int = 0) -> list[tuple[str, int]]:
    kept = [(t, c) for t, c in total.items() if c >= min_count]
    kept.sort(key=lambda tc: (-tc[1], tc[0]))
    return kept[:max_size] if max_size else kept


def vocabulary_digest(terms: Iterable[str]) -> str:
    """A short fingerprint of an ordered vocabulary: agents and coordinator compare it
    on every step to be sure they index the same terms the same way."""
    import hashlib

    h = hashlib.sha256()
    for t in terms:
        h.update(t.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:32]


# ---- the machine -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VocabConfig:
    expected_agents: int = 0  # merge as soon as this many offered (0 = unknown: wait for the deadline)
    min_agents: int = 1  # quorum: at the deadline, merge only with at least this many offers
    deadline: float = 60.0  # seconds after start; with a quorum the merge happens then
    min_count: int = 1
    max_size: int = 0  # keep at most this many terms (0 = all)
    max_terms: int = MAX_TERMS  # per offer and in the result

    def __post_init__(self) -> None:
        if self.expected_agents < 0 or self.min_agents < 1:
            raise ValueError("expected_agents must be >= 0 and min_agents >= 1")
        if self.expected_agents and self.min_agents > self.expected_agents:
            raise ValueError("min_agents cannot exceed expected_agents")
        if not (math.isfinite(self.deadline) and self.deadline > 0):
            raise ValueError("the vocabulary deadline must be a positive number of seconds")
        if self.min_count < 1 or self.max_size < 0 or not 0 < self.max_terms <= MAX_TERMS:
            raise ValueError(f"min_count >= 1, max_size >= 0, 0 < max_terms <= {MAX_TERMS}")
        if self.max_size > self.max_terms:
            raise ValueError("max_size cannot exceed max_terms")


@dataclass(frozen=True, slots=True)
class OfferReceived:
    sender: str
    terms: tuple[str, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


VocabEvent = OfferReceived | Wakeup


@dataclass(frozen=True, slots=True)
class Agreed:
    """The common vocabulary: ``terms`` in index order with their merged ``counts``."""

    terms: tuple[str, ...]
    counts: tuple[int, ...]
    contributors: tuple[str, ...]
    digest: str
    dropped_terms: int = 0  # terms offered but cut by min_count / max_size


@dataclass(frozen=True, slots=True)
class OfferRejected:
    sender: str
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


VocabCommand = Agreed | OfferRejected | RequestWakeup


class VocabPhase(str, Enum):
    IDLE = "idle"
    COLLECTING = "collecting"
    AGREED = "agreed"


class VocabularyMerge:
    """Collects offers and agrees on the vocabulary once (see the module docstring)."""

    def __init__(self, config: VocabConfig, *, allowed: Iterable[str] | None = None) -> None:
        self.config = config
        self.allowed = None if allowed is None else frozenset(allowed)
        self.phase = VocabPhase.IDLE
        self.deadline = math.inf
        self._total: dict[str, int] = {}
        self.contributors: dict[str, int] = {}  # sender -> terms it offered
        self.result: Agreed | None = None

    def start(self, now: float) -> list[VocabCommand]:
        if self.phase is not VocabPhase.IDLE:
            return []
        self.phase = VocabPhase.COLLECTING
        self.deadline = now + self.config.deadline
        return [RequestWakeup(self.deadline)]

    def handle(self, event: VocabEvent, now: float) -> list[VocabCommand]:
        if isinstance(event, OfferReceived):
            return self._on_offer(event, now)
        if isinstance(event, Wakeup):
            return self._maybe_agree(now)
        raise TypeError(f"not a vocabulary event: {event!r}")

    def status(self) -> dict[str, object]:
        return {
            "phase": self.phase.value,
            "offers": sorted(self.contributors),
            "expected": self.config.expected_agents,
            "terms_so_far": len(self._total),
            "terms": len(self.result.terms) if self.result else None,
        }

    def _on_offer(self, ev: OfferReceived, now: float) -> list[VocabCommand]:
        def reject(reason: str, detail: str) -> list[VocabCommand]:
            return [OfferRejected(ev.sender, reason, detail)]

        if self.phase is not VocabPhase.COLLECTING:
            return reject("late", f"vocabulary already {self.phase.value}")
        if self.allowed is not None and ev.sender not in self.allowed:
            return reject("unexpected", f"{ev.sender} is not an expected agent")
        if ev.sender in self.contributors:
            return reject("duplicate", f"second vocabulary from {ev.sender}")
        try:
            check_counts(ev.terms, ev.counts, max_terms=self.config.max_terms)
        except VocabError as exc:
            return reject(exc.reason, exc.detail)
        for t, c in zip(ev.terms, ev.counts):
            self._total[t] = self._total.get(t, 0) + c
        self.contributors[ev.sender] = len(ev.terms)
        return self._maybe_agree(now)

    def _maybe_agree(self, now: float) -> list[VocabCommand]:
        if self.phase is not VocabPhase.COLLECTING:
            return []
        cfg, n = self.config, len(self.contributors)
        everyone = cfg.expected_agents and n >= cfg.expected_agents
        if not everyone and not (now >= self.deadline and n >= cfg.min_agents):
            # Past the deadline without a quorum the merge simply waits for more offers:
            # merging fewer would silently leave agents' terms out of the model.
            return []
        size = cfg.max_size or cfg.max_terms
        merged = finalize(self._total, min_count=cfg.min_count, max_size=size)
        terms = tuple(t for t, _ in merged)
        self.result = Agreed(
            terms,
            tuple(c for _, c in merged),
            tuple(sorted(self.contributors)),
            vocabulary_digest(terms),
            len(self._total) - len(merged),
        )
        self.phase = VocabPhase.AGREED
        self._total = {}
        return [self.result]


__all__ = [
    "MAX_TERMS",
    "MAX_TERM_CHARS",
    "Agreed",
    "OfferReceived",
    "OfferRejected",
    "RequestWakeup",
    "VocabConfig",
    "VocabError",
    "VocabPhase",
    "VocabularyMerge",
    "Wakeup",
    "check_counts",
    "check_term",
    "finalize",
    "merge_vocabularies",
    "vocabulary_digest",
]
