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

With ``[search] space = "joint"`` the sites share one model (SEEC joint learning), so
the query vector is the same for every peer and the space is named by the common
vocabulary's digest. Document vectors are inferred once per global model version and
cached.

With ``space = "mapped"`` (SEEC Algorithm 2) every site trains its own model on its own
documents, with its own vocabulary, once, when a search first needs it; its space is
named by a digest of that model. Before a search the asker asks every online peer for
its vectors of the public corpus (the first ``public_docs`` documents of ``public_corpus``:
the 20-newsgroups sample or the FreeBSD manual pages, which every site has offline), naming the peer space it holds a mapper for; a
peer answers with its vectors (or with its space alone when the mapper is current).
The asker trains a mapper from its own public vectors to each peer's (cached per peer
space), maps the query vector into each peer's space and sends that. Only vectors of
public documents and mapped query vectors cross the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast

import numpy as np
import torch

from fedagent.agent.core import Service, ServiceSpec, Session
from fedagent.agent.vocabulary import needs_vocabulary, vocabulary_task
from fedagent.errors import ConfigError, FedagentError
from fedagent.node.messaging import Incoming
from fedagent.protocols import search as S
from fedagent.protocols import topics
from fedagent.protocols.messages import PublicVectors, PublicVectorsRequest, SearchAnswer, SearchQuery
from fedagent.protocols.ratelimit import RateLimiter
from fedagent.storage import checkpoint
from fedagent.tasks import seec
from fedagent.tasks.base import get_weights, set_weights

log = logging.getLogger("fedagent.search")

MAX_QUERY_CHARS = 200_000  # a whole document may be the query; only its vector leaves the agent
RATE_LIMITED = "rate"
OWN_MODEL_FILE = "search-own-model.ckpt"
PUBLIC_VECTORS = "__public_vectors__"
DEFAULT_TIMEOUT = 5.0


class SearchTask(Protocol):
    """What a task with document search has (``infer_vectors``: mapped spaces only)."""

    def search_ids(self) -> Sequence[str]: ...

    def embed_documents(self, model: torch.nn.Module) -> Any: ...

    def embed_text(self, model: torch.nn.Module, text: str) -> Any: ...

    def infer_vectors(self, model: torch.nn.Module, docs: list[list[str]], *, seed: int) -> Any: ...


def can_search(task: Any) -> bool:
    return all(callable(getattr(task, m, None)) for m in ("search_ids", "embed_documents", "embed_text"))


def search_task(task: Any) -> SearchTask:
    """``task`` as a task with document search (callers check :func:`can_search` first)."""
    return cast(SearchTask, task)


