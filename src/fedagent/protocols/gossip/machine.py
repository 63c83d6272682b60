"""The gossip machine: a node's periods (train, send, merge), its inbox, its sends in
flight and their acknowledgements, and push-sum's mass bookkeeping (the package's
docstring says how and why). The merge rules themselves are
:mod:`~fedagent.protocols.gossip.merge`."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedagent.protocols.aggregation import UpdateRejected, check_update, clip_to
from fedagent.protocols.gossip.config import GossipConfig, neighbours_needed
from fedagent.protocols.gossip.events import (
    AckReceived,
    Command,
    Dropped,
    Event,
    Finished,
    ModelChanged,
    ModelReceived,
    PeerDown,
    PeerUp,
    RequestWakeup,
    SendAck,
    SendFailed,
    SendModel,
    Start,
    Train,
    TrainingDone,
    Wakeup,
)
from fedagent.protocols.gossip.merge import distance, mass_weighted_mean, outer_step, screen

Weights = dict[str, np.ndarray]

_SEEN_IDS = 4096  # (sender, exchange id) pairs remembered for deduplication
_MAX_NEIGHBOURS = 1024  # latest models kept for a screening merge (senders hold certificates)


@dataclass(frozen=True, slots=True)
class Resume:
    """A checkpoint's position: the period its model was saved at, that model's age and
    the push-sum mass the node held (None: its ``num_samples``, as at a first start)."""

    period: int
    age: float
    mass: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.period, int) and not isinstance(self.period, bool) and self.period >= 0):
            raise ValueError(f"a resumed period must be a non-negative integer, not {self.period!r}")
        if not (isinstance(self.age, (int, float)) and math.isfinite(self.age) and self.age >= 0):
            raise ValueError(f"a resumed age must be non-negative and finite, not {self.age!r}")
        if self.mass is not None and not (
            isinstance(self.mass, (int, float)) and math.isfinite(self.mass) and self.mass > 0
        ):
            raise ValueError(f"a resumed mass must be positive and finite, not {self.mass!r}")

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> Resume | None:
        """The position a checkpoint's metadata records (``period``, ``age``, ``mass``);
        None when period or age is missing or malformed. A malformed mass alone gives
        the first start's mass rather than none."""
        mass = meta.get("mass")
        ok_mass = isinstance(mass, (int, float)) and not isinstance(mass, bool) and math.isfinite(mass) and mass > 0
        age = meta.get("age")
        if isinstance(age, bool) or not isinstance(age, (int, float)):
            return None
        try:
            return cls(meta.get("period"), float(age), float(mass) if ok_mass else None)  # type: ignore[arg-type]
        except ValueError:
            return None


# ---- internals ---------------------------------------------------------------------
@dataclass(slots=True)
class _Payload:
    values: Weights  # exchanged parameters
    mass: float
    age: float


@dataclass(slots=True)
class _InFlight:
    peer: str
    payload: _Payload
    deadline: float
    returned: bool
    tried: set[str]


@dataclass(slots=True)
class _Kept:
    sender: str
    exchange_id: str
    payload: _Payload


