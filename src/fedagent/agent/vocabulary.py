"""The agent's half of the vocabulary consensus, for FedAvg sessions (SEEC Algorithm 1:
"Send U_i to server; receive m_1"). The messages and the coordinator's merge are the
ones the Sync-Opt federation uses (``VocabOffer``, ``Vocabulary``,
:mod:`fedagent.protocols.vocab`).

A task has a vocabulary when it has ``term_counts`` and ``set_vocabulary``
(:class:`VocabularyTask`); :func:`vocabulary_task` gives that view of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

from fedagent.errors import ConfigError
from fedagent.protocols.messages import VocabOffer


class VocabularyTask(Protocol):
    """What a task with a vocabulary has (some ``set_vocabulary`` also take the counts)."""

    def term_counts(self) -> Mapping[str, int]: ...

    def set_vocabulary(self, terms: list[str], *args: Any) -> None: ...


def needs_vocabulary(task: Any) -> bool:
    return callable(getattr(task, "term_counts", None)) and callable(getattr(task, "set_vocabulary", None))


def vocabulary_task(task: Any) -> VocabularyTask:
    """``task`` as a task with a vocabulary (checked)."""
    if not needs_vocabulary(task):
        raise ConfigError(f"task {type(task).__name__} has no vocabulary (term_counts/set_vocabulary)")
    return cast(VocabularyTask, task)


def make_offer(task: Any) -> VocabOffer:
    """The task's terms with their counts (worker thread: counting walks the corpus)."""
    # Plain str/int (tasks may hand numpy scalars); ordered by term, so the offer's order
    # reveals nothing about the documents.
    counts = {str(t): int(c) for t, c in task.term_counts().items()}
    terms = tuple(sorted(counts))
    return VocabOffer(terms, tuple(counts[t] for t in terms))
