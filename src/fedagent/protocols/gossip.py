"""Gossip learning (Ormándi et al.; KTH thesis Alg. 2.3, 2.4, 3.1) as a pure machine.

``GossipMachine.handle(event, now) -> list[Command]``: the daemon feeds it what happened
(a peer appeared or vanished, a model or an acknowledgement arrived, training finished,
a wake-up it asked for) with the monotonic time, and carries out the commands it returns
(train, send a model or an acknowledgement, adopt a model, log a drop, wake me at ...).
No clock, socket, thread or torch is touched here.

The exchange period
-------------------
A period is ``period_steps`` local training steps (thesis: 10 = "frequent",
500 = "infrequent"). At every period boundary, i.e. when the training of the period
has finished, the node

1. folds back any of its own mass that came home (see below),
2. sends its current model to a peer chosen uniformly at random (none if it knows no
   peer: no error, it just trains on),
3. builds the next model from what its inbox kept during the period — at most
   ``max_incoming`` (= 2) models; further arrivals are dropped uniformly at random
   (reservoir sampling, seeded), as in Alg. 3.1 — with ``create``:
   ``"mu"`` UPDATE(MERGE(models)) (default, CREATEMODELMU), ``"um"``
   MERGE(UPDATE(m) for each m), ``"rw"`` UPDATE(one model) (random walk, no merge),
4. asks the daemon to train (``Train``), one job at a time; when the last job of the
   period is back (``TrainingDone``) it emits ``ModelChanged`` and the next boundary runs.

The node never waits for the network: training goes on whatever happens to its sends.
With a ``periods`` limit the last boundary merges what the inbox holds without training
on it, then emits ``Finished``: the model a node ends with includes its peers' last
contributions. (The agent decays the step size on a cosine schedule to 0 at ``periods``,
so the last periods are nearly pure averaging; that lives in the daemon's config, not here.)

Merging: ``merge="pushsum"`` (default) and ``merge="thesis"``
-------------------------------------------------------------
Alg. 3.1 taken literally (``merge="thesis"``) builds the new model only from received
models (or the last received one) while the node's own model leaves with its send, and
drops discard models. Every step is an average, so the nodes do reach consensus, but
the weights of that average are random and nothing conserves the sum: the consensus
lands *near* the global mean, not on it (measured in tests/protocols/test_gossip.py: 0.17-0.24
relative error with N = 20 agents). Push-only "average my model with what I received"
has the same defect. The thesis variant is kept for faithful reproduction.

``merge="average"`` is that push-only rule: the node's own model and the kept incoming
ones are averaged with equal weights (no masses, no returns; drops discard). It does
not converge on the sample-weighted mean, but nodes that train on shards of very
different sizes do not pull the merge towards the big ones either: for gossip Word2Vec
with the step scaled by N it lost less against centralized training than push-sum on
word similarity (docs/experiments/gossip-w2v.md). Every other workload keeps push-sum.

The default is push-sum (Kempe, Dobra & Gehrke 2003; "stochastic gradient push" when
combined with local training). Every model carries a *mass* ``w`` > 0, initially the
node's ``num_samples``; the node holds values ``x`` (the model itself; push-sum's
sum-vector is ``w·x``).

* Sending: the node sends ``(x, w/2)`` and keeps ``(x, w/2)`` — its model is unchanged.
* Merging: the kept incoming models and the node's own model are averaged weighted by
  mass, ``x ← Σ w_k x_k / Σ w_k``, and the masses add, ``w ← Σ w_k``. The node's own
  model plays the role of the thesis's ``lastModel``.
* Nothing ever destroys mass. A receiver acknowledges every model it takes custody of
  (``SendAck``); an arrival it drops at once is refused (``accepted=False``) and the
  sender folds its escrowed copy back in; a model kept and later evicted from the
  reservoir is sent back to its origin with ``returned=True`` (a returned model is
  always folded in, outside the inbox limit). A send that is not acknowledged within
  ``send_timeout`` (or fails, or whose peer goes down) is re-sent, same payload, to a
  new random peer (at most ``max_retries`` times), and otherwise folded back.

Invariant (training switched off): with ``M = Σ_nodes w_i + Σ_payloads w_p`` and
``S = Σ_nodes w_i x_i + Σ_payloads w_p x_p``, where payloads are all models in flight,
in an inbox or waiting to be folded back, both M and S are constant, so every node's
model converges to ``S/M = Σ n_i x_i(0) / Σ n_i``: the *sample-weighted* global mean,
i.e. FedAvg's fixed point. With training on, training moves ``x`` but not ``w``, so the
nodes track the sample-weighted mean of the locally trained models. Measured with the
in-memory harness (N = 20, random delays, 2-model inbox): every model is within
1e-3 relative error of the mean after at most 60 periods (measured 31-39, ten seeds).

The invariant is exact if every payload is merged at most once. Receivers deduplicate
on (sender, exchange id), so QoS 1 redelivery is harmless; the daemon must give each
process start a fresh ``session`` so ids never repeat. The one unavoidable hole (two
generals): an acknowledgement arriving after its timeout fired means the payload was
merged *and* re-sent/folded back, so its mass counts twice; ``status()["late_acks"]``
counts these. The result is still a convex combination of the models, so consensus is
not at risk, only exactness of the mean — choose ``send_timeout`` well above a
round-trip time.

Why mass = samples and not model age: an age-weighted average (Ormándi's option) is not
conservative — ages grow at each node's own training speed, which biases the consensus
towards fast nodes (the bias the thesis cites from Giaretta). ``age`` (local training
steps that went into a model, mass-weighted through merges) is tracked and sent for
monitoring only. Pass ``num_samples=1`` everywhere for an unweighted mean.

Screening merge: ``aggregation="median" | "trimmed_mean" | "krum"``
-------------------------------------------------------------------
Push-sum's merge is a mass-weighted mean: one peer that sends an arbitrary model (or
claims a huge mass) moves every node it reaches as far as it likes, and ``clip_norm``
only bounds that pull per merge. With a screening aggregation the node instead follows
the Byzantine-resilient decentralized rule of BRIDGE (Yang & Bajwa 2019): it keeps the
*newest* model received from each neighbour (one slot per sender, so flooding gains a
Byzantine peer nothing; slots older than ``neighbour_ttl`` periods are forgotten), and
at each boundary it sends its model to ``fanout`` random peers and replaces its model
with a robust statistic of {its own} ∪ {the neighbours' newest models}:

* ``median``: the coordinate-wise median (n > 2f);
* ``trimmed_mean``: per coordinate the mean after dropping the f largest and the f
  smallest values (BRIDGE-T; n >= 2f + 1);
* ``krum``: the mean of the n − f models with the lowest Krum scores (n > 2f + 2);

with n the number of models in the merge and f = ``byzantine``, the Byzantine
neighbours one node must tolerate. ``neighbours_needed`` turns the preconditions into a
minimum number of neighbour models; the agent's configuration refuses a ``min_peers``
below it at start, and a node that holds fewer fresh neighbour models at a boundary
trains on alone rather than run a screening whose precondition fails
(``status()["screen_short"]``).

What is given up: the screening is no longer a mass-weighted mean, so nothing is
conserved. Masses, returns and refusals for mass reasons do not exist in this mode
(every received model is acknowledged and only replaces its sender's slot), and the
nodes reach consensus on a robust *centre* of the honest models, not on their exact
(sample-weighted) mean: with non-IID shards that centre can sit away from the mean,
and a median of few models moves in jumps. That is the price of not letting f peers
choose the result; the accuracy cost is measured in tests/byzantine_gossip.py.

Outer step (``outer_step``)
---------------------------
With ``outer_step`` = b != 1 the model a period's training hands back is not adopted
as it is: the node moves from the model the period started from (its merged model)
by b times the training's progress, ``x + b (w - x)`` (floating parameters; rows the
training did not touch stay as they were), and that is what it sends and merges. The
agent's step is then lr x a with a b = the scale it would otherwise apply to the step
alone: with one step per period the two are the same rule; with several, the gradients
are taken nearer the merged model. For gossip Word2Vec a = 5, b = 2 (N = 10) lost less
than a = 10 in process (docs/experiments/gossip-w2v.md); a = 1, b = N diverged. A
result that is not finite after the outer step is refused like a diverged training run.

Partial exchange (thesis "half")
--------------------------------
``exchange`` names the parameters that travel (``None`` = all). Only they are sent,
validated, merged and weighted by mass; every other parameter stays local and only
training changes it (for ``create="um"`` the locally trained copies are averaged).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedagent.protocols.aggregation import (
    ROBUST,
    UpdateRejected,
    WeightedMean,
    check_update,
    clip_to,
    coordinate_median,
    extrapolate,
    krum_scores,
    pairwise_sq_distances,
    trimmed_mean,
)

Weights = dict[str, np.ndarray]

CREATE_MODES = ("mu", "um", "rw")
MERGE_MODES = ("pushsum", "thesis", "average")
AGGREGATIONS = ("mean",) + ROBUST  # "mean": the merge above; the others: a screening merge
FREQUENT_STEPS = 10  # thesis §4.2.2: exchange every 10 local batches
INFREQUENT_STEPS = 500  # thesis §4.2.3: exchange every 500 local batches
_SEEN_IDS = 4096  # (sender, exchange id) pairs remembered for deduplication
_MAX_NEIGHBOURS = 1024  # latest models kept for a screening merge (senders hold certificates)


def neighbours_needed(aggregation: str, byzantine: int) -> int:
    """Neighbour models (besides the node's own) a screening merge with ``aggregation``
    needs so that ``byzantine`` of them cannot steer it; n = this + 1 models enter it.

    median: f < n/2; trimmed mean (f dropped at each end): n >= 2f + 1; Krum: n > 2f + 2.
    At least one neighbour in every case: a merge of one's own model alone is no merge."""
    if aggregation == "krum":
        return 2 * byzantine + 2
    if aggregation in ("median", "trimmed_mean"):
        return max(1, 2 * byzantine)
    return 1


# ---- configuration -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GossipConfig:
    period_steps: int = FREQUENT_STEPS
    max_incoming: int = 2  # models kept per period; extras dropped at random
    create: str = "mu"  # "mu" | "um" | "rw" (Alg. 2.4)
    merge: str = "pushsum"  # "pushsum" (conserves the mean) | "thesis" (Alg. 3.1) | "average"
    exchange: tuple[str, ...] | None = None  # names that travel; None = all
    send_timeout: float = 30.0  # seconds without an ack before a new peer is chosen
    max_retries: int = 2  # new peers tried for one payload before folding it back
    periods: int = 0  # stop after this many exchanges (thesis GLsteps); 0 = never
    seed: int = 0
    catch_up: bool = True  # push-sum: a newcomer's first merge adopts far older models
    max_norm: float | None = None  # refuse a received model whose L2 norm exceeds this
    clip_norm: float | None = None  # cap a received model's distance from ours before it is kept
    aggregation: str = "mean"  # "mean" (merge above) | "median" | "trimmed_mean" | "krum" (screening)
    byzantine: int = 0  # screening: Byzantine neighbours tolerated among a merge's models
    fanout: int = 1  # peers the model is sent to per period
    neighbour_ttl: int = 10  # screening: periods a neighbour's latest model stays usable
    outer_step: float = 1.0  # adopt start + this x (trained - start) after each period (1: as trained)

    @property
    def robust(self) -> bool:
        return self.aggregation != "mean"

    def __post_init__(self) -> None:
        for name in ("max_norm", "clip_norm"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, not {v!r}")
        if self.period_steps < 1 or self.max_incoming < 1:
            raise ValueError("period_steps and max_incoming must be at least 1")
        if self.create not in CREATE_MODES:
            raise ValueError(f"create must be one of {CREATE_MODES}, not {self.create!r}")
        if self.merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {MERGE_MODES}, not {self.merge!r}")
        if self.exchange is not None:
            if not self.exchange or len(set(self.exchange)) != len(self.exchange):
                raise ValueError("exchange must name at least one parameter, each once")
        if not self.send_timeout > 0 or self.max_retries < 0 or self.periods < 0:
            raise ValueError("send_timeout must be positive, max_retries and periods non-negative")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if not (math.isfinite(self.outer_step) and self.outer_step > 0):
            raise ValueError(f"outer_step must be a positive number, not {self.outer_step!r}")
        if self.fanout < 1 or self.neighbour_ttl < 1 or self.byzantine < 0:
            raise ValueError("fanout and neighbour_ttl must be at least 1, byzantine non-negative")
        if self.byzantine and not self.robust:
            raise ValueError(
                f"byzantine = {self.byzantine} needs a screening aggregation "
                f"({', '.join(ROBUST)}): the mean tolerates no Byzantine peer (clip_norm only "
                "bounds each one's pull)"
            )
        if self.robust and (self.create != "mu" or self.merge != "pushsum"):
            raise ValueError(
                f"aggregation = {self.aggregation!r} replaces the merge: it works with "
                "create = 'mu' and the default merge only"
            )

    @classmethod
    def frequent(cls, **kw: object) -> GossipConfig:
        return cls(period_steps=FREQUENT_STEPS, **kw)  # type: ignore[arg-type]

    @classmethod
    def infrequent(cls, **kw: object) -> GossipConfig:
        return cls(period_steps=INFREQUENT_STEPS, **kw)  # type: ignore[arg-type]


# ---- events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    """Begin the first period (local training; the first send follows it)."""


@dataclass(frozen=True, slots=True)
class PeerUp:
    peer: str


@dataclass(frozen=True, slots=True)
class PeerDown:
    peer: str


@dataclass(frozen=True, slots=True)
class TrainingDone:
    train_id: int
    weights: Weights = field(repr=False)
    steps: int | None = None  # steps actually run; None = as requested


@dataclass(frozen=True, slots=True)
class ModelReceived:
    sender: str
    exchange_id: str
    weights: Weights = field(repr=False)  # the exchanged parameters only
    mass: float = 1.0
    age: float = 0.0
    returned: bool = False  # our own mass sent back by a peer that dropped it


@dataclass(frozen=True, slots=True)
class AckReceived:
    sender: str
    exchange_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The transport could not deliver ``exchange_id`` (publish failed, peer unknown)."""

    exchange_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Wakeup:
    pass


Event = Start | PeerUp | PeerDown | TrainingDone | ModelReceived | AckReceived | SendFailed | Wakeup


# ---- commands ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Train:
    """Run ``steps`` local steps from ``weights``; answer ``TrainingDone(train_id, ...)``
    with the same names, shapes and dtypes. The arrays are shared, not copied: train on
    a copy, never in place."""

    train_id: int
    weights: Weights = field(repr=False)
    steps: int = 1


@dataclass(frozen=True, slots=True)
class SendModel:
    peer: str
    exchange_id: str
    weights: Weights = field(repr=False)  # the exchanged parameters only
    mass: float = 1.0
    age: float = 0.0
    returned: bool = False


@dataclass(frozen=True, slots=True)
class SendAck:
    peer: str
    exchange_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ModelChanged:
    """The node's model after the training of ``period`` (status, checkpoint, evaluation)."""

    period: int
    weights: Weights = field(repr=False)
    age: float = 0.0
    mass: float = 1.0


@dataclass(frozen=True, slots=True)
class Dropped:
    sender: str  # who sent it (this node's id for a discarded training result)
    exchange_id: str
    reason: str  # inbox-full, names, shape, dtype, non-finite, mass, finished, ...
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RequestWakeup:
    at: float


@dataclass(frozen=True, slots=True)
class Finished:
    period: int
    weights: Weights = field(repr=False)


Command = Train | SendModel | SendAck | ModelChanged | Dropped | RequestWakeup | Finished


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


def _mean(items: Sequence[tuple[Mapping[str, np.ndarray], float]], names: tuple[str, ...]) -> Weights:
    """Weighted mean over ``names`` (float64 accumulation, original dtypes back)."""
    items = [(w, m) for w, m in items if m > 0]
    if len(items) == 1:
        return {k: items[0][0][k] for k in names}
    acc = WeightedMean({k: items[0][0][k] for k in names})
    # Masses come from peers (any finite positive float): scaled to sum to 1 first, so
    # a claimed mass of 1e300 times a weight of 1e38 cannot overflow to inf.
    top = max(m for _, m in items)
    for w, m in items:
        if m / top > 0:  # a mass 1e-300 beside 1e300 counts for nothing
            acc.add(w, m / top)
    return acc.result()


def outer_step(start: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], scale: float) -> Weights:
    """``start + scale x (trained - start)`` for every floating parameter (computed in
    float64, the parameter's dtype back); other parameters as trained. ``scale`` 1 returns
    ``trained`` unchanged."""
    if scale == 1.0:
        return dict(trained)
    with np.errstate(over="ignore"):  # an overflow is inf, refused by the caller
        return extrapolate(start, trained, scale)


def _distance(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], names: tuple[str, ...]) -> float:
    sq = 0.0
    for k in names:
        d = np.asarray(a[k], dtype=np.float64) - np.asarray(b[k], dtype=np.float64)
        sq += float(np.square(d).sum())
    return math.sqrt(sq)


