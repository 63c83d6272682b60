"""Built-in task ``word2vec``: skip-gram with negative sampling (SGNS) in torch.

The model is two plain embedding tables over one common vocabulary, nothing else:

* ``in_embed.weight`` (V x d): the word vectors that are evaluated ("input" vectors,
  the thesis's lookup table M_2 in its Sec. 3.1.1 naming);
* ``out_embed.weight`` (V x d): the context ("output") vectors of the prediction head
  (the thesis's M_1).

So FedAvg and gossip average them like any other weights, and the thesis's "half"
configuration (exchange one matrix only) is ``[gossip] exchange = ["in_embed.*"]`` (or
``["out_embed.*"]``). Initialisation follows word2vec: input vectors uniform in
``±0.5/d``, output vectors zero (seeded, so every agent starts from the same model).

**Training** (Mikolov et al. 2013; the thesis's eqs. 3.1 and 3.3): for every kept token
a window ``b`` is drawn uniformly from 1..``window`` (word2vec's dynamic window, which
weights near context more), and every word within ``b`` positions in the same document
is a positive (center, context) pair. Frequent words are subsampled: a token of
relative frequency ``f`` is kept with probability ``(sqrt(f/s) + 1) s / f`` (word2vec's
code; ``s = sample``). Each positive pair gets ``negative`` noise words drawn from the
unigram distribution raised to 0.75 (a precomputed table). The loss of a pair is
``-log σ(u_o·v_c) - Σ_k log σ(-u_k·v_c)``; a noise word that happens to be the
context itself is masked. Mini-batches are ``batch_size`` pairs from a shuffled epoch
of pairs; the update is plain SGD on the *sum* of the pair losses, so ``lr`` is the
per-pair step of word2vec's ``alpha`` (0.025) whatever the batch size. Plain SGD keeps
no optimizer state, which is what model averaging between steps wants. The gradients
are written out by hand (:func:`sgns_update`, checked against autograd in the tests):
about six times faster than autograd with sparse embeddings on this machine.

Defaults are word2vec's/gensim's published ones: d = 100, window 5, 5 negatives,
``sample`` 1e-3, min_count 5, alpha 0.025. The thesis used d = 200, span 25 (window 12),
64 negatives, words seen more than 10 times, batches of 2048; all are options.

**Data.** ``corpus = "wiki"``: the Wikipedia dump shipped with gensim (or ``"manpages"``:
the Linux manual pages, :func:`fedagent.tasks.text_data.manpages`), split across
``shards`` agents by ``split`` (``topic``, ``random``, ``imbalanced``; see
:mod:`fedagent.tasks.text_data`); this agent trains on shard ``shard`` (absent: all).

**Vocabulary.** The model is defined on one vocabulary common to all agents (the
consensus stage's result): :meth:`Word2VecTask.term_counts` is this agent's offer and
:meth:`Word2VecTask.set_vocabulary` installs the agreed terms and counts. Until the
daemons run the consensus for this task, the task computes it in-process from all
shards' offers with the consensus protocol's own merge: the same terms and order, and
possible only because every simulated agent reads the same public dump. The option
``vocabulary`` names a file of ``term<TAB>count`` lines instead (an agreed vocabulary).

**Evaluation** (on the input vectors): Spearman's rho on wordsim353 and simlex999 with
their coverage, and with ``reference`` (an ``.npz`` with ``terms`` and ``vectors`` from
a centralized model) the thesis's ``w2v_sim`` neighbour overlap; with ``analogies``
the 3CosAdd accuracy on questions-words (slower: every question against every word).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedagent.errors import ConfigError
from fedagent.tasks import text_data as td
from fedagent.tasks import text_metrics as tm
from fedagent.tasks.base import Task, file_options

NEG_TABLE_SIZE = 2_000_000
MAX_VOCAB = 1_000_000


# ---- vocabulary and corpus ------------------------------------------------------------------
class Vocabulary:
    """Agreed terms (row order of the embedding tables) and their federation-wide counts."""

    __slots__ = ("counts", "index", "terms")

    def __init__(self, terms: Sequence[str], counts: Sequence[int]) -> None:
        if len(terms) != len(counts) or not terms:
            raise ConfigError("a vocabulary needs at least one term and one count per term")
        if len(terms) > MAX_VOCAB:
            raise ConfigError(f"vocabulary of {len(terms)} terms is larger than {MAX_VOCAB}")
        self.terms = tuple(terms)
        self.counts = np.asarray(counts, dtype=np.float64)
        if np.any(self.counts <= 0):
            raise ConfigError("vocabulary counts must be positive")
        self.index = {t: i for i, t in enumerate(self.terms)}
        if len(self.index) != len(self.terms):
            raise ConfigError("vocabulary terms must be unique")

    def __len__(self) -> int:
        return len(self.terms)

    @classmethod
    def from_merge(cls, merged: Sequence[tuple[str, int]]) -> Vocabulary:
        return cls([t for t, _ in merged], [c for _, c in merged])

    @classmethod
    def read(cls, path: str | Path) -> Vocabulary:
        terms, counts = [], []
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            term, sep, count = line.partition("\t")
            if not sep or not count.strip().isdigit():
                raise ConfigError(f"{path}:{n}: expected 'term<TAB>count'")
            terms.append(term)
            counts.append(int(count))
        return cls(terms, counts)

    def write(self, path: str | Path) -> None:
        Path(path).write_text("".join(f"{t}\t{int(c)}\n" for t, c in zip(self.terms, self.counts)), encoding="utf-8")

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        """Token ids; words outside the vocabulary are dropped (as word2vec does)."""
        idx = self.index
        return np.fromiter((idx[t] for t in tokens if t in idx), dtype=np.int64)

    def keep_probabilities(self, sample: float) -> np.ndarray:
        """word2vec's subsampling: P(keep) = (sqrt(f/s) + 1) s/f, f = relative frequency."""
        if sample <= 0:
            return np.ones(len(self))
        f = self.counts / self.counts.sum()
        return np.minimum(1.0, (np.sqrt(f / sample) + 1.0) * sample / f)

    def noise_table(self, exponent: float = 0.75, size: int = NEG_TABLE_SIZE) -> torch.Tensor:
        """Word ids repeated in proportion to count**exponent: drawing a uniform index
        into it samples the noise distribution in O(1)."""
        p = self.counts**exponent
        reps = np.maximum(1, np.round(p / p.sum() * size)).astype(np.int64)
        return torch.from_numpy(np.repeat(np.arange(len(self), dtype=np.int64), reps))


