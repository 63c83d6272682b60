"""Built-in task ``doc2vec``: PV-DBOW paragraph vectors (Le & Mikolov 2014) in torch.

**Why PV-DBOW and not PV-DM.** In a federation the documents stay on their site, so a
document's vector can never be a shared parameter: only the part of the model that every
site uses the same way can be averaged. PV-DBOW trains a document vector to predict the
document's words through one word-prediction head (negative sampling over the output
word vectors, exactly word2vec's output layer). That head is the *whole* shared model
(``out_embed.weight``, V x d), and a document's vector is a function of the head and the
document's words alone: any site can compute it for any text by a few gradient steps
with the head frozen (:meth:`Doc2VecTask.infer_vectors`). So vectors from different
sites are comparable as soon as the head is shared (what SEEC's joint learning needs for
cross-site search), and no per-document state ever crosses the network. PV-DM predicts
a word from the document vector *combined with* the input vectors of its neighbours;
that adds a second shared table and makes every training step depend on both, with no
gain in what can be shared. (SEEC reports "the skip-gram PV-DM algorithm" with gensim;
skip-gram-style document training is PV-DBOW in gensim's terms, ``dm=0``.)

**Model and local state.** The model (what FedAvg averages) is ``out_embed.weight``,
initialised to zeros like word2vec's output layer. The vectors of this site's own
training documents are local state of the task (``doc_vectors``), trained together with
the head in :meth:`fit`/:meth:`fit_steps` and kept across rounds; they never leave the
site. Training pairs are (document, word) for each word of the document kept by
word2vec's subsampling, shuffled per epoch; each gets ``negative`` noise words from the
unigram^0.75 table; the update is the hand-written SGD step of
:func:`fedagent.tasks.word2vec.sgns_update` with the document table as input side.

**Inference** for a document the model has not seen: a fresh vector (uniform in
``±0.5/d``), passes over its words with the head frozen, in steps of 16 of its own pairs,
the step decaying linearly from ``infer_lr`` to ~0 over the document's own passes
(gensim's ``infer_vector`` defaults: 0.025 -> 0.0001). At least ``infer_epochs`` passes,
more for a short text (up to 100 for a query of a few words). The start, the word order
and the noise words come from a generator seeded by the document's own tokens, so the
result does not depend on the other documents inferred with it: a search query equal to
an indexed document's text gets that document's vector.

**Data.** ``corpus = "newsgroups"`` (SEEC's public corpus, the 200-post sample of
alt.atheism and sci.space; a fixed ``holdout`` fraction, default 0.2, is the same test set
on every site), ``corpus = "wiki"`` (the Wikipedia dump; no hold-out by default) or
``corpus = "manpages"`` (the Linux manual pages, :func:`fedagent.tasks.text_data.manpages`).
Splits, vocabulary and options as in :mod:`fedagent.tasks.word2vec`; SEEC's settings are
d = 50, 40 epochs, alpha 0.025 (``dim`` defaults to 50 here).

**Evaluation.** The mean pair loss of inferring the held-out documents (or, without a
hold-out, this site's first 20 documents), and on newsgroups the accuracy of a 5-nearest
-neighbour vote (cosine) of each held-out post's inferred vector among the inferred
vectors of this site's training posts, labelled by their group.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedagent.errors import ConfigError
from fedagent.tasks import text_data as td
from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import Task, file_options
from fedagent.tasks.word2vec import PairStream, Vocabulary, check_options, sgns_update

DEFAULTS: dict[str, Any] = {
    "corpus": "newsgroups",
    "split": "random",
    "shard": None,
    "shards": 1,
    "topics": None,
    "limit": 0,
    "holdout": None,
    "seed": 0,
    "dim": 50,
    "negative": 5,
    "sample": 1e-3,
    "min_count": 2,
    "max_vocab": 0,
    "ns_exponent": 0.75,
    "vocabulary": None,
    "infer_epochs": 20,
    "infer_lr": 0.025,
}
KNN = 5
EVAL_DOCS = 20
INFER_MAX_PASSES = 100  # passes for a very short text (a query of a few words)
INFER_MIN_PAIRS = 1000  # pair updates a document gets at least (below INFER_MAX_PASSES)
INFER_CHUNK = 16  # pairs of one document summed into one step
INFER_BATCH = 8192  # pairs of many documents' chunks per update call


class DocHead(nn.Module):
    """The shared part of PV-DBOW: the output word vectors."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.out_embed = nn.Embedding(vocab_size, dim)


