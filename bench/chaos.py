"""Chaos soak: a federation of real daemons under random faults from a seeded schedule.

    .venv/bin/python bench/chaos.py --out DIR                       # FedAvg, 30 minutes, seed 1
    .venv/bin/python bench/chaos.py --minutes 3 --seed 7 --out DIR  # the size CI runs
    .venv/bin/python bench/chaos.py --mode gossip --minutes 10 --out DIR

A coordinator and agents (``--agents``, 4) train the digits task through a private
Mosquitto with mutual TLS, each daemon supervised as systemd would (an exited daemon is
started again after ``--restart-sec``, 5 s as in the units). As root every daemon and the
broker run in network namespaces of their own (tests/netns.py: one bridge, one veth per
host), otherwise all on loopback. From a schedule drawn from ``--seed``, one fault at a
time, each kind in turn in a shuffled order, with random gaps and lengths:

``kill``       ``kill -9`` of a daemon; the supervisor starts it again after ``--restart-sec``
``broker``     Mosquitto ``SIGKILL``ed (its queues lost) and started again seconds later
``partition``  a daemon's namespace cut off (nft drop-all both ways), then healed (root)
``stop``       ``SIGSTOP`` of a daemon for 2-20 s (past its keep-alive at times), then ``SIGCONT``
``disk``       one node's state directory, a small tmpfs, filled up for a while, then freed (root)
``clock``      the wall clock of one daemon jumps (its Python ``time.time()``: bench/chaos_site;
               the monotonic clock is untouched) and 5-30 s later jumps back (NTP's step)

After each fault is cleared the soak waits for the federation to recover (FedAvg: a round
aggregated from every agent; gossip: every agent two periods further, the target merging
again), records how long that took, and goes on after a random gap. The last stretch of
the run (``--quiet``) is fault-free, then everything is stopped and checked:

* model versions contiguous, each round aggregated once (the coordinator's history);
* every update an agent had acknowledged by the broker aggregated exactly once: each
  participant of a round sent that round's update on that round's model (the agents'
  histories), and an acknowledged update not aggregated is accounted for (refused as
  stale by the coordinator, its round abandoned, or queued at a broker that was killed);
* no signed frame refused for its timestamp (the jumped clock must not matter);
* no daemon left dead, none exited on its own other than with 74 on the full disk;
* the final model within ``--tolerance`` (1 point) of a fault-free run of the same
  length: its twin, the same federation started beside it on the same machine (its own
  broker, on loopback) and never touched (``--reference none``: no twin);
* every process's memory bounded: its peak RSS in the second half of the run at most
  1.25 x its peak in the first half (after start-up) + 30 MB; and every fault recovered
  within ``--recovery-timeout``.

The report goes to ``--out``: ``report.md`` (settings, faults with recovery times,
invariants, memory), ``report.json`` (everything, with the time series) and ``chaos.png``
(needs matplotlib, the ``report`` extra). Exit status 0 only if every invariant holds.

Modes: ``fedavg`` and ``gossip``. A new mode (an asynchronous or a tiered federation)
plugs in as a :class:`Setup` subclass in ``SETUPS``: how its federation is configured,
what recovery means and which invariants it checks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # netns.Lab: the namespaces of the network tests

from fedagent.local.federation import BATCH, SEED, Federation, Proc  # noqa: E402
from fedagent.storage import checkpoint  # noqa: E402
from fedagent.storage.history import read_records  # noqa: E402

KINDS = ("kill", "broker", "partition", "stop", "disk", "clock")
ROOT_KINDS = {"partition", "disk"}  # need root: namespaces, a tmpfs mount
# Offsets a jumped clock moves through, relative to the real wall clock (label, seconds).
CLOCK_OFFSETS = (
    ("+6h", 6 * 3600),
    ("-1d", -86400),
    ("+30d", 30 * 86400),
    ("-3h", -3 * 3600),
    ("+2d", 2 * 86400),
    ("+0", 0),
)
CLOCK_SITE = Path(__file__).resolve().parent / "chaos_site"  # its sitecustomize moves time.time()
EXIT_IOERR = 74
MB = 1024 * 1024


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- network namespaces ------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """This thread in network namespace ``name`` (None: stay): the processes it starts
    and the sockets it opens meanwhile live there (``setns`` acts on the calling thread)."""
    if name is None:
        yield
        return
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(here, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the harness's namespace")
    finally:
        os.close(here)
        os.close(there)


class SmallDisk:
    """A tmpfs of ``size_mb`` mounted over ``path``: the node's whole disk, for the disk-full fault."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
        self.filler = path / "filler"

    def fill(self) -> None:
        with open(self.filler, "ab", buffering=0) as f:
            for chunk in (b"\0" * MB, b"\0" * 4096, b"\0"):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(chunk)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


# -- the federation and its supervisor ---------------------------------------------------------
@dataclass
class Exit:
    name: str
    at: float
    code: int
    expected: str  # why it was expected ("kill", "disk full"), or "" if not


