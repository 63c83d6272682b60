"""Cross-site semantic search in a running agent (``fedagent search``), both sides.

* **Asking** (the control socket's ``search`` command): the query text is vectorised
  here, with the federation's current global model; the vector (never the text) goes to
  every online peer agent as a signed ``SearchQuery`` on its inbox topic; the pure
  :class:`~fedagent.protocols.search.SearchMachine` collects the answers until all
  peers answered or the deadline passed; this site's own top-k joins the merge. The
  reply names the peers that answered, those that stayed silent and those that refused.
* **Answering**: a ``SearchQuery`` from a peer agent is checked (its space must be this
  site's, its vector of this site's dimension and finite) before any arithmetic, ranked
  against this site's document vectors, and answered with the top-k (document id,
  cosine score).

This federation's sites share one model (SEEC joint learning), so the query vector is
the same for every peer and the space is named by the common vocabulary's digest.
Document vectors are inferred once per global model version and cached.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fedagent.agent.messaging import Incoming
from fedagent.errors import ConfigError, FedagentError
from fedagent.protocols import search as S
from fedagent.protocols import topics
from fedagent.protocols.messages import SearchAnswer, SearchQuery
from fedagent.tasks.base import set_weights

if TYPE_CHECKING:
    from fedagent.agent.daemon import Session

log = logging.getLogger("fedagent.search")

MAX_QUERY_CHARS = 10_000
DEFAULT_TIMEOUT = 5.0


def can_search(task: Any) -> bool:
    return all(callable(getattr(task, m, None)) for m in ("search_ids", "embed_documents", "embed_text"))


class SearchService:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.machine = S.SearchMachine()
        self.waiting: dict[str, asyncio.Future] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = float("inf")
        self._index: tuple[Any, np.ndarray, list[str]] | None = None   # (key, vectors, ids)
        self.answered = 0
        self.refused = 0

    # -- the space and this site's index ---------------------------------------------------------
    @property
    def space(self) -> str:
        digest = self.session.vocab_digest
        return f"joint:{digest[:32]}" if digest else "joint"

    def _model(self):
        """The global model this site holds (the latest broadcast one), or None."""
        s = self.session
        if s.global_weights is None:
            return None
        agent = s.agent
        with agent._thread_lock:
            model = agent.task.build_model()
            set_weights(model, s.global_weights)
        return model

    def _index_now(self) -> tuple[np.ndarray, list[str]]:
        """This site's document vectors under the current global model (worker thread)."""
        s = self.session
        key = (s.global_version, s.vocab_digest)
        if self._index is not None and self._index[0] == key:
            return self._index[1], self._index[2]
        model = self._model()
        if model is None:
            raise S.SearchError("no-model", "this site holds no global model yet")
        with s.agent._thread_lock:
            vectors = np.asarray(s.agent.task.embed_documents(model), dtype=np.float64)
            ids = list(s.agent.task.search_ids())
        self._index = (key, vectors, ids)
        return vectors, ids

    # -- answering ----------------------------------------------------------------------------
    async def on_query(self, inc: Incoming) -> None:
        msg: SearchQuery = inc.message
        s = self.session
        if inc.role != "agent":
            s.messenger._reject("role", inc.sender, f"search query signed by a {inc.role or 'non-agent'}")
            return

        def answer() -> SearchAnswer:
            if not can_search(s.agent.task):
                raise S.SearchError("unsupported", f"task {s.cfg.task} has no document search")
            if msg.space != self.space:
                raise S.SearchError("space", f"query for space {msg.space!r}, this site is in {self.space!r}")
            vectors, ids = self._index_now()
            q = S.check_vector(msg.vector, vectors.shape[1])
            hits = S.top_k(q, vectors, ids, S.check_k(msg.k))
            return SearchAnswer(msg.query_id, tuple(d for d, _ in hits), tuple(sc for _, sc in hits))

        try:
            reply = await asyncio.to_thread(answer)
            self.answered += 1
        except S.SearchError as exc:
            self.refused += 1
            log.warning("search query %s from %s refused: %s", msg.query_id, inc.sender, exc)
            reply = SearchAnswer(msg.query_id, (), (), error=exc.reason)
        await s.messenger.send(topics.direct(s.fed, s.cfg.id, inc.sender, "search_answer"), reply)

    def on_answer(self, inc: Incoming) -> None:
        msg: SearchAnswer = inc.message
        self._apply(self.machine.handle(S.AnswerReceived(msg.query_id, inc.sender,
                                                         tuple(zip(msg.doc_ids, msg.scores)), msg.error),
                                        time.monotonic()))

    # -- asking -------------------------------------------------------------------------------
    async def search(self, args: dict) -> dict[str, Any]:
        s = self.session
        text = args.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_QUERY_CHARS:
            raise ConfigError(f"the query must be a non-empty text of at most {MAX_QUERY_CHARS} characters")
        try:
            k = S.check_k(args.get("k", 10))
            timeout = float(args.get("timeout", DEFAULT_TIMEOUT))
            if not 0 < timeout <= S.MAX_TIMEOUT:
                raise S.SearchError("timeout", f"the timeout must be in (0, {S.MAX_TIMEOUT}] seconds")
        except (S.SearchError, TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if not can_search(s.agent.task):
            raise ConfigError(f"task {s.cfg.task} has no document search")
        started = time.monotonic()

        def local() -> tuple[np.ndarray, list[tuple[str, float]]]:
            model = self._model()
            if model is None:
                raise S.SearchError("no-model", "this agent holds no global model yet")
            with s.agent._thread_lock:
                q = np.asarray(s.agent.task.embed_text(model, text), dtype=np.float32)
            vectors, ids = self._index_now()
            return q, S.top_k(q.astype(np.float64), vectors, ids, k)

        try:
            q, own = await asyncio.to_thread(local)
        except S.SearchError as exc:
            raise FedagentError(str(exc)) from None
        peers = tuple(sorted(p for p, info in s.peers.items()
                             if info.get("role") == "agent" and info.get("online") and p != s.cfg.id))
        qid = secrets.token_hex(8)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting[qid] = fut
        try:
            for cmd in self.machine.handle(S.Start(qid, peers, k, timeout), time.monotonic()):
                if isinstance(cmd, S.SendQuery):
                    await s.messenger.send(topics.direct(s.fed, s.cfg.id, cmd.peer, "search_query"),
                                           SearchQuery(qid, cmd.k, self.space, q))
                else:
                    self._apply([cmd])
            done: S.Completed = await fut
        finally:
            self.waiting.pop(qid, None)
        hits = S.merge([(s.cfg.id, own), *((h.site, [(h.doc_id, h.score)]) for h in done.hits)], k)
        return {"query_id": qid, "k": k, "space": self.space, "model_version": s.global_version,
                "results": [{"site": h.site, "doc_id": h.doc_id, "score": round(h.score, 4)} for h in hits],
                "asked": list(peers), "answered": list(done.answered), "silent": list(done.silent),
                "failed": [{"peer": p, "error": e} for p, e in done.failed], "timed_out": done.timed_out,
                "timeout": timeout, "seconds": round(time.monotonic() - started, 3)}

    def _apply(self, cmds: list[S.SearchCommand]) -> None:
        for cmd in cmds:
            if isinstance(cmd, S.Completed):
                fut = self.waiting.get(cmd.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(cmd)
            elif isinstance(cmd, S.RequestWakeup):
                self._schedule(cmd.at)
            elif isinstance(cmd, S.Ignored):
                log.info("search answer from %s for %s ignored: %s", cmd.sender, cmd.query_id, cmd.reason)

    def _schedule(self, at: float) -> None:
        # One timer for all queries, at the earliest deadline; expiring re-requests the next.
        if self._timer is not None and self._at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._wakeup)

    def _wakeup(self) -> None:
        self._timer = None
        self._at = float("inf")
        self._apply(self.machine.handle(S.Wakeup(), time.monotonic()))

    def status(self) -> dict[str, Any]:
        return {"search_space": self.space, "search_queries_answered": self.answered,
                "search_queries_refused": self.refused, "searches_in_flight": len(self.machine.queries)}
