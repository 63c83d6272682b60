"""The vocabulary stage of a coordinator (SEEC Algorithm 1's and gFedNTM's first step).

A coordinator whose task needs a vocabulary (``term_counts`` and ``set_vocabulary``:
doc2vec, word2vec, the topic models) cannot build its model before the agents agreed on
the terms. This stage, used by the FedAvg and the Sync-Opt coordinator alike, wraps the
pure :class:`~fedagent.protocols.vocab.VocabularyMerge` (``VocabOffer`` in,
``Vocabulary`` out, retained when it fits in one message) and keeps the agreement in
the state directory (:mod:`fedagent.storage.vocabfile`), so a restarted coordinator
resumes with the agreed vocabulary instead of asking again. The mode's own machine is
only created once the vocabulary is agreed; it never sees the stage.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fedagent import config
from fedagent.errors import CodecError, ConfigError, FedagentError
from fedagent.protocols import topics
from fedagent.protocols import vocab as V
from fedagent.protocols.messages import Vocabulary
from fedagent.storage import vocabfile

log = logging.getLogger("fedagent.coordinator.vocab")


async def publish_vocabulary(messenger, federation: str, vocabulary: Vocabulary) -> None:
    """Broadcast the agreed vocabulary, retained when it fits in one frame."""
    topic = topics.broadcast(federation, "vocabulary")
    try:
        await messenger.send(topic, vocabulary, retain=True)
    except ValueError:
        # Larger than one chunk: it cannot be retained; an agent that restarts later
        # offers again and is answered with the vocabulary.
        await messenger.send(topic, vocabulary)


def has_vocabulary(task: Any) -> bool:
    return callable(getattr(task, "term_counts", None)) and callable(getattr(task, "set_vocabulary", None))


def load_vocabulary(path: Path) -> Vocabulary | None:
    try:
        saved = vocabfile.load(path)
        if saved is None:
            return None
        return Vocabulary(saved.terms, saved.counts, saved.contributors, saved.digest)
    except (ValueError, CodecError) as exc:
        raise FedagentError(f"{path} is unreadable ({exc}); move it away to start afresh") from exc


def vocab_config(settings: config.RoundsConfig | config.SyncOptSettings, where: str) -> V.VocabConfig:
    """The merge machine's configuration: FedAvg's ``[rounds]`` (the rounds' quorum,
    ``vocab_timeout``, ``vocab_min_count``, ``vocab_max_size``) or Sync-Opt's
    ``[syncopt]``, as their declarations map them (:func:`fedagent.config.vocab_config`)."""
    try:
        return config.vocab_config(settings)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


class VocabStage:
    """Collects offers until the merge machine agrees, persists and publishes the result.

    ``handle`` returns the agreed :class:`Vocabulary` once (then the caller builds its
    model); before that, and for every later offer, it returns None."""

    def __init__(
        self,
        path: Path,
        config: V.VocabConfig,
        messenger: Any,
        federation: str,
        timer: Any,
        history: Any,
        on_reject: Any,
    ) -> None:
        self.path = path
        self.messenger = messenger
        self.fed = federation
        self.timer = timer
        self.history = history
        self.on_reject = on_reject
        self.vocabulary = load_vocabulary(path)
        self.machine = None if self.vocabulary is not None else V.VocabularyMerge(config)
        if self.vocabulary is not None:
            log.info("resuming with the agreed vocabulary of %d terms from %s", len(self.vocabulary.terms), path)

    @property
    def agreed(self) -> bool:
        return self.vocabulary is not None

    @property
    def resumed(self) -> bool:
        """Agreed before this process started (read back from the state directory)."""
        return self.machine is None

    def start(self, now: float) -> None:
        if self.machine is not None:
            for cmd in self.machine.start(now):
                if isinstance(cmd, V.RequestWakeup):
                    self.timer.request(cmd.at)

    async def publish(self) -> None:
        assert self.vocabulary is not None
        await publish_vocabulary(self.messenger, self.fed, self.vocabulary)

    async def offer(
        self, sender: str, terms: tuple[str, ...], counts: tuple[int, ...], now: float
    ) -> Vocabulary | None:
        if self.vocabulary is not None:
            log.info("%s offered its vocabulary again; re-sending the agreed one", sender)
            await self.publish()
            return None
        return await self._run(V.OfferReceived(sender, terms, counts), now)

    async def wakeup(self, now: float) -> Vocabulary | None:
        if self.machine is None or self.vocabulary is not None:
            return None
        return await self._run(V.Wakeup(), now)

    async def _run(self, ev: V.VocabEvent, now: float) -> Vocabulary | None:
        assert self.machine is not None
        agreed: Vocabulary | None = None
        for cmd in self.machine.handle(ev, now):
            if isinstance(cmd, V.RequestWakeup):
                self.timer.request(cmd.at)
            elif isinstance(cmd, V.OfferRejected):
                self.on_reject(cmd.sender, cmd.reason, cmd.detail)
            elif isinstance(cmd, V.Agreed):
                agreed = await self._agreed(cmd)
        return agreed

    async def _agreed(self, cmd: V.Agreed) -> Vocabulary:
        self.vocabulary = Vocabulary(cmd.terms, cmd.counts, cmd.contributors, cmd.digest)
        await asyncio.to_thread(vocabfile.save, self.path, cmd.terms, cmd.counts, cmd.contributors, cmd.digest)
        self.history.append(vocabfile.history_record(cmd.terms, cmd.contributors, cmd.dropped_terms, cmd.digest))
        log.info(
            "vocabulary agreed: %d terms from %s (%d cut by min_count/max_size)",
            len(cmd.terms),
            ", ".join(cmd.contributors),
            cmd.dropped_terms,
        )
        await self.publish()
        return self.vocabulary

    def status(self) -> dict[str, Any]:
        offers = self.machine.status()["offers"] if self.machine is not None else []
        return {
            "vocabulary_size": len(self.vocabulary.terms) if self.vocabulary is not None else None,
            "vocab_digest": self.vocabulary.digest if self.vocabulary is not None else None,
            "vocabulary_offers": offers,
        }