def screen(
    aggregation: str, own: Mapping[str, np.ndarray], others: Sequence[Mapping[str, np.ndarray]], byzantine: int
) -> Weights:
    """The screening merge over ``own`` and ``others`` (same names, shapes, dtypes as
    ``own``, already validated): per floating coordinate the median, or the mean after
    dropping the ``byzantine`` largest and smallest values; or multi-Krum, the mean of
    the n − f models with the lowest Krum scores. Non-floating tensors keep ``own``'s
    values (step counters and the like are not the peers' to set)."""
    models = [own, *others]
    n = len(models)
    if n <= 2 * byzantine or (aggregation == "krum" and n <= 2 * byzantine + 2):
        raise ValueError(f"{aggregation} over {n} models cannot tolerate {byzantine} Byzantine ones")
    floats = [k for k, v in own.items() if np.asarray(v).dtype.kind == "f"]
    chosen = list(range(n))
    if aggregation == "krum":
        scores = krum_scores(pairwise_sq_distances(models, floats), byzantine)
        chosen = sorted(int(i) for i in np.argsort(scores, kind="stable")[: n - byzantine])
    out: Weights = {}
    for name in floats:
        ref = np.asarray(own[name])
        stack = np.stack([np.asarray(models[i][name], np.float64) for i in chosen])
        if aggregation == "median":
            agg = coordinate_median(stack)
        elif aggregation == "trimmed_mean":
            agg = trimmed_mean(stack, byzantine)
        elif aggregation == "krum":
            agg = stack.mean(axis=0)
        else:
            raise ValueError(f"not a screening aggregation: {aggregation!r}")
        out[name] = agg.astype(ref.dtype)
    return out


class GossipMachine:
    def __init__(
        self, node_id: str, config: GossipConfig, weights: Weights, *, num_samples: int = 1, session: str = "0"
    ) -> None:
        """``session`` must differ between process starts (exchange ids embed it)."""
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
        merged = _mean([(w, m) for w, m, _ in entries], self.names)
        self.model = {k: merged.get(k, v) for k, v in self.model.items()}
        self.age = sum(a * m for _, m, a in entries) / total
        if self._pushsum:
            self.mass = total

    def _measure_disagreement(self, kept: list[_Payload]) -> None:
        own = {k: self.model[k] for k in self.names}
        dists = [_distance(own, p.values, self.names) for p in kept]
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
            result = outer_step(weights, ev.weights, self.config.outer_step)
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
            merged = _mean(self._results, tuple(self.model))
            self.model = {k: merged[k] for k in self.model}
        else:
            self.model = {k: self._results[0][0][k] for k in self.model}
        self._results = []
        self.age += steps
        out.append(ModelChanged(self.period, self.model, self.age, self.mass))
        return out + self._boundary(now)
