"""Vocabulary consensus without a coordinator (gossip mode), as pure code.

In a gossip federation nobody merges on everybody's behalf, so every agent merges by
itself and the agents then prove to each other that they got the same result:

1. **Offers.** Each agent sends its own offer (terms and counts, never a document) to
   every peer it sees come up (``SendOffer``), and again to a peer that comes back,
   since a restarted peer has lost what it had collected. Identical repeats are
   ignored; an offer from the same agent with different content is refused.
2. **Merge.** Once the offers of all ``expected_agents`` (itself included) are in, the
   agent merges them with :func:`fedagent.protocols.vocab.finalize`, the same merge
   the coordinator-run consensus uses: summed counts, ``min_count``/``max_size``,
   descending count then term. The result depends only on the set of offers, never on
   the order they arrived in, so agents with the same offers derive the same terms in
   the same order.
3. **Confirmation.** Each agent sends every other contributor the digest of its merged
   vocabulary with the list of contributors (``SendDigest``). It is ready
   (``Agreed``) once every other contributor has confirmed the same digest over the
   same contributors. Training starts only then: an agent never trains rows that a
   peer indexes differently.

Nothing here assumes a message arrives: a peer seen on mDNS may not have subscribed
yet, and MQTT drops what nobody is subscribed to. So until it has agreed, an agent
re-sends every ``resend`` seconds its offer to each peer it has no digest from and its
digest to each contributor that has not confirmed it. An agreed agent answers a digest
from a peer still confirming (``agreed=False``) with its own, marked ``agreed=True``;
agreed digests are never answered, so the exchange ends.

Defined failures (``Failed``, final for this machine; the daemon reports it and does
not train):

* ``missing-offers``: the deadline passed with fewer than ``expected_agents`` offers
  (the detail names who offered and, with ``members``, who did not);
* ``unconfirmed``: offers were complete but some contributors did not confirm before
  the deadline;
* ``mismatch``: a contributor confirmed another digest or another contributor set
  (e.g. more agents than ``expected_agents`` took part and two agents merged
  different subsets). Nobody proceeds on a vocabulary someone disagrees with.

Once agreed, the machine keeps serving late peers: a peer that comes up still gets
this agent's offer and digest, so a restarted member can finish its own consensus.
``VocabConsensus.resumed`` builds a machine already agreed (from the state file).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from fedagent.protocols.vocab import (
    MAX_TERMS,
    OfferRejected,
    RequestWakeup,
    VocabError,
    check_counts,
    finalize,
    vocabulary_digest,
)


@dataclass(frozen=True, slots=True)
class ConsensusConfig:
    expected_agents: int  # offers needed, this agent's own included
    deadline: float = 120.0  # seconds from start for offers and confirmations
    min_count: int = 1
    max_size: int = 0  # keep at most this many terms (0 = all)
    members: tuple[str, ...] | None = None  # if given: exactly these agents take part
    resend: float = 2.0  # seconds between re-sends until agreed

    def __post_init__(self) -> None:
        if self.expected_agents < 1:
            raise ValueError("expected_agents must be at least 1")
        if not (math.isfinite(self.deadline) and self.deadline > 0):
            raise ValueError("the vocabulary deadline must be a positive number of seconds")
        if not (math.isfinite(self.resend) and self.resend > 0):
            raise ValueError("resend must be a positive number of seconds")
        if self.min_count < 1 or not 0 <= self.max_size <= MAX_TERMS:
            raise ValueError(f"min_count >= 1 and 0 <= max_size <= {MAX_TERMS}")
        if self.members is not None and len(set(self.members)) != self.expected_agents:
            raise ValueError(f"members must name expected_agents ({self.expected_agents}) distinct agents")


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PeerUp:
    peer: str


@dataclass(frozen=True, slots=True)
class OfferReceived:
    sender: str
    terms: tuple[str, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DigestReceived:
    sender: str
    digest: str
    contributors: tuple[str, ...]
    agreed: bool = False  # the sender has agreed already: no answer wanted


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


Event = PeerUp | OfferReceived | DigestReceived | Wakeup


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SendOffer:
    peer: str


@dataclass(frozen=True, slots=True)
class SendDigest:
    peer: str
    digest: str
    contributors: tuple[str, ...]
    agreed: bool = False


@dataclass(frozen=True, slots=True)
class Agreed:
    """Every contributor confirmed this vocabulary: ``terms`` in index order."""

    terms: tuple[str, ...]
    counts: tuple[int, ...]
    contributors: tuple[str, ...]
    digest: str
    dropped_terms: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str  # missing-offers | unconfirmed | mismatch
    detail: str
    missing: tuple[str, ...] = ()


Command = SendOffer | SendDigest | Agreed | Failed | OfferRejected | RequestWakeup


class Phase(str, Enum):
    IDLE = "idle"
    COLLECTING = "collecting"
    CONFIRMING = "confirming"
    AGREED = "agreed"
    FAILED = "failed"


def offer_fingerprint(terms: Iterable[str], counts: Iterable[int]) -> str:
    h = hashlib.sha256()
    for t, c in zip(terms, counts):
        h.update(f"{t}\t{c}\n".encode())
    return h.hexdigest()[:32]


class VocabConsensus:
    """One agent's side of the coordinator-free consensus (module docstring)."""

    def __init__(self, node_id: str, config: ConsensusConfig, terms: Iterable[str], counts: Iterable[int]) -> None:
        terms, counts = tuple(terms), tuple(counts)
        check_counts(terms, counts)
        if config.members is not None and node_id not in config.members:
            raise ValueError(f"{node_id} is not among the members {list(config.members)}")
        self.node_id = node_id
        self.config = config
        self.phase = Phase.IDLE
        self.deadline = math.inf
        self._offers: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {node_id: (terms, counts)}
        self._fingerprints: dict[str, str] = {node_id: offer_fingerprint(terms, counts)}
        self.digests: dict[str, tuple[str, tuple[str, ...]]] = {}  # sender -> (digest, contributors)
        self.candidate: Agreed | None = None
        self.result: Agreed | None = None
        self.failure: Failed | None = None
        self.peers_seen: set[str] = set()

    @classmethod
    def resumed(
        cls, node_id: str, config: ConsensusConfig, own_terms: Iterable[str], own_counts: Iterable[int], agreed: Agreed
    ) -> VocabConsensus:
        """A machine that agreed in an earlier run: it only serves peers."""
        m = cls(node_id, config, own_terms, own_counts)
        m.candidate = m.result = agreed
        m.phase = Phase.AGREED
        return m

    @property
    def offers(self) -> tuple[str, ...]:
        return tuple(sorted(self._offers))

    def start(self, now: float) -> list[Command]:
        if self.phase is not Phase.IDLE:
            return []
        self.phase = Phase.COLLECTING
        self.deadline = now + self.config.deadline
        return [RequestWakeup(min(self.deadline, now + self.config.resend)), *self._maybe_merge()]

    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, PeerUp):
            return self._on_peer(event.peer)
        if isinstance(event, OfferReceived):
            return self._on_offer(event)
        if isinstance(event, DigestReceived):
            return self._on_digest(event, now)
        if isinstance(event, Wakeup):
            return self._on_wakeup(now)
        raise TypeError(f"not a vocabulary consensus event: {event!r}")

    def status(self) -> dict[str, object]:
        done = self.result or self.candidate
        return {
            "phase": self.phase.value,
            "expected": self.config.expected_agents,
            "offers": list(self.offers),
            "confirmed": sorted(s for s, (d, _) in self.digests.items() if done and d == done.digest),
            "digest": done.digest if done else None,
            "terms": len(done.terms) if done else None,
            "error": f"{self.failure.reason}: {self.failure.detail}" if self.failure else None,
        }

    # -- events --------------------------------------------------------------------------
    def _on_peer(self, peer: str) -> list[Command]:
        if peer == self.node_id or (self.config.members is not None and peer not in self.config.members):
            return []
        self.peers_seen.add(peer)
        out: list[Command] = [SendOffer(peer)]
        done = self.result or self.candidate
        if done is not None and peer in done.contributors:
            out.append(SendDigest(peer, done.digest, done.contributors, self.result is not None))
        return out

    def _on_offer(self, ev: OfferReceived) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            return [OfferRejected(ev.sender, reason, detail)]

        if ev.sender == self.node_id:
            return reject("self", "an offer under this agent's own id")
        if self.config.members is not None and ev.sender not in self.config.members:
            return reject("unexpected", f"{ev.sender} is not a member")
        try:
            check_counts(ev.terms, ev.counts)
        except VocabError as exc:
            return reject(exc.reason, exc.detail)
        fp = offer_fingerprint(ev.terms, ev.counts)
        known = self._fingerprints.get(ev.sender)
        if known is not None:
            # Peers re-send their offer whenever they see us come up: the same offer
            # again is expected; a different one would change a merge already made.
            return [] if known == fp else reject("changed", f"{ev.sender} offered a different vocabulary before")
        if self.phase is not Phase.COLLECTING and self.phase is not Phase.IDLE:
            return reject("late", f"vocabulary already {self.phase.value} without {ev.sender}")
        self._offers[ev.sender] = (ev.terms, ev.counts)
        self._fingerprints[ev.sender] = fp
        return self._maybe_merge() if self.phase is Phase.COLLECTING else []

    def _on_digest(self, ev: DigestReceived, now: float) -> list[Command]:
        if ev.sender == self.node_id:
            return []
        self.digests[ev.sender] = (ev.digest, tuple(sorted(ev.contributors)))
        if self.phase is Phase.CONFIRMING:
            return self._check_confirmations()
        r = self.result
        if self.phase is Phase.AGREED and r is not None and not ev.agreed and ev.sender in r.contributors:
            # The sender still waits for our confirmation (ours may have been lost).
            return [SendDigest(ev.sender, r.digest, r.contributors, True)]
        return []

    def _on_wakeup(self, now: float) -> list[Command]:
        if self.phase not in (Phase.COLLECTING, Phase.CONFIRMING):
            return []
        if now < self.deadline:
            out: list[Command] = [RequestWakeup(min(self.deadline, now + self.config.resend))]
            c = self.candidate
            for p in sorted(self.peers_seen):
                if p not in self.digests:
                    out.append(SendOffer(p))
                if c is not None and p in c.contributors and self.digests.get(p, ("",))[0] != c.digest:
                    out.append(SendDigest(p, c.digest, c.contributors))
            return out
        if self.phase is Phase.COLLECTING:
            have = sorted(self._offers)
            missing: tuple[str, ...] = ()
            if self.config.members is not None:
                missing = tuple(sorted(set(self.config.members) - set(have)))
            detail = (
                f"{len(have)} of {self.config.expected_agents} offers after {self.config.deadline:g} s "
                f"(from {', '.join(have)})" + (f"; missing: {', '.join(missing)}" if missing else "")
            )
            return self._fail("missing-offers", detail, missing)
        assert self.candidate is not None
        missing = tuple(
            sorted(
                c
                for c in self.candidate.contributors
                if c != self.node_id and self.digests.get(c, ("",))[0] != self.candidate.digest
            )
        )
        return self._fail(
            "unconfirmed", f"no confirmation from {', '.join(missing)} after {self.config.deadline:g} s", missing
        )

    # -- merge and confirmation ----------------------------------------------------------
    def _maybe_merge(self) -> list[Command]:
        cfg = self.config
        if len(self._offers) < cfg.expected_agents:
            return []
        total: dict[str, int] = {}
        for terms, counts in self._offers.values():
            for t, c in zip(terms, counts):
                total[t] = total.get(t, 0) + c
        merged = finalize(total, min_count=cfg.min_count, max_size=cfg.max_size or MAX_TERMS)
        terms = tuple(t for t, _ in merged)
        contributors = tuple(sorted(self._offers))
        self.candidate = Agreed(
            terms, tuple(c for _, c in merged), contributors, vocabulary_digest(terms), len(total) - len(merged)
        )
        self.phase = Phase.CONFIRMING
        out: list[Command] = [
            SendDigest(p, self.candidate.digest, contributors) for p in contributors if p != self.node_id
        ]
        return out + self._check_confirmations()

    def _check_confirmations(self) -> list[Command]:
        c = self.candidate
        assert c is not None
        for peer, (digest, contributors) in sorted(self.digests.items()):
            if peer in c.contributors and (digest != c.digest or contributors != c.contributors):
                return self._fail(
                    "mismatch",
                    f"{peer} merged {digest[:12]} over [{', '.join(contributors)}], "
                    f"this agent {c.digest[:12]} over [{', '.join(c.contributors)}]",
                    (peer,),
                )
        if all(p == self.node_id or p in self.digests for p in c.contributors):
            self.result = c
            self.phase = Phase.AGREED
            return [c]
        return []

    def _fail(self, reason: str, detail: str, missing: tuple[str, ...]) -> list[Command]:
        self.failure = Failed(reason, detail, missing)
        self.phase = Phase.FAILED
        return [self.failure]


__all__ = [
    "Agreed",
    "ConsensusConfig",
    "DigestReceived",
    "Failed",
    "OfferReceived",
    "OfferRejected",
    "PeerUp",
    "Phase",
    "RequestWakeup",
    "SendDigest",
    "SendOffer",
    "VocabConsensus",
    "Wakeup",
    "offer_fingerprint",
]