def skipgram_pairs(
    docs: Sequence[np.ndarray], keep: np.ndarray, window: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One shuffled epoch of (center, context) pairs: subsampling, then a dynamic window
    per kept token, never across documents."""
    if not docs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    tokens = np.concatenate(docs)
    doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    mask = rng.random(len(tokens)) < keep[tokens]
    tokens, doc_of = tokens[mask], doc_of[mask]
    reach = rng.integers(1, window + 1, size=len(tokens))
    centers, contexts = [], []
    for d in range(1, window + 1):
        same = doc_of[:-d] == doc_of[d:]
        fwd = same & (reach[:-d] >= d)  # center i, context i + d
        bwd = same & (reach[d:] >= d)  # center i + d, context i
        centers += [tokens[:-d][fwd], tokens[d:][bwd]]
        contexts += [tokens[d:][fwd], tokens[:-d][bwd]]
    c, x = np.concatenate(centers), np.concatenate(contexts)
    order = rng.permutation(len(c))
    return c[order], x[order]


class PairStream:
    """Mini-batches of pairs across epochs: a new shuffled epoch whenever one runs out.

    The stream lives in the task, so gossip mode's many short ``fit_steps`` calls walk
    through the data instead of restarting at the top of an epoch each time."""

    def __init__(self, make_epoch: Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray]], seed: int) -> None:
        self.make_epoch = make_epoch
        self.rng = np.random.default_rng(seed)
        self.centers = self.contexts = np.zeros(0, np.int64)
        self.pos = 0
        self.epochs = 0

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos >= len(self.centers):
            for _ in range(3):
                self.centers, self.contexts = self.make_epoch(self.rng)
                self.epochs += 1
                if len(self.centers):
                    break
            else:
                raise ConfigError("the local corpus yields no training pairs (too few words in the vocabulary)")
            self.pos = 0
        c = self.centers[self.pos : self.pos + n]
        x = self.contexts[self.pos : self.pos + n]
        self.pos += n
        return torch.from_numpy(c), torch.from_numpy(x)


# ---- the model ----------------------------------------------------------------------------------
class SkipGram(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        # Trained by sgns_update (hand-written sparse SGD); pair_losses is the same loss
        # for autograd, used to check the hand-written gradients.
        self.in_embed = nn.Embedding(vocab_size, dim)
        self.out_embed = nn.Embedding(vocab_size, dim)

    def reset(self, generator: torch.Generator) -> None:
        d = self.in_embed.embedding_dim
        with torch.no_grad():
            self.in_embed.weight.uniform_(-0.5 / d, 0.5 / d, generator=generator)
            self.out_embed.weight.zero_()

    def pair_losses(self, centers: torch.Tensor, contexts: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Negative-sampling loss of each (center, context) pair; ``noise`` is B x k."""
        v = self.in_embed(centers)  # B x d
        u = self.out_embed(contexts)  # B x d
        n = self.out_embed(noise)  # B x k x d
        pos = F.logsigmoid((v * u).sum(-1))
        neg = F.logsigmoid(-torch.bmm(n, v.unsqueeze(-1)).squeeze(-1))
        neg = neg * (noise != contexts.unsqueeze(-1))
        return -(pos + neg.sum(-1))


@torch.no_grad()
def sgns_update(
    in_table: torch.Tensor,
    out_table: torch.Tensor,
    inputs: torch.Tensor,
    contexts: torch.Tensor,
    noise: torch.Tensor,
    lr: float | torch.Tensor,
    *,
    update_in: bool = True,
    update_out: bool = True,
    row_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One SGD step on the summed negative-sampling loss, gradients written by hand.

    The same step autograd would take on ``SkipGram.pair_losses(...).sum()`` (a test
    checks it), without a graph or sparse-gradient coalescing. Repeated rows accumulate,
    all gradients are taken at the weights before the step. Returns the pair losses.
    ``update_out=False`` freezes the prediction head (doc2vec inference). ``row_scale``
    (one factor per row of the input table and of the output table) multiplies each
    row's step (the per-word step of :mod:`fedagent.protocols.gossip_rows`).

    The context is handled as column 0 of a ``B x (k+1)`` target matrix with label 1
    (the noise words have label 0), so one gather, one product and one scatter serve
    both. ``index_select``, broadcast-multiply-and-sum and ``index_put_(accumulate)``
    instead of fancy indexing, ``bmm`` and ``index_add_``: measured 2x faster on one
    thread for 4096 pairs at d 32-64 (bmm over a batch of 1 x (k+1) matrices is slow).
    ``lr`` is one step size, or one per pair (a tensor of ``B``)."""
    batch, k = noise.shape
    d = in_table.shape[1]
    if isinstance(lr, torch.Tensor):  # one step size per pair (B,): doc2vec's per-document schedules
        lr_in, lr_out = lr.view(batch, 1), lr.view(batch, 1, 1)
    else:
        lr_in = lr_out = lr  # type: ignore[assignment]
    targets = torch.cat([contexts.unsqueeze(1), noise], 1).reshape(-1)
    v = in_table.index_select(0, inputs)  # B x d
    u = out_table.index_select(0, targets).view(batch, k + 1, d)  # B x (k+1) x d
    scores = (u * v.unsqueeze(1)).sum(-1)  # B x (k+1)
    keep = torch.ones_like(scores)
    keep[:, 1:] = noise != contexts.unsqueeze(-1)  # a noise word equal to the context is masked
    sign = torch.ones(k + 1, dtype=scores.dtype)
    sign[0] = -1.0
    losses = (F.softplus(scores * sign) * keep).sum(-1)  # -log σ(u_o·v) - Σ log σ(-u_k·v)
    grad = torch.sigmoid(scores) * keep  # dL/d(score): σ(s) - label
    grad[:, 0] -= 1.0
    if update_in:
        step_in = (grad.unsqueeze(-1) * u).sum(1).mul_(lr_in).neg_()
        if row_scale is not None:
            step_in.mul_(row_scale[0].index_select(0, inputs).unsqueeze(-1))
        in_table.index_put_((inputs,), step_in, accumulate=True)
    if update_out:
        step_out = (grad.unsqueeze(-1) * v.unsqueeze(1)).mul_(lr_out).neg_().view(-1, d)
        if row_scale is not None:
            step_out.mul_(row_scale[1].index_select(0, targets).unsqueeze(-1))
        out_table.index_put_((targets,), step_out, accumulate=True)
    return losses


def sgns_steps(
    model: SkipGram,
    stream: PairStream,
    noise_table: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    negative: int,
    lr_at: Callable[[int], float],
    generator: torch.Generator,
) -> dict[str, float]:
    """``steps`` SGD steps on the summed pair loss; returns the mean pair loss."""
    if steps < 0 or batch_size < 1 or negative < 1:
        raise ConfigError("steps >= 0, batch_size >= 1 and negative >= 1 are required")
    model.train()
    total, count = 0.0, 0
    w_in, w_out = model.in_embed.weight.data, model.out_embed.weight.data
    for step in range(steps):
        centers, contexts = stream.next(batch_size)
        noise = noise_table.index_select(
            0, torch.randint(len(noise_table), (len(centers) * negative,), generator=generator)
        ).view(len(centers), negative)
        losses = sgns_update(w_in, w_out, centers, contexts, noise, lr_at(step))
        total += float(losses.sum())
        count += len(centers)
    return {"loss": total / max(count, 1), "pairs": float(count)}


# ---- the task -------------------------------------------------------------------------------------
DEFAULTS: dict[str, Any] = {
    "corpus": "wiki",
    "split": "random",
    "shard": None,
    "shards": 1,
    "topics": None,
    "limit": 0,
    "seed": 0,
    "dim": 100,
    "window": 5,
    "negative": 5,
    "sample": 1e-3,
    "min_count": 5,
    "max_vocab": 0,
    "ns_exponent": 0.75,
    "vocabulary": None,
    "reference": None,
    "analogies": False,
}


def load_corpus(options: Mapping[str, Any]) -> tuple[list[td.Article], td.Split | None]:
    """All documents of the corpus and, with ``shards`` > 1, their split."""
    if options["corpus"] == "wiki":
        articles = td.wiki_articles(limit=int(options["limit"]))
    elif options["corpus"] == "manpages":
        articles = td.manpages(limit=int(options["limit"]))
    else:
        raise ConfigError(f"word2vec: unknown corpus {options['corpus']!r} (available: wiki, manpages)")
    shards = int(options["shards"])
    if shards <= 1:
        return articles, None
    split = td.split_articles(
        [a.tokens for a in articles], shards, options["split"], seed=int(options["seed"]), topics=options["topics"]
    )
    return articles, split


def check_options(name: str, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(defaults)
    if unknown:
        raise ConfigError(f"{name}: unknown options {sorted(unknown)}; known: {sorted(defaults)}")
    opts = {**defaults, **options}
    if opts["shard"] is not None and not 0 <= int(opts["shard"]) < int(opts["shards"]):
        raise ConfigError(f"{name}: shard {opts['shard']} not in 0..{int(opts['shards']) - 1}")
    for key in ("dim", "window", "negative", "min_count"):
        if key in opts and int(opts[key]) < 1:
            raise ConfigError(f"{name}: {key} must be at least 1")
    return opts


class Word2VecTask(Task):
    def __init__(self, options: Mapping[str, Any]) -> None:
        o = check_options("word2vec", options, DEFAULTS)
        self.options = o
        self.seed = int(o["seed"])
        self.dim, self.window, self.negative = int(o["dim"]), int(o["window"]), int(o["negative"])
        self.sample, self.ns_exponent = float(o["sample"]), float(o["ns_exponent"])
        articles, split = load_corpus(o)
        shard = None if o["shard"] is None else int(o["shard"])
        self.split = split
        mine = range(len(articles)) if split is None or shard is None else split.shards[shard]
        self.documents: list[td.Article] = [articles[i] for i in mine]
        if o["vocabulary"]:
            vocab = Vocabulary.read(o["vocabulary"])
        else:
            groups = [range(len(articles))] if split is None else split.shards
            offers = [td.term_counts(articles[i].tokens for i in g) for g in groups]
            vocab = Vocabulary.from_merge(
                td.merge_term_counts(offers, min_count=int(o["min_count"]), max_size=int(o["max_vocab"]))
            )
        self.set_vocabulary(vocab.terms, vocab.counts.astype(np.int64).tolist())
        self._reference: tm.WordVectors | None = None
        if o["reference"]:
            self._reference = load_vectors(o["reference"])

    # -- vocabulary consensus ---------------------------------------------------------------
    def term_counts(self) -> dict[str, int]:
        """This agent's offer: its terms and counts (never its documents)."""
        return td.term_counts(a.tokens for a in self.documents)

    def set_vocabulary(self, terms: Sequence[str], counts: Sequence[int] | None = None) -> None:
        """Install the agreed vocabulary; ``counts`` are the federation-wide counts (they
        set subsampling and the noise distribution); without them the local counts are
        used (+1, so no agreed word has zero noise probability)."""
        if counts is None:
            local = self.term_counts()
            counts = [local.get(t, 0) + 1 for t in terms]
        self.vocab = Vocabulary(terms, counts)
        self.encoded = [self.vocab.encode(a.tokens) for a in self.documents]
        self.noise = self.vocab.noise_table(self.ns_exponent)
        keep = self.vocab.keep_probabilities(self.sample)
        self.stream = PairStream(
            lambda rng: skipgram_pairs(self.encoded, keep, self.window, rng),
            seed=self.seed * 7919 + int(self.options["shard"] or 0),
        )

    # -- Task ---------------------------------------------------------------------------------
    def build_model(self) -> SkipGram:
        model = SkipGram(len(self.vocab), self.dim)
        model.reset(torch.Generator().manual_seed(self.seed))
        return model

    def num_samples(self) -> int:
        return int(sum(len(e) for e in self.encoded))

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        """``epochs`` passes' worth of pairs (the pair count of one epoch is estimated
        from the expected number of kept tokens and the mean window)."""
        steps = max(1, math.ceil(epochs * self.pairs_per_epoch() / batch_size))
        return self.fit_steps(model, steps=steps, lr=lr, batch_size=batch_size, seed=seed)

    def fit_steps(
        self, model: nn.Module, *, steps: int, lr: float, batch_size: int, seed: int, lr_end: float | None = None
    ) -> dict[str, float]:
        """``steps`` SGD steps; with ``lr_end`` the step size moves linearly from ``lr``
        to it over the steps (gossip mode's schedule inside one period)."""
        assert isinstance(model, SkipGram)
        end = lr if lr_end is None else float(lr_end)
        return sgns_steps(
            model,
            self.stream,
            self.noise,
            steps=steps,
            batch_size=batch_size,
            negative=self.negative,
            lr_at=lambda s: lr + (end - lr) * s / max(steps, 1),
            generator=torch.Generator().manual_seed(seed),
        )

    def pairs_per_epoch(self) -> float:
        keep = self.vocab.keep_probabilities(self.sample)
        kept = sum(float(keep[e].sum()) for e in self.encoded)
        return kept * (self.window + 1)  # 2 sides x mean dynamic window (w+1)/2

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        vectors = self.word_vectors(model)
        out: dict[str, float] = {}
        for name, pairs in (("wordsim353", td.wordsim353()), ("simlex999", td.simlex999())):
            s = tm.similarity_benchmark(pairs, vectors)
            out[f"{name}_rho"] = s.rho
            out[f"{name}_coverage"] = s.coverage
        if self.options["analogies"]:
            a = tm.analogy_accuracy(vectors, [q for qs in td.analogies().values() for q in qs])
            out["analogy_accuracy"] = a.rho
            out["analogy_coverage"] = a.coverage
        if self._reference is not None:
            o = tm.neighbour_overlap(vectors, self._reference)
            out["w2v_sim"] = float(o.total)
            out["w2v_sim_fraction"] = o.fraction
        return out

    def word_vectors(self, model: nn.Module) -> tm.WordVectors:
        assert isinstance(model, SkipGram)
        return tm.WordVectors(self.vocab.terms, model.in_embed.weight.detach().cpu().numpy())


def train_centralized(
    task: Word2VecTask,
    model: SkipGram,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    min_lr_fraction: float = 1e-4,
) -> dict[str, float]:
    """The reference run: like word2vec, ``lr`` decays linearly to ``lr * min_lr_fraction``."""

    def lr_at(step: int) -> float:
        return lr * max(min_lr_fraction, 1.0 - step / max(steps, 1))

    return sgns_steps(
        model,
        task.stream,
        task.noise,
        steps=steps,
        batch_size=batch_size,
        negative=task.negative,
        lr_at=lr_at,
        generator=torch.Generator().manual_seed(seed),
    )


def save_vectors(path: str | Path, vectors: tm.WordVectors) -> None:
    """Vectors for ``reference``: terms as a unicode array, no pickled objects."""
    np.savez(path, terms=np.array(vectors.terms, dtype=str), vectors=vectors.vectors.astype(np.float32))


def load_vectors(path: str | Path) -> tm.WordVectors:
    with np.load(path, allow_pickle=False) as z:
        if set(z.files) != {"terms", "vectors"}:
            raise ConfigError(f"{path}: expected arrays 'terms' and 'vectors', found {z.files}")
        return tm.WordVectors([str(t) for t in z["terms"]], z["vectors"])


@file_options("vocabulary", "reference")
def make(options: dict[str, Any]) -> Word2VecTask:
    """Options (all optional): ``corpus`` (wiki, manpages), ``split`` (topic/random/imbalanced),
    ``shard``, ``shards``, ``topics``, ``limit`` (first N articles), ``seed``, ``dim``,
    ``window``, ``negative``, ``sample``, ``min_count``, ``max_vocab``, ``ns_exponent``,
    ``vocabulary`` (file of agreed terms), ``reference`` (.npz of centralized vectors),
    ``analogies`` (also score questions-words)."""
    return Word2VecTask(options)
