"""The messages of Sync-Opt (gFedNTM): the coordinator's step, an agent's gradient, and
an agent's validation loss for early stopping (see :mod:`fedagent.protocols.syncopt`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import encode_weights
from fedagent.protocols.messages.vocabulary import MAX_DIGEST

Weights = dict[str, np.ndarray]

MAX_PARTICIPANTS = 100_000


@dataclass(frozen=True, slots=True)
class SyncStep(F.WireMessage):
    """Coordinator → all (Sync-Opt): compute the gradient of your mini-batch ``step`` at
    model ``model_version`` if you are among ``participants``. ``weights`` is None when
    every participant already holds that version (a repeated step): then only the
    version travels. ``validate`` (an epoch's end, early stopping): instead of a
    gradient, evaluate that model on your held-out documents and answer
    :class:`SyncValidation`. ``sliced_gradients``: the coordinator decodes gradients
    sent without their all-zero slices (absent from older coordinators: then every
    gradient goes whole)."""

    kind: ClassVar[str] = "sync_step"
    WIRE: ClassVar[F.Body] = F.Body(
        "sync_step",
        F.Field("step", F.Count()),
        F.Field("model_version", F.Count()),
        F.Field("participants", F.NodeIds(MAX_PARTICIPANTS)),
        F.Field("deadline_s", F.Number()),
        F.Field("vocab_digest", F.Text(max_len=MAX_DIGEST)),
        F.Field("weights", F.Tensors(), default=None, omit_default=True),
        F.Field("validate", F.Flag(), default=False, omit_default=True),
        F.Field("sliced_gradients", F.Flag(), default=False, omit_default=True),
    )
    step: int
    model_version: int
    participants: tuple[str, ...]
    deadline_s: float
    vocab_digest: str
    weights: Weights | None = field(default=None, repr=False)
    validate: bool = False
    sliced_gradients: bool = False

    def __post_init__(self) -> None:
        F.count(self.step, "sync_step", "step")
        F.count(self.model_version, "sync_step", "model_version")
        if not (math.isfinite(self.deadline_s) and 0 < self.deadline_s <= 7 * 86400):
            raise CodecError("sync_step: deadline out of range")
        if not isinstance(self.vocab_digest, str) or len(self.vocab_digest) > MAX_DIGEST:
            raise CodecError("sync_step: vocab_digest must be a string of at most 64 characters")


@dataclass(frozen=True, slots=True)
class SyncGradient(F.WireMessage):
    """Agent → coordinator (Sync-Opt): the gradient of the mean loss over the agent's
    mini-batch ``step`` at ``base_version``, the batch's size and its mean loss.

    ``sliced`` (not a wire field): encode the tensors without their all-zero slices
    (:func:`~fedagent.protocols.codec.encode_tensor_sliced`), for a coordinator whose
    step said ``sliced_gradients``. The receiver always accepts both forms and gets
    the same dense arrays, bit for bit."""

    kind: ClassVar[str] = "sync_gradient"
    WIRE: ClassVar[F.Body] = F.Body(
        "sync_gradient",
        F.Field("step", F.Count()),
        F.Field("base_version", F.Count()),
        F.Field("num_samples", F.Count(low=1)),
        F.Field("loss", F.Number()),
        F.Field("gradient", F.Tensors(sliced=True), value=lambda g: encode_weights(g.gradient, sliced=g.sliced)),
    )
    step: int
    base_version: int
    num_samples: int
    loss: float
    gradient: Weights = field(repr=False)
    sliced: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        F.count(self.step, "sync_gradient", "step")
        F.count(self.base_version, "sync_gradient", "base_version")
        F.count(self.num_samples, "sync_gradient", "num_samples", low=1)
        if not math.isfinite(self.loss):
            raise CodecError("sync_gradient: loss must be finite")


@dataclass(frozen=True, slots=True)
class SyncValidation(F.WireMessage):
    """Agent → coordinator (Sync-Opt early stopping): the mean validation loss of model
    ``base_version`` over the agent's ``num_docs`` held-out documents (one scalar and a
    count; no document leaves the node). ``num_docs`` = 0: it has none (``loss`` is then
    ignored). A non-finite loss is allowed: a diverged model is a non-improvement."""

    kind: ClassVar[str] = "sync_validation"
    WIRE: ClassVar[F.Body] = F.Body(
        "sync_validation",
        F.Field("step", F.Count()),
        F.Field("base_version", F.Count()),
        F.Field("loss", F.Number()),
        F.Field("num_docs", F.Count()),
    )
    step: int
    base_version: int
    loss: float
    num_docs: int

    def __post_init__(self) -> None:
        F.count(self.step, "sync_validation", "step")
        F.count(self.base_version, "sync_validation", "base_version")
        F.count(self.num_docs, "sync_validation", "num_docs")
        if not isinstance(self.loss, float):
            raise CodecError("sync_validation: loss must be a number")
