"""The parts of the chaos soak (bench/chaos.py) every mode shares: the supervised site of
daemons, what is sampled while it runs, the faults and how they are carried out, and the
:class:`Setup` a mode subclasses."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # netns.Lab: the namespaces of the network tests

from fedagent.local.federation import SEED, Proc  # noqa: E402

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

            self.lab = Lab(work, setup.hosts(self.names)).up()
        setup.lab = self.lab
        self.fed = setup.federation(work, args, self.lab.ip[setup.host("broker")] if self.lab else "127.0.0.1")
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
        """The namespace daemon or broker ``name`` lives in (its host's)."""
        return self.lab.ns(self.setup.host(name)) if self.lab is not None else None

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
        for name, broker in self.brokers().items():
            if broker.pid is not None:
                out[name] = broker.pid
        return out

    def signal(self, name: str, sig: int) -> None:
        p = self.proc(name)
        if p is not None and p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, sig)

    def brokers(self) -> dict[str, Any]:
        """The federation's brokers by name (one, ``broker``, but in a tiered federation)."""
        return self.setup.brokers(self.fed)

    def broker_start(self, name: str) -> None:
        with in_netns(self.ns(name)):
            self.brokers()[name].start()

    def close(self) -> None:
        for name in self.names:
            self.signal(name, signal.SIGCONT)
        if self.lab is not None:
            for host in self.lab.hosts:
                self.lab.heal(host)
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
            s.brokers()[f.target].kill()
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
            s.broker_start(f.target)
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


# How long each kind lasts before it is cleared, drawn uniformly (seconds, before
# ``--hold-scale``); a kill lasts the restart delay.
HOLDS: dict[str, tuple[float, float]] = {
    "broker": (1, 6),
    "partition": (5, 25),
    "stop": (2, 20),
    "disk": (5, 20),
    "clock": (5, 30),
}


def draw(rng: random.Random, kinds: list[str], site: Site, cycle: list[str]) -> Fault:
    """The next fault: kinds in a shuffled order, each once per cycle; target and length at random."""
    if not cycle:
        cycle.extend(rng.sample(kinds, len(kinds)))
    kind = cycle.pop()
    targets = {
        "kill": site.names,
        "stop": site.names,
        "partition": site.setup.partition_targets(site.names),
        "broker": list(site.brokers()),
        "disk": [site.disk_node or ""],
        "clock": [site.clock_node or ""],
    }[kind]
    # Every kind's length is drawn each time (as the schedule always has: a seed gives
    # the same faults as before), the one of this kind taken.
    lengths = {k: rng.uniform(lo, hi) for k, (lo, hi) in HOLDS.items()}
    hold = site.args.restart_sec if kind == "kill" else lengths[kind] * site.args.hold_scale
    return Fault(kind, rng.choice(targets), 0.0, round(hold, 2))


def scheduled(
    rng: random.Random, kinds: list[str], site: Site, cycle: list[str], now: float, faults_until: float
) -> Fault | None:
    """The fault to inject at ``now`` (the next drawn, at most as long as the faulted
    stretch that ends at ``faults_until`` has left), or None: no room left for it."""
    fault = draw(rng, kinds, site, cycle)
    fault.at = round(now, 2)
    return fault if fit(fault, faults_until - fault.at, site.args.hold_scale) else None


def fit(fault: Fault, room: float, hold_scale: float) -> bool:
    """Whether ``fault``, drawn with ``room`` seconds of the faulted stretch left, fits in
    it; its hold is cut to the room if need be. The fault-free tail at the end of a run is
    there to let the federation settle before it is judged against its twin: a fault held
    into it (a partition healed, a daemon restarted seconds before the end) would be
    judged instead. A hold shorter than its kind's shortest is not that fault any more (a
    kill's hold is the restart delay itself): such a fault is not injected. The draw is
    made either way, so the seeded sequence of kinds, targets and lengths stays the same."""
    if fault.kind == "kill":
        return fault.hold <= room
    if room < HOLDS[fault.kind][0] * hold_scale:
        return False
    if fault.hold > room:
        fault.detail["drawn_hold"] = fault.hold
        fault.hold = round(math.floor(room * 100) / 100, 2)
    return True


# -- modes -------------------------------------------------------------------------------------
class Setup:
    """A mode's federation: its daemons, its configuration, what recovery means, its checks.
    A new mode (an asynchronous or a tiered federation) is a subclass in bench/chaos.py's ``SETUPS``."""

    name = ""
    # The run's network namespaces (tests/netns.Lab), set by Site before federation():
    # None when everything runs on loopback.
    lab: Any = None

    def daemons(self, agents: int) -> list[str]:
        raise NotImplementedError

    def hosts(self, names: list[str]) -> list[str]:
        """The network namespaces of a run as root: the broker's and one per daemon."""
        return ["broker", *names]

    def host(self, name: str) -> str:
        """The namespace daemon or broker ``name`` runs in (``broker``: where the
        federation is prepared and its broker started)."""
        return name

    def partition_targets(self, names: list[str]) -> list[str]:
        """The hosts a ``partition`` fault may cut off: any daemon's."""
        return names

    def federation(self, work: Path, args: argparse.Namespace, broker_bind: str) -> Any:
        """The federation (:class:`Federation` or one with its methods: ``prepare``,
        ``spawn``, ``procs``, ``status``, ``config_path``, ``stop``, ``close``)."""
        raise NotImplementedError

    def configure(self, site: Site) -> None:
        """Rewrite the configs ``prepare()`` wrote, before anything starts."""

    def brokers(self, fed: Any) -> dict[str, Any]:
        """The brokers a ``broker`` fault may hit, by name."""
        return {"broker": fed.broker} if fed.broker is not None else {}

    def clock_node(self, names: list[str]) -> str:
        return names[0]

    def stop_order(self, names: list[str]) -> list[str]:
        return names

    def stopping(self, site: Site, name: str) -> None:
        """Called at the end of the run just before daemon ``name`` is stopped: a mode that
        times what it reads (a round's harness time) reads here what came before the stop."""

    # What ``accuracy`` measures, for the report (a mode whose agents keep models of their own says which).
    accuracy_of = "the final model"

    def accuracy(self, site: Site) -> float | None:
        """The final model's test accuracy (where each agent has its own: the federation's)."""
        raise NotImplementedError

    def agent_accuracies(self, site: Site) -> dict[str, float | None]:
        """Where each agent has a model of its own: each one's test accuracy at the end
        (None: no readable model). Empty where the agents share one."""
        return {}

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
