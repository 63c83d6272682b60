"""Built-in tasks ``prodlda`` and ``combinedtm``: neural topic models for gFedNTM
(Calvo-Bartolomé & Arenas-García, shared/seeds/000) trained by Sync-Opt.

ProdLDA (Srivastava & Sutton, "Autoencoding Variational Inference for Topic Models",
ICLR 2017) is a variational autoencoder over a document's bag of words (BoW):

* inference network: BoW -> Linear(V, 100) -> softplus -> Linear(100, 100) -> softplus
  -> dropout -> two heads ``mu`` and ``log sigma^2`` (Linear(100, K) each, without bias,
  followed by a BatchNorm without affine parameters: the BatchNorm cancels a bias
  anyway, see ``ProdLDA.__init__``);
* ``z = mu + sigma * eps`` (reparameterisation), ``theta = softmax(z)``, dropout on theta;
* decoder: ``p(w | theta) = softmax(BN(theta @ beta))``, a weighted product of experts
  with ``beta`` (K x V) the unnormalised topic-word matrix;
* loss per document: ``- sum_w n_w log p(w | theta) + KL(q(z | d) || p(z))`` where the
  prior ``p(z)`` is the Laplace approximation (in the softmax basis) of a symmetric
  Dirichlet(alpha): ``mu_k = log a_k - mean(log a)``,
  ``sigma^2_k = (1 - 2/K) / a_k + sum_i (1 / a_i) / K^2`` (Srivastava & Sutton, eq. 3);
  with alpha = 1 this is N(0, 1 - 1/K).

Hyper-parameters are the published defaults of the authors' reference code: two hidden
layers of 100 softplus units, dropout 0.2, Adam with lr 2e-3 and beta1 = 0.99
(AVITM's TF code: ``AdamOptimizer(learning_rate=0.002, beta1=0.99)``, beta2 left at
0.999), batch size 64 and the BatchNorms without affine parameters as in the
contextualized-topic-models package (Bianchi et al.), on which gFedNTM's implementation
builds.

CombinedTM (Bianchi et al., "Pre-training is a Hot Topic", ACL 2021) is ProdLDA whose
inference network sees the BoW concatenated with an adapted SBERT embedding of the
document: ``Linear(E, V)(embedding)`` is concatenated to the BoW, so the first layer is
``Linear(2 V, 100)``; the decoder and the loss are ProdLDA's.

Determinism and Sync-Opt exactness
----------------------------------
``step_loss(model, step)`` draws everything random (which documents form the batch,
dropout masks, the reparameterisation noise) from generators seeded by
``(seed, shard, step)``, so a node computes the same loss for the same step whether it
runs alone, under a coordinator, or inside :func:`centralized_step`.

BatchNorm is the one layer that couples the documents of a batch. A BatchNorm over the
*concatenated* batch of all nodes (the paper's "effective batch size amounts to the sum
of all the clients' mini-batch sizes") cannot be computed by Sync-Opt without sending
batch statistics around in an extra round trip. fedagent therefore defines the global
step with per-node normalisation ("ghost batch" normalisation): each node's mini-batch
is normalised with its own statistics, in the federated run *and* in the centralized
reference, and the global loss is the sample-weighted mean of the per-node mean losses::

    L(W) = sum_i n_i L_i(W) / sum_i n_i

Its gradient is, by linearity, exactly the sample-weighted mean of the nodes'
gradients, which is what the coordinator aggregates: federated == centralized up to
float summation order. The BatchNorms keep no running statistics
(``track_running_stats=False``): the model's state is its parameters only, there are no
buffers that a gradient step would not update, and the weights the coordinator
broadcasts are the whole model. Inference (``infer_theta``) normalises over the set of
documents passed at once; pass documents in sets of at least a batch (the validation
set, in chunks of >= ``batch_size``), never one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedagent.errors import ConfigError
from fedagent.extras import require
from fedagent.tasks import ntm_data
from fedagent.tasks.base import SyncTask
from fedagent.tasks.ntm_data import NodeCorpus

if TYPE_CHECKING:
    import scipy.sparse as sp
else:
    sp = require("scipy.sparse", "text", "topic modelling (prodlda, combinedtm)")

DEFAULTS: dict[str, Any] = {
    "n_topics": 50,
    "batch_size": 64,
    "hidden": 100,
    "dropout": 0.2,
    "lr": 2e-3,
    "betas": (0.99, 0.999),
    "prior_alpha": 1.0,
    "dtype": "float32",
}

# float64 costs about twice the time of float32 but makes Sync-Opt's equality with
# centralized training hold to ~1e-12 for any seed; in float32 the two runs' different
# summation orders drift apart by 1e-7..1e-4 over 50 Adam steps, depending on the seed.
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ---- the model -------------------------------------------------------------------
def laplace_prior(n_topics: int, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of the Gaussian that approximates a symmetric Dirichlet(alpha)
    in the softmax basis (Laplace approximation, Srivastava & Sutton eq. 3)."""
    if n_topics < 2:
        raise ConfigError("a topic model needs n_topics >= 2")
    a = torch.full((n_topics,), float(alpha), dtype=torch.float64)
    mean = torch.log(a) - torch.log(a).mean()
    var = (1.0 - 2.0 / n_topics) / a + (1.0 / a).sum() / n_topics**2
    return mean, var  # float64; the model casts them to its own dtype


