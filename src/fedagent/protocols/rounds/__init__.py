"""The FedAvg round machine of the coordinator, as pure code.

``RoundMachine.handle(event, now) -> list[Command]``: the caller feeds it what happened
(an agent came online, an update arrived, a wake-up it asked for) with the monotonic
time, and carries out the commands it returns (broadcast a round, checkpoint and
publish an aggregate, ask for a wake-up). No clock, socket or thread is touched here,
so a whole federation can be driven in memory by a test.

Invariants this machine guards:
* round numbers only grow; an update is accepted only for the round in progress,
  only from an agent selected for it, and only once (QoS 1 may redeliver);
* an update is checked against the global model (names, shapes, dtypes, finite)
  before it touches the aggregate, and a rejection names the sender;
* a round is aggregated at most once, when every selected agent still online has
  answered, or at its deadline if at least ``min_updates`` did; otherwise the round
  is abandoned and a new one (with a new number) starts from the same model;
* membership is dynamic: agents come and go between rounds, and an agent that sends its
  last update with ``leaving`` set is not selected again (a vehicle leaving a road-side
  unit's coverage), even before its goodbye arrives;
* how updates are weighted is a :class:`~fedagent.protocols.aggregation.Strategy`
  (FedAvg by samples, by a reported metric, FLSimCo's eq. 11, or dropping updates whose
  metric is above a threshold), always aggregated as a stream;
* with differential privacy (``RoundConfig.dp``, :mod:`~fedagent.protocols.dp`) every
  update counts once and is clipped (central) or arrives clipped and noised by its agent
  (distributed); every aggregate is charged to the accountant, and no round starts whose
  release would take ε past the budget: the machine finishes instead, saying why.

Streamed updates (:mod:`~fedagent.protocols.streaming`) arrive as ``UpdateHead``, any
number of ``UpdatePart`` and one ``UpdateEnd``. All checks that need only the header
(round, sender, base version, weight, tensor names/shapes/dtypes) run before the first
value is folded; each part is checked finite before it is folded into the round's running
sums. A part cannot be taken back out of a sum without its data, and keeping the data is
what streaming avoids; a caller that keeps every frame of the round in flight (the
coordinator's round journal) can give it back, though: with ``replays`` the machine asks
for such updates again (:class:`Refold`) at the round's end. An update that fails *after*
parts of it were folded (digest mismatch, norm bound, transfer broken off, sender gone) is
then taken back out and the round goes on without it; without ``replays`` it spoils the
round's sums, which is abandoned and restarted from the same model without that sender.
Either way the sender sits out rounds (:class:`~.bounds.Bench`). A stream that makes no
progress once every other update is in is dropped after as long as the others took, and
one still arriving at the deadline is dropped then.

How far one member can move the model, its weight and its distance from the global
model, is bounded by :mod:`.bounds` (``weight_cap``, ``norm_bound``).

The package: :mod:`.config` (:class:`RoundConfig`), :mod:`.events` (the events and
commands), :mod:`.machine` (:class:`RoundMachine`: rounds, the intake of whole updates,
aggregation) with :mod:`.intake` (streamed updates and their replays, a mixin of the
machine), and the machine's collaborators :mod:`.serverstep` (the global model's step),
:mod:`.privacy` (the DP accounting), :mod:`.secure` (the secure-aggregation path) and
:mod:`.bounds` (one member's influence, and the agents benched for spoiling updates).
"""

from __future__ import annotations

from fedagent.protocols.rounds.config import NormBound, RoundConfig, check_secure
from fedagent.protocols.rounds.events import (
    AgentOffline,
    AgentOnline,
    Command,
    Event,
    Finished,
    LateUpdate,
    Phase,
    Refold,
    Refolded,
    Rejected,
    RequestWakeup,
    RoundAbandoned,
    RoundAggregated,
    SecAggReceived,
    SendSecAgg,
    StartRound,
    UpdateReceived,
    Wakeup,
    Weights,
)
from fedagent.protocols.rounds.machine import RoundMachine
from fedagent.protocols.rounds.privacy import PrivacyBudget
from fedagent.protocols.rounds.secure import SecureRounds
from fedagent.protocols.rounds.serverstep import ServerStep

__all__ = [
    "AgentOffline",
    "AgentOnline",
    "Command",
    "Event",
    "Finished",
    "LateUpdate",
    "NormBound",
    "Phase",
    "PrivacyBudget",
    "Refold",
    "Refolded",
    "Rejected",
    "RequestWakeup",
    "RoundAbandoned",
    "RoundAggregated",
    "RoundConfig",
    "RoundMachine",
    "SecAggReceived",
    "SecureRounds",
    "SendSecAgg",
    "ServerStep",
    "StartRound",
    "UpdateReceived",
    "Wakeup",
    "Weights",
    "check_secure",
]
