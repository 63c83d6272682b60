"""A federation in two tiers on this machine, as separate processes.

A hub broker with the hub's coordinator (``[tier] sites = true``), and per site its own
broker, a site aggregator (``fedagent aggregator``: the coordinator of its site broker,
and at the hub broker a participant with a certificate of role ``aggregator``) and its
agents, which know only their site broker. Every broker has the federation's CA and ACL;
nothing is bridged (the site aggregator carries what crosses tiers). ``fedagent demo
--sites N`` and the network tests build on it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedagent import config
from fedagent.config import TlsConfig
from fedagent.errors import FedagentError
from fedagent.local import launch
from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED, Proc
from fedagent.mosquitto import EmbeddedBroker
from fedagent.node.control import request
from fedagent.security import pki
from fedagent.stopsignals import child_starting
from fedagent.storage import checkpoint

HUB = "coordinator"


def site_name(s: int) -> str:
    return f"site-{s + 1}"


class TieredFederation:
    """``sites`` lists the number of agents of each site; agent ``k`` (counted over all
    sites, in order) trains shard ``k`` of the total, as agent ``k`` of a flat federation
    of the same agents does. ``close()`` stops everything started."""

    def __init__(
        self,
        work: Path,
        *,
        sites: list[int],
        rounds: int,
        alpha: float,
        federation: str | None = None,
        round_timeout: float = 60.0,
        hub_rounds: dict[str, Any] | None = None,
        site_rounds: dict[str, Any] | None = None,
        transfer: dict[str, Any] | None = None,
        hub_privacy: dict[str, Any] | None = None,
        train_seconds: float = 0.0,
    ) -> None:
        """``hub_privacy``: the hub's ``[privacy]`` table (distributed DP across tiers).
        ``train_seconds``: every agent's training takes at least this long, as on a
        device slower than this machine (``fedagent.tasks.slowed``)."""
        self.work = work
        self.fed = federation or f"tiers-{secrets.token_hex(3)}"
        self.sites = list(sites)
        self.rounds = rounds
        self.alpha = alpha
        self.round_timeout = round_timeout
        self.hub_rounds = dict(hub_rounds or {})
        self.site_rounds = dict(site_rounds or {})
        self.transfer = dict(transfer or {})
        self.hub_privacy = dict(hub_privacy) if hub_privacy else None
        self.train_seconds = train_seconds
        self.n = sum(sites)
        self.site_ids = [site_name(s) for s in range(len(sites))]
        self.agents: dict[str, list[str]] = {}
        k = 0
        for s, count in enumerate(sites):
            self.agents[self.site_ids[s]] = [f"agent-{k + i + 1}" for i in range(count)]
            k += count
        self.agent_ids = [a for ids in self.agents.values() for a in ids]
        self.brokers: dict[str, EmbeddedBroker] = {}
        self.procs: list[Proc] = []
        self.run_root = work / "run"
        self._short_run: Path | None = None
        if len(str(self.run_root / "agent-100" / "coordinator.sock").encode()) > 100:
            self._short_run = Path(tempfile.mkdtemp(prefix="fedagent-run-", dir="/tmp"))
            self.run_root = self._short_run

    # -- set-up ----------------------------------------------------------------------
    def prepare(self) -> None:
        ca = self.work / "pki"
        pki.create_ca(ca, self.fed)
        pki.issue(ca, ca, HUB, "coordinator")
        for site in self.site_ids:
            pki.issue(ca, ca, site, "coordinator")
            pki.issue(ca, ca, f"{site}-up", "aggregator")
        for aid in self.agent_ids:
            pki.issue(ca, ca, aid, "agent")
        hub = self._broker("hub", HUB)
        base = {
            "round_timeout": self.round_timeout,
            "local_epochs": LOCAL_EPOCHS,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
        }
        sites = len(self.site_ids)
        self._write(
            HUB,
            HUB,
            hub.uri,
            {"seed": SEED},
            {
                **base,
                "rounds": self.rounds,
                "min_agents": sites,
                "expected_agents": sites,
                "min_updates": 1,
                **self.hub_rounds,
            },
            tier={"sites": True},
            privacy=self.hub_privacy,
        )
        for site in self.site_ids:
            broker = self._broker(site, site)
            members = self.agents[site]
            self._write(
                site,
                site,
                broker.uri,
                {"seed": SEED},
                {
                    **base,
                    "min_agents": len(members),
                    "expected_agents": len(members),
                    "min_updates": 1,
                    "server_momentum": 0.0,
                    **self.site_rounds,
                },
                tier={
                    "upstream": hub.uri,
                    "upstream_id": f"{site}-up",
                    "upstream_cert": str(ca / f"{site}-up.crt"),
                    "upstream_key": str(ca / f"{site}-up.key"),
                },
            )
            for aid in members:
                k = self.agent_ids.index(aid)
                options: dict[str, Any] = {"shard": k, "shards": self.n, "alpha": self.alpha, "seed": SEED}
                task = "digits"
                if self.train_seconds:
                    task = "fedagent.tasks.slowed:make"
                    options = {**options, "inner": "digits", "slowdown": 1.0, "at_least": self.train_seconds}
                self._write(aid, aid, broker.uri, options, None, task=task)

    def _broker(self, key: str, coordinator: str) -> EmbeddedBroker:
        # Kept before it starts: a start interrupted half-way is still stopped by close().
        self.brokers[key] = EmbeddedBroker(
            self.work / f"broker-{key}",
            federations=[self.fed],
            coordinators=[coordinator],
            ca_dir=self.work / "pki",
            name=f"broker-{key}",
            bind=self.broker_bind(key),
        )
        self.start_broker(key)
        return self.brokers[key]

    def broker_bind(self, key: str) -> str:
        """The address broker ``key`` (``hub`` or a site) listens on: loopback, where
        everything runs in one network namespace."""
        return "127.0.0.1"

    def start_broker(self, key: str) -> None:
        """Start broker ``key`` (again, after it stopped). A subclass that puts each tier
        in a network namespace of its own starts it there, since its address exists only
        in that namespace."""
        self.brokers[key].start()

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
        ca = self.work / "pki"
        tls = TlsConfig(ca=ca / "ca.crt", cert=ca / f"{node_id}.crt", key=ca / f"{node_id}.key")
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
            transfer=self.transfer if rounds is not None else None,
            **extra,
        )
        path = self.config_path(stem)
        path.write_text(text)
        return path

    def config_path(self, stem: str) -> Path:
        return self.work / f"{stem}.toml"

    def _command(self, stem: str) -> str:
        if stem == HUB:
            return "coordinator"
        return "aggregator" if stem in self.site_ids else "agent"

    def socket(self, stem: str) -> Path:
        role = "agent" if self._command(stem) == "agent" else "coordinator"
        return self.run_root / stem / f"{role}.sock"

    def spawn(self, stem: str) -> Proc:
        log = self.work / "logs" / f"{stem}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NOTIFY_SOCKET", None)
        with child_starting(), log.open("ab") as out:
            popen = launch.start([self._command(stem), "--config", str(self.config_path(stem))], out, env)
            proc = Proc(stem, popen, log)
            self.procs.append(proc)
        return proc

    def restart(self, stem: str, sig: int = signal.SIGKILL) -> Proc:
        """Stop ``stem`` with ``sig`` (SIGKILL: a crash) and start it again on the same
        config and state directory."""
        old = next(p for p in self.procs if p.name == stem)
        self.stop(old, sig)
        self.procs.remove(old)
        return self.spawn(stem)

    def start_all(self) -> None:
        self.spawn(HUB)
        for site in self.site_ids:
            self.spawn(site)
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
        loaded = checkpoint.load(self.work / "state" / HUB / "coordinator" / self.fed / "global.ckpt")
        if loaded is None:
            raise FedagentError("the hub's coordinator wrote no checkpoint")
        weights, meta = loaded
        return {k: v for k, v in weights.items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)}, meta

    # -- tear-down -------------------------------------------------------------------
    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()

    def close(self) -> None:
        # Agents first, then the sites, then the hub: nobody waits for a vanished tier.
        for p in reversed(self.procs):
            self.stop(p)
        self.procs.clear()
        for b in self.brokers.values():
            b.stop()
        self.brokers.clear()
        if self._short_run is not None:
            shutil.rmtree(self._short_run, ignore_errors=True)