def _dropout(x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``gen`` (torch's own dropout draws from the
    global generator, which a federated and a centralized run would consume differently)."""
    if gen is None or p <= 0.0:
        return x
    keep = torch.rand(x.shape, generator=gen, dtype=x.dtype) >= p
    return x * keep / (1.0 - p)


class ProdLDA(nn.Module):
    """ProdLDA; with ``contextual_size > 0`` the inference network of CombinedTM."""

    def __init__(
        self,
        vocab_size: int,
        n_topics: int,
        *,
        hidden: int = 100,
        dropout: float = 0.2,
        contextual_size: int = 0,
        prior_alpha: float = 1.0,
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ConfigError("the vocabulary is empty: set_vocabulary() first")
        self.vocab_size, self.n_topics, self.dropout = vocab_size, n_topics, dropout
        self.contextual_size = contextual_size
        in_size = vocab_size
        if contextual_size:
            self.adapt_context = nn.Linear(contextual_size, vocab_size)
            in_size = 2 * vocab_size
        self.input_layer = nn.Linear(in_size, hidden)
        self.hidden_layer = nn.Linear(hidden, hidden)
        # No bias before a BatchNorm that subtracts the batch mean: such a bias has an
        # exactly zero gradient, and Adam would turn its float rounding noise into full
        # lr-sized steps, different in a federated and a centralized run.
        self.f_mu = nn.Linear(hidden, n_topics, bias=False)
        self.f_logvar = nn.Linear(hidden, n_topics, bias=False)
        bn = {"affine": False, "track_running_stats": False}
        self.mu_bn = nn.BatchNorm1d(n_topics, **bn)
        self.logvar_bn = nn.BatchNorm1d(n_topics, **bn)
        self.beta = nn.Parameter(torch.empty(n_topics, vocab_size))
        nn.init.xavier_uniform_(self.beta)
        self.beta_bn = nn.BatchNorm1d(vocab_size, **bn)
        prior_mean, prior_var = laplace_prior(n_topics, prior_alpha)
        # Constants, not buffers: the state exchanged by Sync-Opt is the parameters only.
        self._prior_mean, self._prior_var = prior_mean, prior_var

    def encode(
        self, bow: torch.Tensor, context: torch.Tensor | None, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = bow
        if self.contextual_size:
            if context is None:
                raise ValueError("CombinedTM needs the documents' contextual embeddings")
            x = torch.cat([bow, self.adapt_context(context)], dim=1)
        h = F.softplus(self.input_layer(x))
        h = F.softplus(self.hidden_layer(h))
        h = _dropout(h, self.dropout, gen if self.training else None)
        return self.mu_bn(self.f_mu(h)), self.logvar_bn(self.f_logvar(h))

    def document_losses(self, bow: torch.Tensor, context: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
        """Negative ELBO of every document of a batch (noise and dropout from ``gen``)."""
        if bow.shape[0] < 2:
            raise ValueError("a batch needs >= 2 documents (BatchNorm over the batch)")
        mu, logvar = self.encode(bow, context, gen)
        eps = torch.randn(mu.shape, generator=gen, dtype=mu.dtype)
        theta = F.softmax(mu + torch.exp(0.5 * logvar) * eps, dim=1)
        theta = _dropout(theta, self.dropout, gen if self.training else None)
        log_word = F.log_softmax(self.beta_bn(theta @ self.beta), dim=1)
        recon = -(bow * log_word).sum(1)
        var = torch.exp(logvar)
        prior_mean, prior_var = self._prior_mean.to(mu.dtype), self._prior_var.to(mu.dtype)
        kl = 0.5 * (
            (var / prior_var).sum(1)
            + ((mu - prior_mean) ** 2 / prior_var).sum(1)
            - self.n_topics
            + torch.log(prior_var).sum()
            - logvar.sum(1)
        )
        return recon + kl

    @torch.no_grad()
    def infer_theta(self, bow: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """Document-topic proportions at the posterior mean, ``softmax(mu)`` (no noise, no
        dropout), normalised over the documents passed together."""
        mu, _ = self.encode(bow, context, None)
        return F.softmax(mu, dim=1)

    @torch.no_grad()
    def topic_word(self) -> torch.Tensor:
        """``softmax(beta)``: the topics as the CTM package and gFedNTM's authors read them."""
        return F.softmax(self.beta, dim=1)

    @torch.no_grad()
    def decoder_topic_word(self, theta: torch.Tensor) -> torch.Tensor:
        """The word distribution the decoder gives a document made of topic k alone,
        ``softmax((beta_k - m) / s)``, with the decoder BatchNorm's per-term mean ``m`` and
        standard deviation ``s`` of ``theta @ beta`` over the documents ``theta``.

        Why not ``softmax(beta)``: the decoder BatchNorm makes the loss invariant to
        ``beta[:, w] -> a_w beta[:, w]`` for every term w (a_w > 0, up to the BatchNorm's
        eps), and to ``beta[:, w] + b_w`` wherever theta sums to 1 (everywhere but under
        theta-dropout), so the scale and offset of each column of ``beta`` are hardly
        learnt and ``softmax(beta)`` keeps about the spread of the initialisation however
        long one trains. This reading does not depend on them: it is what the model
        predicts."""
        x = theta.to(self.beta.dtype) @ self.beta
        mean = x.mean(0)
        std = torch.sqrt(x.var(0, unbiased=False) + self.beta_bn.eps)
        return F.softmax((self.beta - mean) / std, dim=1)


# ---- seeding ---------------------------------------------------------------------
def _prodlda(model: nn.Module) -> ProdLDA:
    """The Task interface passes a plain module; these tasks only ever build ProdLDA."""
    if not isinstance(model, ProdLDA):
        raise TypeError(f"expected the task's ProdLDA model, got {type(model).__name__}")
    return model


def _seed_of(*parts: int) -> int:
    """A 63-bit seed from integers; SeedSequence mixes them so that neighbouring steps or
    shards do not get correlated streams."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1)
    )


_BATCH_STREAM, _NOISE_STREAM = 1, 2


# ---- the task --------------------------------------------------------------------
class NtmTask(SyncTask):
    """A ProdLDA / CombinedTM workload on one node's corpus."""

    def __init__(
        self,
        corpus: NodeCorpus,
        *,
        combined: bool = False,
        shard: int = 0,
        seed: int = 0,
        n_topics: int = DEFAULTS["n_topics"],
        batch_size: int = DEFAULTS["batch_size"],
        hidden: int = DEFAULTS["hidden"],
        dropout: float = DEFAULTS["dropout"],
        lr: float = DEFAULTS["lr"],
        prior_alpha: float = DEFAULTS["prior_alpha"],
        dtype: str = DEFAULTS["dtype"],
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if batch_size < 2:
            raise ConfigError("batch_size must be >= 2 (BatchNorm normalises over the batch)")
        if corpus.train.shape[0] < batch_size:
            raise ConfigError(
                f"shard {shard} has {corpus.train.shape[0]} training documents, fewer than batch_size={batch_size}"
            )
        if combined and corpus.train_context is None:
            raise ConfigError("combinedtm needs contextual embeddings of the documents")
        self.corpus, self.combined = corpus, combined
        self.shard, self.seed, self.n_topics = int(shard), int(seed), int(n_topics)
        self.batch_size, self.hidden, self.dropout = int(batch_size), int(hidden), float(dropout)
        self.lr, self.prior_alpha = float(lr), float(prior_alpha)
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self._set_columns(list(corpus.terms), corpus.train, corpus.val)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    # -- vocabulary ------------------------------------------------------------
    def _set_columns(self, terms: list[str], train: sp.csr_matrix, val: sp.csr_matrix) -> None:
        self.terms = terms
        self.train = sp.csr_matrix(train, dtype=np.float32)
        self.val = sp.csr_matrix(val, dtype=np.float32)

    def term_counts(self) -> dict[str, int]:
        totals = np.asarray(self.corpus.train.sum(axis=0)).ravel()
        return {t: int(c) for t, c in zip(self.corpus.terms, totals) if c > 0}

    def set_vocabulary(self, terms: Sequence[str]) -> None:
        terms = list(terms)
        if not terms:
            raise ValueError("the common vocabulary is empty")
        index = {t: j for j, t in enumerate(terms)}
        if len(index) != len(terms):
            raise ValueError("duplicate terms in the common vocabulary")
        src = [i for i, t in enumerate(self.corpus.terms) if t in index]
        dst = [index[self.corpus.terms[i]] for i in src]
        # A sparse selection matrix maps local columns to common ones; dropped terms vanish.
        remap = sp.csr_matrix(
            (np.ones(len(src), dtype=np.float32), (src, dst)), shape=(len(self.corpus.terms), len(terms))
        )
        self._set_columns(terms, self.corpus.train @ remap, self.corpus.val @ remap)

    # -- model and optimizer ---------------------------------------------------
    def build_model(self) -> ProdLDA:
        ctx = self.corpus.train_context
        context = ctx.shape[1] if self.combined and ctx is not None else 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = ProdLDA(
                len(self.terms),
                self.n_topics,
                hidden=self.hidden,
                dropout=self.dropout,
                contextual_size=context,
                prior_alpha=self.prior_alpha,
            )
        return model.to(self.dtype)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr, betas=DEFAULTS["betas"])

    def num_samples(self) -> int:
        return self.train.shape[0]

    def num_batches(self) -> int:
        # The remainder of each epoch's permutation is left out so that every batch has
        # batch_size documents (a tiny last batch would make BatchNorm meaningless); the
        # permutation changes every epoch, so no document is left out for good.
        return self.num_samples() // self.batch_size

    # -- one Sync-Opt step -----------------------------------------------------
    def batch_indices(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError("step must be >= 0")
        epoch, b = divmod(step, self.num_batches())
        if epoch != self._perm_epoch:
            rng = np.random.default_rng(_seed_of(self.seed, self.shard, epoch, _BATCH_STREAM))
            self._perm, self._perm_epoch = rng.permutation(self.num_samples()), epoch
        return np.sort(self._perm[b * self.batch_size : (b + 1) * self.batch_size])

    def _batch(
        self, matrix: sp.csr_matrix, context: np.ndarray | None, idx: np.ndarray, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bow = torch.from_numpy(matrix[idx].toarray()).to(dtype)
        ctx = torch.from_numpy(np.asarray(context[idx])).to(dtype) if self.combined and context is not None else None
        return bow, ctx

    def step_loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, int]:
        model = _prodlda(model)
        idx = self.batch_indices(step)
        bow, ctx = self._batch(self.train, self.corpus.train_context, idx, model.beta.dtype)
        gen = torch.Generator().manual_seed(_seed_of(self.seed, self.shard, step, _NOISE_STREAM))
        model.train()
        return model.document_losses(bow, ctx, gen).mean(), len(idx)

    # -- local training (the non-collaborative baseline) ------------------------
    def fit(
        self,
        model: nn.Module,
        *,
        epochs: int,
        lr: float | None = None,
        batch_size: int | None = None,
        seed: int | None = None,
    ) -> dict[str, float]:
        """Train alone on this node's documents for ``epochs`` passes. The batch size is the
        task's own (``batch_size`` option) because Sync-Opt's steps are defined by it; an
        ``lr`` given here overrides the task's."""
        opt = self.make_optimizer(model.parameters())
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = float(lr)
        total, count = 0.0, 0
        for step in range(epochs * self.num_batches()):
            opt.zero_grad()
            loss, n = self.step_loss(model, step)
            loss.backward()
            opt.step()
            total, count = total + float(loss.detach()) * n, count + n
        return {"loss": total / max(count, 1)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean negative ELBO per held-out document (noise from a fixed seed) and its
        perplexity-style bound ``exp(sum loss / sum words)``."""
        model = _prodlda(model)
        if self.val.shape[0] < 2:
            return {}
        bow, ctx = self._batch(self.val, self.corpus.val_context, np.arange(self.val.shape[0]), model.beta.dtype)
        gen = torch.Generator().manual_seed(_seed_of(self.seed, self.shard, 0, 3))
        model.eval()
        losses = model.document_losses(bow, ctx, gen)
        words = float(bow.sum())
        return {"val_loss": float(losses.mean()), "perplexity": math.exp(float(losses.sum()) / max(words, 1.0))}

    def validation_loss(self, model: nn.Module) -> tuple[float, int]:
        """What an agent answers at a Sync-Opt epoch's end (early stopping): the mean
        validation loss over its held-out documents and their number (0: it has fewer
        than two, and its loss does not count)."""
        n = int(self.val.shape[0])
        if n < 2:
            return 0.0, 0
        return float(self.evaluate(model)["val_loss"]), n

    # -- what the model says ----------------------------------------------------
    def topic_word(self, model: nn.Module) -> np.ndarray:
        return _prodlda(model).topic_word().double().numpy()

    def decoder_topic_word(self, model: nn.Module, theta: np.ndarray) -> np.ndarray:
        """:meth:`ProdLDA.decoder_topic_word` with the BatchNorm statistics of documents
        whose proportions (as :meth:`infer_theta` gives them) are ``theta``."""
        return _prodlda(model).decoder_topic_word(torch.from_numpy(np.asarray(theta))).double().numpy()

    def topics(self, model: nn.Module, n_words: int = 10, theta: np.ndarray | None = None) -> list[list[str]]:
        """Each topic's most probable terms: in softmax(beta), or with ``theta`` (documents'
        proportions) in the decoder's topics (see :meth:`ProdLDA.decoder_topic_word`)."""
        tw = self.topic_word(model) if theta is None else self.decoder_topic_word(model, theta)
        return [[self.terms[j] for j in np.argsort(-row, kind="stable")[:n_words]] for row in tw]

    def infer_theta(self, model: nn.Module, which: str = "val") -> np.ndarray:
        """Document-topic proportions of this node's ``val`` (or ``train``) documents,
        normalised in chunks of >= batch_size documents."""
        model = _prodlda(model)
        matrix, context = (
            (self.val, self.corpus.val_context) if which == "val" else (self.train, self.corpus.train_context)
        )
        model.eval()
        n = matrix.shape[0]
        chunk = max(self.batch_size, 1024)
        parts = []
        for start in range(0, n, chunk):
            stop = n if n - start < chunk + self.batch_size else start + chunk
            bow, ctx = self._batch(matrix, context, np.arange(start, stop), model.beta.dtype)
            parts.append(model.infer_theta(bow, ctx).double().numpy())
            if stop == n:
                break
        return np.concatenate(parts) if parts else np.zeros((0, self.n_topics))


# ---- the centralized reference and the in-process Sync-Opt step -------------------
def centralized_step(model: nn.Module, optimizer: torch.optim.Optimizer, tasks: Sequence[NtmTask], step: int) -> float:
    """One optimizer step on the concatenation of every node's mini-batch of ``step``:
    loss = sum_i n_i loss_i / sum_i n_i (each node-batch normalised on its own, see the
    module docstring), one backward pass, one optimizer step. Returns the loss."""
    if not tasks:
        raise ValueError("no tasks")
    optimizer.zero_grad()
    losses, sizes = zip(*(t.step_loss(model, step) for t in tasks))
    total = sum(sizes)
    loss = sum(n * part for n, part in zip(sizes, losses)) / total
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def node_gradient(model: nn.Module, task: NtmTask, step: int) -> tuple[dict[str, np.ndarray], int, float]:
    """What a Sync-Opt client returns for ``step``: the gradient of its mini-batch loss
    (as float64 numpy arrays, by parameter name), its batch size and the loss."""
    model.zero_grad()
    loss, n = task.step_loss(model, step)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise ValueError(f"parameter {name} got no gradient")
        grads[name] = p.grad.detach().double().numpy().copy()
    model.zero_grad()
    return grads, n, float(loss.detach())


def federated_step(model: nn.Module, optimizer: torch.optim.Optimizer, tasks: Sequence[NtmTask], step: int) -> float:
    """Sync-Opt in one process: every node's gradient on its own, their sample-weighted
    mean set as the model's gradient, one optimizer step (Algorithm 1, lines 9-12)."""
    results = [node_gradient(model, t, step) for t in tasks]
    total = sum(n for _, n, _ in results)
    for name, p in model.named_parameters():
        mean = sum(g[name] * n for g, n, _ in results) / total
        p.grad = torch.from_numpy(mean).to(p.dtype)
    optimizer.step()
    return sum(loss * n for _, n, loss in results) / total


def train_joint(tasks: Sequence[NtmTask], steps: int, *, federated: bool = False, progress=None) -> ProdLDA:
    """A model trained jointly on ``tasks`` (all already on one common vocabulary) for
    ``steps`` Sync-Opt steps, centralized or with per-node gradients; ``progress`` is
    called with (step, loss) after each step."""
    model = tasks[0].build_model()
    opt = tasks[0].make_optimizer(model.parameters())
    step_fn = federated_step if federated else centralized_step
    for step in range(steps):
        loss = step_fn(model, opt, tasks, step)
        if progress is not None:
            progress(step, loss)
    return model


# ---- factories -------------------------------------------------------------------
_COMMON_OPTIONS = {
    "shard",
    "shards",
    "seed",
    "n_topics",
    "batch_size",
    "hidden",
    "dropout",
    "lr",
    "prior_alpha",
    "corpus",
    "dtype",
    "holdout",
}

_HOLDOUT_STREAM = 4


def split_holdout(corpus: NodeCorpus, fraction: float, seed: int, shard: int) -> NodeCorpus:
    """The corpus with a random ``fraction`` of its training documents moved into ``val``
    (replacing the held-out set it had): the early-stopping split of gFedNTM Sec. 4.1
    ("we split the data into a 75 : 25 ratio"), drawn per node from ``(seed, shard)``
    so that a node's split is the same alone, in the pooled corpus and under a
    coordinator."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"holdout must be in (0, 1), got {fraction}")
    n = corpus.train.shape[0]
    n_hold = int(round(n * fraction))
    if n_hold < 2 or n - n_hold < 2:
        raise ConfigError(f"holdout {fraction} of {n} documents leaves too few on one side")
    perm = np.random.default_rng(_seed_of(seed, shard, _HOLDOUT_STREAM)).permutation(n)
    keep, hold = np.sort(perm[n_hold:]), np.sort(perm[:n_hold])
    ctx = corpus.train_context
    return NodeCorpus(
        list(corpus.terms),
        corpus.train[keep],
        corpus.train[hold],
        None if ctx is None else ctx[keep],
        None if ctx is None else ctx[hold],
    )


def _make(options: dict[str, Any], combined: bool) -> NtmTask:
    name = "combinedtm" if combined else "prodlda"
    known = _COMMON_OPTIONS | ntm_data.CORPUS_OPTIONS
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"{name}: unknown options {sorted(unknown)}; known: {sorted(known)}")
    shard, shards = int(options.get("shard", 0)), int(options.get("shards", 1))
    if not 0 <= shard < shards:
        raise ConfigError(f"{name}: shard {shard} not in 0..{shards - 1}")
    corpus = ntm_data.node_corpus(options, shard=shard, shards=shards, contextual=combined)
    if options.get("holdout") is not None:
        corpus = split_holdout(corpus, float(options["holdout"]), int(options.get("seed", 0)), shard)
    return NtmTask(
        corpus,
        combined=combined,
        shard=shard,
        seed=int(options.get("seed", 0)),
        n_topics=int(options.get("n_topics", DEFAULTS["n_topics"])),
        batch_size=int(options.get("batch_size", DEFAULTS["batch_size"])),
        hidden=int(options.get("hidden", DEFAULTS["hidden"])),
        dropout=float(options.get("dropout", DEFAULTS["dropout"])),
        lr=float(options.get("lr", DEFAULTS["lr"])),
        prior_alpha=float(options.get("prior_alpha", DEFAULTS["prior_alpha"])),
        dtype=str(options.get("dtype", DEFAULTS["dtype"])),
    )


def make_prodlda(options: dict[str, Any]) -> NtmTask:
    """ProdLDA on node ``shard`` of ``shards``; see :mod:`fedagent.tasks.ntm_data` for the
    corpus options (``corpus = "synthetic"`` or ``"newsgroups"``)."""
    return _make(options, combined=False)


def make_combinedtm(options: dict[str, Any]) -> NtmTask:
    """CombinedTM: ProdLDA plus document embeddings (``embedding = "sbert"`` by default)."""
    return _make(options, combined=True)
