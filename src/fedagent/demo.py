"""``fedagent demo``: a whole federation on this machine, end to end.

A private Mosquitto (its own CA, certificates, ACL, a free loopback port), a
coordinator and N agents as separate processes that find the coordinator by mDNS on
loopback, FedAvg rounds on the built-in digits task split non-IID, and at the end
the accuracy of the federated model next to each agent's local-only model and a
centralized model trained on the union of the data.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedagent import checkpoint, config, pki
from fedagent.broker import EmbeddedBroker
from fedagent.config import TlsConfig
from fedagent.errors import FedagentError
from fedagent.node.control import request

LOCAL_EPOCHS = 2
LR = 0.05
BATCH = 32
SEED = 0


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


class Federation:
    """Processes and files of one local federation; ``close()`` removes them all."""

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
        gossip: dict | None = None,
        broker_per_agent: bool = False,
        task: str = "digits",
        task_options: dict | None = None,
    ) -> None:
        self.work = work
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
        # Another built-in task than digits: its options (plus shard/shards/seed) for
        # every agent; ``alpha`` is digits' own option and is then not passed.
        self.task = task
        self.task_options = task_options
        self.broker_per_agent = broker_per_agent  # gossip: every agent on a broker of its own
        self.agent_brokers: dict[str, EmbeddedBroker] = {}

    # -- set-up ----------------------------------------------------------------------
    def prepare(self) -> None:
        ca_dir = self.work / "pki"
        pki.create_ca(ca_dir, self.fed)
        for name in [self.coordinator_id, *self.agent_ids]:
            pki.issue(ca_dir, ca_dir, name, "coordinator" if name == self.coordinator_id else "agent")
        self.broker = EmbeddedBroker(
            self.work / "broker", federations=[self.fed], coordinators=[self.coordinator_id], ca_dir=ca_dir
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
                b.start()
                self.agent_brokers[aid] = b
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
        }
        self._write(
            "coordinator",
            self.coordinator_id,
            self.broker.uri,
            {"seed": SEED, **(self.task_options or {})},
            rounds,
            self.task,
        )
        for i, aid in enumerate(self.agent_ids):
            self._write(aid, aid, "" if self.by_mdns else self.broker.uri, self.shard_options(i), None, self.task)

    def prepare_syncopt(self, task: str, agent_options, coordinator_options: dict, syncopt: dict) -> None:
        """Configs for a ``mode = "syncopt"`` federation (call after ``prepare()`` has made
        the PKI and the broker): ``agent_options(i)`` gives agent i's task options."""
        assert self.broker is not None
        self._write(
            "coordinator",
            self.coordinator_id,
            self.broker.uri,
            coordinator_options,
            None,
            task,
            mode="syncopt",
            syncopt=syncopt,
        )
        for i, aid in enumerate(self.agent_ids):
            self._write(aid, aid, "" if self.by_mdns else self.broker.uri, agent_options(i), None, task, mode="syncopt")

    def _write(
        self,
        stem: str,
        node_id: str,
        broker: str,
        task_options: dict,
        rounds: dict | None,
        task: str = "digits",
        **extra,
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
            runtime_dir=self.work / "run" / stem,
            task=task,
            task_options=task_options,
            rounds=rounds,
            **extra,
        )
        path = self.config_path(stem)
        path.write_text(text)
        return path

    def shard_options(self, shard: int) -> dict:
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
        )

    def _enroll(self, node_id: str, write) -> Proc:
        """Issue ``node_id`` a certificate, ``write()`` its config, start it."""
        ca_dir = self.work / "pki"
        pki.issue(ca_dir, ca_dir, node_id, "agent")
        write()
        self.agent_ids.append(node_id)
        return self.spawn(node_id)

    def write_coordinator(self, task: str, task_options: dict, rounds: dict) -> Path:
        """Replace the coordinator's config (another task, other round settings)."""
        assert self.broker is not None
        return self._write("coordinator", self.coordinator_id, self.broker.uri, task_options, rounds, task)

    def add_agent(
        self, node_id: str, task: str, task_options: dict, rounds: dict | None = None, broker: str | None = None
    ) -> Proc:
        """A new agent (its own certificate and config) started now; ``broker=None``
        gives it the broker's address, ``""`` makes it look the broker up by mDNS."""
        assert self.broker is not None
        uri = self.broker.uri if broker is None else broker
        return self._enroll(node_id, lambda: self._write(node_id, node_id, uri, task_options, rounds, task))

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
        return self.work / "run" / stem / f"{role}.sock"

    def spawn(self, stem: str) -> Proc:
        role = "coordinator" if stem == "coordinator" else "agent"
        log = self.work / "logs" / f"{stem}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NOTIFY_SOCKET", None)
        popen = subprocess.Popen(
            [sys.executable, "-m", "fedagent", role, "--config", str(self.config_path(stem))],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        proc = Proc(stem, popen, log)
        self.procs.append(proc)
        return proc

    def start_all(self) -> None:
        if self.mode != "gossip":
            self.spawn("coordinator")
        for aid in self.agent_ids:
            self.spawn(aid)

    # -- watching --------------------------------------------------------------------
    def status(self, stem: str) -> dict | None:
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

    def final_weights(self):
        loaded = checkpoint.load(self.work / "state" / "coordinator" / "coordinator" / self.fed / "global.ckpt")
        if loaded is None:
            raise FedagentError("the coordinator wrote no checkpoint")
        return loaded

    # -- tear-down -------------------------------------------------------------------
    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def close(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            self.stop(p)
        self.procs.clear()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        for b in self.agent_brokers.values():
            b.stop()
        self.agent_brokers.clear()


def _tidy(fed: Federation, work: Path, keep: bool, console: Console) -> None:
    """Stop everything a demo started; keep or remove its work directory."""
    fed.close()
    if keep:
        console.print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def train_reference(options: dict, epochs: int) -> float:
    """Accuracy of a model trained with plain local SGD on the data ``options`` selects."""
    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    for e in range(epochs):
        task.fit(model, epochs=1, lr=LR, batch_size=BATCH, seed=e + 1)
    return task.evaluate(model)["accuracy"]


def train_reference_steps(options: dict, steps: int, lr: float = LR, cosine: bool = False) -> float:
    """Accuracy after ``steps`` plain local SGD mini-batches (gossip's local-only and
    centralized baselines), with the gossip agents' cosine step-size decay if asked."""
    import math

    import torch

    from fedagent.tasks.base import load_task

    torch.manual_seed(SEED)
    task = load_task("digits", options)
    model = task.build_model()
    done, chunk = 0, 10
    while done < steps:
        n = min(chunk, steps - done)
        lr_t = lr * 0.5 * (1.0 + math.cos(math.pi * done / steps)) if cosine else lr
        task.fit_steps(model, steps=n, lr=lr_t, batch_size=BATCH, seed=done + 1)
        done += n
    return task.evaluate(model)["accuracy"]


# Gossip demo margin: every agent's own model ends within this much of centralized
# training on the union of the data with the same total number of mini-batches.
GOSSIP_MARGIN = 0.05
# Training 10 mini-batches of the tiny digits MLP takes milliseconds; a period of at
# least this long gives models time to travel, as a real model's training would.
PERIOD_SECONDS = 0.1
# The peak step size of the cosine schedule (gossip.lr_schedule): it decays to 0 at the
# last period, so the agents end in consensus.
GOSSIP_LR = 0.1


def run_gossip_demo(
    *,
    agents: int = 5,
    periods: int = 100,
    period_steps: int = 10,
    alpha: float = 0.3,
    keep: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
    merge: str = "pushsum",
) -> int:
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    if agents < 2:
        raise FedagentError("the demo needs at least 2 agents")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedagent-gossip-demo-"))
    fed = Federation(
        work,
        agents=agents,
        rounds=1,
        alpha=alpha,
        mode="gossip",
        gossip={
            "periods": periods,
            "period_steps": period_steps,
            "merge": merge,
            "min_peers": agents - 1,
            "period_seconds": PERIOD_SECONDS,
            "lr": GOSSIP_LR,
        },
    )
    started = time.monotonic()
    try:
        console.print(
            f"[bold]fedagent demo --mode gossip[/]: federation [cyan]{fed.fed}[/], {agents} agents and "
            f"[bold]no coordinator[/]; each trains {period_steps} mini-batches, sends its model to a random "
            f"peer and merges what it received ({merge}), {periods} times; scikit-learn digits "
            f"(Dirichlet alpha={alpha}); work dir {work}"
        )
        with console.status("creating a CA and certificates, starting a private Mosquitto ..."):
            fed.prepare()
        console.print(
            f"broker [green]{fed.broker.uri}[/] (mutual TLS, per-agent ACL); {fed.agent_ids[0]} is given "
            f"the broker and advertises it, the others find it by mDNS on 127.0.0.1"
        )
        fed.start_all()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        statuses: dict[str, dict | None] = {}
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("waiting for agents", total=periods)
            while True:
                fed.check_alive()
                statuses = {aid: fed.status(aid) for aid in fed.agent_ids}
                live = [s for s in statuses.values() if s is not None and "gossip" in s]
                if live:
                    slowest = min(s["period"] for s in live)
                    sent = sum(s["gossip"]["sent"] for s in live)
                    dropped = sum(s["gossip"]["dropped"] for s in live)
                    dis = [s["disagreement_rel"] for s in live if s.get("disagreement_rel") is not None]
                    desc = (
                        f"slowest agent at period {slowest}, {len(live)}/{agents} gossiping, {sent} models sent, "
                        f"{dropped} dropped" + (f", disagreement {max(dis):.1%}" if dis else "")
                    )
                    progress.update(bar, completed=slowest, description=desc)
                    if len(live) == agents and all(s["round_state"] == "finished" for s in live):
                        break
                if time.monotonic() - started > 600:
                    raise FedagentError(f"the federation did not finish in 10 minutes; logs in {work / 'logs'}")
                time.sleep(0.25)
        fed.close()
        console.print(
            f"all agents finished {periods} periods in {time.monotonic() - started:.1f}s; evaluating each "
            "agent's own model against local-only and centralized training"
        )
        task = load_task("digits", {"seed": SEED})
        table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
        for col, just in (("model", "left"), ("training data", "left"), ("accuracy", "right")):
            table.add_column(col, justify=just)
        steps = periods * period_steps
        gossip_acc: dict[str, float] = {}
        for aid in fed.agent_ids:
            loaded = checkpoint.load(fed.model_path(aid))
            if loaded is None:
                raise FedagentError(f"{aid} wrote no model checkpoint")
            model = task.build_model()
            set_weights(model, loaded[0])
            gossip_acc[aid] = task.evaluate(model)["accuracy"]
        local_acc: dict[str, float] = {}
        for i, aid in enumerate(fed.agent_ids):
            n = (statuses.get(aid) or {}).get("num_samples", "?")
            table.add_row(
                f"[bold]gossip: {aid}'s own model[/]",
                f"{agents} agents, never pooled",
                f"[bold]{gossip_acc[aid]:.3f}[/]",
            )
            local_acc[aid] = train_reference_steps(
                {"shard": i, "shards": agents, "alpha": alpha, "seed": SEED}, steps, GOSSIP_LR, cosine=True
            )
            table.add_row(f"local only: {aid}", f"its own shard ({n} images), {steps} steps", f"{local_acc[aid]:.3f}")
        central = train_reference_steps({"seed": SEED}, steps * agents, GOSSIP_LR, cosine=True)
        table.add_row("centralized", f"union of all shards, {steps * agents} steps", f"{central:.3f}")
        console.print(table)
        worst = min(gossip_acc.values())
        if report_dir is not None:
            from fedagent.report import write_gossip_report

            md = write_gossip_report(
                sorted((work / "state").glob(f"*/agent/{fed.fed}/history.jsonl")),
                report_dir,
                title=f"fedagent gossip demo: {agents} agents, {periods} periods of "
                f"{period_steps} steps, digits (alpha={alpha}), merge={merge}",
                final=gossip_acc,
                local=local_acc,
                centralized=central,
                margin=GOSSIP_MARGIN,
            )
            console.print(f"report with plots: [cyan]{md}[/]")
        ok = central - worst <= GOSSIP_MARGIN
        verdict = (
            f"[green]every agent within {GOSSIP_MARGIN} of centralized[/]"
            if ok
            else f"[red]an agent is more than {GOSSIP_MARGIN} below centralized[/]"
        )
        console.print(
            f"{verdict}: worst agent {worst:.3f}, centralized {central:.3f} "
            f"(gap {central - worst:+.3f}); total {time.monotonic() - started:.1f}s"
        )
        return 0 if ok else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process the demo started[/]")
        return 130
    finally:
        _tidy(fed, work, keep, console)


def run_demo(
    *,
    agents: int = 3,
    rounds: int = 15,
    alpha: float = 0.3,
    keep: bool = False,
    report_dir: Path | None = None,
    console: Console | None = None,
) -> int:
    import torch

    from fedagent.tasks.base import load_task, set_weights

    console = console or Console()
    if agents < 2:
        raise FedagentError("the demo needs at least 2 agents")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedagent-demo-"))
    fed = Federation(work, agents=agents, rounds=rounds, alpha=alpha)
    started = time.monotonic()
    try:
        console.print(
            f"[bold]fedagent demo[/]: federation [cyan]{fed.fed}[/], {agents} agents, {rounds} FedAvg "
            f"rounds on scikit-learn digits (Dirichlet alpha={alpha}); work dir {work}"
        )
        with console.status("creating a CA and certificates, starting a private Mosquitto ..."):
            fed.prepare()
        console.print(
            f"broker [green]{fed.broker.uri}[/] (mutual TLS, per-agent ACL); starting the "
            f"coordinator and {agents} agents; agents find the coordinator by mDNS on 127.0.0.1"
        )
        fed.start_all()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("waiting for agents", total=rounds)
            while True:
                fed.check_alive()
                s = fed.status("coordinator")
                if s is not None:
                    m = s.get("metrics") or {}
                    online = sum(1 for p in (s.get("peers") or {}).values() if p.get("online"))
                    desc = f"round {s['round']} ({s['phase']}), {online}/{agents} agents online" + (
                        f", train loss {m['loss']:.3f}" if "loss" in m else ""
                    )
                    progress.update(bar, completed=s["completed_rounds"], description=desc)
                    if s["phase"] == "done":
                        break
                if time.monotonic() - started > 600:
                    raise FedagentError(f"the federation did not finish in 10 minutes; logs in {work / 'logs'}")
                time.sleep(0.25)
        agent_status = {aid: fed.status(aid) for aid in fed.agent_ids}
        weights, meta = fed.final_weights()
        fed.close()
        console.print(
            f"federation finished {meta['completed_rounds']} rounds in "
            f"{time.monotonic() - started:.1f}s; evaluating against local-only and centralized training"
        )

        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, weights)
        federated = task.evaluate(model)["accuracy"]
        epochs = rounds * LOCAL_EPOCHS
        table = Table(title="test accuracy on the held-out digits (450 images)", title_justify="left")
        table.add_column("model")
        table.add_column("training data")
        table.add_column("accuracy", justify="right")
        table.add_row("[bold]federated (FedAvg)[/]", f"{agents} agents, never pooled", f"[bold]{federated:.3f}[/]")
        locals_ = []
        for i, aid in enumerate(fed.agent_ids):
            n = (agent_status.get(aid) or {}).get("num_samples", "?")
            acc = train_reference({"shard": i, "shards": agents, "alpha": alpha, "seed": SEED}, epochs)
            locals_.append(acc)
            table.add_row(f"local only: {aid}", f"its own shard ({n} images)", f"{acc:.3f}")
        central = train_reference({"seed": SEED}, epochs)
        table.add_row("centralized", "union of all shards", f"{central:.3f}")
        console.print(table)
        if report_dir is not None:
            from fedagent.report import find_histories, write_report

            md = write_report(
                find_histories(work / "state"),
                report_dir,
                title=f"fedagent demo: {agents} agents, {rounds} rounds, digits (alpha={alpha})",
            )
            with md.open("a") as f:
                f.write(
                    "\n## Final test accuracy\n\n| model | accuracy |\n|---|---|\n"
                    f"| federated (FedAvg) | {federated:.3f} |\n"
                    + "".join(f"| local only: {aid} | {acc:.3f} |\n" for aid, acc in zip(fed.agent_ids, locals_))
                    + f"| centralized | {central:.3f} |\n"
                )
            console.print(f"report with plots: [cyan]{md}[/]")
        ok = all(federated >= a for a in locals_)
        verdict = (
            "[green]federated >= every local-only model[/]"
            if ok
            else "[red]federated model is below a local-only model[/]"
        )
        console.print(
            f"{verdict}; gap to centralized {central - federated:+.3f}; total {time.monotonic() - started:.1f}s"
        )
        return 0 if ok else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process the demo started[/]")
        return 130
    finally:
        _tidy(fed, work, keep, console)


# ---- Sync-Opt (gFedNTM) -----------------------------------------------------------------
# ProdLDA on the paper's synthetic generator (Sec. 4.1), at a size that trains in about a
# minute on 2 cores: 500 terms, 10 true topics of which 5 are shared by every agent.
SYNCOPT_OPTIONS: dict = {
    "corpus": "synthetic",
    "vocab_size": 500,
    "true_topics": 10,
    "shared_topics": 5,
    "eta": 0.05,
    "docs": 400,
    "val_docs": 50,
    "doc_length": [50, 100],
    "data_seed": 0,
    "seed": 0,
    "n_topics": 10,
    "batch_size": 32,
}


def run_syncopt_demo(*, agents: int = 5, steps: int = 300, keep: bool = False, console: Console | None = None) -> int:
    """Vocabulary consensus and Sync-Opt steps over the network, then the same steps
    centralized in this process: the two models must agree and find the true topics."""
    import numpy as np
    import torch

    from fedagent.tasks import ntm, ntm_data, ntm_scores
    from fedagent.tasks.base import get_weights, load_task, set_weights

    console = console or Console()
    if agents < 2:
        raise FedagentError("the demo needs at least 2 agents")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedagent-syncopt-demo-"))
    fed = Federation(work, agents=agents, rounds=1, alpha=0.0)
    started = time.monotonic()

    def options(i: int) -> dict:
        return {**SYNCOPT_OPTIONS, "shard": i, "shards": agents}

    try:
        o = SYNCOPT_OPTIONS
        console.print(
            f"[bold]fedagent demo --mode syncopt[/] (gFedNTM): federation [cyan]{fed.fed}[/], {agents} "
            f"agents with {o['docs']} synthetic documents each ({o['vocab_size']} terms, "
            f"{o['true_topics']} true topics, {o['shared_topics']} shared); ProdLDA with {o['n_topics']} "
            f"topics, {steps} Sync-Opt steps of {o['batch_size']} documents per agent; work dir {work}"
        )
        with console.status("creating a CA and certificates, starting a private Mosquitto ..."):
            fed.prepare()
            fed.prepare_syncopt(
                "prodlda",
                options,
                options(0),
                {
                    "steps": steps,
                    "expected_agents": agents,
                    "min_agents": agents,
                    "step_timeout": 60.0,
                    "on_fault": "continue",
                    "checkpoint_every": 50,
                },
            )
        console.print(
            f"broker [green]{fed.broker.uri}[/] (mutual TLS, per-agent ACL); agents find the coordinator "
            "by mDNS, send it their vocabularies (terms and counts, never a document), then one gradient "
            "per step"
        )
        fed.start_all()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("waiting for agents", total=steps)
            while True:
                fed.check_alive()
                s = fed.status("coordinator")
                if s is not None:
                    if s["phase"] == "vocabulary":
                        desc = f"vocabulary: {len(s.get('vocabulary_offers') or [])}/{agents} offers"
                    else:
                        loss = s.get("last_loss")
                        desc = f"{s['phase']}: step {s['step']}, vocabulary {s.get('vocabulary_size')} terms" + (
                            f", loss {loss:.2f}" if loss is not None else ""
                        )
                    progress.update(bar, completed=s["steps_done"], description=desc)
                    if s["phase"] in ("done", "aborted"):
                        break
                if time.monotonic() - started > 900:
                    raise FedagentError(f"the federation did not finish in 15 minutes; logs in {work / 'logs'}")
                time.sleep(0.25)
        if s["phase"] != "done":
            raise FedagentError(f"Sync-Opt aborted; logs in {work / 'logs'}")
        weights, meta = fed.final_weights()
        weights = {k: v for k, v in weights.items() if not k.startswith("optim/")}
        vocab = (work / "state" / "coordinator" / "coordinator" / fed.fed / "vocabulary.json").read_text()
        import json

        terms = json.loads(vocab)["terms"]
        fed.close()
        console.print(
            f"federation finished {meta['model_version']} steps in {time.monotonic() - started:.1f}s "
            f"(exact: {meta['exact']}); training the same steps centralized in this process ..."
        )
        tasks = [load_task("prodlda", options(i)) for i in range(agents)]
        for t in tasks:
            t.set_vocabulary(terms)
        central = tasks[0].build_model()
        opt = tasks[0].make_optimizer(central.parameters())
        for step in range(steps):
            ntm.centralized_step(central, opt, tasks, step)
        federated = tasks[0].build_model()
        set_weights(federated, weights)
        cw = get_weights(central)
        diff = max(float(np.max(np.abs(weights[k].astype(np.float64) - cw[k]))) for k in cw)
        # The true topics on the agreed vocabulary (terms nobody used are dropped).
        all_terms = ntm_data.synthetic_terms(o["vocab_size"])
        col = {t: j for j, t in enumerate(all_terms)}
        beta = ntm_data.true_topics(o["vocab_size"], o["true_topics"], o["eta"], o["data_seed"])[
            :, [col[t] for t in terms]
        ]
        beta = beta / beta.sum(axis=1, keepdims=True)
        tss_fed = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(federated))
        tss_central = ntm_scores.topic_similarity_score(beta, tasks[0].topic_word(central))
        table = Table(title="federated ProdLDA topics (top 8 words)", title_justify="left")
        table.add_column("topic", justify="right")
        table.add_column("words")
        for k, words in enumerate(tasks[0].topics(federated, 8)):
            table.add_row(str(k), " ".join(words))
        console.print(table)
        res = Table(title="federated vs centralized", title_justify="left")
        res.add_column("measure")
        res.add_column("value", justify="right")
        res.add_row("max |w_federated - w_centralized|", f"{diff:.2e}")
        res.add_row(f"TSS federated (max {o['true_topics']})", f"{tss_fed:.3f}")
        res.add_row("TSS centralized", f"{tss_central:.3f}")
        console.print(res)
        ok = diff <= 1e-3 and abs(tss_fed - tss_central) <= 0.01
        console.print(
            (
                "[green]federated training matches centralized training[/]"
                if ok
                else "[red]federated training differs from centralized training[/]"
            )
            + f"; total {time.monotonic() - started:.1f}s"
        )
        return 0 if ok else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process the demo started[/]")
        return 130
    finally:
        _tidy(fed, work, keep, console)