class Site:
    """The federation's processes, as systemd would run them: every exited daemon is
    started again after ``restart_sec``. Knows which namespace each one lives in, whose
    clock is faked and whose state directory is a small disk."""

    def __init__(self, work: Path, args: argparse.Namespace, setup: Setup, rng: random.Random) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.args = args
        self.setup = setup
        self.names = setup.daemons(args.agents)
        self.lab = None
        if args.netns:
            from netns import Lab

            self.lab = Lab(work, ["broker", *self.names]).up()
        self.fed = setup.federation(work, args, self.lab.ip["broker"] if self.lab else "127.0.0.1")
        self.restart_at: dict[str, float] = {}
        self.held: set[str] = set()  # stopped by a fault: not restarted until it is cleared
        self.expect: dict[str, str] = {}  # name -> why its next exit is expected
        self.exits: list[Exit] = []
        self.starts: dict[str, int] = {n: 0 for n in self.names}
        self.t0 = time.monotonic()
        # The clock fault's daemon reads its wall clock through an offset file from its first start.
        self.clock_node = setup.clock_node(self.names) if "clock" in args.faults else None
        self.clock_file = work / "clock-offset"
        self.clock_file.write_text("0\n")
        self.disk: SmallDisk | None = None
        self.disk_node = rng.choice(self.names) if "disk" in args.faults else None
        if self.disk_node is not None:
            self.disk = SmallDisk(work / "state" / self.disk_node, args.disk_mb)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def ns(self, name: str) -> str | None:
        return self.lab.ns(name) if self.lab is not None else None

    def prepare(self) -> None:
        with in_netns(self.ns("broker")):
            self.fed.prepare()
        self.setup.configure(self)
        if self.disk_node is not None:
            # A history that fits on the small disk with room to spare: rotated at 1 MiB, 2 kept.
            path = self.fed.config_path(self.disk_node)
            doc = tomllib.loads(path.read_text())
            doc.update(history_max_bytes=MB, history_keep=2)
            path.write_text(tomli_w.dumps(doc))

    def start_all(self) -> None:
        for name in self.names:
            self.spawn(name)

    def spawn(self, name: str) -> Proc:
        env_before = dict(os.environ)
        if name == self.clock_node:
            path = os.pathsep.join(p for p in (str(CLOCK_SITE), os.environ.get("PYTHONPATH")) if p)
            os.environ.update(PYTHONPATH=path, FEDAGENT_CHAOS_CLOCK=str(self.clock_file))
        try:
            with in_netns(self.ns(name)):
                proc = self.fed.spawn(name)
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        self.starts[name] += 1
        return proc

    def proc(self, name: str) -> Proc | None:
        return next((p for p in self.fed.procs if p.name == name), None)

    def alive(self, name: str) -> bool:
        p = self.proc(name)
        return p is not None and p.popen.poll() is None

    def supervise(self) -> None:
        """Reap exited daemons (recording whether the exit was expected) and start those due."""
        now = self.now()
        for p in list(self.fed.procs):
            code = p.popen.poll()
            if code is None:
                continue
            self.fed.procs.remove(p)
            why = self.expect.pop(p.name, "")
            if not why and code == EXIT_IOERR and p.name == self.disk_node and now <= self.disk_full_until + 10:
                why = "disk full"
            self.exits.append(Exit(p.name, round(now, 2), code, why))
            log(f"{p.name} exited with {code}" + (f" ({why})" if why else " (unexpected)"))
            self.restart_at[p.name] = now + self.args.restart_sec
        for name, at in list(self.restart_at.items()):
            if at <= now and name not in self.held:
                del self.restart_at[name]
                self.spawn(name)

    disk_full_until = -1.0  # while the small disk is full (inf), or when it was last freed

    def status(self, name: str) -> dict[str, Any]:
        return self.fed.status(name) or {}

    def pids(self) -> dict[str, int]:
        out = {p.name: p.popen.pid for p in self.fed.procs if p.popen.poll() is None}
        if self.fed.broker is not None and self.fed.broker.pid is not None:
            out["broker"] = self.fed.broker.pid
        return out

    def signal(self, name: str, sig: int) -> None:
        p = self.proc(name)
        if p is not None and p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, sig)

    def broker_start(self) -> None:
        assert self.fed.broker is not None
        with in_netns(self.ns("broker")):
            self.fed.broker.start()

    def close(self) -> None:
        for name in self.names:
            self.signal(name, signal.SIGCONT)
        if self.lab is not None:
            for name in self.names:
                self.lab.heal(name)
        self.fed.close()
        if self.disk is not None:
            self.disk.close()
        if self.lab is not None:
            self.lab.close()


# -- what is measured while it runs ------------------------------------------------------------
class Tail:
    """New records of a history as they are appended, across its rotation (``tail -F``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f: Any = None
        self.ino = 0
        self.buf = b""

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.f is None:
                try:
                    self.f = open(self.path, "rb")
                except FileNotFoundError:
                    return out
                self.ino = os.fstat(self.f.fileno()).st_ino
            self.buf += self.f.read()
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
            try:
                rotated = os.stat(self.path).st_ino != self.ino
            except FileNotFoundError:
                return out
            if not rotated:
                return out
            self.f.close()  # drained above: go on with the new file
            self.f = None


def _proc_figures(pid: int) -> tuple[int, int] | None:
    """(RSS in bytes, open file descriptors) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds
    except (OSError, ValueError, IndexError):
        return None