class GossipMachine:
    def __init__(
        self,
        node_id: str,
        config: GossipConfig,
        weights: Weights,
        *,
        num_samples: int = 1,
        session: str = "0",
        resume: Resume | None = None,
    ) -> None:
        """``session`` must differ between process starts (exchange ids embed it).
        ``resume``: where a restarted node's checkpoint of ``weights`` left it."""
        if not weights:
            raise ValueError("a gossip node needs a model")
        if not num_samples > 0:
            raise ValueError("num_samples must be positive")
        names = tuple(weights) if config.exchange is None else config.exchange
        unknown = sorted(set(names) - set(weights))
        if unknown:
            raise ValueError(f"exchanged parameters not in the model: {unknown[:3]}")
        self.node_id = node_id
        self.config = config
        # A screening merge ignores masses, so none of push-sum's mass bookkeeping applies.
        self._pushsum = config.merge == "pushsum" and not config.robust
        self.names = names
        self.model: Weights = dict(weights)
        self.mass = float(num_samples)
        self.age = 0.0
        self.period = 0
        if resume is not None:
            # A restart goes on from its checkpoint's period, age and mass. Counted from
            # zero again it would train the whole ``periods`` anew (long after the others
            # finished), at the step size of the schedule's start, its age 0 would make
            # its own trained model sit out its first merge as a newcomer's (catch-up),
            # and it would pull the others' ages down.
            self.period, self.age = resume.period, resume.age
            if resume.mass is not None:
                self.mass = resume.mass
        self.started = False
        self.finished = False
        self.peers: set[str] = set()
        self._session = session
        self._rng = random.Random(f"{config.seed}/{node_id}")
        self._next_xid = 0
        self._next_train = 0
        self._merged_once = False
        # thesis lastModel (Alg. 3.1 starts with lastModel <- currentModel)
        self._last = _Payload({k: weights[k] for k in names}, 1.0, 0.0)
        self._inbox: list[_Kept] = []
        self._arrivals = 0  # this period, for reservoir sampling
        self._home: list[_Payload] = []  # our own mass back: refused, returned, given up
        self._in_flight: dict[str, _InFlight] = {}
        self._expired: deque[str] = deque(maxlen=_SEEN_IDS)
        self._seen: dict[tuple[str, str], bool] = {}  # -> accepted
        self._seen_order: deque[tuple[str, str]] = deque()
        # screening: each neighbour's latest model and the period it arrived in
        self._latest: dict[str, tuple[Weights, int]] = {}
        # the period's create plan: jobs still to train and results collected
        self._train_id: int | None = None
        self._jobs: list[tuple[Weights, float]] = []
        self._results: list[tuple[Weights, float]] = []
        self._merge_all = False
        self.disagreement: float | None = None
        self.disagreement_rel: float | None = None
        # How far behind this node the models it merges are, in local steps (its age
        # minus theirs): agents that train at unequal speeds merge stale models.
        self.lag: float | None = None
        self._lag_sum = 0.0
        self._lag_count = 0
        self.counts = dict.fromkeys(
            (
                "sent",
                "received",
                "dropped",
                "rejected",
                "refused",
                "returned",
                "bounced",
                "acked",
                "timeouts",
                "retries",
                "reclaimed",
                "late_acks",
                "duplicates",
                "merged",
                "train_rejected",
                "caught_up",
                "screened",
                "screen_short",
            ),
            0,
        )

    # -- public ------------------------------------------------------------------------
    @property
    def weights(self) -> Weights:
        return self.model

    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, Start):
            if self.started:
                return []
            self.started = True
            if self.config.periods and self.period >= self.config.periods:
                # Restarted after its last period: nothing is left to train.
                self.finished = True
                return [Finished(self.period, self.model)]
            return self._plan([(self.model, self.mass)], merge_all=False)
        if isinstance(event, PeerUp):
            if event.peer != self.node_id:
                self.peers.add(event.peer)
            return []
        if isinstance(event, PeerDown):
            self.peers.discard(event.peer)
            self._latest.pop(event.peer, None)
            out: list[Command] = []
            for xid in [x for x, f in self._in_flight.items() if f.peer == event.peer]:
                out += self._reroute(xid, now)
            return out
        if isinstance(event, TrainingDone):
            return self._on_trained(event, now)
        if isinstance(event, ModelReceived):
            return self._on_model(event, now)
        if isinstance(event, AckReceived):
            return self._on_ack(event)
        if isinstance(event, SendFailed):
            if event.exchange_id not in self._in_flight:
                return []
            return self._reroute(event.exchange_id, now)
        if isinstance(event, Wakeup):
            out = []
            for xid in [x for x, f in self._in_flight.items() if f.deadline <= now]:
                self.counts["timeouts"] += 1
                out += self._reroute(xid, now)
            return out
        raise TypeError(f"not a gossip event: {event!r}")

    def status(self) -> dict[str, object]:
        """Counters: ``sent`` (models, incl. retries and returns), ``received`` (taken into
        custody), ``dropped`` (inbox full), ``rejected`` (invalid or finished), ``refused``
        / ``acked`` (answers to our sends), ``returned`` (our mass sent back), ``bounced``
        (evicted models we sent back), ``timeouts``, ``retries``, ``reclaimed``,
        ``late_acks``, ``duplicates``, ``merged``; ``age`` in local steps; ``disagreement``
        = mean L2 distance of our exchanged parameters from the models merged at the last
        boundary that had any (``disagreement_rel`` divides by our model's norm); ``lag``
        = our age minus theirs at that boundary, in local steps (positive: they are older),
        and ``lag_mean`` the same over every model merged so far (push-sum and average
        merges: screening payloads carry no age)."""
        return {
            "period": self.period,
            "merge": self.config.merge,
            "create": self.config.create,
            "age": self.age,
            "mass": self.mass,
            "peers": sorted(self.peers),
            "in_flight": len(self._in_flight),
            "inbox": len(self._inbox),
            "disagreement": self.disagreement,
            "disagreement_rel": self.disagreement_rel,
            "lag": self.lag,
            "lag_mean": self._lag_sum / self._lag_count if self._lag_count else None,
            "finished": self.finished,
            **self.counts,
        }

    # -- receiving ---------------------------------------------------------------------
    def _on_model(self, ev: ModelReceived, now: float) -> list[Command]:
        key = (ev.sender, ev.exchange_id)
        if key in self._seen:
            # QoS 1 redelivery: decided already (kept, or refused and reclaimed by the
            # sender); deciding again could merge one payload twice.
            self.counts["duplicates"] += 1
            return [SendAck(ev.sender, ev.exchange_id, self._seen[key], "duplicate")]

        def refuse(reason: str, detail: str) -> list[Command]:
            self.counts["rejected"] += 1
            return [
                Dropped(ev.sender, ev.exchange_id, reason, detail),
                SendAck(ev.sender, ev.exchange_id, False, reason),
            ]

        if self.finished:
            return refuse("finished", f"{self.node_id} stopped after period {self.period}")
        if ev.returned and not self._pushsum:
            return refuse("returned", "returned models exist only with merge='pushsum'")
        if not (isinstance(ev.mass, (int, float)) and math.isfinite(ev.mass) and ev.mass > 0):
            return refuse("mass", f"mass must be positive and finite, got {ev.mass!r}")
        if not (isinstance(ev.age, (int, float)) and math.isfinite(ev.age) and ev.age >= 0):
            return refuse("age", f"age must be non-negative and finite, got {ev.age!r}")
        own = {k: self.model[k] for k in self.names}
        try:
            check_update(own, ev.weights, max_norm=self.config.max_norm)
        except UpdateRejected as exc:
            return refuse(exc.reason, exc.detail)
        self._remember(key, True)
        self.counts["received"] += 1
        values = dict(ev.weights)
        if self.config.clip_norm is not None and not ev.returned:
            # Push-sum's merge is a mass-weighted mean, which one peer sending an
            # arbitrary model controls entirely; capping how far a received model may
            # sit from ours bounds that pull (the mean is then no longer exact).
            values = clip_to(own, values, self.config.clip_norm)
        payload = _Payload(values, float(ev.mass), float(ev.age))
        ack = SendAck(ev.sender, ev.exchange_id, True)
        if self.config.robust:
            # Only a neighbour's newest model counts: a Byzantine peer sending many models
            # still fills one slot, and the screening sees each sender at most once.
            self._latest.pop(ev.sender, None)
            self._latest[ev.sender] = (values, self.period)
            if len(self._latest) > _MAX_NEIGHBOURS:
                self._latest.pop(next(iter(self._latest)))
            return [ack]
        if ev.returned:
            self.counts["returned"] += 1
            self._home.append(payload)
            return [ack]
        # Reservoir sampling: after j arrivals each one is kept with probability k/j,
        # so the kept ones are a uniform random k-subset, decided without a deadline.
        k = self.config.max_incoming
        self._arrivals += 1
        item = _Kept(ev.sender, ev.exchange_id, payload)
        if len(self._inbox) < k:
            self._inbox.append(item)
            return [ack]
        self.counts["dropped"] += 1
        slot = self._rng.randrange(self._arrivals)
        if slot >= k:
            # Dropped on arrival: refusing it hands the mass back without weights travelling.
            self._remember(key, False)
            return [
                Dropped(ev.sender, ev.exchange_id, "inbox-full", f"{self._arrivals} arrivals this period"),
                SendAck(ev.sender, ev.exchange_id, False, "inbox-full"),
            ]
        victim, self._inbox[slot] = self._inbox[slot], item
        out: list[Command] = [
            ack,
            Dropped(
                victim.sender,
                victim.exchange_id,
                "inbox-full",
                f"evicted by {ev.sender} ({self._arrivals} arrivals this period)",
            ),
        ]
        if self._pushsum:
            # Already acknowledged, so its mass is ours to give back.
            self.counts["bounced"] += 1
            out += self._send(victim.sender, victim.payload, now, returned=True)
        return out

    def _remember(self, key: tuple[str, str], accepted: bool) -> None:
        if key not in self._seen:
            self._seen_order.append(key)
        self._seen[key] = accepted
        if len(self._seen_order) > _SEEN_IDS:
            self._seen.pop(self._seen_order.popleft(), None)

    def _on_ack(self, ev: AckReceived) -> list[Command]:
        f = self._in_flight.get(ev.exchange_id)
        if f is None or f.peer != ev.sender:
            if ev.accepted and ev.exchange_id in self._expired:
                self._expired.remove(ev.exchange_id)
                self.counts["late_acks"] += 1  # merged there *and* re-sent/folded here
            return []
        del self._in_flight[ev.exchange_id]
        if ev.accepted:
            self.counts["acked"] += 1
            return []
        self.counts["refused"] += 1
        if self._pushsum:
            self._home.append(f.payload)
        return []

    # -- sending -----------------------------------------------------------------------
    def _send(
        self, peer: str, payload: _Payload, now: float, *, returned: bool = False, tried: set[str] | None = None
    ) -> list[Command]:
        self._next_xid += 1
        xid = f"{self._session}.{self._next_xid}"
        deadline = now + self.config.send_timeout
        self._in_flight[xid] = _InFlight(peer, payload, deadline, returned, (tried or set()) | {peer})
        self.counts["sent"] += 1
        return [SendModel(peer, xid, payload.values, payload.mass, payload.age, returned), RequestWakeup(deadline)]

    def _reroute(self, xid: str, now: float) -> list[Command]:
        """A send was lost (timeout, failure, peer down): a new peer, never a stall."""
        f = self._in_flight.pop(xid)
        self._expired.append(xid)
        candidates = sorted(self.peers - f.tried)
        if not f.returned and candidates and len(f.tried) <= self.config.max_retries:
            self.counts["retries"] += 1
            return self._send(self._rng.choice(candidates), f.payload, now, tried=f.tried)
        if self._pushsum:
            self.counts["reclaimed"] += 1
            self._home.append(f.payload)
        return []

    # -- the period --------------------------------------------------------------------
    def _boundary(self, now: float) -> list[Command]:
        cfg = self.config
        self.period += 1
        if cfg.robust:
            return self._screening_boundary(now)
        pushsum = self._pushsum
        if cfg.periods and self.period >= cfg.periods:
            # The last step is a MERGE without UPDATE: what came home and what the inbox
            # kept are folded in, so the final model is a consensus estimate rather than
            # one biased by the node's last local steps.
            kept = [k.payload for k in self._inbox]
            self._inbox, self._arrivals = [], 0
            self.counts["merged"] += len(kept)
            entries = [(self.model, self.mass if pushsum else 1.0, self.age)]
            entries += [(p.values, p.mass, p.age) for p in self._home] if pushsum else []
            entries += [(self._full(p.values), p.mass if pushsum else 1.0, p.age) for p in kept]
            self._home = []
            if len(entries) > 1:
                self._fold(entries)
            self.finished = True
            return [Finished(self.period, self.model)]
        out: list[Command] = []
        if pushsum and self._home:
            self._fold([(self.model, self.mass, self.age)] + [(p.values, p.mass, p.age) for p in self._home])
            self._home = []
        if self.peers and (self.mass > 0 or not pushsum):
            peer = self._rng.choice(sorted(self.peers))
            send_mass = self.mass / 2 if pushsum else 1.0
            out += self._send(peer, _Payload({k: self.model[k] for k in self.names}, send_mass, self.age), now)
            if pushsum:
                self.mass -= send_mass
        kept = [k.payload for k in self._inbox]
        self._inbox, self._arrivals = [], 0
        self._rng.shuffle(kept)
        self.counts["merged"] += len(kept)
        if kept:
            self._measure_disagreement(kept)
            lags = [self.age - p.age for p in kept]
            self.lag = sum(lags) / len(lags)
            self._lag_sum += sum(lags)
            self._lag_count += len(lags)
        own_mass_only = 0.0
        if pushsum:
            # The node's own model (with the mass it kept) stands where lastModel stands.
            entries = [(self.model, self.mass, self.age)]
            entries += [(self._full(p.values), p.mass, p.age) for p in kept]
            if cfg.catch_up and kept and not self._merged_once and 2 * self.age < min(p.age for p in kept):
                # Catch-up: a node that joins a running federation (its first merge, its
                # model less than half as old as any it received) would pull everybody
                # back towards its initial model with its full sample weight. Its values
                # sit this merge out; its mass still counts, so no mass is lost.
                own_mass_only = entries.pop(0)[1]
                self.counts["caught_up"] += 1
            if kept:
                self._merged_once = True
        elif cfg.merge == "average":
            # Own model and the kept ones, equal weights (lastModel is not used).
            entries = [(self.model, 1.0, self.age)] + [(self._full(p.values), 1.0, p.age) for p in kept]
        else:
            # Alg. 3.1 CREATEMODEL: only received models (or lastModel) enter the merge.
            if len(kept) >= 2:
                recs = kept
                self._last = self._rng.choice(kept)
            elif len(kept) == 1:
                recs = [kept[0], self._last]
                self._last = kept[0]
            else:
                recs = [self._last, self._last]
            entries = [(self._full(p.values), 1.0, p.age) for p in recs]
        if cfg.create == "rw":
            # No merge: one model walks on (a received one if any). Masses still add up
            # under push-sum so that none is lost, but values are not averaged.
            if pushsum:
                pool = entries if own_mass_only else entries[1:]
                chosen = self._rng.choice(pool) if pool else entries[0]
            elif cfg.merge == "average":
                chosen = self._rng.choice(entries[1:]) if len(entries) > 1 else entries[0]
            else:
                chosen = entries[0]  # a random kept model, else lastModel
            self.model, self.age = chosen[0], chosen[2]
            if pushsum:
                self.mass = sum(m for _, m, _ in entries) + own_mass_only
            return out + self._plan([(self.model, 1.0)], merge_all=False)
        if cfg.create == "um":
            total = sum(m for _, m, _ in entries)
            self.age = sum(a * m for _, m, a in entries) / total
            if pushsum:
                self.mass = total + own_mass_only
            return out + self._plan([(w, m) for w, m, _ in entries], merge_all=True)
        self._fold(entries)
        self.mass += own_mass_only
        return out + self._plan([(self.model, 1.0)], merge_all=False)

    def _screening_boundary(self, now: float) -> list[Command]:
        """The period boundary with a screening merge (BRIDGE-style, Yang & Bajwa 2019):
        send the model to ``fanout`` peers, then replace it with the coordinate-wise
        median / trimmed mean / multi-Krum choice over itself and the newest model of
        every neighbour heard from in the last ``neighbour_ttl`` periods, and train.
        With fewer neighbours than the rule needs the node trains on alone: a screening
        outside its precondition would let the Byzantine peers win."""
        cfg = self.config
        last = bool(cfg.periods and self.period >= cfg.periods)
        out: list[Command] = []
        if self.peers and not last:
            own = {k: self.model[k] for k in self.names}
            for peer in self._rng.sample(sorted(self.peers), min(cfg.fanout, len(self.peers))):
                out += self._send(peer, _Payload(own, 1.0, self.age), now)
        for sender in [s for s, (_, p) in self._latest.items() if self.period - p > cfg.neighbour_ttl]:
            del self._latest[sender]
        others = [v for v, _ in self._latest.values()]
        if len(others) >= neighbours_needed(cfg.aggregation, cfg.byzantine):
            self._measure_disagreement([_Payload(v, 1.0, 0.0) for v in others])
            own = {k: self.model[k] for k in self.names}
            self.model = {**self.model, **screen(cfg.aggregation, own, others, cfg.byzantine)}
            self.counts["screened"] += 1
            self.counts["merged"] += len(others)
        elif others or self.peers:
            self.counts["screen_short"] += 1
        if last:
            self.finished = True
            return out + [Finished(self.period, self.model)]
        return out + self._plan([(self.model, 1.0)], merge_all=False)

    def _fold(self, entries: Sequence[tuple[Mapping[str, np.ndarray], float, float]]) -> None:
        """MERGE: mass-weighted mean of the exchanged parameters (masses are all 1 in
        thesis mode); the others keep the node's own values."""
        total = sum(m for _, m, _ in entries)
        if total <= 0:
            return
        merged = mass_weighted_mean([(w, m) for w, m, _ in entries], self.names)
        self.model = {k: merged.get(k, v) for k, v in self.model.items()}
        self.age = sum(a * m for _, m, a in entries) / total
        if self._pushsum:
            self.mass = total

    def _measure_disagreement(self, kept: list[_Payload]) -> None:
        own = {k: self.model[k] for k in self.names}
        dists = [distance(own, p.values, self.names) for p in kept]
        self.disagreement = sum(dists) / len(dists)
        norm = math.sqrt(sum(float(np.square(np.asarray(v, np.float64)).sum()) for v in own.values()))
        self.disagreement_rel = self.disagreement / norm if norm > 0 else None

    def _full(self, values: Mapping[str, np.ndarray]) -> Weights:
        return {k: values[k] if k in values else v for k, v in self.model.items()}

    def _plan(self, models: list[tuple[Weights, float]], *, merge_all: bool) -> list[Command]:
        """Train each of ``models`` in turn; with ``merge_all`` (UM) merge the results."""
        self._jobs = list(models)
        self._results = []
        self._merge_all = merge_all
        return self._next_job()

    def _next_job(self) -> list[Command]:
        self._next_train += 1
        self._train_id = self._next_train
        return [Train(self._train_id, self._jobs[0][0], self.config.period_steps)]

    def _on_trained(self, ev: TrainingDone, now: float) -> list[Command]:
        if ev.train_id != self._train_id or self.finished:
            return []
        out: list[Command] = []
        weights, mass = self._jobs.pop(0)
        steps = self.config.period_steps if ev.steps is None else ev.steps
        try:
            check_update(weights, ev.weights)
            result = outer_step(weights, ev.weights, self.config.outer_step, self.config.fixed)
            if self.config.outer_step != 1.0:
                check_update(weights, result)
        except UpdateRejected as exc:
            # A diverged run must not spread: keep the model it started from.
            self.counts["train_rejected"] += 1
            out.append(Dropped(self.node_id, "", f"training-{exc.reason}", exc.detail))
            result, steps = weights, 0
        self._results.append((result, mass))
        if self._jobs:
            return out + self._next_job()
        self._train_id = None
        if self._merge_all and len(self._results) > 1:
            merged = mass_weighted_mean(self._results, tuple(self.model))
            self.model = {k: merged[k] for k in self.model}
        else:
            self.model = {k: self._results[0][0][k] for k in self.model}
        self._results = []
        self.age += steps
        out.append(ModelChanged(self.period, self.model, self.age, self.mass))
        return out + self._boundary(now)
