"""The agreed vocabulary on disk: ``vocabulary.json`` in a federation's state directory.

A coordinator's vocabulary stage (FedAvg and Sync-Opt) and a gossip agent's consensus
write the same document once the terms are agreed, and read it back after a restart
instead of agreeing again: terms in index order, the merged counts, the contributors and
the digest, which is checked against the terms (a file edited by hand or half restored
must not make a node index terms differently from its peers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent.protocols.vocab import vocabulary_digest
from fedagent.storage.statefile import atomic_write, read_bytes

MAX_VOCAB_FILE = 64 * 2**20


@dataclass(frozen=True, slots=True)
class AgreedVocabulary:
    terms: tuple[str, ...]
    counts: tuple[int, ...]
    contributors: tuple[str, ...]
    digest: str


def save(path: Path, terms: Sequence[str], counts: Sequence[int], contributors: Sequence[str], digest: str) -> None:
    doc = {"terms": list(terms), "counts": list(counts), "contributors": list(contributors), "digest": digest}
    atomic_write(path, json.dumps(doc).encode())


def load(path: Path) -> AgreedVocabulary | None:
    """The vocabulary saved at ``path``, None when there is none; ValueError saying what
    is wrong with a file that cannot be used."""
    raw = read_bytes(path, MAX_VOCAB_FILE)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        saved = AgreedVocabulary(tuple(doc["terms"]), tuple(doc["counts"]), tuple(doc["contributors"]), doc["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a vocabulary document: {exc}") from None
    if not (
        all(isinstance(t, str) for t in (*saved.terms, *saved.contributors, saved.digest))
        and all(type(c) is int for c in saved.counts)
    ):
        raise ValueError("terms, contributors and digest must be strings, counts integers")
    if not saved.terms or len(saved.terms) != len(saved.counts) or saved.digest != vocabulary_digest(saved.terms):
        raise ValueError("digest or counts do not match the terms")
    return saved


def history_record(
    terms: Sequence[str], contributors: Sequence[str], dropped_terms: int, digest: str
) -> dict[str, Any]:
    """The history line of an agreement."""
    return {
        "event": "vocabulary",
        "terms": len(terms),
        "contributors": list(contributors),
        "dropped_terms": dropped_terms,
        "digest": digest,
    }
