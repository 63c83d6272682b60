"""The messages of vocabulary consensus (gFedNTM): an agent's offer of terms and counts,
the coordinator's common vocabulary, and, without a coordinator, the digest peers
compare (see :mod:`fedagent.protocols.vocab`, :mod:`fedagent.protocols.gossip_vocab`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.topics import is_valid_name
from fedagent.protocols.vocab import VocabError, check_counts, vocabulary_digest

MAX_VOCAB_TERMS = 100_000  # the codec's default array limit; see protocols/vocab.py
MAX_TERM_CHARS = 200
MAX_DIGEST = 64
MAX_CONTRIBUTORS = 100_000  # agents whose offers a vocabulary merges
MAX_DIGEST_CONTRIBUTORS = 10_000  # ... named in a gossip peer's digest


def _check_vocab(terms: tuple[str, ...], counts: tuple[int, ...], what: str) -> None:
    try:
        check_counts(terms, counts, max_terms=MAX_VOCAB_TERMS)
    except VocabError as exc:
        raise CodecError(f"{what}: {exc}") from None


@dataclass(frozen=True, slots=True)
class VocabOffer(F.WireMessage):
    """Agent → coordinator: the terms of the agent's corpus and how often each occurs.
    Only terms and counts: no document, no order of words, no per-document data."""

    kind: ClassVar[str] = "vocab_offer"
    WIRE: ClassVar[F.Body] = F.Body(
        "vocab_offer",
        F.Field("terms", F.Items(MAX_VOCAB_TERMS)),
        F.Field("counts", F.Items(MAX_VOCAB_TERMS)),
        exact=True,
    )
    terms: tuple[str, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_vocab(self.terms, self.counts, "vocab_offer")


@dataclass(frozen=True, slots=True)
class Vocabulary(F.WireMessage):
    """Coordinator → all: the common vocabulary in index order, with the merged counts
    and the agents whose offers it merges."""

    kind: ClassVar[str] = "vocabulary"
    WIRE: ClassVar[F.Body] = F.Body(
        "vocabulary",
        F.Field("terms", F.Items(MAX_VOCAB_TERMS)),
        F.Field("counts", F.Items(MAX_VOCAB_TERMS)),
        F.Field("contributors", F.NodeIds(MAX_CONTRIBUTORS)),
        F.Field("digest", F.Text(max_len=MAX_DIGEST)),
    )
    terms: tuple[str, ...]
    counts: tuple[int, ...]
    contributors: tuple[str, ...]
    digest: str

    def __post_init__(self) -> None:
        _check_vocab(self.terms, self.counts, "vocabulary")
        if not self.terms:
            raise CodecError("vocabulary: empty")
        if self.digest != vocabulary_digest(self.terms):
            raise CodecError("vocabulary: digest does not match the terms")
        if not all(is_valid_name(c) for c in self.contributors):
            raise CodecError("vocabulary: invalid contributor id")


@dataclass(frozen=True, slots=True)
class VocabDigest(F.WireMessage):
    """Agent → agent (gossip mode, no coordinator): the digest of the vocabulary this
    agent merged and whose offers it merged, so peers can confirm they index the same
    terms the same way before training (see :mod:`fedagent.protocols.gossip_vocab`)."""

    kind: ClassVar[str] = "vocab_digest"
    WIRE: ClassVar[F.Body] = F.Body(
        "vocab_digest",
        F.Field("digest", F.Text(max_len=MAX_DIGEST)),
        F.Field("contributors", F.NodeIds(MAX_DIGEST_CONTRIBUTORS)),
        F.Field("agreed", F.Flag(), default=False),
    )
    digest: str
    contributors: tuple[str, ...]
    agreed: bool = False  # the sender has agreed already (an answer; not to be answered)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not 0 < len(self.digest) <= MAX_DIGEST:
            raise CodecError("vocab_digest: bad digest")
        if not self.contributors or not all(is_valid_name(c) for c in self.contributors):
            raise CodecError("vocab_digest: invalid contributor id")
