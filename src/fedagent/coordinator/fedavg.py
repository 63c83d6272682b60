"""FedAvg rounds: the coordinator mode over the pure :class:`~fedagent.protocols.rounds.RoundMachine`.

Queue items become the machine's events (agents online/offline, whole updates, streamed
update parts, wake-ups); its commands are carried out here: broadcast a round,
checkpoint and announce an aggregate, schedule a wake-up. A task with a vocabulary
(SEEC Algorithm 1) first agrees on it with the agents (:class:`VocabStage`); the round
machine, and the initial model, exist only after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedagent.config import NodeConfig, round_config
from fedagent.coordinator.core import CoordinatorCore
from fedagent.coordinator.durability import DurableJournal, reconcile_history
from fedagent.coordinator.refold import read_back_round
from fedagent.coordinator.streams import StreamFeed
from fedagent.coordinator.velocity import FileVelocity
from fedagent.coordinator.vocabstage import VocabStage, has_vocabulary, vocab_config
from fedagent.errors import FedagentError, TransportError
from fedagent.node import sdnotify
from fedagent.node.messaging import PARTICIPANT_ROLES, Incoming
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import Timer, release_large_frees
from fedagent.protocols import rounds as R
from fedagent.protocols import topics
from fedagent.protocols.catchup import ModelServer
from fedagent.protocols.messages import (
    Evaluation,
    GlobalModel,
    ModelRequest,
    RoundResult,
    Update,
    VocabOffer,
)
from fedagent.protocols.ratelimit import Rate, SenderBudget
from fedagent.protocols.secagg import MESSAGES as SECAGG_MESSAGES
from fedagent.protocols.secagg import SecAggMasked, SecAggStart
from fedagent.protocols.serveropt import VELOCITY, check_velocity
from fedagent.protocols.streaming import StreamEvent, UpdateEnd, UpdateHead
from fedagent.protocols.tiers import UpperRoundMachine
from fedagent.storage import checkpoint
from fedagent.storage.roundjournal import InFlight
from fedagent.storage.statefile import atomic_write, read_bytes
from fedagent.tasks.base import get_weights
from fedagent.tasks.fingerprint import fingerprint

log = logging.getLogger("fedagent.coordinator")

#: Checkpoint keys of the server momentum's velocity in checkpoints written before it
#: had a file of its own (the tensor's name follows).
VELOCITY_KEY = checkpoint.OPTIMIZER_PREFIX + VELOCITY


#: What one agent may send a FedAvg coordinator, by kind, before its frames are checked
#: (fedagent.protocols.ratelimit): an update's frames (up to a few hundred chunks of a
#: large model per round), the secure-aggregation stages, evaluations; a kind a FedAvg
#: coordinator has no use for gets next to nothing. Evaluations are the one kind taken
#: in full (verified, handled) that a member may send at will, and each one handled
#: delays the updates queued behind it: measured, one member's 78 accepted a second
#: halved the rounds per second of a digits federation. 20 a second covers an agent's
#: one per round up to 20 rounds a second; above that, the held-out line skips versions.
RATES: dict[str, Rate] = {
    "presence": Rate(2.0, 10),
    "heartbeat": Rate(5.0, 20),
    "model_request": Rate(2.0, 10),
    "evaluation": Rate(20.0, 40),
    "update": Rate(500.0, 5000),
    "vocab_offer": Rate(2.0, 10),
    **{
        k: Rate(100.0, 1000)
        for k in ("secagg_keys", "secagg_shares", "secagg_masked", "secagg_signature", "secagg_reveal")
    },
}
#: A transfer to the coordinator (an update, a masked vector, a vocabulary offer) is at
#: most this many times the model (uncompressed float32 with framing stays below 2).
TRANSFER_MODELS = 4
#: Answers to model requests waiting to be sent at most (each holds a model version).
MAX_ANSWERS = 4


@dataclass(frozen=True, slots=True)
class _VocabWakeup:
    pass


def receive_maximum(cfg: NodeConfig) -> int:
    """As many unacknowledged messages as MQTT allows. What waits in this process is
    bounded by reading one message at a time (``Transport.hold_limit``), the rest waits
    in the socket buffer and at the broker. A small Receive Maximum made Mosquitto 2.0.11
    queue the coordinator's messages, and it lets a message that arrives while the quota
    has room overtake the ones it queued: at 50 agents × 44.8 MB, streamed chunks came
    up to 7 places out of order and whole rounds were abandoned (the intake holds back
    only a few chunks that arrive early). It also did not bound anything (see Transport)."""
    return 65535


class FedAvgMode:
    title = "coordinator"

    def __init__(self, core: CoordinatorCore) -> None:
        release_large_frees()  # before the model is built: see its docstring for the measurement
        self.core = core
        cfg = core.cfg
        self.cfg = cfg
        self.task = core.task
        self.round_path = core.dir / "last_round_started"
        self.velocity_file: FileVelocity | None = None  # the server momentum's velocity, on disk
        # The round in flight, durable before any of its updates is acknowledged; a
        # restart takes that round up again (coordinator/durability.py).
        self.durability = DurableJournal(
            core.dir / "round-journal",
            max_frame=core.messenger.wire_limits.max_message_bytes,
            # An update (whole, chunked or streamed: a header, values, a little framing per chunk).
            per_sender=2 * cfg.max_model_bytes + 2**20,
            replay=core.messenger.replay_journal,
        )
        self.journal = self.durability.journal
        self._resume: InFlight | None = None
        core.messenger.journal = self.durability.frame
        core.messenger.before_replay_commit = self.durability.flush
        self.durability.before_drop = core.messenger.persist_replay
        # The agents' evaluations (one per agent and model, arriving while the next
        # round's updates come in) reach the replay guard's journal within a second, not
        # with an fdatasync each on the intake's path: replayed after a crash, one could
        # only report again what its agent reported (the held-out table keeps each
        # agent's latest report per model version) and make it look alive, as a heartbeat.
        core.messenger.lazy_durable_kinds = core.messenger.lazy_durable_kinds | {Evaluation.kind}
        self.timer = Timer(core.queue, R.Wakeup())
        # One received message at a time: the broker's Receive Maximum does not bound
        # what reaches this process (see Transport's hold_limit), this does.
        core.transport.hold_limit = 1
        self.streams = StreamFeed(core.queue)
        core.messenger.on_stream = self._on_stream
        # Before any frame is checked: a budget per agent and kind, and update frames only
        # from the agents selected for the round in flight.
        core.messenger.budget = SenderBudget(RATES, other=Rate(2.0, 10))
        core.messenger.admit = self._admit
        self.round_started_at: float | None = None
        self._selected: tuple[int, tuple[str, ...]] = (0, ())  # the round in flight's selection
        # Wall-clock marks of the round in flight (broadcast sent, each update in, the
        # aggregate, its checkpoint), written with the round's history line.
        self._marks: dict[str, Any] = {}
        self.last_round_seconds: float | None = None
        self.done = asyncio.Event()
        # A returning agent asks for the model it missed (round starts are not queued for
        # absent agents): answered one at a time, off the event loop's queue.
        self.model_server = ModelServer()
        self._answering = asyncio.Lock()
        self._answers: set[asyncio.Task[None]] = set()
        self.vocab: VocabStage | None = None
        self.machine: R.RoundMachine | None = None
        self.model_meta: dict[str, Any] = {}  # what checkpoints record of the model
        if has_vocabulary(self.task):
            self.vocab = VocabStage(
                core.dir / "vocabulary.json",
                vocab_config(cfg.rounds, str(cfg.path)),
                core.messenger,
                core.fed,
                Timer(core.queue, _VocabWakeup()),
                core.history,
                self._vocab_rejected,
            )
        if self.vocab is None or self.vocab.agreed:
            self._build_machine()

    @property
    def _vocab_digest(self) -> str:
        return self.vocab.vocabulary.digest if self.vocab is not None and self.vocab.vocabulary is not None else ""

    def _build_machine(self) -> None:
        cfg, core = self.cfg, self.core
        if self.vocab is not None:
            assert self.vocab.vocabulary is not None
            self.task.set_vocabulary(list(self.vocab.vocabulary.terms))  # type: ignore[attr-defined]
            torch.manual_seed(cfg.rounds.seed)
        model = self.task.build_model()
        # Known at the core's start, unless the model waited for the vocabulary.
        fp = core.admission.fingerprint or fingerprint(model)
        weights = get_weights(model)
        del model
        resumed = checkpoint.load(core.ckpt_path)
        meta: dict[str, Any] = {}
        velocity: dict[str, np.ndarray] = {}
        if resumed is not None:
            saved, meta = resumed
            weights = {k: v for k, v in saved.items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)}
            velocity = {k[len(VELOCITY_KEY) :]: v for k, v in saved.items() if k.startswith(VELOCITY_KEY)}
            if meta.get("vocab_digest", "") != self._vocab_digest:
                raise FedagentError(f"{core.ckpt_path} was trained on another vocabulary; move it away")
            log.info(
                "resuming from %s: model version %s after round %s",
                core.ckpt_path,
                meta.get("model_version"),
                meta.get("round"),
            )
            reconcile_history(self.core.history, meta)
        # A restart never reuses the number of a round it had started: agents ignore a
        # round start they have seen, and the updates of that round may already have been
        # acknowledged by this process before it died. The unfinished round is abandoned
        # (its late updates are stale) and a new one starts from the checkpointed model.
        started = read_bytes(self.round_path, 64)
        last_started = int(started) if started and started.strip().isdigit() else 0
        model_bytes = sum(int(w.nbytes) for w in weights.values())
        self.streams.size_for(model_bytes)
        # What an agent can send is a few times the model, not max_model_bytes: a transfer
        # announcing more is refused at its first chunk, and one agent's frames journaled
        # in a round are an update's worth.
        core.messenger.bound_transfers(TRANSFER_MODELS * model_bytes + 2**20)
        self.durability.per_sender = min(self.durability.per_sender, 2 * model_bytes + 2**20)
        rc = round_config(cfg)
        roles = fp.roles(local_norm=rc.train.local_norm)
        if rc.train.local_norm and not roles.kept:
            log.warning(
                "[rounds] local_norm is set, but the model has no normalisation layer: every tensor is averaged"
            )
        elif roles.kept:
            log.info("local_norm (FedBN): %d tensors of normalisation layers stay on the agents", len(roles.kept))
        self.model_meta = fp.meta(kept=roles.kept)
        store: FileVelocity | None = None
        if rc.momentum > 0:
            # The velocity is kept on disk beside the checkpoint (coordinator/velocity.py),
            # not in memory.
            version = int(meta.get("model_version", 0))
            store = self.velocity_file = FileVelocity(core.ckpt_path.parent)
            if store.open(version, weights):
                log.info("server momentum %g: resuming with the velocity of model version %d", rc.momentum, version)
            elif velocity:
                # A checkpoint written before the velocity had a file of its own.
                try:
                    check_velocity(weights, velocity)
                except ValueError as exc:
                    raise FedagentError(
                        f"{core.ckpt_path}: the server momentum's velocity does not fit the model ({exc}); "
                        "move the checkpoint away to start afresh"
                    ) from None
                store.write_all(velocity, weights, version)
                log.info("server momentum %g: resuming with the checkpoint's velocity", rc.momentum)
            else:
                log.info(
                    "server momentum %g (FedAvgM): the velocity starts at zero and is kept in %s",
                    rc.momentum,
                    store.dir,
                )
        # A hub or region: its members are site aggregators, each weighed as its site.
        tiered: dict[str, Any] = {"is_aggregator": self._is_aggregator} if cfg.tier.sites else {}
        self.machine = (UpperRoundMachine if cfg.tier.sites else R.RoundMachine)(
            rc,
            weights,
            **tiered,
            model_version=int(meta.get("model_version", 0)),
            completed_rounds=int(meta.get("completed_rounds", 0)),
            last_round=max(int(meta.get("round", 0)), last_started),
            privacy_state=meta.get("privacy") if isinstance(meta.get("privacy"), dict) else None,
            velocity_store=store,
            # secure rounds: a survivor whose signature of the survivor list fails is dropped
            # here, so only valid signatures go on to the agents
            verify_statement=core.messenger.verifier.check_statement,
            # every update frame of the round in flight is in the round journal
            replays=True,
            norm_history=norm_history_of(meta.get("norms")),
            roles=roles,
        )
        privacy = self.machine.privacy()
        if privacy is not None:
            log.info(
                "differential privacy (%s): noise multiplier %.4g, clip norm %.4g, delta %g, epsilon spent %.4g%s",
                cfg.privacy.mode if cfg.privacy is not None else "?",
                privacy["noise_multiplier"],
                privacy["clip_norm"],
                privacy["delta"],
                privacy["epsilon"],
                f" of a budget of {privacy['epsilon_budget']:g}" if "epsilon_budget" in privacy else "",
            )
        m = self.machine
        # Resumed in start(). A secure round's keys and shares died with the process: it
        # is not resumed (a new round starts, with new keys).
        self._resume = self.durability.recover(
            m.round,
            m.model_version,
            resumable=m.config.secure is None and m.phase is R.Phase.WAITING,
            checkpoint_round=int(meta.get("round", 0)),
        )

    def _record_received(self, inc: Incoming) -> None:
        """In a secure federation, a line of history per update-bearing message received:
        what the coordinator held (kind, size and, for a masked vector, the share of its
        values inside the quantised range: about 2^(bits-32) when masked, 1 when not)."""
        if self.machine is None or self.machine.config.secure is None:
            return
        msg = inc.message
        line: dict[str, Any] = {
            "event": "received",
            "kind": msg.kind,
            "sender": inc.sender,
            "round": getattr(msg, "round", None),
            "bytes": inc.nbytes,
        }
        if isinstance(msg, SecAggMasked) and msg.masked.size:
            line["in_quantised_range"] = round(float(np.mean(msg.masked <= self.machine.config.secure.levels)), 6)
        self.core.history.append(line)

    def _secure_record(self) -> dict[str, Any]:
        res = self.machine.secure_result if self.machine is not None else None
        if res is None:
            return {}
        params = self.machine.secure_params if self.machine is not None else None
        return {
            "secure": {
                "error_bound": res.error_bound,
                # each coordinate of an agent's (noised, weighted) update is quantised in ±range
                **({"range": params.clip} if params is not None else {}),
                "dropped_before_input": list(res.dropped_before_input),
                "silent_at_unmask": list(res.silent_at_unmask),
                # survivor -> why its signature of the survivor list was not valid
                "bad_signatures": dict(res.bad_signatures),
                # agent -> how it spoiled its part (bad keys, input or shares, silence
                # after sharing): the round went on without what it sent; it sits out
                "offenders": dict(res.offenders),
                # agent -> why it left after the share stage (a box it could not open)
                "withdrawn": dict(res.withdrawn),
                # the keys came a round ahead, with the masked inputs (no key stage)
                "keys_ahead": self.machine is not None and self.machine.aggregated_ahead,
            }
        }

    def _missing_sites(self, cmd: R.RoundAggregated) -> dict[str, Any]:
        """A hub's round aggregated without some of the sites it selected (a site
        aggregator cut off, killed, or without a quorum of its own): which ones."""
        if not self.cfg.tier.sites or self._selected[0] != cmd.round:
            return {}
        missing = sorted(set(self._selected[1]) - set(cmd.participants) - set(cmd.dropped))
        if missing:
            log.warning("round %d aggregated without the sites %s", cmd.round, ", ".join(missing))
        return {"missing": missing} if missing else {}

    def _is_aggregator(self, member: str) -> bool:
        """Whether ``member`` is a site aggregator (its certificate's role, from its presence)."""
        return self.core.peers.get(member, {}).get("role") == "aggregator"

    def _admit(self, sender: str, kind: str, round_: int) -> bool:
        """Whether to look at a frame of (part of) an update from ``sender`` at all: only
        from an agent selected for the round in flight, for that round (before the
        vocabulary is agreed there is no round: its offers may come)."""
        m = self.machine
        if m is None:
            return True
        return m.phase is R.Phase.TRAINING and round_ == m.round and m.expects(sender)

    def _vocab_rejected(self, sender: str, reason: str, detail: str) -> None:
        self.core.reject(sender, reason, detail, round=0)

    # -- Mode ----------------------------------------------------------------------------
    def model_version(self) -> int:
        return self.machine.model_version if self.machine is not None else 0

    async def on_connect(self) -> None:
        if self.vocab is not None and self.vocab.agreed:
            await self.vocab.publish()

    async def start(self, now: float) -> None:
        if self.vocab is not None:
            self.vocab.start(now)
        if self.machine is not None and self.machine.phase is R.Phase.DONE:
            log.info("checkpoint says training already finished; serving status only")
        if self.machine is not None and self._resume is not None:
            r = self._resume
            log.info(
                "resuming round %d from model version %d with %s: %d update frames in the journal",
                r.round,
                r.model_version,
                ", ".join(r.selected),
                self.journal.frames,
            )
            self._resume = None
            for cmd in self.machine.resume(r.round, r.selected, now):
                await self._execute(cmd)

    def recovered_frames(self) -> Iterator[tuple[str, bytes]]:
        # Called before start() has run (the frames are queued behind the resumption).
        if self._resume is None:
            return iter(())
        return self.journal.frames_of()

    async def on_presence(self, agent: str, online: bool, samples: int, now: float) -> None:
        # Before the vocabulary is agreed there is no machine: the core's peer table keeps
        # the presence and it is replayed to the machine once it exists.
        if online and self._is_aggregator(agent) and not self.cfg.tier.sites:
            # Weighed as one agent (against the median of the agents' counts) a site would
            # count for a few agents only: a coordinator takes sites when it says so.
            log.warning("%s is a site aggregator, and this coordinator has no [tier] sites = true: not taken", agent)
            online = False
        if self.machine is not None:
            await self._handle(self._online(agent, samples) if online else R.AgentOffline(agent))

    def _online(self, agent: str, samples: int) -> R.AgentOnline:
        """An agent online, with whether its presence says it rebuilds int8 steps."""
        downlinks = self.core.peers.get(agent, {}).get("downlinks", ())
        reads = "int8" in downlinks
        if not reads and self.machine is not None and self.machine.config.downlink == "int8":
            log.info(
                "%s does not rebuild int8 steps (an earlier release): it takes part in rounds that start with the "
                "whole model",
                agent,
            )
        # a site aggregator's agents: a hub calibrates distributed DP's noise shares with them
        agents = int(self.core.peers.get(agent, {}).get("agents", 0))
        return R.AgentOnline(agent, samples, reads_steps=reads, agents=agents)

    async def on_message(self, inc: Incoming, now: float) -> None:
        msg = inc.message
        if isinstance(msg, VocabOffer) and self.vocab is not None:
            if inc.role != "agent":
                self._vocab_rejected(inc.sender, "role", f"a vocabulary offer signed by a {inc.role or 'non-agent'}")
                return
            await self._vocab_agreed(await self.vocab.offer(inc.sender, msg.terms, msg.counts, now))
        elif isinstance(msg, SECAGG_MESSAGES) and not isinstance(msg, SecAggStart):
            if inc.role not in PARTICIPANT_ROLES or (inc.role == "aggregator" and not self.cfg.tier.sites):
                self.core.messenger.reject("role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-agent'}")
                return
            self._record_received(inc)
            if self.machine is not None:
                await self._handle(R.SecAggReceived(inc.sender, msg))
        elif isinstance(msg, Update):
            self._record_received(inc)
            if inc.role not in PARTICIPANT_ROLES or (inc.role == "aggregator" and not self.cfg.tier.sites):
                # As for streams (messaging): only an agent's certificate may submit an update.
                self.core.messenger.reject("role", inc.sender, f"update signed by a {inc.role or 'non-agent'}")
                return
            if self.machine is not None:
                event = R.UpdateReceived(
                    inc.sender, msg.round, msg.base_version, msg.num_samples, msg.weights, msg.metrics, msg.leaving
                )
                self._marks.setdefault("updates", {})[inc.sender] = round(time.time(), 4)
                await self._handle(event)
        elif isinstance(msg, ModelRequest):
            self._model_request(inc, msg, now)
        else:
            log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)

    def _model_request(self, inc: Incoming, msg: ModelRequest, now: float) -> None:
        core = self.core
        if inc.role != "agent":
            core.messenger.reject("role", inc.sender, f"model request signed by a {inc.role or 'non-agent'}")
            return
        m = self.machine
        if len(self._answers) >= MAX_ANSWERS:
            # Answers already wait for their turn (each holds a model): this one would add
            # to the pile, not be sent sooner. The agent asks again on its next connection.
            self.model_server.refused["rate"] += 1
            return
        if m is None or not self.model_server.answer(inc.sender, msg.have_version, m.model_version, now):
            return
        model = GlobalModel(m.model_version, m.round, m.phase is R.Phase.DONE, m.weights)
        task = asyncio.get_running_loop().create_task(self._send_model(inc.sender, model, msg.have_version))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _send_model(self, agent: str, model: GlobalModel, had: int) -> None:
        # One answer at a time. The model is the machine's, which replaces it and never
        # changes it in place: its chunks are cut from it without an encoded copy.
        async with self._answering:
            topic = topics.direct(self.core.fed, self.core.cfg.id, agent, "model")
            try:
                n = await self.core.messenger.send(topic, model, round_=model.round, stable=True)
            except TransportError as exc:
                log.warning("model version %d for %s not sent: %s", model.model_version, agent, exc)
                return
            log.info("sent model version %d to %s (it had %d): %d bytes", model.model_version, agent, had, n)

    async def on_item(self, item: Any, now: float) -> None:
        if isinstance(item, _VocabWakeup):
            if self.vocab is not None:
                await self._vocab_agreed(await self.vocab.wakeup(now))
            return
        self.streams.taken(item)
        if isinstance(item, UpdateEnd) and item.ok:
            self._marks.setdefault("updates", {})[item.sender] = round(time.time(), 4)
        if self.machine is not None:
            await self._handle(item)

    def snapshot(self) -> dict[str, Any]:
        """What `status` shows: the machine's view once the commands of the last event have
        been carried out (checkpoint saved, history appended), never a state the disk has
        not caught up to. Before the vocabulary is agreed there is no round machine yet."""
        vs = self.vocab.status() if self.vocab is not None else {}
        if self.machine is None:
            m: dict[str, Any] = {
                "phase": "vocabulary",
                "round": 0,
                "completed_rounds": 0,
                "rounds": self.cfg.rounds.rounds,
                "model_version": 0,
                "selected": [],
                "received": [],
                "metrics": {},
            }
        else:
            m = self.machine.status()
        return {
            "phase": m["phase"],
            "round": m["round"],
            "completed_rounds": m["completed_rounds"],
            "rounds": m["rounds"],
            "model_version": m["model_version"],
            "selected": m["selected"],
            "received": m["received"],
            "waiting": m.get("waiting"),
            "metrics": m["metrics"],
            "vocabulary_size": vs.get("vocabulary_size"),
            "vocab_digest": vs.get("vocab_digest"),
            "vocabulary_offers": vs.get("vocabulary_offers", []),
            "last_round_seconds": self.last_round_seconds,
            "model_requests": {"answered": self.model_server.answered, "refused": dict(self.model_server.refused)},
            "privacy": {"mode": self.cfg.privacy.mode, **m["privacy"]}
            if m.get("privacy") and self.cfg.privacy is not None
            else None,
            "stop_reason": m.get("stop_reason") or None,
            "updates": self.update_transfer(),
            "server_step": self.server_step(),
            "journal": self.journal.status(),
            # the weight cap and the norm bound, and who sits out rounds for spoiling updates
            "bounds": m.get("bounds"),
            "tier": self._sites(m) if self.cfg.tier.sites else None,
            "secure_aggregation": (
                self.machine.secagg.status()
                if self.machine is not None and self.machine.secagg is not None
                else (self.machine is not None and self.machine.config.secure is not None) or None
            ),
        }

    def _sites(self, m: dict[str, Any]) -> dict[str, Any]:
        """A hub's or region's view of its members that are site aggregators: the agents
        and samples each announced, and where it stands in the round in flight."""
        selected, received = set(m["selected"]), set(m["received"])
        training = m["phase"] == R.Phase.TRAINING.value
        sites: dict[str, Any] = {}
        for name, p in sorted(self.core.peers.items()):
            if p.get("role") != "aggregator":
                continue
            if not p.get("online"):
                state = "offline"
            elif training and name in received:
                state = "sent"
            elif training and name in selected:
                state = "training"
            else:
                state = "idle"
            sites[name] = {"agents": int(p.get("agents", 0)), "samples": int(p.get("samples", 0)), "state": state}
        return {"role": "hub", "sites": sites}

    def update_transfer(self) -> dict[str, Any]:
        """How the agents send their updates this federation: the compression the rounds
        ask for (and whether it is the default or set in [transfer]), streamed or whole;
        and how round starts carry the model ([transfer] downlink)."""
        rc = self.machine.config if self.machine is not None else round_config(self.cfg)
        train = rc.train
        return {
            "compression": train.compression,
            "streamed": train.stream,
            "default": self.cfg.compression is None,
            "downlink": rc.downlink,
            "downlink_default": self.cfg.downlink is None,
            # online agents of earlier releases: they take part in the rounds that start whole
            "whole_model_only": self.machine.whole_model_only() if self.machine is not None else [],
        }

    def _save_checkpoint(self, weights: R.Weights, meta: dict[str, Any], version: int) -> None:
        """The model of ``version`` to the checkpoint (worker thread); its velocity, if
        any, is made durable first, so that no checkpoint is ever without it."""
        if self.velocity_file is not None:
            self.velocity_file.sync(version)
        checkpoint.save(self.core.ckpt_path, weights, meta)

    def server_step(self) -> dict[str, Any]:
        """How the global model follows the aggregate: ``[rounds] server_lr`` and
        ``server_momentum`` (and whether the momentum is the default, not set)."""
        rc = self.machine.config if self.machine is not None else round_config(self.cfg)
        return {"lr": rc.server_lr, "momentum": rc.momentum, "default": self.cfg.rounds.server_momentum is None}

    def refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_round_limits(self.cfg.rounds.min_agents, self.cfg.rounds.round_timeout)
        if self.machine is not None:
            m.set_model_version(self.machine.model_version)
            m.round_started(self.machine.round)
            privacy = self.machine.privacy()
            if privacy is not None:
                m.set_privacy(privacy)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self.streams.expire_stalled(self.core.messenger, 5.0)]

    def close(self) -> None:
        self.timer.cancel()
        self.durability.close()
        for task in self._answers:
            task.cancel()

    # -- streams -------------------------------------------------------------------------
    async def _on_stream(self, events: list[StreamEvent]) -> None:
        await self.streams.put(events, self._stream_seen)

    def _stream_seen(self, ev: StreamEvent) -> None:
        if isinstance(ev, UpdateHead) and self.machine is not None and self.machine.config.secure is not None:
            self.core.history.append({"event": "received", "kind": "ustream", "sender": ev.sender, "round": ev.round})

    # -- replays -------------------------------------------------------------------------
    async def _refold(self, cmd: R.Refold) -> None:
        """Read updates of the round back from the journal into the machine (a worker
        thread: the event loop keeps reading meanwhile; nothing else touches the machine
        until its Refolded is handled, which this awaits)."""
        machine = self.machine
        assert machine is not None
        wanted = dict(cmd.updates)
        m = self.core.messenger
        journal = self.journal

        def work() -> frozenset[str]:
            return read_back_round(
                journal.frames_of,
                wanted,
                cmd.counted,
                cmd.round,
                machine.refold,
                federation=self.core.fed,
                wire_limits=m.wire_limits,
                model_limits=m.model_limits,
            )

        t0 = time.perf_counter()
        incomplete = await asyncio.to_thread(work)
        log.info(
            "round %d: %d update(s) read back from the journal in %.2fs (%s)%s",
            cmd.round,
            len(wanted),
            time.perf_counter() - t0,
            ", ".join(sorted(wanted)),
            f"; not held whole: {', '.join(sorted(incomplete))}" if incomplete else "",
        )
        await self._handle(R.Refolded(cmd.round, incomplete))

    # -- machine -------------------------------------------------------------------------
    async def _vocab_agreed(self, agreed: Any) -> None:
        """Once the vocabulary is agreed the round machine is built and told which agents
        are online."""
        if agreed is None or self.machine is not None:
            return
        t0 = time.perf_counter()
        await asyncio.to_thread(self._build_machine)
        log.info("model built on the vocabulary (%d terms) in %.2fs", len(agreed.terms), time.perf_counter() - t0)
        for aid, samples in self.core.online_agents().items():
            await self._handle(self._online(aid, samples))

    async def _handle(self, event: Any) -> None:
        assert self.machine is not None
        cmds = self.machine.handle(event, time.monotonic())
        del event
        restarts = any(isinstance(c, R.StartRound) for c in cmds)
        batch: list[R.SendSecAgg] = []
        for cmd in cmds:
            if isinstance(cmd, R.SendSecAgg):
                batch.append(cmd)
                continue
            if batch:
                await self._send_secagg(batch)
                batch = []
            await self._execute(cmd, next_round_follows=restarts)
        if batch:
            await self._send_secagg(batch)

    async def _send_secagg(self, cmds: list[R.SendSecAgg] | tuple[R.SendSecAgg, ...]) -> None:
        """A stage's messages to the agents (a roster, a share box, the survivor list or
        an unmask request each): published together, not one acknowledgement after the
        other; one agent's messages keep their order."""
        by_agent: dict[str, list[R.SendSecAgg]] = {}
        for c in cmds:
            by_agent.setdefault(c.to, []).append(c)

        async def send(msgs: list[R.SendSecAgg]) -> None:
            for c in msgs:
                await self._execute(c)

        await asyncio.gather(*(send(m) for m in by_agent.values()))

    async def _execute(self, cmd: R.Command, *, next_round_follows: bool = False) -> None:
        core, fed = self.core, self.core.fed
        assert self.machine is not None
        if isinstance(cmd, R.StartRound):
            self.round_started_at = time.monotonic()
            self._selected = (cmd.round, cmd.selected)
            self._marks = {"start": round(time.time(), 4)}
            self.durability.count_round()
            if not cmd.resumed:
                # Both durable before the round start leaves; independent of each other
                # (a crash between them leaves a journal that recovery finds past, or
                # none), so their syncs overlap.
                done = await asyncio.gather(
                    asyncio.to_thread(atomic_write, self.round_path, str(cmd.round).encode()),
                    self.durability.begin(cmd.round, cmd.model_version, cmd.selected),
                    return_exceptions=True,  # both finished before a failure of either is raised
                )
                for outcome in done:
                    if isinstance(outcome, BaseException):
                        raise outcome
            core.metrics.round_started(cmd.round)
            log.info(
                "round %d%s: model version %d to %s",
                cmd.round,
                " (resumed after a restart)" if cmd.resumed else "",
                cmd.model_version,
                cmd.to_whom(),
            )
            sdnotify.status(f"round {cmd.round}: training on {len(cmd.selected)} agents")
            if cmd.secagg is not None:
                await core.messenger.send(
                    topics.broadcast(fed, "secagg_start"),
                    SecAggStart(cmd.round, cmd.selected, cmd.secagg),
                    round_=cmd.round,
                )
                # Keys advertised ahead: the rosters go now, ahead of the model, so the
                # share stage runs while the model is on its way.
                await self._send_secagg(cmd.secagg_first)
            await core.messenger.send(
                topics.broadcast(fed, "round_start"),
                cmd.message(),
                round_=cmd.round,
                stable=True,  # the machine replaces its model, never changes it in place
            )
            self._marks["broadcast"] = round(time.time(), 4)
        elif isinstance(cmd, R.SendSecAgg):
            await core.messenger.send(
                # The message's own round: the machine may have started the next one already.
                topics.direct(fed, self.cfg.id, cmd.to, cmd.message.kind),
                cmd.message,
                round_=cmd.message.round,
            )
        elif isinstance(cmd, R.RoundAggregated):
            took = time.monotonic() - (self.round_started_at or time.monotonic())
            marks = self._marks
            marks["aggregated"] = round(time.time(), 4)
            self.last_round_seconds = took
            core.metrics.round_completed(took, cmd.metrics)
            core.metrics.set_model_version(cmd.model_version)
            meta = {
                "model_version": cmd.model_version,
                "round": cmd.round,
                "completed_rounds": self.machine.completed,
                "federation": fed,
                "participants": list(cmd.participants),
                "metrics": cmd.metrics,
                "final": cmd.final,
                "vocab_digest": self._vocab_digest,
                "model": self.model_meta,
            }
            privacy_state = self.machine.privacy_state()
            if privacy_state is not None:
                meta["privacy"] = privacy_state
            norms = self.machine.norm_state()
            if norms:
                meta["norms"] = norms
            await asyncio.to_thread(self._save_checkpoint, cmd.weights, meta, cmd.model_version)
            if self.velocity_file is not None:
                # The velocity file that goes with this checkpoint is written (the round
                # adopted it): the older ones can go.
                self.velocity_file.prune(cmd.model_version)
            marks["checkpointed"] = round(time.time(), 4)
            core.history.append(
                {
                    "event": "round",
                    "round": cmd.round,
                    "model_version": cmd.model_version,
                    "participants": list(cmd.participants),
                    "metrics": cmd.metrics,
                    "aggregation": self.machine.config.strategy.name,
                    "agg_weights": cmd.weights_used,
                    "dropped": cmd.dropped,
                    **self._missing_sites(cmd),
                    # participant -> its weight capped ({samples, weight}) or its distance
                    # scaled down ({norm, bound})
                    "bounded": cmd.bounded,
                    "seconds": round(took, 4),
                    "bytes_in": core.messenger.bytes_in,
                    "bytes_out": core.messenger.bytes_out,
                    **({"privacy": cmd.privacy} if cmd.privacy is not None else {}),
                    **self._secure_record(),
                    "marks": marks,
                    # the intake's disk cost (docs/faults.md)
                    "syncs": self.durability.round_syncs(),
                }
            )
            if not next_round_follows:
                # After the checkpoint: its updates are in the model now. When the next
                # round starts at once its start record replaces the journal anyway, and
                # until then recovery finds the journal past (its model version is
                # older than the checkpoint's) and ends it there: a sync pair saved.
                await self.durability.end()
            for agent, what in cmd.bounded.items():
                for bound in ("weight", "norm"):
                    if bound in what:
                        core.metrics.bounded(agent, bound)
                log.info("round %d: %s's update bounded: %s", cmd.round, agent, what)
            log.info(
                "round %d aggregated from %d agents in %.2fs: %s%s",
                cmd.round,
                len(cmd.participants),
                took,
                ", ".join(f"{k}={v:.4f}" for k, v in cmd.metrics.items()),
                f"; epsilon {cmd.privacy['epsilon']:.4g} spent (delta {cmd.privacy['delta']:g})" if cmd.privacy else "",
            )
            if cmd.privacy is not None:
                core.metrics.set_privacy(cmd.privacy)
            await core.messenger.send(
                topics.broadcast(fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version, len(cmd.participants), cmd.metrics),
                round_=cmd.round,
            )
        elif isinstance(cmd, R.RoundAbandoned):
            log.warning("round %d abandoned: %s", cmd.round, cmd.reason)
            core.metrics.round_abandoned()
            await self.durability.end()
            core.history.append({"event": "abandoned", "round": cmd.round, "reason": cmd.reason})
            await core.messenger.send(
                topics.broadcast(fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version, 0, {}, aggregated=False, reason=cmd.reason),
                round_=cmd.round,
            )
        elif isinstance(cmd, R.Rejected):
            core.reject(cmd.sender, cmd.reason, cmd.detail, round=cmd.round)
        elif isinstance(cmd, R.LateUpdate):
            # Late, not wrong: the round it was for was abandoned meanwhile, or its agent
            # came online just after the round started.
            log.info("discarded from %s: %s", cmd.sender, cmd.detail)
            core.metrics.discarded()
        elif isinstance(cmd, R.Refold):
            await self._refold(cmd)
        elif isinstance(cmd, R.RequestWakeup):
            self.timer.request(cmd.at)
        elif isinstance(cmd, R.Finished):
            if cmd.reason:
                log.warning("training stopped after %d rounds: %s", self.machine.completed, cmd.reason)
                core.history.append({"event": "stopped", "reason": cmd.reason, "privacy": self.machine.privacy()})
            log.info("training finished: model version %d", cmd.model_version)
            sdnotify.status(f"finished: model version {cmd.model_version}")
            await core.messenger.send(
                topics.broadcast(fed, "model"),
                GlobalModel(cmd.model_version, self.machine.round, True, cmd.weights),
                round_=self.machine.round,
                # Chunks cut from the final model where it lies: an encoded copy made first
                # was a whole model more, the coordinator's peak of a whole run.
                stable=True,
            )
            self.done.set()


def norm_history_of(saved: Any) -> list[list[float]]:
    """The norm bound's recent distances as a checkpoint kept them ([] if absent or not
    a list of lists of numbers: the bound then warms up again)."""
    if not isinstance(saved, list):
        return []
    out: list[list[float]] = []
    for r in saved:
        if isinstance(r, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in r):
            out.append([float(x) for x in r])
    return out