def _disk_use(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class Sampler(threading.Thread):
    """Every ``every`` seconds: RSS and open files of each process, disk use of each state
    directory (``samples``: one dict per tick)."""

    def __init__(self, site: Site, every: float) -> None:
        super().__init__(daemon=True)
        self.site, self.every = site, every
        self.samples: list[dict[str, Any]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            tick: dict[str, Any] = {"t": round(self.site.now(), 1), "rss": {}, "fds": {}, "disk": {}}
            for name, pid in self.site.pids().items():
                got = _proc_figures(pid)
                if got is not None:
                    tick["rss"][name], tick["fds"][name] = got
            for name in self.site.names:
                tick["disk"][name] = _disk_use(self.site.work / "state" / name)
            self.samples.append(tick)


# -- faults ------------------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    target: str
    at: float  # seconds since the start
    hold: float  # how long it lasts before it is cleared (0: at once)
    detail: dict[str, Any] = field(default_factory=dict)
    cleared: float | None = None
    recovered: float | None = None  # seconds after it was cleared

    def label(self) -> str:
        extra = f" {self.detail['offset']}" if "offset" in self.detail else ""
        return f"{self.kind} {self.target}{extra}"


class Injector:
    """Carries a fault out on the site and clears it."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.offset_index = 0

    def inject(self, f: Fault) -> None:
        s = self.site
        if f.kind == "kill":
            # Held down for the restart delay, then started again by clear(): recovery is
            # measured from the new process's start.
            s.expect[f.target] = "kill"
            s.held.add(f.target)
            s.signal(f.target, signal.SIGKILL)
        elif f.kind == "broker":
            assert s.fed.broker is not None
            s.fed.broker.kill()
        elif f.kind == "partition":
            assert s.lab is not None
            s.lab.cut(f.target)
        elif f.kind == "stop":
            s.held.add(f.target)
            s.signal(f.target, signal.SIGSTOP)
        elif f.kind == "disk":
            assert s.disk is not None
            s.disk_full_until = float("inf")
            s.disk.fill()
        elif f.kind == "clock":
            label, seconds = CLOCK_OFFSETS[self.offset_index % len(CLOCK_OFFSETS)]
            self.offset_index += 1
            f.detail["offset"] = label
            s.clock_file.write_text(f"{seconds}\n")

    def clear(self, f: Fault) -> None:
        s = self.site
        if f.kind == "kill":
            s.held.discard(f.target)
            s.restart_at[f.target] = s.now()
            s.supervise()
        elif f.kind == "broker":
            s.broker_start()
        elif f.kind == "partition":
            assert s.lab is not None
            s.lab.heal(f.target)
        elif f.kind == "stop":
            s.held.discard(f.target)
            s.signal(f.target, signal.SIGCONT)
        elif f.kind == "disk":
            assert s.disk is not None
            s.disk.free()
            s.disk_full_until = s.now()
        elif f.kind == "clock":
            # NTP steps it back: a second jump, the other way.
            s.clock_file.write_text("0\n")


def draw(rng: random.Random, kinds: list[str], site: Site, cycle: list[str]) -> Fault:
    """The next fault: kinds in a shuffled order, each once per cycle; target and length at random."""
    if not cycle:
        cycle.extend(rng.sample(kinds, len(kinds)))
    kind = cycle.pop()
    targets = {
        "kill": site.names,
        "stop": site.names,
        "partition": site.names,
        "broker": ["broker"],
        "disk": [site.disk_node or ""],
        "clock": [site.clock_node or ""],
    }[kind]
    hold = {
        "kill": site.args.restart_sec,
        "broker": rng.uniform(1, 6),
        "partition": rng.uniform(5, 25),
        "stop": rng.uniform(2, 20),
        "disk": rng.uniform(5, 20),
        "clock": rng.uniform(5, 30),
    }[kind]
    if kind != "kill":
        hold *= site.args.hold_scale
    return Fault(kind, rng.choice(targets), 0.0, round(hold, 2))


# -- modes -------------------------------------------------------------------------------------
class Setup:
    """A mode's federation: its daemons, its configuration, what recovery means, its checks.
    A new mode (an asynchronous or a tiered federation) is a subclass here."""

    name = ""

    def daemons(self, agents: int) -> list[str]:
        raise NotImplementedError

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        raise NotImplementedError

    def configure(self, site: Site) -> None:
        """Rewrite the configs ``prepare()`` wrote, before anything starts."""

    def clock_node(self, names: list[str]) -> str:
        return names[0]

    def stop_order(self, names: list[str]) -> list[str]:
        return names

    def accuracy(self, site: Site) -> float | None:
        """The final model's test accuracy (the mean over agents where each has its own)."""
        raise NotImplementedError

    def poll(self, site: Site) -> dict[str, Any]:
        """Progress now (for the log, the plot and recovery)."""
        raise NotImplementedError

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        """Whether the federation is back to full health since ``mark`` (its ``poll()`` when
        the fault was cleared)."""
        raise NotImplementedError

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        """Invariants of the mode, each ``{"name", "ok", "detail"}``."""
        raise NotImplementedError


def _invariant(name: str, ok: bool, detail: Any) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def digits_accuracy(weights: dict[str, Any]) -> float:
    from fedagent.tasks.base import load_task, set_weights

    task = load_task("digits", {"seed": SEED})
    model = task.build_model()
    set_weights(model, weights)
    return float(task.evaluate(model)["accuracy"])


class FedAvgSetup(Setup):
    name = "fedavg"

    def daemons(self, agents: int) -> list[str]:
        return ["coordinator", *(f"agent-{i + 1}" for i in range(agents))]

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        self.agents = [f"agent-{i + 1}" for i in range(args.agents)]
        self.rounds_seen: list[dict[str, Any]] = []  # (harness time, record) of aggregated rounds
        self.tail: Tail | None = None
        return Federation(
            work,
            agents=args.agents,
            rounds=1_000_000,
            alpha=args.alpha,
            round_timeout=args.round_timeout,
            agent_broker_by_mdns=False,
            broker_bind=broker_bind,
            rounds_options={
                # Rounds go on with part of the federation down; an agent silent for a
                # keep-alive is left out of the round in progress.
                "min_agents": max(1, args.agents // 2),
                "min_updates": max(1, args.agents // 2),
                "expected_agents": args.agents,
            },
        )

    def configure(self, site: Site) -> None:
        self.tail = Tail(self.history_path(site))

    def history_path(self, site: Site, node: str = "coordinator") -> Path:
        role = "coordinator" if node == "coordinator" else "agent"
        return site.work / "state" / node / role / site.fed.fed / "history.jsonl"

    def clock_node(self, names: list[str]) -> str:
        return "coordinator"  # its deadlines and its checks of the agents' timestamps

    def poll(self, site: Site) -> dict[str, Any]:
        assert self.tail is not None
        for rec in self.tail.read():
            if rec.get("event") == "round":
                self.rounds_seen.append({"t": round(site.now(), 2), **rec})
        last = self.rounds_seen[-1] if self.rounds_seen else {}
        return {"t": site.now(), "version": last.get("model_version", 0), "seen": len(self.rounds_seen)}

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        self.poll(site)
        return any(set(self.agents) <= set(r["participants"]) for r in self.rounds_seen[mark["seen"] :])

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        records = read_records(self.history_path(site))
        rounds = [r for r in records if r.get("event") == "round"]
        abandoned = {r["round"] for r in records if r.get("event") == "abandoned"}
        versions = [r["model_version"] for r in rounds]
        numbers = [r["round"] for r in rounds]
        out.append(
            _invariant(
                "model versions contiguous, each round aggregated once",
                versions == list(range(1, len(versions) + 1)) and numbers == sorted(set(numbers)) and versions,
                {"versions": f"1..{len(versions)}" if versions else "none", "rounds abandoned": len(abandoned)},
            )
        )
        sent: dict[str, list[dict[str, Any]]] = {
            a: [u for u in read_records(self.history_path(site, a)) if u.get("event") == "update"] for a in self.agents
        }
        by_round = {r["round"]: r for r in rounds}
        seen_at = {r["round"]: r["t"] for r in self.rounds_seen}
        exits = {a: [e["at"] for e in run["exits"] if e["name"] == a] for a in self.agents}
        window = site.args.round_timeout + 10
        # While its disk is full an agent's update goes out, then its history line fails
        # (and it exits 74, seconds later on a busy machine).
        full = [(f["target"], f["at"], (f["cleared"] or f["at"]) + 2) for f in run["faults"] if f["kind"] == "disk"]
        phantom = []
        unrecorded = 0
        twice = []
        for r in rounds:
            if len(set(r["participants"])) != len(r["participants"]):
                twice.append(r["round"])
            for a in r["participants"]:
                if any(u["round"] == r["round"] and u["base_version"] == r["model_version"] - 1 for u in sent[a]):
                    continue
                # An agent records an update once the broker has acknowledged it: killed
                # (or its disk full) in between, the update went out unrecorded.
                t = seen_at.get(r["round"])
                if t is not None and any(t - window <= e <= t + 10 for e in exits[a]):
                    unrecorded += 1
                elif t is not None and any(a == node and lo <= t <= hi for node, lo, hi in full):
                    unrecorded += 1
                else:
                    phantom.append((r["round"], a))
        # Acknowledged updates that were not aggregated, and why.
        stale = _stale_refusals(site.work / "logs" / "coordinator.log")
        last_started = max([*numbers, *abandoned], default=0)
        kept: dict[str, int] = {"aggregated": 0, "refused as stale": 0, "round abandoned": 0, "broker killed": 0}
        unexplained = []
        broker_kills = [
            (f["wall"], f["wall"] + f["hold"] + 5) for f in run["faults"] if f["kind"] == "broker" and "wall" in f
        ]
        for a, updates in sent.items():
            for u in updates:
                r = by_round.get(u["round"])
                if r is not None and a in r["participants"] and u["base_version"] == r["model_version"] - 1:
                    kept["aggregated"] += 1
                elif (a, u["round"]) in stale:
                    kept["refused as stale"] += 1
                elif u["round"] in abandoned:
                    kept["round abandoned"] += 1
                elif any(lo - 2 <= u["time"] <= hi for lo, hi in broker_kills):
                    kept["broker killed"] += 1
                elif u["round"] >= last_started:
                    continue  # the round in flight when the run stopped
                else:
                    unexplained.append((a, u["round"], u["base_version"]))
        out.append(
            _invariant(
                "every acknowledged update aggregated exactly once",
                not phantom and not twice and not unexplained,
                {
                    **kept,
                    "aggregated, its agent's record lost in a crash or to the full disk": unrecorded,
                    "not accounted for": unexplained[:20],
                    "aggregated without being sent": phantom[:20],
                    "rounds with an agent twice": twice[:20],
                },
            )
        )
        # Signed frames carry, and are checked against, a clock that wall-clock jumps do
        # not move (fedagent.security.signing.SteadyClock): none may be refused for its time.
        refused = {n: _timestamp_refusals(site.work / "logs" / f"{n}.log") for n in site.names}
        out.append(
            _invariant(
                "no signed frame refused for its timestamp (the clock jumps)",
                not any(refused.values()),
                {n: c for n, c in refused.items() if c} or "none",
            )
        )
        return out

    def accuracy(self, site: Site) -> float | None:
        loaded = checkpoint.load(self.history_path(site).parent / "global.ckpt")
        if loaded is None:
            return None
        return digits_accuracy({k: v for k, v in loaded[0].items() if not k.startswith(checkpoint.OPTIMIZER_PREFIX)})


_STALE = re.compile(r"rejected from (\S+) \(round (\d+)\): stale")
_TIMESTAMP = re.compile(r"rejected message from \S+: stale \(timestamp")


def _timestamp_refusals(path: Path) -> int:
    try:
        return len(_TIMESTAMP.findall(path.read_text(errors="replace")))
    except FileNotFoundError:
        return 0


def _stale_refusals(path: Path) -> set[tuple[str, int]]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return set()
    return {(m.group(1), int(m.group(2))) for m in _STALE.finditer(text)}


class GossipSetup(Setup):
    name = "gossip"
    PERIOD_S = 0.5

    def daemons(self, agents: int) -> list[str]:
        return [f"agent-{i + 1}" for i in range(agents)]

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        self.agents = self.daemons(args.agents)
        self.last: dict[str, dict[str, int]] = {a: {"period": 0, "merged": 0} for a in self.agents}
        periods = int(args.minutes * 60 / self.PERIOD_S) + 600
        return Federation(
            work,
            agents=args.agents,
            rounds=1,
            alpha=args.alpha,
            mode="gossip",
            agent_broker_by_mdns=False,
            broker_bind=broker_bind,
            gossip={
                "periods": periods,
                "period_steps": 10,
                "lr": 0.1,
                "batch_size": BATCH,
                "seed": SEED,
                "period_seconds": self.PERIOD_S,
                "send_timeout": 5.0,
                "eval_every": 20,
                "min_peers": 1,
            },
        )

    def configure(self, site: Site) -> None:
        if site.lab is None:
            return
        # Peers find each other by mDNS: each daemon advertises and browses on its namespace's address.
        for name in self.agents:
            path = site.fed.config_path(name)
            doc = tomllib.loads(path.read_text())
            doc.setdefault("discovery", {})["interfaces"] = [site.lab.ip[name]]
            path.write_text(tomli_w.dumps(doc))

    def poll(self, site: Site) -> dict[str, Any]:
        # An agent that does not answer (stopped, restarting, busy) keeps its last figures.
        for a in self.agents:
            st = site.status(a)
            if st:
                self.last[a] = {"period": st.get("period", 0), "merged": (st.get("gossip") or {}).get("merged", 0)}
        return {
            "t": site.now(),
            "periods": {a: v["period"] for a, v in self.last.items()},
            "merged": {a: v["merged"] for a, v in self.last.items()},
            "version": min((v["period"] for v in self.last.values()), default=0),
        }

    def recovered(self, site: Site, fault: Fault, mark: dict[str, Any]) -> bool:
        now = self.poll(site)
        for a, period in now["periods"].items():
            if period < mark["periods"].get(a, 0):
                # Restarted from its last checkpoint (every eval_every periods): its
                # progress counts from where it resumed.
                mark["periods"][a] = period
        ahead = all(now["periods"].get(a, 0) >= mark["periods"].get(a, 0) + 2 for a in self.agents)
        target = fault.target if fault.target in self.agents else None
        merging = target is None or now["merged"].get(target, 0) != mark["merged"].get(target, 0)
        return ahead and merging

    def check(self, site: Site, run: dict[str, Any]) -> list[dict[str, Any]]:
        evals = {
            a: [
                r["period"]
                for r in read_records(site.work / "state" / a / "agent" / site.fed.fed / "history.jsonl")
                if r.get("event") == "gossip_eval"
            ]
            for a in self.agents
        }
        # Push-sum's mass: the agents' checkpointed masses against their sample counts
        # (measured, not checked: a crash loses what a process merged since its last checkpoint).
        mass = 0.0
        for a in self.agents:
            loaded = checkpoint.load(site.fed.model_path(a))
            if loaded is not None:
                mass += float(loaded[1].get("mass", 0.0))
        run["gossip_mass"] = mass
        return [
            _invariant(
                "every agent went on training (periods evaluated)",
                all(len(v) >= 2 for v in evals.values()),
                {a: (v[-1] if v else None) for a, v in evals.items()},
            )
        ]

    def accuracy(self, site: Site) -> float | None:
        accs = []
        for a in self.agents:
            loaded = checkpoint.load(site.fed.model_path(a))
            if loaded is not None:
                accs.append(digits_accuracy(loaded[0]))
        return sum(accs) / len(accs) if accs else None


class NotYet(Setup):
    def __init__(self, name: str) -> None:
        self.name = name

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Federation:
        raise SystemExit(
            f"chaos: there is no {self.name} federation in this release; add a Setup subclass for it to SETUPS"
        )


SETUPS: dict[str, Callable[[], Setup]] = {
    "fedavg": FedAvgSetup,
    "gossip": GossipSetup,
    "async": lambda: NotYet("asynchronous"),
    "tiered": lambda: NotYet("tiered"),
}


# -- the run -----------------------------------------------------------------------------------
def memory_check(samples: list[dict[str, Any]], warmup: float, end: float) -> dict[str, Any]:
    """Per process: peak RSS after start-up in the first and the second half of the rest."""
    mid = warmup + (end - warmup) / 2
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    for s in samples:
        if s["t"] < warmup:
            continue
        half = first if s["t"] < mid else second
        for name, rss in s["rss"].items():
            half[name] = max(half.get(name, 0), rss)
    table = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name, 0), second.get(name, 0)
        bound = int(1.25 * a + 30 * MB) if a else 0
        table[name] = {"first_half_peak": a, "second_half_peak": b, "bound": bound, "ok": not a or b <= bound}
    return table


def stop_site(site: Site, setup: Setup) -> None:
    """SIGTERM every daemon in the mode's order (what each holds is on disk when it returns)."""
    for name in setup.stop_order(site.names):
        proc = site.proc(name)
        if proc is not None:
            site.fed.stop(proc)
            site.fed.procs.remove(proc)
    site.fed.close()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The federation under faults for ``args.minutes`` (from its first progress) and, beside it on the same machine,
    its fault-free twin (``--reference twin``): the same settings, never touched, the
    accuracy the faulted one is held to."""
    rng = random.Random(args.seed)
    setup = SETUPS[args.mode]()
    twin_setup = SETUPS[args.mode]() if args.reference == "twin" else None
    twin_args = argparse.Namespace(**{**vars(args), "netns": False, "faults": []})
    with contextlib.ExitStack() as stack:
        site = Site(work / "chaos", args, setup, rng)
        stack.callback(site.close)
        twin = None
        if twin_setup is not None:
            twin = Site(work / "twin", twin_args, twin_setup, random.Random(args.seed))
            stack.callback(twin.close)
        return _run(args, rng, setup, site, twin_setup, twin)


def _run(
    args: argparse.Namespace,
    rng: random.Random,
    setup: Setup,
    site: Site,
    twin_setup: Setup | None,
    twin: Site | None,
) -> dict[str, Any]:
    duration = args.minutes * 60
    quiet = min(args.quiet, duration / 3)
    out: dict[str, Any] = {
        "faults": [],
        "progress": [],
        "twin_progress": [],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    sampler = Sampler(site, args.sample_every)
    injector = Injector(site)
    cycle: list[str] = []
    try:
        site.prepare()
        site.start_all()
        if twin is not None:
            twin.prepare()
            twin.start_all()
        sampler.start()
        next_fault = float("inf")  # set once the federation has made progress
        last_log = 0.0
        current: Fault | None = None
        mark: dict[str, Any] = {}
        state = "idle"  # idle -> held -> recovering -> idle
        # The run's length counts from the first aggregated round (or gossip period), so a
        # slow start-up on a busy machine does not eat the time for faults; a start-up
        # that never gets there ends the run after --startup-timeout.
        end = args.startup_timeout
        # Past the end only to see the last fault's recovery through (bounded by its timeout).
        while site.now() < end or state == "recovering":
            site.supervise()
            progress = setup.poll(site)
            out["progress"].append({"t": round(progress["t"], 1), "version": progress["version"]})
            if twin is not None and twin_setup is not None:
                twin.supervise()
                tp = twin_setup.poll(twin)
                out["twin_progress"].append({"t": round(site.now(), 1), "version": tp["version"]})
            now = site.now()
            if next_fault == float("inf") and progress["version"] >= 1:
                out["first_progress"] = round(now, 1)
                next_fault = now + args.warmup
                end = now + duration
            budget_left = not args.cycles or len(out["faults"]) < args.cycles * len(args.faults)
            if state == "idle" and args.faults and budget_left and now >= next_fault and now < end - quiet:
                current = draw(rng, args.faults, site, cycle)
                current.at = round(now, 2)
                current.detail["wall"] = time.time()
                injector.inject(current)
                out["faults"].append(current)
                log(f"fault: {current.label()} for {current.hold:.1f}s")
                state = "held"
            elif state == "held" and current is not None and now >= current.at + current.hold:
                injector.clear(current)
                current.cleared = round(site.now(), 2)
                mark = setup.poll(site)
                state = "recovering"
            elif state == "recovering" and current is not None:
                if setup.recovered(site, current, mark):
                    current.recovered = round(site.now() - (current.cleared or 0), 2)
                    log(f"recovered from {current.label()} in {current.recovered:.1f}s")
                    state = "idle"
                    next_fault = site.now() + rng.uniform(args.gap_min, args.gap_max)
                    if args.cycles and len(out["faults"]) >= args.cycles * len(args.faults):
                        end = min(end, site.now() + quiet)  # every fault done: the quiet stretch, then stop
                elif now - (current.cleared or 0) > args.recovery_timeout:
                    log(f"NOT recovered from {current.label()} within {args.recovery_timeout:.0f}s")
                    state = "idle"
                    next_fault = site.now() + rng.uniform(args.gap_min, args.gap_max)
                    if args.cycles and len(out["faults"]) >= args.cycles * len(args.faults):
                        end = min(end, site.now() + quiet)
            if now - last_log >= args.log_every:
                last_log = now
                rss = sampler.samples[-1]["rss"] if sampler.samples else {}
                twin_v = f" (twin {out['twin_progress'][-1]['version']})" if out["twin_progress"] else ""
                log(
                    f"{now / 60:5.1f} min: version {progress['version']}{twin_v}, {len(out['faults'])} faults, "
                    f"{state}{' ' + current.label() if current and state != 'idle' else ''}; RSS MB "
                    + " ".join(f"{k}={v / MB:.0f}" for k, v in sorted(rss.items()))
                )
            time.sleep(0.25)
        if current is not None and state == "held":
            injector.clear(current)
            current.cleared = round(site.now(), 2)
        # A last look: everyone must be up after one more supervision pass.
        site.supervise()
        setup.poll(site)
        out["alive_at_end"] = {n: site.alive(n) for n in site.names}
        sampler.stopped.set()
        sampler.join()
        out["samples"] = sampler.samples
        out["end"] = round(site.now(), 1)
        stop_site(site, setup)
        if twin is not None and twin_setup is not None:
            stop_site(twin, twin_setup)
        out["faults"] = [asdict(f) | {"wall": f.detail.pop("wall", None)} for f in out["faults"]]
        out["exits"] = [asdict(e) for e in site.exits]
        out["starts"] = site.starts
        out["disk_node"], out["clock_node"] = site.disk_node, site.clock_node
        out["invariants"] = setup.check(site, out)
        acc = setup.accuracy(site)
        ref = twin_setup.accuracy(twin) if twin is not None and twin_setup is not None else None
        out["accuracy"] = {"chaos": acc, "fault_free_twin": ref}
        if ref is None:
            out["invariants"].append(
                _invariant("final accuracy (no fault-free twin)", acc is not None, {"accuracy": acc})
            )
        else:
            out["invariants"].append(
                _invariant(
                    f"final accuracy within {args.tolerance:g} of the fault-free twin",
                    acc is not None and acc >= ref - args.tolerance,
                    {"accuracy": acc, "fault-free twin": ref, "twin's progress": out["twin_progress"][-1]["version"]},
                )
            )
    finally:
        sampler.stopped.set()
    return out


def common_invariants(run: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = [
        _invariant(
            f"the federation made progress within {args.startup_timeout:.0f} s of its start",
            "first_progress" in run,
            {"first progress at (s)": run.get("first_progress")},
        )
    ]
    dead = [n for n, up in run["alive_at_end"].items() if not up]
    unexpected = [e for e in run["exits"] if not e["expected"]]
    out.append(_invariant("no daemon left dead", not dead, {"dead at the end": dead}))
    out.append(
        _invariant(
            "no daemon exited on its own (other than 74 on the full disk)",
            not unexpected,
            {"unexpected exits": unexpected[:20], "exits": len(run["exits"])},
        )
    )
    late = [f"{f['kind']} {f['target']}" for f in run["faults"] if f["recovered"] is None]
    out.append(
        _invariant(
            f"every fault recovered within {args.recovery_timeout:.0f} s",
            not late,
            {"not recovered": late, "faults": len(run["faults"])},
        )
    )
    mem = memory_check(run["samples"], run.get("first_progress", 0) + args.warmup, run["end"])
    run["memory"] = mem
    out.append(
        _invariant(
            "memory of every process bounded (second-half peak <= 1.25 x first-half peak + 30 MB)",
            all(m["ok"] for m in mem.values()),
            {k: f"{m['first_half_peak'] / MB:.0f} -> {m['second_half_peak'] / MB:.0f} MB" for k, m in mem.items()},
        )
    )
    return out


def write_report(out: Path, run: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(run, indent=1, default=str))
    s = run["settings"]
    lines = [
        f"# Chaos soak: {s['mode']}, {s['minutes']:g} min, seed {s['seed']}",
        "",
        f"{s['agents']} agents, digits (α = {s['alpha']}), round timeout {s['round_timeout']} s, "
        f"faults: {', '.join(s['faults'])}; network namespaces: {'yes' if s['netns'] else 'no'}; "
        f"small disk: {run.get('disk_node')}; faked clock: {run.get('clock_node')}; "
        f"load average at the start {run.get('load_start')}, at the end {run.get('load_end')}.",
        "",
        "## Invariants",
        "",
        "| invariant | holds | figures |",
        "|---|---|---|",
    ]
    for inv in run["invariants"]:
        lines.append(
            f"| {inv['name']} | {'yes' if inv['ok'] else '**NO**'} | {json.dumps(inv['detail'], default=str)} |"
        )
    lines += ["", "## Faults", "", "| # | at (s) | fault | held (s) | recovered after (s) |", "|---|---|---|---|---|"]
    for i, f in enumerate(run["faults"], 1):
        label = f"{f['kind']} {f['target']}" + (f" {f['detail']['offset']}" if "offset" in f["detail"] else "")
        rec = "—" if f["recovered"] is None else f"{f['recovered']:.1f}"
        lines.append(f"| {i} | {f['at']:.0f} | {label} | {f['hold']:.1f} | {rec} |")
    by_kind: dict[str, list[float]] = {}
    for f in run["faults"]:
        if f["recovered"] is not None:
            by_kind.setdefault(f["kind"], []).append(f["recovered"])
    lines += ["", "| fault | count | recovery median (s) | max (s) |", "|---|---|---|---|"]
    for kind, times in sorted(by_kind.items()):
        times.sort()
        lines.append(f"| {kind} | {len(times)} | {times[len(times) // 2]:.1f} | {times[-1]:.1f} |")
    lines += ["", "## Memory", "", "| process | peak RSS, first half (MB) | second half (MB) | bound (MB) |"]
    lines.append("|---|---|---|---|")
    for name, m in run.get("memory", {}).items():
        lines.append(
            f"| {name} | {m['first_half_peak'] / MB:.0f} | {m['second_half_peak'] / MB:.0f} | {m['bound'] / MB:.0f} |"
        )
    exits = run.get("exits", [])
    lines += ["", f"Exits: {len(exits)} ({sum(1 for e in exits if e['expected'] == 'kill')} by kill -9, "]
    lines[-1] += (
        f"{sum(1 for e in exits if e['expected'] == 'disk full')} with 74 on the full disk); starts: {run.get('starts')}."
    )
    lines += ["", "![faults, progress and memory](chaos.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    plot(out / "chaos.png", run)


def plot(path: Path, run: dict[str, Any]) -> None:
    try:
        from fedagent.extras import require

        require("matplotlib", "report", "the plot of bench/chaos.py")
    except Exception as exc:
        log(f"no plot: {exc}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    colors = {
        "kill": "red",
        "broker": "purple",
        "partition": "orange",
        "stop": "blue",
        "disk": "brown",
        "clock": "green",
    }
    prog = run["progress"][:: max(1, len(run["progress"]) // 4000)]
    ax1.plot([p["t"] / 60 for p in prog], [p["version"] for p in prog], color="black", lw=1, label="under faults")
    twin = run.get("twin_progress", [])[:: max(1, len(run.get("twin_progress", [])) // 4000)]
    if twin:
        ax1.plot([p["t"] / 60 for p in twin], [p["version"] for p in twin], color="grey", lw=1, ls="--", label="twin")
    ax1.set_ylabel("model version" if run["settings"]["mode"] == "fedavg" else "slowest agent's period")
    for f in run["faults"]:
        end = (f["cleared"] or f["at"]) + (f["recovered"] or 0)
        for ax in (ax1, ax2):
            ax.axvspan(f["at"] / 60, max(end, f["at"] + 1) / 60, color=colors.get(f["kind"], "grey"), alpha=0.2, lw=0)
    for kind, c in colors.items():
        ax1.plot([], [], color=c, alpha=0.4, lw=6, label=kind)
    ax1.legend(loc="upper left", fontsize=8, ncol=6)
    ax1.set_title("faults (shaded: injected until recovered) and progress")
    names = sorted({n for s in run["samples"] for n in s["rss"]})
    for n in names:
        pts = [(s["t"] / 60, s["rss"][n] / MB) for s in run["samples"] if n in s["rss"]]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=n)
    ax2.set_ylabel("RSS (MB)")
    ax2.legend(loc="upper left", fontsize=7, ncol=4)
    rec = [f for f in run["faults"] if f["recovered"] is not None]
    ax3.scatter(
        [f["at"] / 60 for f in rec],
        [f["recovered"] for f in rec],
        c=[colors.get(f["kind"], "grey") for f in rec],
        s=18,
    )
    ax3.set_ylabel("recovery (s)")
    ax3.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for report.md, report.json, chaos.png")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mode", choices=sorted(SETUPS), default="fedavg")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5, help="digits shards' Dirichlet α (non-IID)")
    p.add_argument("--round-timeout", type=float, default=20.0)
    p.add_argument("--faults", default=",".join(KINDS), help="comma-separated kinds (default: all the machine allows)")
    p.add_argument(
        "--netns", choices=("auto", "on", "off"), default="auto", help="daemons in network namespaces (root)"
    )
    p.add_argument(
        "--minutes", type=float, default=30.0, help="length of the run, from the first progress (after start-up)"
    )
    p.add_argument(
        "--cycles",
        type=int,
        default=0,
        help="stop after this many rounds of every fault kind and a quiet stretch (0: run the whole time)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the first progress may take")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds from the first progress to the first fault")
    p.add_argument("--quiet", type=float, default=120.0, help="fault-free seconds at the end")
    p.add_argument("--gap-min", type=float, default=5.0)
    p.add_argument("--gap-max", type=float, default=20.0)
    p.add_argument("--restart-sec", type=float, default=5.0, help="delay before an exited daemon starts again")
    p.add_argument(
        "--hold-scale",
        type=float,
        default=1.0,
        help="scales how long broker, partition, stop, disk and clock faults last",
    )
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    p.add_argument("--tolerance", type=float, default=0.01, help="accuracy the run may lose to the fault-free one")
    p.add_argument(
        "--reference",
        choices=("twin", "none"),
        default="twin",
        help="run a fault-free twin federation beside the faulted one, for the accuracy check",
    )
    p.add_argument("--disk-mb", type=int, default=32, help="size of the small disk")
    p.add_argument("--sample-every", type=float, default=2.0)
    p.add_argument("--log-every", type=float, default=15.0)
    p.add_argument("--work", type=Path, help="keep the federation's files here (default: a temporary directory)")
    args = p.parse_args(argv)
    root = os.geteuid() == 0
    args.netns = args.netns == "on" or (args.netns == "auto" and root and shutil.which("ip") is not None)
    wanted = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = set(wanted) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds: {sorted(unknown)} (known: {', '.join(KINDS)})")
    skipped = []
    for k in list(wanted):
        if (k == "partition" and not args.netns) or (k == "disk" and not root):
            skipped.append(k)
    if skipped:
        log(f"skipping {', '.join(skipped)}: needs root (namespaces, a mount)")
    args.faults = [k for k in wanted if k not in skipped]
    return args


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    # Stopped from outside (SIGTERM, or SIGINT, which a shell's background job ignores):
    # unwind, so that daemons, namespaces and the small disk are cleaned up.
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        if args.work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedagent-chaos-")))
        else:
            work = args.work
            work.mkdir(parents=True, exist_ok=True)
        load_start = os.getloadavg()
        log(f"chaos run: {args.mode}, {args.minutes:g} min, seed {args.seed}, faults {', '.join(args.faults)}")
        out = run(args, work)
        out["invariants"] += common_invariants(out, args)
        out["load_start"] = [round(x, 1) for x in load_start]
        out["load_end"] = [round(x, 1) for x in os.getloadavg()]
        write_report(args.out, out)
    for inv in out["invariants"]:
        log(f"{'ok  ' if inv['ok'] else 'FAIL'} {inv['name']}: {json.dumps(inv['detail'], default=str)[:300]}")
    log(f"report: {args.out / 'report.md'}")
    return 0 if all(i["ok"] for i in out["invariants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
