"""The agreed vocabulary on disk, as the coordinators' vocabulary stage and the gossip
agents' consensus write and read it back after a restart."""

from __future__ import annotations

import json

import pytest

from fedagent.protocols.vocab import vocabulary_digest
from fedagent.storage import vocabfile

TERMS = ("apple", "pear", "plum")


def test_saved_vocabulary_reads_back(tmp_path):
    path = tmp_path / "vocabulary.json"
    assert vocabfile.load(path) is None
    vocabfile.save(path, TERMS, (5, 3, 2), ("a1", "a2"), vocabulary_digest(TERMS))
    saved = vocabfile.load(path)
    assert saved == vocabfile.AgreedVocabulary(TERMS, (5, 3, 2), ("a1", "a2"), vocabulary_digest(TERMS))
    assert vocabfile.history_record(TERMS, ("a1", "a2"), 4, saved.digest) == {
        "event": "vocabulary",
        "terms": 3,
        "contributors": ["a1", "a2"],
        "dropped_terms": 4,
        "digest": saved.digest,
    }


@pytest.mark.parametrize(
    "doc",
    [
        {"terms": ["pear", "apple", "plum"], "counts": [5, 3, 2], "contributors": ["a1"]},  # reordered terms
        {"terms": list(TERMS), "counts": [5, 3], "contributors": ["a1"]},
        {"terms": [], "counts": [], "contributors": ["a1"]},
        {"terms": list(TERMS), "counts": [5, 3, "2"], "contributors": ["a1"]},
        {"terms": list(TERMS), "counts": [5, 3, 2]},
    ],
)
def test_a_vocabulary_file_that_does_not_hold_together_is_refused(tmp_path, doc):
    path = tmp_path / "vocabulary.json"
    path.write_text(json.dumps({"digest": vocabulary_digest(TERMS), **doc}))
    with pytest.raises(ValueError):
        vocabfile.load(path)


def test_a_torn_vocabulary_file_is_refused(tmp_path):
    path = tmp_path / "vocabulary.json"
    path.write_text('{"terms": ["apple"')
    with pytest.raises(ValueError, match="not a vocabulary document"):
        vocabfile.load(path)
