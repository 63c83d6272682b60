"""A whole federation on this machine, as separate processes.

:class:`Federation` makes a CA and certificates, starts a private Mosquitto (mutual TLS,
per-agent ACL, a free loopback port), writes the coordinator's and agents' config files,
starts the daemons (``python -m fedagent coordinator|agent``), asks them for their status
over their control sockets, and stops everything it started in :meth:`Federation.close`.
``fedagent demo``, the network tests, the experiments and the benchmarks build on it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedagent import config
from fedagent.config import TlsConfig
from fedagent.errors import FedagentError
from fedagent.local import launch
from fedagent.local.launch import DaemonProcess
from fedagent.mosquitto import EmbeddedBroker
from fedagent.node.control import request
from fedagent.security import pki
from fedagent.stopsignals import child_starting
from fedagent.storage import checkpoint

# Training settings of the digits federations (the demo's and the tests' reference runs
# use the same ones).
LOCAL_EPOCHS = 2
LR = 0.05
BATCH = 32
SEED = 0


@dataclass
class Proc:
    name: str
    popen: DaemonProcess
    log: Path


class Federation:
    """Processes and files of one local federation; ``close()`` stops them all."""

    def __init__(
        self,
        work: Path,
        *,
        agents: int,
        rounds: int,
        alpha: float,
        federation: str | None = None,
        round_timeout: float = 60.0,
        agent_broker_by_mdns: bool = True,
        mode: str = "fedavg",
        gossip: dict[str, Any] | None = None,
        broker_per_agent: bool = False,
        task: str = "digits",
        task_options: dict[str, Any] | None = None,
        privacy: dict[str, Any] | None = None,
        rounds_options: dict[str, Any] | None = None,
        fedbuff: dict[str, Any] | None = None,
        slow_agents: dict[str, float] | None = None,
        train_seconds: float = 0.0,
        broker_bind: str = "127.0.0.1",
    ) -> None:
        """``rounds_options``: more ``[rounds]`` keys for the coordinator (e.g.
        ``secure_aggregation``), over the defaults written here. ``fedbuff``: the
        ``[async]`` table of a ``mode = "async"`` federation. ``slow_agents``: agent id ->
        how many times as long its training takes (``fedagent.tasks.slowed``);
        ``train_seconds``: every agent's training takes at least this long (before its
        slowdown), as on a device slower than this machine. ``broker_bind``: the address
        the broker listens on (another than loopback when the daemons run in network
        namespaces of their own, as the chaos soak's do)."""
        self.work = work
        # [privacy] of the coordinator (fedavg) or of every agent (gossip: local DP).
        self.privacy = dict(privacy) if privacy else None
        self.rounds_options = dict(rounds_options or {})
        self.n = agents
        self.rounds = rounds
        self.alpha = alpha
        self.fed = federation or f"demo-{secrets.token_hex(3)}"
        self.round_timeout = round_timeout
        self.by_mdns = agent_broker_by_mdns
        self.procs: list[Proc] = []
        self.broker: EmbeddedBroker | None = None
        self.agent_ids = [f"agent-{i + 1}" for i in range(agents)]
        self.coordinator_id = "coordinator"
        self.mode = mode
        self.gossip = dict(gossip or {})
        self.fedbuff = dict(fedbuff or {})
        self.slow_agents = dict(slow_agents or {})
        self.train_seconds = train_seconds
        # Another built-in task than digits: its options (plus shard/shards/seed) for
        # every agent; ``alpha`` is digits' own option and is then not passed.
        self.task = task
        self.task_options = task_options
        self.broker_bind = broker_bind
        self.broker_per_agent = broker_per_agent  # gossip: every agent on a broker of its own
        self.agent_brokers: dict[str, EmbeddedBroker] = {}
        # Control sockets: a Unix socket path holds at most 107 bytes, so under a long
        # TMPDIR they go to a short private directory of their own, removed by close().
        self.run_root = work / "run"
        self._short_run: Path | None = None
        if len(str(self.run_root / "coordinator" / "coordinator.sock").encode()) > 100:
            self._short_run = Path(tempfile.mkdtemp(prefix="fedagent-run-", dir="/tmp"))
            self.run_root = self._short_run

    # -- set-up ----------------------------------------------------------------------
    @property
    def broker_uri(self) -> str:
        if self.broker is None:
            raise FedagentError("the federation's broker is not started (call prepare() first)")
        return self.broker.uri

    def prepare(self) -> None:
        ca_dir = self.work / "pki"
        pki.create_ca(ca_dir, self.fed)
        for name in [self.coordinator_id, *self.agent_ids]:
            pki.issue(ca_dir, ca_dir, name, "coordinator" if name == self.coordinator_id else "agent")
        # Assigned before start(): a start interrupted half-way is still stopped by close().
        self.broker = EmbeddedBroker(
            self.work / "broker",
            federations=[self.fed],
            coordinators=[self.coordinator_id],
            ca_dir=ca_dir,
            bind=self.broker_bind,
        )
        self.broker.start()
        if self.mode == "gossip" and self.broker_per_agent:
            # Every agent on its own broker (same CA): a model goes to the receiver's
            # inbox on the receiver's broker, found through the receiver's mDNS advert.
            for i, aid in enumerate(self.agent_ids):
                b = EmbeddedBroker(
                    self.work / f"broker-{aid}",
                    federations=[self.fed],
                    coordinators=[],
                    ca_dir=ca_dir,
                    name=f"broker-{aid}",
                )
                self.agent_brokers[aid] = b
                b.start()
                self._write_gossip_agent(aid, i, b.uri)
            return
        if self.mode == "gossip":
            # No coordinator: the first agent is told the broker and advertises it on
            # mDNS; the others find it there (unless mDNS is switched off).
            for i, aid in enumerate(self.agent_ids):
                self._write_gossip_agent(aid, i, self.broker.uri if (i == 0 or not self.by_mdns) else "")
            return
        rounds = {
            "rounds": self.rounds,
            "min_agents": self.n,
            "expected_agents": self.n,
            "min_updates": max(1, self.n // 2),
            "round_timeout": self.round_timeout,
            "local_epochs": LOCAL_EPOCHS,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
            **self.rounds_options,
        }
        mode: dict[str, Any] = {"mode": "async", "fedbuff": self.fedbuff} if self.mode == "async" else {}
        self._write(
            "coordinator",
            self.coordinator_id,
            self.broker.uri,
            {"seed": SEED, **(self.task_options or {})},
            rounds,
            self.task,
            privacy=self.privacy,
            **mode,
        )
        for i, aid in enumerate(self.agent_ids):
            task, options = self.task, self.shard_options(i)
            if aid in self.slow_agents or self.train_seconds:
                slowed = {"inner": task, "slowdown": self.slow_agents.get(aid, 1.0)}
                if self.train_seconds:
                    slowed["at_least"] = self.train_seconds
                task, options = "fedagent.tasks.slowed:make", {**options, **slowed}
            self._write(aid, aid, "" if self.by_mdns else self.broker.uri, options, None, task, **mode)

    def prepare_syncopt(
        self,
        task: str,
        agent_options: Callable[[int], dict[str, Any]],
        coordinator_options: dict[str, Any],
        syncopt: dict[str, Any],
    ) -> None:
        """Configs for a ``mode = "syncopt"`` federation (call after ``prepare()`` has made
        the PKI and the broker): ``agent_options(i)`` gives agent i's task options."""
        uri = self.broker_uri
        self._write(
            "coordinator", self.coordinator_id, uri, coordinator_options, None, task, mode="syncopt", syncopt=syncopt
        )
        for i, aid in enumerate(self.agent_ids):
            self._write(aid, aid, "" if self.by_mdns else uri, agent_options(i), None, task, mode="syncopt")

    def _write(
        self,
        stem: str,
        node_id: str,
        broker: str,
        task_options: dict[str, Any],
        rounds: dict[str, Any] | None,
        task: str = "digits",
        **extra: Any,
    ) -> Path:
        """Write ``<stem>.toml``; ``extra`` goes to :func:`config.render` (mode, gossip)."""
        ca_dir = self.work / "pki"
        tls = TlsConfig(ca=ca_dir / "ca.crt", cert=ca_dir / f"{node_id}.crt", key=ca_dir / f"{node_id}.key")
        text = config.render(
            node_id=node_id,
            federation=self.fed,
            tls=tls,
            broker=broker,
            state_dir=self.work / "state" / stem,
            runtime_dir=self.run_root / stem,
            task=task,
            task_options=task_options,
            rounds=rounds,
            **extra,
        )
        path = self.config_path(stem)
        path.write_text(text)
        return path

    def shard_options(self, shard: int) -> dict[str, Any]:
        if self.task_options is None:
            return {"shard": shard, "shards": self.n, "alpha": self.alpha, "seed": SEED}
        return {"seed": SEED, **self.task_options, "shard": shard, "shards": self.n}

    def _write_gossip_agent(self, node_id: str, shard: int, broker: str) -> Path:
        return self._write(
            node_id,
            node_id,
            broker,
            self.shard_options(shard),
            None,
            self.task,
            mode="gossip",
            gossip={"lr": LR, "batch_size": BATCH, "seed": SEED, **self.gossip},
            privacy=self.privacy,
        )

    def _enroll(self, node_id: str, write: Callable[[], Path]) -> Proc:
        """Issue ``node_id`` a certificate, ``write()`` its config, start it."""
        ca_dir = self.work / "pki"
        pki.issue(ca_dir, ca_dir, node_id, "agent")
        write()
        self.agent_ids.append(node_id)
        return self.spawn(node_id)

    def write_coordinator(
        self,
        task: str,
        task_options: dict[str, Any],
        rounds: dict[str, Any],
        transfer: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Path:
        """Replace the coordinator's config (another task, other round settings, and
        ``transfer``: its [transfer] table, e.g. a compression pinned; ``extra``: more of
        :func:`config.render`'s tables, e.g. ``mode`` and ``fedbuff``)."""
        return self._write(
            "coordinator", self.coordinator_id, self.broker_uri, task_options, rounds, task, transfer=transfer, **extra
        )

    def add_agent(
        self,
        node_id: str,
        task: str,
        task_options: dict[str, Any],
        rounds: dict[str, Any] | None = None,
        broker: str | None = None,
        **extra: Any,
    ) -> Proc:
        """A new agent (its own certificate and config) started now; ``broker=None``
        gives it the broker's address, ``""`` makes it look the broker up by mDNS;
        ``extra``: more of :func:`config.render`'s tables (``mode``...)."""
        uri = self.broker_uri if broker is None else broker
        return self._enroll(node_id, lambda: self._write(node_id, node_id, uri, task_options, rounds, task, **extra))

    def add_gossip_agent(self, node_id: str, shard: int, broker: str = "") -> Proc:
        """A new member (its own certificate and config) started mid-training."""
        return self._enroll(node_id, lambda: self._write_gossip_agent(node_id, shard, broker))

    def model_path(self, stem: str) -> Path:
        """A gossip agent's own model checkpoint."""
        return self.work / "state" / stem / "agent" / self.fed / "model.ckpt"

    def config_path(self, stem: str) -> Path:
        return self.work / f"{stem}.toml"

    def socket(self, stem: str) -> Path:
        role = "coordinator" if stem == "coordinator" else "agent"
        return self.run_root / stem / f"{role}.sock"

    def spawn(self, stem: str) -> Proc:
        role = "coordinator" if stem == "coordinator" else "agent"
        log = self.work / "logs" / f"{stem}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NOTIFY_SOCKET", None)
        # A stop signal waits until the process is in self.procs, where close() finds it.
        with child_starting(), log.open("ab") as out:
            # In a session of its own (see launch.popen and _signal).
            popen = launch.start([role, "--config", str(self.config_path(stem))], out, env)
            proc = Proc(stem, popen, log)
            self.procs.append(proc)
        return proc

    def proc(self, stem: str) -> Proc:
        """The running process of ``stem`` (``"coordinator"``, ``"agent-1"``, ...)."""
        for p in self.procs:
            if p.name == stem:
                return p
        raise FedagentError(f"{stem} is not running in this federation")

    def restart(self, stem: str, sig: int = signal.SIGKILL) -> Proc:
        """Stop ``stem`` with ``sig`` (SIGKILL: a crash, nothing saved on the way out) and
        start it again on the same config and state directory."""
        old = self.proc(stem)
        self.stop(old, sig)
        self.procs.remove(old)
        return self.spawn(stem)

    def start_all(self) -> None:
        if self.mode != "gossip":
            self.spawn("coordinator")
        for aid in self.agent_ids:
            self.spawn(aid)

    # -- watching --------------------------------------------------------------------
    def status(self, stem: str) -> dict[str, Any] | None:
        try:
            return request(self.socket(stem), "status", timeout=2.0)
        except FedagentError:
            return None

    def check_alive(self) -> None:
        for p in self.procs:
            code = p.popen.poll()
            if code is not None:
                tail = p.log.read_text(errors="replace")[-2000:] if p.log.exists() else ""
                raise FedagentError(f"{p.name} exited with code {code}; last log lines:\n{tail}")

    def final_weights(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        loaded = checkpoint.load(self.work / "state" / "coordinator" / "coordinator" / self.fed / "global.ckpt")
        if loaded is None:
            raise FedagentError("the coordinator wrote no checkpoint")
        weights, meta = loaded  # the model only, without the server optimizer's state
        return {k: v for k, v in weights.items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)}, meta

    # -- tear-down -------------------------------------------------------------------
    @staticmethod
    def _signal(proc: Proc, sig: int) -> None:
        """``sig`` to the daemon's process group. Only while the daemon is not reaped:
        until then its PID, which is also the group's ID, cannot name anyone else."""
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        self._signal(proc, sig)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(proc, signal.SIGKILL)
            proc.popen.wait()

    def close(self) -> None:
        for p in self.procs:
            self._signal(p, signal.SIGTERM)
        for p in self.procs:
            self.stop(p)
        self.procs.clear()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        for b in self.agent_brokers.values():
            b.stop()
        self.agent_brokers.clear()
        if self._short_run is not None:
            shutil.rmtree(self._short_run, ignore_errors=True)
