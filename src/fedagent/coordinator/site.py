"""A site aggregator: the coordinator mode over the pure
:class:`~fedagent.protocols.tiers.SiteMachine`, with a link to its upstream tier.

Towards its own broker it is a FedAvg coordinator (presence, round starts, the intake of
whole and streamed updates, every update frame journaled and acknowledged once durable,
replays from the journal); towards the upstream broker it is one participant
(:mod:`.upstream`). When the upstream tier starts a round that selects it, it starts a
round of its own from that model for its agents; when that round closes, its aggregate
goes up as the site's partial result and nowhere else: the site publishes no model. The
upstream tier's final model is passed on to the site's agents.

What the site keeps across a restart: its round numbers (its agents ignore a round start
they have seen), the norm bound's recent distances with them, and the upstream round it
answers (its model, training settings, deadline and coordinator, written before its site
round starts). A site round in flight at a restart, or aggregated and not yet sent up (its
journal is kept until then), is taken up again from the round journal, as a coordinator's
is, while its upstream round may still be open (its deadline has not passed, and no
result of it is heard); its result then goes up as if nothing had happened. Otherwise
the journal is past and the site's work for it is dropped, logged.

While the upstream connection is down the site goes on running the round its agents are
in (they are on the site broker) and holds its partial result; it goes up when the
connection is back if its upstream round may still be open, and is dropped, logged,
otherwise (:class:`~fedagent.protocols.tiers.SiteMachine`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent.config import round_config
from fedagent.coordinator.core import CoordinatorCore
from fedagent.coordinator.durability import DurableJournal
from fedagent.coordinator.fedavg import RATES, TRANSFER_MODELS
from fedagent.coordinator.refold import read_back_round
from fedagent.coordinator.streams import StreamFeed
from fedagent.coordinator.upstream import FromUpstream, UpstreamLink
from fedagent.coordinator.vocabstage import has_vocabulary
from fedagent.errors import ConfigError, FedagentError, StateWriteError
from fedagent.node import sdnotify
from fedagent.node.messaging import Incoming
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import Timer, release_large_frees
from fedagent.protocols import rounds as R
from fedagent.protocols import tiers as T
from fedagent.protocols import topics
from fedagent.protocols.messages import GlobalModel, RoundResult, RoundStart, TrainConfig, Update
from fedagent.protocols.ratelimit import Rate, SenderBudget
from fedagent.protocols.secagg import MESSAGES as SECAGG_MESSAGES
from fedagent.protocols.secagg import (
    Delta,
    SecAggMessage,
    SecAggRoster,
    SecAggShareBox,
    SecAggStart,
    SecAggSurvivors,
    SecAggUnmask,
)
from fedagent.protocols.streaming import StreamEvent
from fedagent.storage import checkpoint
from fedagent.storage.roundjournal import InFlight
from fedagent.storage.statefile import atomic_write, read_bytes
from fedagent.tasks.base import get_weights

log = logging.getLogger("fedagent.site")


@dataclass(frozen=True, slots=True)
class _Unsent:
    """A partial result that could not go up: the connection broke while it went."""

    result: T.PartialResult


@dataclass(frozen=True, slots=True)
class _SendFailed:
    error: Exception


class SiteMode:
    title = "site aggregator"

    def __init__(self, core: CoordinatorCore) -> None:
        release_large_frees()
        self.core = core
        cfg = core.cfg
        self.cfg = cfg
        if not cfg.tier.upstream:
            raise FedagentError(f"{cfg.path}: a site aggregator needs [tier] upstream (its upstream tier's broker)")
        if has_vocabulary(core.task):
            raise ConfigError(
                f"{cfg.path}: task {cfg.task!r} agrees on a vocabulary first, which is not run across tiers: "
                "run it with one coordinator"
            )
        self.state_path = core.dir / "site.json"
        self.durability = DurableJournal(
            core.dir / "round-journal",
            max_frame=core.messenger.wire_limits.max_message_bytes,
            per_sender=2 * cfg.max_model_bytes + 2**20,
            replay=core.messenger.replay_journal,
        )
        self.journal = self.durability.journal
        core.messenger.journal = self.durability.frame
        core.messenger.before_replay_commit = self.durability.flush
        self.durability.before_drop = core.messenger.persist_replay
        self.timer = Timer(core.queue, R.Wakeup())
        core.transport.hold_limit = 1
        model = core.task.build_model()
        weights = get_weights(model)
        del model
        model_bytes = sum(int(w.nbytes) for w in weights.values())
        self.streams = StreamFeed(core.queue)
        self.streams.size_for(model_bytes)
        core.messenger.bound_transfers(TRANSFER_MODELS * model_bytes + 2**20)
        self.durability.per_sender = min(self.durability.per_sender, 2 * model_bytes + 2**20)
        core.messenger.on_stream = self._on_stream
        core.messenger.budget = SenderBudget(RATES, other=Rate(2.0, 10))
        core.messenger.admit = self._admit
        rc = round_config(cfg)
        fp = core.admission.fingerprint
        roles = fp.roles(local_norm=rc.train.local_norm) if fp is not None else None
        saved = self._load_state()
        self.upstream_path = core.dir / "upstream-round"
        inflight = self.journal.recover()
        last = max(int(saved.get("site_round", 0)), inflight.round if inflight is not None else 0)
        self.machine = T.SiteMachine(
            T.TierConfig(rc, cfg.tier.upload_share),
            is_aggregator=self._is_aggregator if cfg.tier.sites else None,
            replays=True,
            roles=roles,
            last_round=last,
            verify_statement=core.messenger.verifier.check_statement,
        )
        norms = saved.get("norms")
        if isinstance(norms, list):
            self.machine.norm_history = [
                [float(x) for x in r] for r in norms if isinstance(r, list) and all(isinstance(x, float) for x in r)
            ]
        self.link = UpstreamLink(cfg, core.queue, core.dir / "upstream", core.admission.digest)
        self.link.on_up = self._upstream_up
        self.version = 0  # the newest upstream model version heard of
        self.final: GlobalModel | None = None
        self.done = asyncio.Event()
        self._started_at: float | None = None
        self.last_round_seconds: float | None = None
        self._secure_up = 0  # the latest upstream round that is a secure one
        self._up_weights: tuple[int, dict[str, Any]] = (0, {})  # the upstream round's model
        self._link_down = False  # told to the machine: the upstream connection is down
        self._recorded = 0  # the latest site round whose result the history has
        # partial results on their way up
        self._sends: dict[asyncio.Task[None], T.PartialResult] = {}
        # The resumed site round's commands, carried out in start(): the machine is resumed
        # here already, so that the journal's frames replayed before start() are admitted.
        self._resumed: list[Any] = []
        if inflight is not None:
            self._resume(inflight)

    # -- state ---------------------------------------------------------------------------
    def _save_upstream(self, msg: RoundStart, deadline_s: float, coordinator: str) -> None:
        """The upstream round this site is about to answer, for a restart in its middle:
        durable before the site round's journal begins."""
        assert msg.weights is not None
        meta = {
            "round": msg.round,
            "model_version": msg.model_version,
            "train": msg.train.to_body(),
            "deadline_s": deadline_s,
            # The monotonic clock is the machine's, not the process's: it outlives a
            # restart (and, unlike the wall clock, does not jump), but not a reboot.
            "ends_monotonic": time.monotonic() + deadline_s,
            "boot_id": _boot_id(),
            "coordinator": coordinator,
            "secure": msg.secagg is not None,
        }
        checkpoint.save(self.upstream_path, msg.weights, meta)

    def _recorded_already(self, site_round: int) -> bool:
        """Whether the history has the result of ``site_round`` (a restart between its line
        and its send: not written twice)."""
        for line in self.core.history.tail(65536):
            if b'"event": "site_round"' not in line:
                continue
            try:
                if json.loads(line).get("round") == site_round:
                    return True
            except (ValueError, AttributeError):
                continue
        return False

    def _resume(self, inflight: InFlight) -> None:
        """A site round was in flight at the restart: take it up again if its upstream
        round may still be open, else end its journal (the site's work for it is dropped)."""
        why = ""
        try:
            loaded = checkpoint.load(self.upstream_path, max_bytes=2 * self.cfg.max_model_bytes + 2**20)
        except FedagentError as exc:
            loaded, why = None, str(exc)
        up: T.UpstreamRound | None = None
        if loaded is None:
            why = why or "the upstream round it answered was not saved"
        else:
            weights, meta = loaded
            try:
                # After a reboot the upstream round cannot be told open: taken as closed.
                left = float(meta["ends_monotonic"]) - time.monotonic() if meta.get("boot_id") == _boot_id() else 0.0
                up = T.UpstreamRound(
                    int(meta["round"]),
                    int(meta["model_version"]),
                    weights,
                    TrainConfig.from_body(meta["train"]),
                    min(left, float(meta["deadline_s"])),
                )
                coordinator = str(meta["coordinator"])
                secure = bool(meta["secure"])
            except (KeyError, TypeError, ValueError, FedagentError) as exc:
                up, why = None, f"the saved upstream round is unreadable ({exc})"
            else:
                if up.model_version != inflight.model_version:
                    why = f"the saved upstream round (model version {up.model_version}) is another one"
                    up = None
                elif secure:
                    why = f"upstream round {up.round} is a secure one: its keys died with the process"
                    up = None
                elif left <= 0:
                    why = f"upstream round {up.round} is over (its deadline passed {-left:.0f}s ago)"
                    up = None
        if up is not None:
            try:
                cmds = self.machine.resume(up, inflight.round, inflight.selected, time.monotonic())
            except ValueError as exc:
                why = str(exc)
            else:
                self._resumed = cmds
                if self._recorded_already(inflight.round):
                    self._recorded = inflight.round
                self.link.coordinator = coordinator
                self._up_weights = (up.round, up.weights)
                # its agents evaluate and train that version: it exists
                self.version = max(self.version, up.model_version)
                log.info(
                    "resuming site round %d for upstream round %d (%.0fs left) with %s: %d update frames in the journal",
                    inflight.round,
                    up.round,
                    up.deadline_s,
                    ", ".join(inflight.selected),
                    self.journal.frames,
                )
                return
        log.warning("site round %d not resumed, its work is dropped: %s", inflight.round, why)
        self.core.history.append({"event": "site_dropped", "round": inflight.round, "reason": why})
        self.durability.end_past()

    def _load_state(self) -> dict[str, Any]:
        raw = read_bytes(self.state_path, 1 << 20)
        if not raw:
            return {}
        try:
            state = json.loads(raw)
        except ValueError:
            log.warning("%s is not JSON: the site's round numbers start after the journal's", self.state_path)
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self, site_round: int) -> None:
        state = {"site_round": site_round, "norms": self.machine.norm_history}
        atomic_write(self.state_path, json.dumps(state).encode())

    def _is_aggregator(self, member: str) -> bool:
        return self.core.peers.get(member, {}).get("role") == "aggregator"

    def _admit(self, sender: str, kind: str, round_: int) -> bool:
        m = self.machine.machine
        return m is not None and m.phase is R.Phase.TRAINING and round_ == m.round and m.expects(sender)

    # -- Mode ----------------------------------------------------------------------------
    def model_version(self) -> int:
        return self.version

    async def on_connect(self) -> None:
        return None

    async def start(self, now: float) -> None:
        cmds, self._resumed = self._resumed, []
        for cmd in cmds:
            await self._execute(cmd)

    def recovered_frames(self) -> Iterator[tuple[str, bytes]]:
        # Called before start() has run: the machine is resumed already (in __init__).
        if self.machine.machine is None:
            return iter(())
        return self.journal.frames_of()

    async def on_presence(self, agent: str, online: bool, samples: int, now: float) -> None:
        if online and self._is_aggregator(agent) and not self.cfg.tier.sites:
            log.warning("%s is a site aggregator, and this one has no [tier] sites = true: not taken", agent)
            online = False
        # A region's members are site aggregators: each stands for the agents it announced.
        agents = int(self.core.peers.get(agent, {}).get("agents", 0))
        await self._handle(R.AgentOnline(agent, samples, agents=agents) if online else R.AgentOffline(agent))

    async def on_message(self, inc: Incoming, now: float) -> None:
        msg = inc.message
        if isinstance(msg, Update):
            allowed = ("agent", "aggregator") if self.cfg.tier.sites else ("agent",)
            if inc.role not in allowed:
                self.core.messenger.reject("role", inc.sender, f"update signed by a {inc.role or 'non-agent'}")
                return
            await self._handle(
                R.UpdateReceived(
                    inc.sender, msg.round, msg.base_version, msg.num_samples, msg.weights, msg.metrics, msg.leaving
                )
            )
        elif isinstance(msg, SECAGG_MESSAGES) and not isinstance(msg, SecAggStart):
            allowed = ("agent", "aggregator") if self.cfg.tier.sites else ("agent",)
            if inc.role not in allowed:
                self.core.messenger.reject("role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-agent'}")
                return
            await self._handle(R.SecAggReceived(inc.sender, msg))
        else:
            log.debug("ignoring %s from %s", type(msg).__name__, inc.sender)

    async def on_item(self, item: Any, now: float) -> None:
        if isinstance(item, FromUpstream):
            await self._from_upstream(item.incoming)
            return
        if isinstance(item, _Unsent):
            await self._hold(item.result)
            return
        if isinstance(item, _SendFailed):
            raise item.error
        if isinstance(item, T.UpstreamUp | T.UpstreamDown):
            self._link_down = isinstance(item, T.UpstreamDown)
            await self._handle(item)
            if self._link_down:
                # A publish cut off before its acknowledgement is sent again on the next
                # connection, whenever that is: held instead, it goes up only while its
                # upstream round may still be open.
                for task, result in list(self._sends.items()):
                    task.cancel()
                    del self._sends[task]
                    await self._hold(result)
            return
        self.streams.taken(item)
        await self._handle(item)

    def snapshot(self) -> dict[str, Any]:
        st = self.machine.status()
        inner = st["round"] if isinstance(st["round"], dict) else {}
        last = st["last"]
        mono, wall = time.monotonic(), time.time()
        down = self.machine.down_since
        held: dict[str, Any] | None = None
        if self.machine.held is not None:
            result, until = self.machine.held
            held = {
                "round": result.round,
                "site_round": result.site_round,
                "num_samples": result.num_samples,
                "agents": len(result.participants),
                # the machine's clock is monotonic: what is left of the upstream round's wait
                "seconds_left": round(max(0.0, until - mono), 1),
            }
        return {
            "phase": st["phase"],
            "round": self.machine.site_round if not inner else inner.get("round"),
            "completed_rounds": None,
            "rounds": None,
            "model_version": self.version,
            "selected": inner.get("selected", []),
            "received": inner.get("received", []),
            "waiting": inner.get("waiting"),
            "metrics": inner.get("metrics", {}),
            "last_round_seconds": self.last_round_seconds,
            "journal": self.journal.status(),
            "bounds": inner.get("bounds"),
            "tier": {
                "role": "site",
                "upstream": self.link.status(),
                "upstream_round": st["upstream_round"],
                "site_round": st["site_round"],
                # agent -> the samples it announced
                "agents": st["agents"],
                "samples": st["samples"],
                "last_partial_result": last,
                # wall-clock time the upstream connection was lost at (None: it is up)
                "upstream_down_since": None if down is None else round(wall - (mono - down), 1),
                # the partial result waiting for the upstream connection
                "held": held,
                "final_model_version": self.final.model_version if self.final is not None else None,
                # distributed DP of the upstream round: the agents' shares, none added here
                "privacy": st["privacy"],
            },
        }

    def refresh_metrics(self, m: NodeMetrics) -> None:
        m.set_round_limits(self.cfg.rounds.min_agents, self.cfg.rounds.round_timeout)
        m.set_model_version(self.version)
        m.round_started(self.machine.site_round)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._upstream(), self.streams.expire_stalled(self.core.messenger, 5.0), self._watch_upstream()]

    def close(self) -> None:
        for task in self._sends:
            task.cancel()  # the broker keeps what was not acknowledged; a restart drops it
        self.timer.cancel()
        self.durability.close()

    async def _upstream_up(self) -> None:
        await self.core.queue.put(T.UpstreamUp())

    async def _watch_upstream(self) -> None:
        """Tell the machine when the upstream connection is lost (its return is told by
        the connection's own callback, once the presence is out)."""
        while True:
            if not self._link_down and not self.link.transport.connected:
                await self.core.queue.put(T.UpstreamDown())
                self._link_down = True
            await asyncio.sleep(1.0)

    async def _upstream(self) -> None:
        try:
            await self.link.run()
        finally:
            await self.link.close()

    # -- upstream ------------------------------------------------------------------------
    async def _from_upstream(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, SECAGG_MESSAGES):
            await self._secure_upstream(inc)
            return
        if not isinstance(msg, RoundStart | RoundResult | GlobalModel):
            log.debug("ignoring %s from upstream %s", type(msg).__name__, inc.sender)
            return
        if inc.role != "coordinator":
            self.link.messenger.reject("role", inc.sender, f"{msg.kind} signed by a {inc.role or 'non-coordinator'}")
            return
        self.link.coordinator = inc.sender
        if isinstance(msg, RoundStart):
            self.version = max(self.version, msg.model_version)
            if not msg.selects(self.link.cfg.id):
                return
            if msg.weights is None:
                # An int8 step needs the model before it, which a site aggregator does not
                # keep between rounds: the upstream sends it whole (its presence reads no steps).
                log.warning("upstream round %d came as a model step: this site does not take part", msg.round)
                return
            if msg.everyone and not self.machine.online_upstream:
                # It selects the sites online when it started, and this one said offline
                # (below its quorum): handed on only to end a round still answered here.
                log.info("upstream round %d is not this site's: it was offline upstream (below its quorum)", msg.round)
                await self._handle(
                    T.UpstreamRound(msg.round, msg.model_version, msg.weights, msg.train, msg.deadline_s, everyone=True)
                )
                return
            log.info("upstream round %d from %s: model version %d", msg.round, inc.sender, msg.model_version)
            self._up_weights = (msg.round, msg.weights)
            try:
                await asyncio.to_thread(self._save_upstream, msg, msg.deadline_s, inc.sender)
            except (OSError, StateWriteError, FedagentError) as exc:
                log.warning("upstream round %d not saved (a restart in it drops the site's work): %s", msg.round, exc)
            if msg.secagg is not None:
                self._secure_up = msg.round
                await self.link.send_secagg(self.link.secagg.on_round_start(msg.round, msg.selected, msg.secagg))
            deadline = msg.deadline_s
            if msg.secagg is not None:
                # A secure round takes masked inputs until two stage timeouts before its
                # deadline, each at most a sixth of it: the site's result must be in by then.
                deadline *= 2 / 3
            await self._handle(
                T.UpstreamRound(msg.round, msg.model_version, msg.weights, msg.train, deadline, msg.everyone)
            )
        elif isinstance(msg, RoundResult):
            if msg.aggregated:
                self.version = max(self.version, msg.model_version)
            await self._handle(T.UpstreamClosed(msg.round))
        elif msg.final and (self.final is None or msg.model_version > self.final.model_version):
            self.final = msg
            self.version = max(self.version, msg.model_version)
            log.info("the upstream tier finished: model version %d, passed on to the site's agents", msg.model_version)
            self.core.history.append({"event": "finished", "model_version": msg.model_version})
            await self.core.messenger.send(
                topics.broadcast(self.core.fed, "model"), GlobalModel(msg.model_version, msg.round, True, msg.weights)
            )
            sdnotify.status(f"finished: model version {msg.model_version}")
            self.done.set()

    async def _secure_upstream(self, inc: Incoming) -> None:
        """The upstream tier's secure round, as an agent's part in one (agent/fedavg.py)."""
        msg = inc.message
        link = self.link
        if isinstance(msg, SecAggStart):
            if inc.role != "coordinator" or not inc.topic.startswith(
                topics.federation_root(self.core.fed) + "/global/"
            ):
                link.messenger.reject("role", inc.sender, "secagg_start not broadcast by a coordinator")
                return
            link.coordinator = inc.sender
            self._secure_up = max(self._secure_up, msg.round)
            await link.send_secagg(link.secagg.on_round_start(msg.round, msg.selected, msg.setup))
        elif isinstance(msg, SecAggRoster | SecAggShareBox | SecAggSurvivors | SecAggUnmask):
            if inc.role != "coordinator" or inc.sender != link.coordinator:
                link.messenger.reject("role", inc.sender, f"{msg.kind} not from the upstream coordinator")
                return
            await link.send_secagg(await asyncio.to_thread(link.secagg.on_message, msg))

    def _record_partial(self, cmd: T.PartialResult) -> None:
        self._recorded = cmd.site_round
        self.core.history.append(
            {
                "event": "site_round",
                "round": cmd.site_round,
                "upstream_round": cmd.round,
                "model_version": cmd.base_version,
                "participants": list(cmd.participants),
                "num_samples": cmd.num_samples,
                "metrics": cmd.metrics,
                "agg_weights": cmd.weights_used,
                "bounded": cmd.bounded,
                "seconds": round(self.last_round_seconds or 0.0, 4),
                # The agents noised their updates for the upstream round's cohort; this site
                # added nothing and charged nothing (the top tier accounts).
                **({"privacy": dict(self.machine.privacy)} if self.machine.privacy is not None else {}),
            }
        )
        for agent, what in cmd.bounded.items():
            log.info("site round %d: %s's update bounded: %s", cmd.site_round, agent, what)

    async def _deliver_partial(self, cmd: T.PartialResult) -> None:
        try:
            sent = await self._send_partial(cmd)
        except Exception as exc:  # noqa: BLE001 - raised again on the core's loop (a config error exits)
            await self.core.queue.put(_SendFailed(exc))
            return
        if not sent and not self.link.transport.connected:
            await self.core.queue.put(_Unsent(cmd))
            return
        await self.durability.end_round(cmd.site_round)
        log.info(
            "site round %d: %d agents, %d samples%s upstream round %d",
            cmd.site_round,
            len(cmd.participants),
            cmd.num_samples,
            " sent to" if sent else " NOT sent to",
            cmd.round,
        )

    async def _hold(self, cmd: T.PartialResult) -> None:
        """The partial result could not go up: held until the connection is back."""
        log.warning("upstream round %d: the upstream tier is out of reach; partial result held", cmd.round)
        self._link_down = True
        for c in self.machine.hold(cmd, time.monotonic()):
            await self._execute(c)

    async def _send_partial(self, cmd: T.PartialResult) -> bool:
        """The site's partial result upstream: whole, or masked in a secure upstream round."""
        if cmd.round != self._secure_up:
            return await self.link.send_update(
                Update(cmd.round, cmd.base_version, cmd.num_samples, dict(cmd.metrics), cmd.weights)
            )
        if self._up_weights[0] != cmd.round:
            log.warning("upstream round %d: its model is not held here; the masked mean is not sent", cmd.round)
            return False
        base = self._up_weights[1]
        secagg = self.link.secagg

        def masked() -> list[SecAggMessage]:
            return secagg.on_trained(
                cmd.round,
                Delta(cmd.weights, base),
                base_version=cmd.base_version,
                num_samples=cmd.num_samples,
                metrics=cmd.metrics,
            )

        await self.link.send_secagg(await asyncio.to_thread(masked))
        return True

    # -- streams (as the FedAvg coordinator's) -------------------------------------------
    async def _on_stream(self, events: list[StreamEvent]) -> None:
        await self.streams.put(events)

    async def _refold(self, cmd: R.Refold) -> None:
        """Updates of the site round read back from the journal (coordinator/refold.py)."""
        m = self.core.messenger
        incomplete = await asyncio.to_thread(
            read_back_round,
            self.journal.frames_of,
            dict(cmd.updates),
            cmd.counted,
            cmd.round,
            self.machine.refold,
            federation=self.core.fed,
            wire_limits=m.wire_limits,
            model_limits=m.model_limits,
        )
        await self._handle(R.Refolded(cmd.round, incomplete))

    # -- the machine ---------------------------------------------------------------------
    async def _handle(self, event: Any) -> None:
        cmds = self.machine.handle(event, time.monotonic())
        del event
        batch: list[R.SendSecAgg] = []
        for cmd in cmds:
            if isinstance(cmd, R.SendSecAgg):
                batch.append(cmd)
                continue
            if batch:
                await self._send_secagg(batch)
                batch = []
            await self._execute(cmd)
        if batch:
            await self._send_secagg(batch)

    async def _send_secagg(self, cmds: list[R.SendSecAgg] | tuple[R.SendSecAgg, ...]) -> None:
        """A secure stage's messages to the site's agents: each agent's in order, the agents
        at once (as the FedAvg coordinator's)."""
        by_agent: dict[str, list[R.SendSecAgg]] = {}
        for c in cmds:
            by_agent.setdefault(c.to, []).append(c)

        async def send(msgs: list[R.SendSecAgg]) -> None:
            for c in msgs:
                await self._execute(c)

        await asyncio.gather(*(send(m) for m in by_agent.values()))

    async def _execute(self, cmd: Any) -> None:
        core, fed = self.core, self.core.fed
        if isinstance(cmd, R.StartRound):
            self._started_at = time.monotonic()
            self.durability.count_round()
            if not cmd.resumed:
                await asyncio.gather(
                    asyncio.to_thread(self._save_state, cmd.round),
                    self.durability.begin(cmd.round, cmd.model_version, cmd.selected),
                )
            up = self.machine.upstream
            log.info(
                "site round %d%s (upstream round %s): model version %d to %s",
                cmd.round,
                " (resumed after a restart)" if cmd.resumed else "",
                up.round if up is not None else "?",
                cmd.model_version,
                cmd.to_whom(),
            )
            sdnotify.status(f"site round {cmd.round}: training on {len(cmd.selected)} agents")
            if cmd.secagg is not None:
                await core.messenger.send(
                    topics.broadcast(fed, "secagg_start"),
                    SecAggStart(cmd.round, cmd.selected, cmd.secagg),
                    round_=cmd.round,
                )
                await self._send_secagg(cmd.secagg_first)
            await core.messenger.send(
                topics.broadcast(fed, "round_start"),
                cmd.message(),
                round_=cmd.round,
                stable=True,
            )
        elif isinstance(cmd, R.SendSecAgg):
            await core.messenger.send(
                topics.direct(fed, self.cfg.id, cmd.to, cmd.message.kind), cmd.message, round_=cmd.message.round
            )
        elif isinstance(cmd, R.RoundAggregated):
            took = time.monotonic() - (self._started_at or time.monotonic())
            self.last_round_seconds = took
            # The journal stays until the partial result has gone up (or is dropped): a
            # restart before then makes it again from the journal's updates.
            await asyncio.to_thread(self._save_state, self.machine.site_round)
            # The agents learn their round is over; the model they trained from is still
            # the current one until the upstream tier says otherwise.
            await core.messenger.send(
                topics.broadcast(fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version - 1, len(cmd.participants), cmd.metrics),
                round_=cmd.round,
            )
            held = self.machine.held
            if held is not None and held[0].site_round == cmd.round:
                self._record_partial(held[0])
                log.warning(
                    "site round %d: %d agents, %d samples held for upstream round %d: the upstream tier is out of reach",
                    cmd.round,
                    len(held[0].participants),
                    held[0].num_samples,
                    held[0].round,
                )
        elif isinstance(cmd, T.PartialResult):
            if cmd.site_round != self._recorded:  # not recorded when it was held
                self._record_partial(cmd)
            if not self.link.transport.connected:
                await self._hold(cmd)
                return
            # A task of its own: a stalled connection holds the publish up to its timeout,
            # and the site's agents, its status and the machine's clock must not wait.
            task = asyncio.get_running_loop().create_task(self._deliver_partial(cmd))
            self._sends[task] = cmd
            task.add_done_callback(lambda t: self._sends.pop(t, None))
        elif isinstance(cmd, T.PartialDropped):
            log.warning("upstream round %d: site round %d's partial result %s", cmd.round, cmd.site_round, cmd.reason)
            core.history.append(
                {"event": "site_dropped", "round": cmd.site_round, "upstream_round": cmd.round, "reason": cmd.reason}
            )
            await self.durability.end_round(cmd.site_round)
        elif isinstance(cmd, T.SiteRoundFailed):
            log.warning("upstream round %d: no partial result from this site: %s", cmd.round, cmd.reason)
            core.history.append(
                {"event": "site_failed", "round": cmd.site_round, "upstream_round": cmd.round, "reason": cmd.reason}
            )
            await self.durability.end_round(cmd.site_round)
        elif isinstance(cmd, R.RoundAbandoned):
            core.metrics.round_abandoned()
            await core.messenger.send(
                topics.broadcast(fed, "round_result"),
                RoundResult(cmd.round, cmd.model_version, 0, {}, aggregated=False, reason=cmd.reason),
                round_=cmd.round,
            )
        elif isinstance(cmd, T.Announce):
            await self.link.announce(cmd.num_samples, cmd.agents)
        elif isinstance(cmd, R.Rejected):
            core.reject(cmd.sender, cmd.reason, cmd.detail, round=cmd.round)
        elif isinstance(cmd, R.LateUpdate):
            log.info("discarded from %s: %s", cmd.sender, cmd.detail)
            core.metrics.discarded()
        elif isinstance(cmd, R.Refold):
            await self._refold(cmd)
        elif isinstance(cmd, R.RequestWakeup):
            self.timer.request(cmd.at)
        else:
            log.debug("site command %s not carried out", type(cmd).__name__)


def _boot_id() -> str:
    """This boot's id (Linux): monotonic times saved in another boot mean nothing in this one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
