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

The package: :mod:`.config` (:class:`GossipConfig`), :mod:`.events` (the events and
commands), :mod:`.merge` (the merge rules) and :mod:`.machine` (:class:`GossipMachine`).
"""

from __future__ import annotations

from fedagent.protocols.gossip.config import (
    AGGREGATIONS,
    CREATE_MODES,
    FREQUENT_STEPS,
    INFREQUENT_STEPS,
    MERGE_MODES,
    GossipConfig,
    neighbours_needed,
)
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
from fedagent.protocols.gossip.machine import GossipMachine, Resume
from fedagent.protocols.gossip.merge import distance, mass_weighted_mean, outer_step, screen

__all__ = [
    "AGGREGATIONS",
    "CREATE_MODES",
    "FREQUENT_STEPS",
    "INFREQUENT_STEPS",
    "MERGE_MODES",
    "AckReceived",
    "Command",
    "Dropped",
    "Event",
    "Finished",
    "GossipConfig",
    "GossipMachine",
    "ModelChanged",
    "ModelReceived",
    "PeerDown",
    "PeerUp",
    "RequestWakeup",
    "Resume",
    "SendAck",
    "SendFailed",
    "SendModel",
    "Start",
    "Train",
    "TrainingDone",
    "Wakeup",
    "distance",
    "mass_weighted_mean",
    "neighbours_needed",
    "outer_step",
    "screen",
]
