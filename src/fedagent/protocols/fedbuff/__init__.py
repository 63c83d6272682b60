"""Asynchronous buffered FedAvg (FedBuff: Nguyen et al., AISTATS 2022), as pure code.

``BufferMachine.handle(event, now) -> list[Command]`` is the coordinator's side;
``AsyncWorker.handle(event) -> list[Command]`` the agent's. No clock, socket or thread
is touched here.

There are no rounds. The coordinator gives each idle agent a *task* (train from model
``v``), at most ``concurrency`` at a time, and adds every update to a *buffer* as it
arrives; every ``buffer_size`` (K) updates the buffer becomes the next global model,
which is broadcast, and the agents that finished get new tasks from it while the others
go on training. An update's *staleness* is ``s = (current version) − (the version it
was trained from)``.

Invariants this machine guards:

* an update is refused when ``s > max_staleness`` (or it claims a version that does not
  exist yet); otherwise its values are added with weight ``n · (1 + s) ** −a`` (``n`` its
  samples, ``a = staleness_exponent``, 0.5 by default: ``n / √(1 + s)``) while the mean's
  denominator counts ``n``: a model made of stale updates moves less (FedBuff's damping),
  and the updates of one buffer weigh by their samples and freshness;
* an update is taken once: by (agent, task, base version), remembered for as long as
  the staleness bound could admit it, across a restart too (the checkpoint keeps them);
* at most ``concurrency`` tasks are out at once; a task frees its place when its update
  comes, when its deadline (``task_timeout``) passes or when its agent goes offline, and
  its update is still taken later, within the bound (an agent cut off keeps training);
* a streamed update is checked at its header (staleness, names, shapes, dtypes, deltas
  for floating tensors) before any value is added, each part finite before it is added;
  one that fails after parts of it were added is taken out again by a replay from the
  caller's journal before the buffer is published (without replays, or when it cannot
  be read back, it spoils the buffer: emptied, its updates lost, none half counted); a
  model is never made while a stream is being added;
* one member cannot move a model more than an honest agent could (the protections of
  FedAvg rounds, :class:`~fedagent.protocols.rounds.bounds.Influence`, a buffer in the
  place of a round): an update weighs at most its agent's announced samples and
  ``weight_cap`` × the lower median of every announcement; its distance is scaled to
  ``multiplier`` × the median distance of the last ``window`` buffers' updates; one
  agent adds at most half a buffer (or what it takes the agents online to fill it:
  ``BufferConfig.share``), and gets no task while it holds that. A
  stream's distance is known only at its end, and the buffer's journal holds every frame
  of its updates, so streams are added as they come while within the bound (the usual
  case, no second read) and one that crosses it, or any update while the bound warms up,
  is held and replayed scaled (:class:`Refold`) once the buffer is full: folding every
  stream only once its distance is known would read every update twice;
* every model is made by the server step of FedAvg rounds (``server_lr``, server
  momentum; :class:`~fedagent.protocols.rounds.serverstep.ServerStep`) and, with the int8
  downlink, broadcast as the int8 step from the model before, which every agent
  rebuilds to the bit;
* with differential privacy every published model is one release charged to the
  accountant (q = 1: no sampling is claimed), an agent adds at most one update to a
  model, and no model is published whose release would pass the budget. Central: each
  whole update's delta is clipped to ``C`` (times its staleness weight, at most 1) and
  the sum gets noise ``z·C``; distributed: each agent clips and adds ``z·C/√K`` itself
  and updates weigh equally, so a buffer of at least K carries at least ``z·C``.

The package: :mod:`.config` (:class:`BufferConfig`), :mod:`.events`, :mod:`.machine`
(:class:`BufferMachine`), :mod:`.worker` (:class:`AsyncWorker`, the agent's side).
"""

from __future__ import annotations

from fedagent.protocols.fedbuff.config import MAX_STALENESS, BufferConfig
from fedagent.protocols.fedbuff.events import (
    AgentOffline,
    AgentOnline,
    AssignTask,
    BufferSpoilt,
    Command,
    Event,
    Finished,
    Phase,
    Published,
    Refold,
    Refolded,
    Rejected,
    ReplayKey,
    RequestWakeup,
    Wakeup,
    WholeUpdate,
)
from fedagent.protocols.fedbuff.machine import BufferMachine, Key, Task
from fedagent.protocols.fedbuff.worker import AsyncWorker

__all__ = [
    "MAX_STALENESS",
    "AgentOffline",
    "AgentOnline",
    "AssignTask",
    "AsyncWorker",
    "BufferConfig",
    "BufferMachine",
    "BufferSpoilt",
    "Command",
    "Event",
    "Finished",
    "Key",
    "Phase",
    "Published",
    "Refold",
    "Refolded",
    "Rejected",
    "ReplayKey",
    "RequestWakeup",
    "Task",
    "Wakeup",
    "WholeUpdate",
]
