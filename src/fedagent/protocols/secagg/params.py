"""A secure round's parameters: the quantisation and the threshold every agent of the
round uses (:class:`SecAggParams`), and what a round start adds for a secure round
(:class:`SecAggSetup`), with the limits the other modules share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from fedagent.errors import CodecError
from fedagent.protocols import fields as F
from fedagent.protocols.codec import Limits

MODULUS_BITS = 32  # masked sums live in uint32 and wrap
MAX_NEIGHBOURS = 1024
MAX_CERT = 8192
SECAGG_VERSION = 2  # carried by every round's setup; 2: keys advertised a round ahead
MAX_CLIP = 1e6  # largest quantisation range (SecAggParams.clip)
MAX_LIST = 100_000  # most names in a round's selection or survivor list


class SecAggError(Exception):
    """The protocol cannot go on for this agent or round (a refusal, a bad message)."""


@dataclass(frozen=True, slots=True)
class SecAggParams(F.WireMessage):
    WIRE: ClassVar[F.Body] = F.Body(
        "secure aggregation",
        F.Field("clip", F.Number(send_float=True)),
        F.Field("bits", F.Count()),
        F.Field("neighbours", F.Count()),
        F.Field("threshold", F.Number(send_float=True)),
        F.Field("min_survivors", F.Count()),
        exact=True,
    )
    clip: float = 1.0  # each coordinate of a weighted update is clipped to [-clip, clip]
    bits: int = 20  # quantisation levels 2^bits
    neighbours: int = 0  # graph degree k (0: 2⌈log₂ n⌉, at most n − 1)
    threshold: float = 0.5  # a secret needs strictly more than this fraction of its holders
    min_survivors: int = 2  # fewer masked inputs than this: the round is abandoned

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
            raise CodecError("secure aggregation: clip must be a number")
        if not (math.isfinite(self.clip) and 0 < self.clip <= MAX_CLIP):
            raise CodecError(f"secure aggregation: clip must be in (0, {MAX_CLIP:g}]")
        if type(self.bits) is not int or not 2 <= self.bits <= 30:
            raise CodecError("secure aggregation: bits must be an integer in [2, 30]")
        if type(self.neighbours) is not int or not 0 <= self.neighbours <= MAX_NEIGHBOURS:
            raise CodecError(f"secure aggregation: neighbours must be an integer in [0, {MAX_NEIGHBOURS}]")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise CodecError("secure aggregation: threshold must be a number")
        if not 0.5 <= self.threshold < 1:
            raise CodecError(
                "secure aggregation: threshold must be in [0.5, 1): at or below half the holders "
                "a coordinator could collect both shares of an agent from different holders"
            )
        if type(self.min_survivors) is not int or not 2 <= self.min_survivors <= 100_000:
            raise CodecError("secure aggregation: min_survivors must be at least 2 (one input alone is not hidden)")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        return 2.0 * self.clip / self.levels

    @property
    def max_agents(self) -> int:
        """Most masked inputs whose sum cannot wrap mod 2³²."""
        return ((1 << MODULUS_BITS) - 1) // self.levels

    def error_bound(self, weight_sum: float, survivors: int) -> float:
        """Largest quantisation error of one coordinate of the averaged update."""
        return survivors * self.step / 2 / weight_sum

    def threshold_of(self, holders: int) -> int:
        """Shares needed to rebuild a secret held by ``holders`` agents."""
        return min(holders, math.floor(self.threshold * holders) + 1)


@dataclass(frozen=True, slots=True)
class SecAggSetup(F.WireMessage):
    """What a round start adds for a secure round (the round and the selected agents
    are the round start's own). On the wire its ``version`` comes first: a node that
    speaks another says so rather than misreading the rest."""

    WIRE: ClassVar[F.Body] = F.Body(
        "secure aggregation",
        F.Field("params", F.Nested(SecAggParams)),
        F.Field("seed", F.Binary(16, 16)),
        F.Field("max_weight", F.Count(low=1)),
        F.Field("next_round", F.Count()),
        F.Field("ahead", F.Flag()),
    )
    params: SecAggParams
    seed: bytes  # shuffles the neighbour graph; also binds keys and masks to this round
    max_weight: int  # samples weighing 1 (W)
    # The secure round whose keys the agents advertise ahead, with their masked input
    # (0: none); and whether this round uses the keys advertised in the previous one
    # (no key stage) or asks for fresh ones.
    next_round: int = 0
    ahead: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.seed, bytes) or len(self.seed) != 16:
            raise CodecError("secure aggregation: seed must be 16 bytes")
        if type(self.max_weight) is not int or not 1 <= self.max_weight < 2**53:
            raise CodecError("secure aggregation: max_weight must be a positive integer")
        if type(self.next_round) is not int or not 0 <= self.next_round < 2**53:
            raise CodecError("secure aggregation: next_round must be a non-negative integer")
        if not isinstance(self.ahead, bool):
            raise CodecError("secure aggregation: ahead must be a bool")

    def to_body(self) -> dict[str, Any]:
        return {"version": SECAGG_VERSION, **self.WIRE.write(self)}

    @classmethod
    def from_body(cls, body: Any, limits: Limits = F.DEFAULT_LIMITS) -> SecAggSetup:
        version = F.is_map(body, "secure aggregation").get("version", 1)
        if version != SECAGG_VERSION:
            raise CodecError(
                f"secure aggregation version {version!r} from the coordinator; this node speaks "
                f"{SECAGG_VERSION} (upgrade the older side)"
            )
        return cls(**cls.WIRE.read(body, limits))

    def context(self, round_: int) -> bytes:
        return b"round=%d|" % round_ + self.seed

    def ratio(self, num_samples: int) -> float:
        return min(num_samples, self.max_weight) / self.max_weight
