"""The agent's half of the vocabulary consensus, for FedAvg sessions (SEEC Algorithm 1:
"Send U_i to server; receive m_1"). The messages and the coordinator's merge are the
ones the Sync-Opt federation uses (``VocabOffer``, ``Vocabulary``,
:mod:`fedagent.protocols.vocab`).
"""

from __future__ import annotations

from typing import Any

from fedagent.protocols.messages import VocabOffer


def needs_vocabulary(task: Any) -> bool:
    return callable(getattr(task, "term_counts", None)) and callable(getattr(task, "set_vocabulary", None))


def make_offer(task: Any) -> VocabOffer:
    """The task's terms with their counts (worker thread: counting walks the corpus)."""
    # Plain str/int (tasks may hand numpy scalars); ordered by term, so the offer's order
    # reveals nothing about the documents.
    counts = {str(t): int(c) for t, c in task.term_counts().items()}
    terms = tuple(sorted(counts))
    return VocabOffer(terms, tuple(counts[t] for t in terms))
