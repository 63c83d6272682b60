"""Prometheus metrics of one daemon, served over HTTP on loopback by default.

Each node owns its own ``CollectorRegistry`` (never the process-global one), so
several nodes can live in one process (tests, many-agent simulations) without
colliding. The endpoint is a small asyncio server in the daemon's own event loop:
no extra thread, and it answers only ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fedagent.errors import ConfigError

log = logging.getLogger(__name__)

ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Refusals of frames that failed authentication (security/signing.py's AuthError reasons
#: and a sender the envelope does not match): an alert fires on the first one.
AUTH_REASONS = ("signature", "certificate", "unsigned", "replay", "spoofed")


class NodeMetrics:
    def __init__(self, role: str, node_id: str, federation: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"role": role, "node": node_id}
        r = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        self._labels = labels
        # The per-direction series of the counters every frame moves, looked up once:
        # ``labels()`` checks and joins the label values each time (12 µs a frame).
        self._directed: dict[tuple[Counter, str], Any] = {}
        self.rounds = counter("fedagent_rounds_completed", "rounds aggregated (coordinator) or trained (agent)")
        self.round = gauge("fedagent_round", "current round number")
        self.model_version = gauge("fedagent_model_version", "version of the latest global model")
        self.bytes = counter("fedagent_bytes", "payload bytes over MQTT", ("direction",))
        self.messages = counter("fedagent_messages", "protocol messages", ("direction",))
        self.round_seconds = Histogram(
            "fedagent_round_seconds", "round latency", [*labels], buckets=ROUND_BUCKETS, registry=r
        )
        self.train_seconds = Histogram(
            "fedagent_training_seconds", "local training time per round", [*labels], buckets=ROUND_BUCKETS, registry=r
        )
        self.peers = gauge("fedagent_peers_online", "peers seen online")
        self.rejected_total = counter("fedagent_rejected_messages", "messages refused", ("reason",))
        self.dropped_total = counter(
            "fedagent_dropped_messages",
            "frames dropped before they were checked: a sender over its budget for the kind (rate:KIND, "
            "rate:total) or a transfer not expected from it",
            ("reason",),
        )
        self.bounded_total = counter(
            "fedagent_bounded_updates",
            "coordinator: updates whose weight (bound=weight) or distance from the global model (bound=norm) "
            "was scaled down",
            ("agent", "bound"),
        )
        self.discarded_total = counter(
            "fedagent_discarded_updates", "coordinator: updates that came late for a round abandoned meanwhile"
        )
        self.reconnects = counter("fedagent_reconnects", "reconnections to the broker")
        self.connected = gauge("fedagent_connected", "1 while connected to the broker")
        self.last = gauge("fedagent_last_metric", "last reported training/evaluation metric", ("name",))
        self.dp_epsilon = gauge("fedagent_dp_epsilon", "differential privacy: epsilon spent so far at dp_delta")
        self.dp_delta = gauge("fedagent_dp_delta", "differential privacy: the delta epsilon is reported at")
        self.dp_budget = gauge("fedagent_dp_epsilon_budget", "differential privacy: epsilon at which training stops")
        self.dp_clip = gauge("fedagent_dp_clip_norm", "differential privacy: the current clipping bound")
        self.dp_unclipped = gauge(
            "fedagent_dp_unclipped_fraction",
            "differential privacy, adaptive clipping: the noised fraction of the last round's updates within the bound",
        )
        self.dp_clipped = counter(
            "fedagent_dp_clipped_updates", "differential privacy: updates this agent clipped before sending"
        )
        self.progress = gauge(
            "fedagent_progress_timestamp_seconds",
            "when this node last completed a round or step (Unix time), or started",
        )
        self.abandoned = counter("fedagent_rounds_abandoned", "rounds closed without an aggregate (coordinator)")
        self.phase = gauge("fedagent_phase", "the coordinator's phase (value 1 for the current one)", ("phase",))
        self.min_agents = gauge("fedagent_min_agents", "the quorum: live agents a round (or step) needs to start")
        self.round_timeout = gauge("fedagent_round_timeout_seconds", "how long a round (or step) may take")
        self.agents_live = gauge("fedagent_agents_live", "agents online and heard within their keep-alive")
        self.agent_silent = gauge(
            "fedagent_agent_silent",
            "1 while a known agent is silent (no heartbeat for its keep-alive) or offline, 0 while it is live",
            ("agent",),
        )
        self.fs_avail = gauge(
            "fedagent_state_filesystem_avail_bytes", "bytes free for this daemon on its state directory's filesystem"
        )
        self.fs_size = gauge("fedagent_state_filesystem_size_bytes", "size of the state directory's filesystem")
        # An agent can change federation at run time (join/leave): it is an info label.
        self.federation = gauge("fedagent_federation", "the federation this node is in (value 1)", ("federation",))
        self.set_federation(federation)
        self.progress.labels(**labels).set(time.time())
        # A rate needs the series from zero on, or the first increase is never seen: the
        # first abandoned round, the first frame failing authentication.
        self.abandoned.labels(**labels)
        for reason in AUTH_REASONS:
            self.rejected_total.labels(**labels, reason=reason)
        self._server: asyncio.AbstractServer | None = None
        self._reconnects_seen = 0
        # Called before each scrape so gauges reflect the daemon's state at that moment.
        self.before_scrape: Callable[[NodeMetrics], None] | None = None

    # -- what the daemons call -----------------------------------------------------------
    def set_federation(self, federation: str) -> None:
        self.federation.clear()
        self.federation.labels(**self._labels, federation=federation or "-").set(1)

    def round_started(self, round_: int) -> None:
        self.round.labels(**self._labels).set(round_)

    def round_completed(self, seconds: float | None, metrics: dict[str, float]) -> None:
        self.rounds.labels(**self._labels).inc()
        self.progress.labels(**self._labels).set(time.time())
        if seconds is not None:
            self.round_seconds.labels(**self._labels).observe(seconds)
        self.report(metrics)

    def report(self, metrics: dict[str, float], prefix: str = "") -> None:
        for name, value in metrics.items():
            self.last.labels(**self._labels, name=prefix + name).set(value)

    def set_privacy(self, privacy: dict[str, float]) -> None:
        self.dp_epsilon.labels(**self._labels).set(privacy["epsilon"])
        self.dp_delta.labels(**self._labels).set(privacy["delta"])
        self.dp_clip.labels(**self._labels).set(privacy["clip_norm"])
        if "epsilon_budget" in privacy:
            self.dp_budget.labels(**self._labels).set(privacy["epsilon_budget"])
        if "unclipped_fraction" in privacy:
            self.dp_unclipped.labels(**self._labels).set(privacy["unclipped_fraction"])

    def dp_update_clipped(self) -> None:
        self.dp_clipped.labels(**self._labels).inc()

    def round_abandoned(self) -> None:
        self.abandoned.labels(**self._labels).inc()

    def set_phase(self, phase: str) -> None:
        self.phase.clear()
        if phase:
            self.phase.labels(**self._labels, phase=phase).set(1)

    def set_round_limits(self, min_agents: int, timeout: float) -> None:
        """The quorum and the round's (step's) deadline, which the alerts compare with."""
        self.min_agents.labels(**self._labels).set(min_agents)
        self.round_timeout.labels(**self._labels).set(timeout)

    def set_agents(self, silent: dict[str, bool]) -> None:
        """Every agent the coordinator knows of, and whether it is silent or offline."""
        self.agent_silent.clear()
        for agent, quiet in silent.items():
            self.agent_silent.labels(**self._labels, agent=agent).set(1 if quiet else 0)
        self.agents_live.labels(**self._labels).set(sum(1 for quiet in silent.values() if not quiet))

    def set_state_filesystem(self, path: Path) -> None:
        """Free and total bytes of the filesystem ``path`` is on, as this process may use it."""
        try:
            st = os.statvfs(path)
        except OSError:
            return  # (the directory is gone or unreadable: the daemon itself reports that)
        self.fs_avail.labels(**self._labels).set(st.f_bavail * st.f_frsize)
        self.fs_size.labels(**self._labels).set(st.f_blocks * st.f_frsize)

    def set_model_version(self, version: int) -> None:
        self.model_version.labels(**self._labels).set(version)

    def _direction(self, counter: Counter, direction: str) -> Any:
        child = self._directed.get((counter, direction))
        if child is None:
            child = self._directed[(counter, direction)] = counter.labels(**self._labels, direction=direction)
        return child

    def add_bytes(self, in_: int = 0, out: int = 0) -> None:
        if in_:
            self._direction(self.bytes, "in").inc(in_)
        if out:
            self._direction(self.bytes, "out").inc(out)

    def message_in(self) -> None:
        self._direction(self.messages, "in").inc()

    def message_out(self) -> None:
        self._direction(self.messages, "out").inc()

    def rejected(self, reason: str) -> None:
        self.rejected_total.labels(**self._labels, reason=reason).inc()

    def dropped(self, reason: str) -> None:
        self.dropped_total.labels(**self._labels, reason=reason).inc()

    def bounded(self, agent: str, bound: str) -> None:
        self.bounded_total.labels(**self._labels, agent=agent, bound=bound).inc()

    def discarded(self) -> None:
        self.discarded_total.labels(**self._labels).inc()

    def set_peers(self, n: int) -> None:
        self.peers.labels(**self._labels).set(n)

    def reconnected(self) -> None:
        self.reconnects.labels(**self._labels).inc()

    def set_reconnects(self, total: int) -> None:
        """Advance the counter to the transport's running total."""
        if total > self._reconnects_seen:
            self.reconnects.labels(**self._labels).inc(total - self._reconnects_seen)
            self._reconnects_seen = total

    def set_connected(self, up: bool) -> None:
        self.connected.labels(**self._labels).set(1 if up else 0)

    def training_seconds(self, seconds: float) -> None:
        self.train_seconds.labels(**self._labels).observe(seconds)

    def exposition(self) -> bytes:
        if self.before_scrape is not None:
            try:
                self.before_scrape(self)
            except Exception:
                log.exception("updating metrics before a scrape failed")
        return generate_latest(self.registry)

    # -- HTTP endpoint ---------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 0, *, allow_remote: bool = False) -> tuple[str, int]:
        if not allow_remote and not ipaddress.ip_address(host).is_loopback:
            raise ConfigError(
                f"metrics endpoint on {host} would be reachable from the network; "
                "bind it to 127.0.0.1 or allow it explicitly"
            )
        self._server = await asyncio.start_server(self._handle, host, port)
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            line = request.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body, status, ctype = self.exposition(), b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"only GET /metrics here\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
