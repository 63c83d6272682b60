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
what streaming avoids, so an update that fails *after* parts of it were folded (digest
mismatch, norm bound, transfer broken off, sender gone) spoils the round's sums: the round
is abandoned and restarted from the same model without that sender, which sits out one
round. Everything else about an update (and every other sender) costs nothing. A round
whose deadline passes while folded-but-unfinished updates are still arriving waits for
them to end (the intake times a silent transfer out), so a straggler mid-transfer neither
gets half-counted nor spoils a round that could aggregate.

The package: :mod:`.config` (:class:`RoundConfig`), :mod:`.events` (the events and
commands), :mod:`.machine` (:class:`RoundMachine`: rounds, intake, aggregation) and its
collaborators :mod:`.serverstep` (the global model's step), :mod:`.privacy` (the DP
accounting) and :mod:`.secure` (the secure-aggregation path).
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