class SearchService(Service):
    """The search service of one session (hosted by the FedAvg mode: it needs the
    federation's joint model, or with ``space = "mapped"`` trains its own)."""

    message_types: ClassVar[tuple[type, ...]] = (SearchQuery, SearchAnswer, PublicVectorsRequest, PublicVectors)

    def __init__(self, session: Session) -> None:
        self.session = session
        self.machine = S.SearchMachine()
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = float("inf")
        self._index: tuple[Any, np.ndarray, list[str]] | None = None  # (key, vectors, ids)
        self.answered = 0
        self.refused = 0
        self.settings = session.cfg.search
        self.mapped = self.settings.space == "mapped"
        # mapped: this site's own model, trained once: (space, model, public vectors)
        self._own: tuple[str, Any, np.ndarray] | None = None
        self._own_lock = threading.Lock()
        self._public: tuple[str, list[list[str]]] | None = None
        self.exchange = S.ExchangeMachine(self.settings.public_docs) if self.mapped else None
        self._received: dict[tuple[str, str], np.ndarray] = {}  # (request id, peer) -> public vectors
        self.mappers: dict[str, tuple[str, str, Any]] = {}  # peer -> (own space, peer space, mapper)
        self.vectors_sent = 0
        self.vectors_received = 0
        self.mappers_trained = 0
        self.own_model_source = ""  # mapped: "trained" or "restored" (from the state directory)
        self.limiter = RateLimiter(self.settings.requests_per_minute / 60.0, self.settings.request_burst)
        self._limited: set[str] = set()  # peers refused since their last allowed request

    # -- the space and this site's index ---------------------------------------------------------
    @property
    def space(self) -> str:
        if self.mapped:
            return self._own[0] if self._own is not None else "mapped"
        digest = self.session.vocab_digest
        return f"joint:{digest[:32]}" if digest else "joint"

    def public_corpus(self) -> tuple[str, list[list[str]]]:
        """(digest, token lists) of the public documents every site vectorises."""
        if self._public is None:
            from fedagent.errors import ConfigError
            from fedagent.tasks import text_data as td

            try:
                self._public = td.public_corpus(self.settings.public_corpus, self.settings.public_docs)
            except ConfigError as exc:
                raise S.SearchError("public", str(exc)) from None
        return self._public

    def own_model(self) -> tuple[str, Any, np.ndarray]:
        """mapped: this site's own model, trained on its own documents with its own
        vocabulary (worker thread; the first call trains it)."""
        with self._own_lock:
            if self._own is not None:
                return self._own
            from fedagent.tasks import text_data as td

            st, agent = self.settings, self.session.agent
            task = agent.task
            _, public = self.public_corpus()
            with agent.thread_lock:
                if needs_vocabulary(task):
                    # Its own documents' terms only: no vocabulary consensus in a mapped federation.
                    o = getattr(task, "options", {})
                    vocab = vocabulary_task(task)
                    merged = td.merge_term_counts(
                        [vocab.term_counts()], min_count=int(o.get("min_count", 1)), max_size=int(o.get("max_vocab", 0))
                    )
                    vocab.set_vocabulary([t for t, _ in merged], [c for _, c in merged])
                key = self._own_key(task)
                model = task.build_model()
                pub = self._restore_own(model, key)
                if pub is None:
                    model = seec.train_own_model(
                        task, epochs=st.local_epochs, lr=st.lr, batch_size=st.batch_size, seed=st.seed
                    )
                    pub = seec.public_vectors(task, model, public, st.seed)
            head = b"".join(np.ascontiguousarray(t.detach().numpy()).tobytes() for t in model.state_dict().values())
            space = "mapped:" + hashlib.sha256(head).hexdigest()[:32]
            if self.own_model_source == "":
                self.own_model_source = "trained"
                self._save_own(model, pub, key, space)
            self._own = (space, model, pub)
            log.info("search: own model %s (%d epochs), space %s", self.own_model_source, st.local_epochs, space)
            return self._own

    # -- the own model across restarts ----------------------------------------------------------
    def _own_key(self, task: Any) -> str:
        """What the own model is a function of: the site's documents (or, for a task that
        does not expose them, its vocabulary counts), its vocabulary, the training
        settings, the public corpus, the task. A restored model must match all of it."""
        st = self.settings
        h = hashlib.sha256(
            json.dumps(
                [
                    self.session.cfg.task,
                    st.local_epochs,
                    st.lr,
                    "cosine",
                    "per-document inference",  # public vectors from before it are not reused
                    st.batch_size,
                    st.seed,
                    self.public_corpus()[0],
                    getattr(task, "options", {}),
                ],
                sort_keys=True,
                default=str,
            ).encode()
        )
        docs = getattr(task, "tokens", None)
        if isinstance(docs, list):
            for doc in docs:
                h.update(" ".join(doc).encode() + b"\x00")
        counts = task.term_counts() if callable(getattr(task, "term_counts", None)) else {}
        h.update(json.dumps(sorted(counts.items())).encode())
        return h.hexdigest()

    @property
    def _own_path(self) -> Path:
        return self.session.dir / OWN_MODEL_FILE

    def _restore_own(self, model: torch.nn.Module, key: str) -> np.ndarray | None:
        """The public vectors of a model saved for ``key`` (loaded into ``model``), or None."""
        try:
            saved = checkpoint.load(self._own_path, max_bytes=2**31)
        except FedagentError as exc:
            log.warning("search: %s; training the own model again", exc)
            return None
        if saved is None:
            return None
        weights, meta = saved
        pub = weights.pop(PUBLIC_VECTORS, None)
        if meta.get("key") != key:
            log.info("search: the saved own model is for other documents or settings; training it again")
            return None
        try:
            if pub is None or pub.dtype != np.float32 or pub.ndim != 2 or pub.shape[0] != self.settings.public_docs:
                raise ValueError("public vectors missing or of the wrong shape")
            set_weights(model, weights)
        except (ValueError, RuntimeError) as exc:
            log.warning("search: the saved own model does not fit (%s); training it again", exc)
            return None
        self.own_model_source = "restored"
        return pub

    def _save_own(self, model: torch.nn.Module, pub: np.ndarray, key: str, space: str) -> None:
        try:
            checkpoint.save(self._own_path, {**get_weights(model), PUBLIC_VECTORS: pub}, {"key": key, "space": space})
        except (FedagentError, OSError, ValueError) as exc:
            # Only a cost: the next start trains it again.
            log.warning("search: cannot save the own model: %s", exc)

    def _model(self) -> torch.nn.Module | None:
        """The global model this site holds (the latest broadcast one), or None."""
        s = self.session
        if s.global_weights is None:
            return None
        agent = s.agent
        with agent.thread_lock:
            model = agent.task.build_model()
            set_weights(model, s.global_weights)
        return model

    def _index_now(self) -> tuple[np.ndarray, list[str]]:
        """This site's document vectors under the current global model (worker thread)."""
        s = self.session
        key = (self.own_model()[0],) if self.mapped else (s.global_version, s.vocab_digest)
        if self._index is not None and self._index[0] == key:
            return self._index[1], self._index[2]
        model = self.own_model()[1] if self.mapped else self._model()
        if model is None:
            raise S.SearchError("no-model", "this site holds no global model yet")
        with s.agent.thread_lock:
            task = search_task(s.agent.task)
            vectors = np.asarray(task.embed_documents(model), dtype=np.float64)
            ids = list(task.search_ids())
        self._index = (key, vectors, ids)
        return vectors, ids

    # -- the service's hooks --------------------------------------------------------------------
    def on_message(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, SearchQuery):
            self.session.agent.spawn(self.on_query(inc, msg))
        elif isinstance(msg, SearchAnswer):
            self.on_answer(inc, msg)
        elif isinstance(msg, PublicVectorsRequest):
            self.session.agent.spawn(self.on_vectors_request(inc, msg))
        elif isinstance(msg, PublicVectors):
            self.on_vectors(inc, msg)

    async def command(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self.search(args)

    # -- answering ----------------------------------------------------------------------------
    async def on_query(self, inc: Incoming, msg: SearchQuery) -> None:
        s = self.session
        if not await self._admit(
            inc, "search query", "search_answer", SearchAnswer(msg.query_id, (), (), error=RATE_LIMITED)
        ):
            return

        def answer() -> SearchAnswer:
            if not can_search(s.agent.task):
                raise S.SearchError("unsupported", f"task {s.cfg.task} has no document search")
            if self.mapped:
                self.own_model()
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

    async def _admit(self, inc: Incoming, what: str, answer_kind: str, refusal: Any) -> bool:
        """Only agents may ask, each within its request budget; a request over the budget
        is answered with ``refusal`` (on ``answer_kind``) so the asker stops waiting."""
        s = self.session
        if inc.role != "agent":
            s.messenger.reject("role", inc.sender, f"{what} signed by a {inc.role or 'non-agent'}")
            return False
        if not self._allow(inc.sender, what):
            await s.messenger.send(topics.direct(s.fed, s.cfg.id, inc.sender, answer_kind), refusal)
            return False
        return True

    def _allow(self, peer: str, what: str) -> bool:
        """The peer's token bucket (``[search] requests_per_minute``, ``request_burst``).
        A refused request still gets an answer (error ``rate``) so the asker stops waiting;
        the log names a peer once per run of refusals, not once per request of a flood."""
        now = time.monotonic()
        if self.limiter.allow(peer, now):
            self._limited.discard(peer)
            return True
        self.session.messenger.count_rejected("rate")
        if peer not in self._limited:
            self._limited.add(peer)
            log.warning(
                "%s from %s refused: more than %g a minute (burst %d); next in %.1f s",
                what,
                peer,
                self.settings.requests_per_minute,
                self.settings.request_burst,
                self.limiter.retry_after(peer, now),
            )
        return False

    def on_answer(self, inc: Incoming, msg: SearchAnswer) -> None:
        self._apply(
            self.machine.handle(
                S.AnswerReceived(msg.query_id, inc.sender, tuple(zip(msg.doc_ids, msg.scores)), msg.error),
                time.monotonic(),
            )
        )

    async def on_vectors_request(self, inc: Incoming, msg: PublicVectorsRequest) -> None:
        s = self.session
        if not await self._admit(
            inc,
            "public-vector request",
            "public_vectors",
            PublicVectors(msg.request_id, self.space, error=RATE_LIMITED),
        ):
            return

        def answer() -> PublicVectors:
            if not self.mapped:
                raise S.SearchError("space", "this site is in a joint-learning federation (no mapping)")
            if not can_search(s.agent.task):
                raise S.SearchError("unsupported", f"task {s.cfg.task} has no document search")
            if msg.public != self.public_corpus()[0]:
                raise S.SearchError("public", "another public corpus than this site's")
            space, _, pub = self.own_model()
            if msg.have_space == space:
                return PublicVectors(msg.request_id, space)
            return PublicVectors(msg.request_id, space, pub)

        try:
            reply = await asyncio.to_thread(answer)
            self.vectors_sent += reply.vectors is not None
        except S.SearchError as exc:
            log.warning("public-vector request %s from %s refused: %s", msg.request_id, inc.sender, exc)
            reply = PublicVectors(msg.request_id, self.space, error=exc.reason)
        await s.messenger.send(topics.direct(s.fed, s.cfg.id, inc.sender, "public_vectors"), reply)

    def on_vectors(self, inc: Incoming, msg: PublicVectors) -> None:
        if self.exchange is None:
            return
        x = self.exchange.pending.get(msg.request_id)
        rows = 0 if msg.vectors is None else msg.vectors.shape[0]
        if x is not None and inc.sender in x.have and msg.vectors is not None and not msg.error:
            self._received.setdefault((msg.request_id, inc.sender), msg.vectors)
        self._apply(
            self.exchange.handle(
                S.VectorsReceived(msg.request_id, inc.sender, msg.space, rows, msg.error), time.monotonic()
            )
        )

    async def _exchange(
        self, peers: tuple[str, ...], own_space: str, own_public: np.ndarray, timeout: float
    ) -> tuple[S.Exchanged, dict[str, tuple[str, Any, str]]]:
        """Public vectors from the peers, then a mapper per answering peer (trained or
        cached): (the exchange's outcome, peer -> (peer space, mapper, "trained"|"cached"))."""
        s = self.session
        assert self.exchange is not None
        public_digest = self.public_corpus()[0]
        have = tuple((p, m[1] if (m := self.mappers.get(p)) and m[0] == own_space else "") for p in peers)
        rid = secrets.token_hex(8)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        try:
            for cmd in self.exchange.handle(S.ExchangeStart(rid, have, timeout), time.monotonic()):
                if isinstance(cmd, S.SendVectorsRequest):
                    await s.messenger.send(
                        topics.direct(s.fed, s.cfg.id, cmd.peer, "public_vectors_request"),
                        PublicVectorsRequest(rid, public_digest, cmd.have_space),
                    )
                else:
                    self._apply([cmd])
            done: S.Exchanged = await fut
        finally:
            self.waiting.pop(rid, None)
            received = {p: v for (r, p), v in list(self._received.items()) if r == rid}
            for p in received:
                self._received.pop((rid, p), None)
        st = self.settings
        out: dict[str, tuple[str, Any, str]] = {p: (sp, self.mappers[p][2], "cached") for p, sp in done.current}
        for peer, space in done.train:
            target = received.get(peer)
            if target is None:
                continue
            self.vectors_received += 1

            def fit(target: np.ndarray = target) -> Any:
                return seec.train_mapper(
                    own_public, target, hidden=st.mapper_hidden, lr=st.mapper_lr, epochs=st.mapper_epochs, seed=st.seed
                )

            mapper = await asyncio.to_thread(fit)
            self.mappers[peer] = (own_space, space, mapper)
            self.mappers_trained += 1
            out[peer] = (space, mapper, "trained")
        return done, out

    # -- asking -------------------------------------------------------------------------------
    async def search(self, args: dict[str, Any]) -> dict[str, Any]:
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
            model = self.own_model()[1] if self.mapped else self._model()
            if model is None:
                raise S.SearchError("no-model", "this agent holds no global model yet")
            with s.agent.thread_lock:
                q = np.asarray(search_task(s.agent.task).embed_text(model, text), dtype=np.float32)
            vectors, ids = self._index_now()
            return q, S.top_k(q.astype(np.float64), vectors, ids, k)

        try:
            q, own = await asyncio.to_thread(local)
        except S.SearchError as exc:
            raise FedagentError(str(exc)) from None
        peers = tuple(
            sorted(
                p for p, info in s.peers.items() if info.get("role") == "agent" and info.get("online") and p != s.cfg.id
            )
        )
        # peer -> (the space its query is for, the vector sent there)
        sends: dict[str, tuple[str, np.ndarray]] = {p: (self.space, q) for p in peers}
        mapped: list[dict[str, Any]] = []
        pre_silent: tuple[str, ...] = ()
        pre_failed: tuple[tuple[str, str], ...] = ()
        if self.mapped:
            own_space, _, own_public = await asyncio.to_thread(self.own_model)
            ex, mappers = await self._exchange(peers, own_space, own_public, timeout)
            pre_silent, pre_failed = ex.silent, ex.failed
            from fedagent.tasks.seec import map_vectors

            sends = {}
            for p, (space, mapper, how) in sorted(mappers.items()):
                sends[p] = (space, np.asarray(map_vectors(mapper, q[None, :])[0], dtype=np.float32))
                mapped.append({"peer": p, "space": space, "dim": int(sends[p][1].shape[0]), "mapper": how})
        qid = secrets.token_hex(8)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting[qid] = fut
        left = max(0.5, timeout - (time.monotonic() - started)) if self.mapped else timeout
        try:
            for cmd in self.machine.handle(
                S.Start(qid, tuple(sorted(sends)), k, min(left, S.MAX_TIMEOUT)), time.monotonic()
            ):
                if isinstance(cmd, S.SendQuery):
                    space, vec = sends[cmd.peer]
                    await s.messenger.send(
                        topics.direct(s.fed, s.cfg.id, cmd.peer, "search_query"), SearchQuery(qid, cmd.k, space, vec)
                    )
                else:
                    self._apply([cmd])
            done: S.Completed = await fut
        finally:
            self.waiting.pop(qid, None)
        hits = S.merge([(s.cfg.id, own), *((h.site, [(h.doc_id, h.score)]) for h in done.hits)], k)
        out = {
            "query_id": qid,
            "k": k,
            "space": self.space,
            "model_version": s.global_version,
            "results": [{"site": h.site, "doc_id": h.doc_id, "score": round(h.score, 4)} for h in hits],
            "asked": list(peers),
            "answered": list(done.answered),
            "silent": sorted({*pre_silent, *done.silent}),
            "failed": [{"peer": p, "error": e} for p, e in (*pre_failed, *done.failed)],
            "timed_out": done.timed_out or bool(pre_silent),
            "timeout": timeout,
            "seconds": round(time.monotonic() - started, 3),
        }
        if self.mapped:
            out["mode"] = "mapped"
            out["mapped"] = mapped
        return out

    def _apply(self, cmds: Sequence[S.SearchCommand | S.ExchangeCommand]) -> None:
        for cmd in cmds:
            if isinstance(cmd, S.Exchanged):
                fut = self.waiting.get(cmd.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(cmd)
            elif isinstance(cmd, S.Completed):
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
        if self.exchange is not None:
            self._apply(self.exchange.handle(S.Wakeup(), time.monotonic()))

    def status(self) -> dict[str, Any]:
        out = {
            "search_space": self.space,
            "search_queries_answered": self.answered,
            "search_queries_refused": self.refused,
            "searches_in_flight": len(self.machine.queries),
            "search_requests_rate_limited": self.limiter.refused,
        }
        if self.mapped:
            out.update(
                search_mode="mapped",
                search_own_model=self.own_model_source or None,
                public_vectors_sent=self.vectors_sent,
                public_vectors_received=self.vectors_received,
                mappers_trained=self.mappers_trained,
                mappers={p: m[1] for p, m in sorted(self.mappers.items())},
            )
        return out


SEARCH = ServiceSpec(
    "search",
    SearchService,
    "agent {id} is in no FedAvg federation: search needs a joint model (mode fedavg) and a running session",
)
