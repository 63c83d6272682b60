"""The Sync-Opt step machine of the coordinator (gFedNTM Algorithm 1, stage 2), pure.

``SyncOptMachine.handle(event, now) -> list[Command]`` like the round machine: the
daemon feeds it what happened with the monotonic time and carries out its commands;
no clock, socket, thread or torch here. One step:

1. ``StartStep``: broadcast W(e) (only its version when every participant already
   holds it, e.g. a step repeated after a fault), with a deadline;
2. collect one gradient per participant: checked against the parameters (names,
   shapes, dtypes, finite), added to a streaming aggregate at once (never N gradients
   in memory); late, duplicate and stale gradients are refused naming the sender;
3. ``ApplyGradient``: the aggregate G(e) (default: the sample-weighted mean, which is
   exactly the gradient of the mean loss over the union of the mini-batches); the
   daemon applies the optimizer (torch lives there) and answers ``OptimizerApplied``
   with W(e+1);
4. ``StepDone`` (checkpoint, history) with the relative change ||W(e+1)−W(e)||/||W(e)||,
   then the next ``StartStep`` — or ``Finished`` after ``steps`` steps or when the
   relative change falls below ``tol``.

Early stopping (``patience`` > 0, gFedNTM Sec. 4.1: the rule of the package the paper's
authors train with). Every ``epoch_steps`` steps the machine sends ``StartValidation``
(the new weights, a step number of its own) instead of the next step; every participant
evaluates them on its own held-out documents and answers one scalar and a count
(``ValidationReceived``); their sample-weighted mean (:func:`pooled_validation_loss`,
summed in the participants' order) feeds :class:`PatienceStop`. ``EpochDone`` reports the
epoch; when the rule stops, ``Finished`` carries the best epoch's weights and version.

Order. ``aggregation = "ordered"`` sums the gradients in the participants' (sorted) order
from zero, Σ n_ℓ G_ℓ / Σ n_ℓ, holding a gradient that arrives before its predecessors
until they are in: the aggregate no longer depends on the order the network delivered
the gradients in, so in float64 a federated run repeats an in-process one bit for bit
(the streaming ``"weighted"`` mean keeps one model's worth of sums but its last bits
depend on the arrival order).

Faults. Exactness (federated = centralized on the union of the mini-batches) holds only
when every participant contributes to every step. When a participant is missing at the
step deadline (silent, or its presence went offline):

* ``on_fault = "continue"`` (default): the step is aggregated from the gradients that
  arrived if there are at least ``min_gradients``; the missing agents are dropped from
  the participants (named in ``StepDone.missing``) and taken back, with the full
  weights, at the first step after their presence says online again. If a participant goes offline mid-step the machine does
  not wait for the deadline. The run is flagged inexact from then on.
* ``on_fault = "abort"``: the machine waits until the deadline (a reconnecting agent's
  gradient may still arrive: QoS 1 redelivers) and then ends training with ``Aborted``;
  the last checkpoint is the model before the faulty step. For runs that must be exact.

A step with too few gradients under "continue" is repeated with the same weights and a
new step number (stale gradients of the old number are refused), like an abandoned
round.

The package: :mod:`.config` (:class:`SyncOptConfig`), :mod:`.events` (the events and
commands), :mod:`.machine` (:class:`SyncOptMachine`), :mod:`.gradients` (how a step's
gradients are combined) and :mod:`.earlystop` (:class:`PatienceStop`).
"""

from __future__ import annotations

from fedagent.protocols.syncopt.config import FAULT_POLICIES, SyncOptConfig
from fedagent.protocols.syncopt.earlystop import PatienceStop, pooled_validation_loss
from fedagent.protocols.syncopt.events import (
    Aborted,
    AgentOffline,
    AgentOnline,
    ApplyGradient,
    Begin,
    Command,
    EpochDone,
    Event,
    Finished,
    GradientReceived,
    OptimizerApplied,
    Phase,
    Rejected,
    RequestWakeup,
    StartStep,
    StartValidation,
    StepDone,
    StepRepeated,
    ValidationReceived,
    Wakeup,
)
from fedagent.protocols.syncopt.gradients import (
    AGGREGATORS,
    AggregatorFactory,
    GradientAggregator,
    OrderedWeightedMean,
    PlainMean,
    SampleWeightedMean,
    SumBuffers,
    relative_change,
)
from fedagent.protocols.syncopt.machine import SyncOptMachine

__all__ = [
    "AGGREGATORS",
    "FAULT_POLICIES",
    "Aborted",
    "AgentOffline",
    "AgentOnline",
    "AggregatorFactory",
    "ApplyGradient",
    "Begin",
    "Command",
    "EpochDone",
    "Event",
    "Finished",
    "GradientAggregator",
    "GradientReceived",
    "OptimizerApplied",
    "OrderedWeightedMean",
    "PatienceStop",
    "Phase",
    "PlainMean",
    "Rejected",
    "RequestWakeup",
    "SampleWeightedMean",
    "StartStep",
    "StartValidation",
    "StepDone",
    "StepRepeated",
    "SumBuffers",
    "SyncOptConfig",
    "SyncOptMachine",
    "ValidationReceived",
    "Wakeup",
    "pooled_validation_loss",
    "relative_change",
]
