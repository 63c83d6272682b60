"""A site aggregator's link to its upstream tier: a second broker connection, as one
participant of the upstream coordinator's rounds.

The site aggregator is the coordinator of its own broker (its ``[tls]`` certificate, of
role ``coordinator``); at the upstream broker it is ``[tier] upstream_id`` with a
certificate of role ``aggregator``, which the upstream coordinator takes as a
participant weighing its site's samples (``[tier] sites = true`` there). Over this link
it announces its site (a retained presence whose ``num_samples`` is the sum its agents
announced), hears the upstream round starts, results and the final model, and sends its
partial results to the coordinator that started the round, whole (a site mean is not
compressed: the upstream mean stays FedAvg over the agents to float precision), or masked
in the upstream tier's secure rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedagent.config import NodeConfig, TlsConfig
from fedagent.errors import EXIT_CONFIG, TransportError
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.metrics import NodeMetrics
from fedagent.node.runtime import make_transport, node_identity, presence_payload
from fedagent.protocols import topics
from fedagent.protocols.messages import Message, Presence, Update
from fedagent.protocols.secagg import SecAggAgent, SecAggError, SecAggMasked, SecAggMessage
from fedagent.security.signing import AuthError, sign_statement
from fedagent.storage.statefile import make_dirs

log = logging.getLogger("fedagent.coordinator.upstream")

#: Seconds between two presence updates upstream. The upstream coordinator takes a
#: member's presence frames at 2 a second (a burst of 10) and drops the rest unread; a
#: site whose agents connect by the hundred changes its announcement with each of them,
#: and the one dropped could be the last (the site online, its final count), which the
#: hub would then never see. Paced, the newest announcement always goes out.
PRESENCE_INTERVAL = 0.6


@dataclass(frozen=True, slots=True)
class FromUpstream:
    """A verified message from the upstream broker, as a queue item of the site's core."""

    incoming: Incoming


def upstream_config(cfg: NodeConfig) -> NodeConfig:
    """The node configuration of the upstream side: its own name, certificate and broker,
    and the role of a participant there."""
    t = cfg.tier
    tls = TlsConfig(ca=cfg.tls.ca, cert=Path(t.upstream_cert), key=Path(t.upstream_key))
    return replace(cfg, id=t.upstream_id, broker=t.upstream, tls=tls, role="agent")