def dbow_pairs(docs: Sequence[np.ndarray], keep: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One shuffled epoch of (document row, word) pairs after subsampling."""
    if not docs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    words = np.concatenate(docs)
    rows = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    mask = rng.random(len(words)) < keep[words]
    rows, words = rows[mask], words[mask]
    order = rng.permutation(len(rows))
    return rows[order], words[order]


def _majority(labels: list[Hashable]) -> Hashable:
    """The most frequent label; a tie goes to the one seen first (the nearest neighbour's)."""
    return max(set(labels), key=lambda lab: (labels.count(lab), -labels.index(lab)))


def _init_vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, dim, generator=g) - 0.5) / dim


def _doc_seed(seed: int, tokens: Sequence[str]) -> int:
    """The generator seed of one document's inference: ``seed`` and its tokens."""
    h = hashlib.blake2b(str(int(seed)).encode() + b"\x00" + "\x1f".join(tokens).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def infer_passes(length: int, epochs: int) -> int:
    """Passes over a document of ``length`` known words: at least ``epochs``, and enough
    for ``INFER_MIN_PAIRS`` pair updates, at most ``INFER_MAX_PASSES``. A query is a few
    words: with the documents' number of passes its vector barely leaves its random start
    and every query lands near the same documents (measured on the Wikipedia articles:
    "atomic number" ranks the article *Atomic number* first with 100 passes, behind
    *Algorithms (journal)* with 3). One rule for documents and queries alike, so equal
    texts get equal vectors."""
    return max(epochs, min(INFER_MAX_PASSES, -(-INFER_MIN_PAIRS // max(length, 1))))


class Doc2VecTask(Task):
    def __init__(self, options: Mapping[str, Any]) -> None:
        o = check_options("doc2vec", options, DEFAULTS)
        self.options = o
        self.seed = int(o["seed"])
        self.dim, self.negative = int(o["dim"]), int(o["negative"])
        self.sample, self.ns_exponent = float(o["sample"]), float(o["ns_exponent"])
        self.infer_epochs, self.infer_lr = int(o["infer_epochs"]), float(o["infer_lr"])
        titles, tokens, labels = self._corpus(o)
        holdout = float(o["holdout"]) if o["holdout"] is not None else (0.2 if o["corpus"] == "newsgroups" else 0.0)
        if not 0.0 <= holdout < 1.0:
            raise ConfigError("doc2vec: holdout must be in [0, 1)")
        order = np.random.default_rng(self.seed).permutation(len(tokens))
        n_test = int(round(holdout * len(tokens)))
        test, train = sorted(order[:n_test].tolist()), sorted(order[n_test:].tolist())
        shards = int(o["shards"])
        shard = None if o["shard"] is None else int(o["shard"])
        if shards > 1:
            split = td.split_articles(
                [tokens[i] for i in train], shards, o["split"], seed=self.seed, topics=o["topics"]
            )
            groups = [[train[j] for j in s] for s in split.shards]
        else:
            groups = [train]
        mine = train if shard is None else groups[shard]
        self.titles = [titles[i] for i in mine]
        self.tokens = [tokens[i] for i in mine]
        self.labels = [labels[i] for i in mine] if labels else None
        self.test_tokens = [tokens[i] for i in test]
        self.test_labels = [labels[i] for i in test] if labels else None
        if o["vocabulary"]:
            vocab = Vocabulary.read(o["vocabulary"])
        else:
            offers = [td.term_counts(tokens[i] for i in g) for g in groups]
            vocab = Vocabulary.from_merge(
                td.merge_term_counts(offers, min_count=int(o["min_count"]), max_size=int(o["max_vocab"]))
            )
        self.set_vocabulary(vocab.terms, vocab.counts.astype(np.int64).tolist())

    @staticmethod
    def _corpus(o: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, ...]], list[str]]:
        if o["corpus"] == "newsgroups":
            posts = td.newsgroups()
            limit = int(o["limit"]) or len(posts)
            posts = posts[:limit]
            return (
                [f"{p.group}: {p.subject}" for p in posts],
                [tuple(td.tokenize(p.text)) for p in posts],
                [p.group for p in posts],
            )
        if o["corpus"] == "wiki":
            arts = td.wiki_articles(limit=int(o["limit"]))
            return [a.title for a in arts], [a.tokens for a in arts], []
        if o["corpus"] == "manpages":
            pages = td.manpages(limit=int(o["limit"]))
            return [a.title for a in pages], [a.tokens for a in pages], []
        raise ConfigError(f"doc2vec: unknown corpus {o['corpus']!r} (available: newsgroups, wiki, manpages)")

    # -- vocabulary consensus -------------------------------------------------------------------
    def term_counts(self) -> dict[str, int]:
        return td.term_counts(self.tokens)

    def set_vocabulary(self, terms: Sequence[str], counts: Sequence[int] | None = None) -> None:
        if counts is None:
            local = self.term_counts()
            counts = [local.get(t, 0) + 1 for t in terms]
        self.vocab = Vocabulary(terms, counts)
        self.encoded = [self.vocab.encode(t) for t in self.tokens]
        self.noise = self.vocab.noise_table(self.ns_exponent)
        self.keep = self.vocab.keep_probabilities(self.sample)
        self.doc_vectors = _init_vectors(len(self.tokens), self.dim, self.seed * 7919 + int(self.options["shard"] or 0))
        self.stream = PairStream(
            lambda rng: dbow_pairs(self.encoded, self.keep, rng),
            seed=self.seed * 7919 + int(self.options["shard"] or 0),
        )

    # -- Task ---------------------------------------------------------------------------------------
    def build_model(self) -> DocHead:
        model = DocHead(len(self.vocab), self.dim)
        with torch.no_grad():
            model.out_embed.weight.zero_()
        return model

    def num_samples(self) -> int:
        return int(sum(len(e) for e in self.encoded))

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        kept = sum(float(self.keep[e].sum()) for e in self.encoded)
        steps = max(1, math.ceil(epochs * kept / batch_size))
        return self.fit_steps(model, steps=steps, lr=lr, batch_size=batch_size, seed=seed)

    def fit_steps(self, model: nn.Module, *, steps: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        assert isinstance(model, DocHead)
        g = torch.Generator().manual_seed(seed)
        head = model.out_embed.weight.data
        total, count = 0.0, 0
        for _ in range(steps):
            rows, words = self.stream.next(batch_size)
            noise = self.noise[torch.randint(len(self.noise), (len(rows), self.negative), generator=g)]
            losses = sgns_update(self.doc_vectors, head, rows, words, noise, lr)
            total += float(losses.sum())
            count += len(rows)
        return {"loss": total / max(count, 1), "pairs": float(count)}

    def infer_vectors(
        self,
        model: nn.Module,
        docs: Sequence[Sequence[str]],
        *,
        epochs: int | None = None,
        lr: float | None = None,
        seed: int = 0,
        chunk: int = INFER_CHUNK,
    ) -> tuple[np.ndarray, float]:
        """Vectors for ``docs`` (token lists) with the head frozen; and the mean pair loss
        of the last pass. Words outside the vocabulary are ignored; a document with none
        keeps its random start.

        Every document is inferred on its own: its start, its word order per pass, its
        noise words and its step schedule come from a generator seeded by ``seed`` and the
        document's own tokens, and it takes steps of ``chunk`` of its own pairs. So a
        document's vector does not depend on which other documents are inferred with it
        or in which order: a query text equal to an indexed document gets that document's
        vector (the documents of one request are still computed together, in lock-step,
        for speed). The number of passes is :func:`infer_passes` of its length."""
        assert isinstance(model, DocHead)
        base = self.infer_epochs if epochs is None else epochs
        lr = self.infer_lr if lr is None else lr
        encoded = [self.vocab.encode(d) for d in docs]
        n = len(docs)
        vectors = torch.empty(n, self.dim)
        rngs = []
        for i, d in enumerate(docs):
            rng = np.random.Generator(np.random.PCG64(_doc_seed(seed, d)))
            vectors[i] = torch.from_numpy(((rng.random(self.dim) - 0.5) / self.dim).astype(np.float32))
            rngs.append(rng)
        lengths = np.array([len(e) for e in encoded], dtype=np.int64)
        passes = np.array([infer_passes(int(m), base) if m else 0 for m in lengths], dtype=np.int64)
        chunks = -(-lengths // chunk)  # ceil
        head = model.out_embed.weight.data
        floor = 1e-4 / 0.025
        loss_sum, loss_pairs = np.zeros(n), np.zeros(n)
        for p in range(int(passes.max(initial=0))):
            active = np.flatnonzero(passes > p)
            # This pass, for every active document: its words in its own order, its noise
            # words, and each pair's step number within the document's schedule.
            words = np.concatenate([encoded[i][rngs[i].permutation(lengths[i])] for i in active])
            noise = np.concatenate(
                [rngs[i].integers(len(self.noise), size=(lengths[i], self.negative)) for i in active]
            )
            rows = np.repeat(active, lengths[active])
            pos = np.concatenate([np.arange(lengths[i]) for i in active]) // chunk
            total = (passes[rows] * chunks[rows]).astype(np.float64)
            step_lr = lr * np.maximum(floor, 1.0 - (p * chunks[rows] + pos) / total)
            last = passes[rows] == p + 1
            order = np.argsort(pos, kind="stable")  # chunk c of every document, then c + 1, ...
            bounds = np.searchsorted(pos[order], np.arange(int(pos.max(initial=-1)) + 2))
            for c in range(len(bounds) - 1):
                idx = order[bounds[c] : bounds[c + 1]]
                for sub in range(0, len(idx), INFER_BATCH):
                    # A chunk never spans two calls: each is at most ``chunk`` pairs of
                    # one document, and a call holds whole chunks of distinct documents.
                    part = idx[sub : sub + INFER_BATCH]
                    r = torch.from_numpy(rows[part])
                    losses = sgns_update(
                        vectors,
                        head,
                        r,
                        torch.from_numpy(words[part]),
                        self.noise[torch.from_numpy(noise[part])],
                        torch.from_numpy(step_lr[part].astype(np.float32)),
                        update_out=False,
                    )
                    done = last[part]
                    if done.any():
                        np.add.at(loss_sum, rows[part][done], losses.numpy()[done])
                        np.add.at(loss_pairs, rows[part][done], 1)
        mean_loss = float(loss_sum.sum() / loss_pairs.sum()) if loss_pairs.sum() else float("nan")
        return vectors.numpy(), mean_loss

    # -- semantic search (SEEC) -------------------------------------------------------------------
    def search_ids(self) -> list[str]:
        """The ids this site answers a search with: its documents' titles (at most 200
        characters, made unique with a counter when two documents share one)."""
        seen: dict[str, int] = {}
        out = []
        for t in self.titles:
            t = " ".join(str(t).split())[:190] or "untitled"
            n = seen.get(t, 0)
            seen[t] = n + 1
            out.append(t if n == 0 else f"{t} #{n + 1}")
        return out

    def embed_documents(self, model: nn.Module) -> np.ndarray:
        """This site's documents as vectors of ``model``'s space (inferred with the head
        frozen, so they are comparable with any other site's vectors of the same model)."""
        vectors, _ = self.infer_vectors(model, self.tokens, seed=self.seed + 3)
        return vectors

    def embed_text(self, model: nn.Module, text: str) -> np.ndarray:
        """A query text as one vector of ``model``'s space: tokenised like the corpus and
        inferred exactly as :meth:`embed_documents` infers an indexed document (same seed,
        same passes rule), so a document's own text finds its indexed vector."""
        vectors, _ = self.infer_vectors(model, [td.tokenize(text)], seed=self.seed + 3)
        return vectors[0]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        queries = self.test_tokens or self.tokens[:EVAL_DOCS]
        q, loss = self.infer_vectors(model, queries, seed=self.seed + 1)
        out = {"infer_loss": loss}
        if self.test_labels and self.labels:
            base, _ = self.infer_vectors(model, self.tokens, seed=self.seed + 2)
            nn_idx = tm.nearest(base, [], min(KNN, len(base)), query_vectors=q)
            votes = [[self.labels[j] for j in row] for row in nn_idx]
            predicted = [_majority(v) for v in votes]
            out["knn_accuracy"] = float(np.mean([p == t for p, t in zip(predicted, self.test_labels)]))
        return out


@file_options("vocabulary")
def make(options: dict[str, Any]) -> Doc2VecTask:
    """Options (all optional): ``corpus`` (newsgroups, wiki, manpages), ``split``, ``shard``,
    ``shards``, ``topics``, ``limit``, ``holdout``, ``seed``, ``dim``, ``negative``,
    ``sample``, ``min_count``, ``max_vocab``, ``ns_exponent``, ``vocabulary``,
    ``infer_epochs``, ``infer_lr``."""
    return Doc2VecTask(options)
