"""A model's fingerprint: every tensor of its ``state_dict`` with its shape, its dtype and
what it is to the model (pure code; the torch side that reads a module is
:mod:`fedagent.tasks.fingerprint`).

Every node builds the task's model and announces the digest of its fingerprint in its
presence, so that a node whose model differs is found when it arrives, not when its
first update fails to fit. Two nodes whose digests differ exchange their fingerprints
(:class:`~fedagent.protocols.messages.ModelCheck`) and each names the first tensor that
differs, with both sides' view of it.

What a tensor is decides how a round treats it (:meth:`Fingerprint.roles`):

``parameter``  trained by the agents (``requires_grad``): moved by the server step
               (``server_lr``, server momentum);
``frozen``     a parameter nobody trains: every agent sends it back unchanged;
``buffer``     state the model computes rather than learns (BatchNorm's running mean and
               variance, its batch counter): the sample-weighted mean of the agents'
               values, never extrapolated by the server step, so a variance stays a
               variance.

``norm`` marks the tensors of a normalisation layer, which ``[rounds] local_norm``
(FedBN) keeps on each agent. ``tied_to`` names the first name of a tensor that the model
holds under two names (an output layer tied to its embedding): both names travel, with
the same values.

Dtypes: a tensor travels in its own dtype, except ``bfloat16``, which numpy has no type
for: inside fedagent (the wire, the aggregate, checkpoints) it is float32, which holds
every bfloat16 value exactly, and the fingerprint keeps the model's dtype so that loading
the weights into a model or exporting them turns it back (round to nearest even).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from fedagent.errors import CodecError
from fedagent.protocols import fields as F

KINDS = ("parameter", "frozen", "buffer")
#: Model dtype -> the numpy dtype its values have inside fedagent.
TRAVELS: dict[str, str] = {
    "float16": "float16",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}
MAX_TENSORS = 10_000
MAX_NAME = 200
MAX_DIMS = 8
DIGEST_CHARS = 32


@dataclass(frozen=True, slots=True)
class TensorInfo(F.WireMessage):
    """One ``state_dict`` entry."""

    WIRE: ClassVar[F.Body] = F.Body(
        "model tensor",
        F.Field("name", F.Text(max_len=MAX_NAME, min_len=1, printable=True)),
        F.Field("dtype", F.Text(max_len=32, min_len=1, printable=True)),
        F.Field("shape", F.Items(MAX_DIMS, F.Count())),
        F.Field("kind", F.Text(max_len=16)),
        F.Field("tied_to", F.Text(max_len=MAX_NAME), default="", omit_default=True),
        F.Field("norm", F.Flag(), default=False, omit_default=True),
    )
    name: str
    dtype: str  # the model's dtype, as torch names it without "torch."
    shape: tuple[int, ...]
    kind: str
    tied_to: str = ""
    norm: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CodecError(f"model tensor {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.shape, tuple) or any(type(d) is not int or d < 0 for d in self.shape):
            raise CodecError(f"model tensor {self.name!r}: shape must be a tuple of non-negative ints")

    @property
    def trainable(self) -> bool:
        return self.kind == "parameter"

    def describe(self) -> str:
        """``float32[64, 8] parameter`` (``, tied to embed.weight``, ``, normalisation``)."""
        text = f"{self.dtype}[{', '.join(map(str, self.shape))}] {self.kind}"
        if self.tied_to:
            text += f" tied to {self.tied_to}"
        if self.norm:
            text += " of a normalisation layer"
        return text


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The tensors of a model's ``state_dict``, in its order."""

    tensors: tuple[TensorInfo, ...]

    def __post_init__(self) -> None:
        if len(self.tensors) > MAX_TENSORS:
            raise CodecError(f"a model fingerprint lists at most {MAX_TENSORS} tensors")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise CodecError("a model fingerprint names a tensor twice")

    @property
    def digest(self) -> str:
        """A short hash of everything listed (the order included): equal digests, equal models."""
        canon = [[t.name, t.dtype, list(t.shape), t.kind, t.tied_to, t.norm] for t in self.tensors]
        return hashlib.sha256(msgpack.packb(canon, use_bin_type=True)).hexdigest()[:DIGEST_CHARS]

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def names(self, *kinds: str) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors if t.kind in kinds)

    @property
    def buffers(self) -> frozenset[str]:
        return self.names("buffer")

    @property
    def local_norm(self) -> frozenset[str]:
        """The tensors ``[rounds] local_norm`` keeps on each agent (FedBN)."""
        return frozenset(t.name for t in self.tensors if t.norm)

    def model_dtypes(self) -> dict[str, str]:
        """The tensors whose model dtype is not the one they have inside fedagent
        (bfloat16), with that dtype: what a checkpoint records to restore them."""
        return {t.name: t.dtype for t in self.tensors if TRAVELS.get(t.dtype, t.dtype) != t.dtype}

    def kinds(self) -> dict[str, str]:
        return {t.name: t.kind for t in self.tensors}

    def roles(self, *, local_norm: bool = False) -> Roles:
        """How a FedAvg round treats each tensor (module docstring)."""
        kept = self.local_norm if local_norm else frozenset()
        fixed = frozenset(t.name for t in self.tensors if not t.trainable) | kept
        return Roles(buffers=self.buffers - kept, fixed=fixed, kept=kept)

    def meta(self, *, kept: frozenset[str] = frozenset()) -> dict[str, object]:
        """What a checkpoint records of the model (its ``meta["model"]``): the digest, the
        tensors whose model dtype is not the array's (bfloat16), the buffers, the frozen
        parameters and the layers kept on the agents; every other tensor is a parameter."""
        return {
            "digest": self.digest,
            "dtypes": self.model_dtypes(),
            "buffers": sorted(self.buffers),
            "frozen": sorted(self.names("frozen")),
            "kept": sorted(kept),
        }

    def to_wire(self) -> list[dict]:
        return [t.to_body() for t in self.tensors]

    @classmethod
    def from_wire(cls, items: Iterable[TensorInfo]) -> Fingerprint:
        return cls(tuple(items))


@dataclass(frozen=True, slots=True)
class Roles:
    """What a round does with each tensor beyond averaging it (names):

    ``buffers``  averaged from the agents' values in float64, sent exact (never as a
                 compressed step): a mean of non-negative values is non-negative;
    ``fixed``    not moved by the server step (buffers, frozen parameters, ``kept``): the
                 aggregate as it is, no momentum;
    ``kept``     the global model's value stays (``local_norm``: each agent keeps its own).
    """

    buffers: frozenset[str] = frozenset()
    fixed: frozenset[str] = frozenset()
    kept: frozenset[str] = frozenset()


def first_difference(ours: Fingerprint, theirs: Fingerprint, *, here: str = "here", there: str = "there") -> str:
    """The first tensor (in our order, then theirs) that the two models do not share
    alike, with both sides' view of it; "" when the fingerprints are equal."""
    mine, other = ours.by_name(), theirs.by_name()
    for t in ours.tensors:
        o = other.get(t.name)
        if o is None:
            return f"tensor {t.name!r}: {t.describe()} {here}, absent {there}"
        if o != t:
            return f"tensor {t.name!r}: {t.describe()} {here}, {o.describe()} {there}"
    for o in theirs.tensors:
        if o.name not in mine:
            return f"tensor {o.name!r}: absent {here}, {o.describe()} {there}"
    if [t.name for t in ours.tensors] != [o.name for o in theirs.tensors]:
        return f"the same tensors in another order ({here} {ours.tensors[0].name!r} first, {there} {theirs.tensors[0].name!r})"
    return ""