class UpstreamLink:
    """The connection to the upstream broker; what it hears goes to ``queue`` as
    :class:`FromUpstream`."""

    def __init__(self, cfg: NodeConfig, queue: asyncio.Queue[Any], state_dir: Any, model_digest: str) -> None:
        self.cfg = upstream_config(cfg)
        self.fed = cfg.federation
        self.queue = queue
        self.model_digest = model_digest
        self.samples = 0  # what the presence announces: the site's agents' total
        self.agents = 0
        self.coordinator: str | None = None  # of the upstream tier, from its round starts
        # Awaited after every (re)connection, once what the broker held for this link while
        # it was away has been handed on (the end of an upstream round among it).
        self.on_up: Callable[[], Awaitable[None]] | None = None
        self._up_mark: float | None = None  # this connection's presence, sent at
        self._presence_due = asyncio.Event()  # the announcement changed since it went up
        self.sent: dict[str, int] = {"results": 0, "bytes": 0}
        fed, me = self.fed, self.cfg.id
        self.transport = make_transport(
            self.cfg,
            fed,
            self.cfg.broker,
            subscriptions=[
                # As an agent's (agent/fedavg.py): round starts are not queued while away.
                (topics.broadcast(fed, "round_start"), 0),
                topics.broadcast(fed, "secagg_start"),
                topics.broadcast(fed, "round_result"),
                topics.broadcast(fed, "model"),
                topics.inbox(fed, me),
                # Its own presence, heard back: the broker sends it after what it held for
                # this session, so hearing it means all of that has been handed on.
                topics.presence(fed, me),
            ],
            on_connect=self._on_connect,
        )
        make_dirs(state_dir)
        self.messenger = Messenger(
            federation=fed,
            node_id=me,
            transport=self.transport,
            max_chunk_bytes=self.cfg.max_chunk_bytes,
            max_model_bytes=self.cfg.max_model_bytes,
            metrics=NodeMetrics("aggregator", me, fed),
            identity=node_identity(self.cfg),
            max_skew=self.cfg.max_clock_skew,
            state_dir=state_dir,
        )
        identity = self.messenger.identity
        # The site aggregator's part in the upstream tier's secure rounds: its site's mean
        # goes up masked, and the upstream coordinator unmasks only the sum over sites.
        self.secagg = SecAggAgent(me, sign=lambda data: sign_statement(identity, data), verify=self._verify_statement)

    def _verify_statement(self, name: str, data: bytes, cert: bytes, sig: bytes) -> None:
        try:
            self.messenger.verifier.check_statement(name, data, cert, sig)
        except AuthError as exc:
            raise SecAggError(f"the keys of {name} are not signed by {name}: {exc}") from None

    async def send_secagg(self, msgs: list[SecAggMessage]) -> None:
        """A secure round's messages to the upstream coordinator (the site's masked mean
        among them), in order."""
        if self.secagg.error:
            log.warning("upstream round %d: secure aggregation stopped here: %s", self.secagg.round, self.secagg.error)
            self.secagg.error = ""
        if self.coordinator is None:
            return
        for m in msgs:
            topic = topics.direct(self.fed, self.cfg.id, self.coordinator, m.kind)
            try:
                await self.messenger.send(topic, m, round_=m.round, stable=isinstance(m, SecAggMasked))
            except TransportError as exc:
                if exc.exit_code == EXIT_CONFIG:
                    raise
                log.warning("upstream round %d: %s not delivered (%s)", m.round, m.kind, exc)
                return
            if isinstance(m, SecAggMasked):
                self.sent["results"] += 1

    def _presence(self, online: bool) -> bytes:
        if not online or self.samples == 0:
            # no agents, or fewer than the site's quorum: not a participant upstream
            return presence_payload(self.cfg, self.fed, False)
        return presence_payload(
            self.cfg, self.fed, True, num_samples=self.samples, model=self.model_digest, agents=self.agents
        )

    async def _on_connect(self) -> None:
        self._up_mark = time.time()
        await self._publish_presence()

    async def _publish_presence(self) -> None:
        await self.transport.publish(topics.presence(self.fed, self.cfg.id), self._presence(True), retain=True)

    async def announce(self, samples: int, agents: int) -> None:
        """The site's agents changed: the presence says their new total (when connected;
        the next connection says it anyway), at most every ``PRESENCE_INTERVAL``."""
        # Below its quorum (no samples) the presence says offline whatever the count.
        unchanged = samples == 0 and self.samples == 0
        self.samples, self.agents = samples, agents
        if not unchanged:
            self._presence_due.set()

    async def _pace_presence(self) -> None:
        while True:
            await self._presence_due.wait()
            self._presence_due.clear()
            if self.transport.connected:
                try:
                    await self._publish_presence()
                except TransportError as exc:
                    log.warning("upstream presence not updated: %s", exc)
            await asyncio.sleep(PRESENCE_INTERVAL)

    async def _on_payload(self, topic: str, payload: bytes | bytearray) -> Any:
        return await self.messenger.receive(topic, payload, self._deliver)

    async def _deliver(self, inc: Incoming) -> None:
        if inc.sender == self.cfg.id:
            mark = self._up_mark
            if isinstance(inc.message, Presence) and mark is not None and inc.envelope.ts >= mark:
                self._up_mark = None
                if self.on_up is not None:
                    await self.on_up()
            return  # its own presence, retained from before or re-announced
        await self.queue.put(FromUpstream(inc))

    async def send_update(self, update: Update) -> bool:
        """The site's partial result to the upstream coordinator; False when it could not go."""
        if self.coordinator is None:
            log.warning("upstream round %d: no upstream coordinator known; partial result dropped", update.round)
            return False
        topic = topics.direct(self.fed, self.cfg.id, self.coordinator, "update")
        try:
            n = await self.messenger.send(topic, update, round_=update.round)
        except TransportError as exc:
            if exc.exit_code == EXIT_CONFIG:
                raise
            log.warning("upstream round %d: partial result not delivered (%s)", update.round, exc)
            return False
        self.sent["results"] += 1
        self.sent["bytes"] += n
        return True

    async def send(self, topic: str, message: Message) -> None:
        await self.messenger.send(topic, message)

    async def run(self) -> None:
        ready = asyncio.Event()
        pacer = asyncio.create_task(self._pace_presence(), name="upstream-presence")
        try:
            await self.transport.run(self._on_payload, ready)
        finally:
            pacer.cancel()
            await asyncio.gather(pacer, return_exceptions=True)

    async def close(self) -> None:
        self.messenger.close()
        try:
            await asyncio.wait_for(
                self.transport.close((topics.presence(self.fed, self.cfg.id), self._presence(False))), 5
            )
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("upstream close failed: %s", exc)

    def status(self) -> dict[str, Any]:
        silent = self.transport.silent_for()
        return {
            "id": self.cfg.id,
            "broker": self.cfg.broker,
            "connection": self.transport.link_state,
            "broker_silent_s": None if silent is None else round(silent, 1),
            "coordinator": self.coordinator,
            "announced_samples": self.samples,
            "announced_agents": self.agents,
            "partial_results_sent": self.sent["results"],
            "bytes_out": self.messenger.bytes_out,
            "rejected": dict(self.messenger.rejected),
        }
