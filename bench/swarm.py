"""Many agents in one process, over the real broker: the scale and memory benchmarks.

Each :class:`LightAgent` is a real federation member as the broker and the coordinator
see it — its own MQTT connection, its own certificate (CN = its id, so the broker's
pattern ACL confines it to its own topics), a retained presence message with a Last
Will, the participant machine, updates sent as compressed streams — but it trains
nothing: its "training" adds a small seeded step to the global weights (numpy), so the
numbers measure the framework, not torch. Thousands fit in one asyncio loop.

:func:`run_federation` puts it together: a throw-away CA with one certificate per agent
(the CA key is loaded once and reused, so issuing 1,000 takes seconds), a private
Mosquitto (embedded default config: mutual TLS, pattern ACL, a queue limit raised past
the number of agents), the real ``fedagent coordinator`` as a separate process (so its
memory is its own, sampled from /proc), and the swarm in this process — or, with
``procs=K``, in K child processes (``python -m bench.swarm`` reading its
share of the agents from stdin), so that one Python process driving every connection is
not what limits the run, and each side's CPU is measured on its own.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomli_w
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedagent.errors import ConfigError
from fedagent.mosquitto import EmbeddedBroker
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import TlsFiles, Transport
from fedagent.protocols import topics
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.downlink import READS
from fedagent.protocols.messages import GlobalModel, Presence, RoundResult, RoundStart
from fedagent.protocols.participant import DeltaReceiver, Participant, SendUpdate, Train, TrainingDone
from fedagent.security import pki
from fedagent.security.signing import Identity
from fedagent.storage.history import read_records

FEDERATION = "swarm"
COORDINATOR = "coordinator"


# ---- certificates, fast ----------------------------------------------------------------
def issue_many(ca_dir: Path, out_dir: Path, names: list[str], role: str = "agent") -> dict[str, TlsFiles]:
    """Certificates for ``names`` signed by the CA in ``ca_dir``, loading its key once.
    Same profile as :func:`fedagent.security.pki.issue` (Ed25519 node key, the one frames are
    signed with; clientAuth; role in OU)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / pki.CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / pki.CA_KEY).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_dir / pki.CA_KEY} is not an ECDSA key")
    now = dt.datetime.now(dt.UTC)
    out: dict[str, TlsFiles] = {}
    for name in names:
        pki.check_name(name, "node id")
        key = ed25519.Ed25519PrivateKey.generate()
        subject = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, name), x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        crt, kf = out_dir / f"{name}.crt", out_dir / f"{name}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        kf.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        os.chmod(kf, 0o600)
        out[name] = TlsFiles(ca=ca_dir / pki.CA_CERT, cert=crt, key=kf)
    return out


# ---- the light agent ---------------------------------------------------------------------
def _presence(messenger: Messenger, online: bool, samples: int, reads_steps: bool = True) -> bytes:
    downlinks = READS if reads_steps and online else ()
    return messenger.frame(
        Presence(online=online, role="agent", mode="fedavg", num_samples=samples, downlinks=downlinks)
    )


@dataclass
class LightAgent:
    id: str
    broker: str
    tls: TlsFiles
    samples: int = 100
    step: float = 1e-3  # size of the fake training step (0: send the global model back)
    whole: bool = False  # send the update as one whole message (the pre-streaming path)
    # A thousand connections share one event loop (and, here, two busy cores): the 10 s
    # default keep-alive then gets missed under load and the broker drops healthy agents.
    keepalive: int = 60
    # False: an agent of a release before the int8 broadcast (its presence does not
    # announce the steps, and a round start carrying one is an error it cannot handle)
    reads_steps: bool = True
    federation: str = FEDERATION
    transport: Transport = field(init=False)
    messenger: Messenger = field(init=False)
    rounds_sent: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.participant = Participant(self.id)
        self.steps = DeltaReceiver()  # round starts that carry the model as an int8 step
        self.held: tuple[int, dict[str, np.ndarray]] | None = None
        self.compressor = Compressor()
        self.coordinator: str | None = None
        self.messenger = Messenger(
            federation=self.federation,
            node_id=self.id,
            transport=None,
            identity=Identity.load(self.tls.cert, self.tls.key, self.tls.ca),
        )
        self.transport = Transport(
            uri=self.broker,
            client_id=self.id,
            tls=self.tls,
            will=(topics.presence(self.federation, self.id), _presence(self.messenger, False, self.samples)),
            on_connect=self._on_connect,
            keepalive=self.keepalive,
            subscriptions=[topics.all_broadcasts(self.federation), topics.inbox(self.federation, self.id)],
        )
        self.messenger.transport = self.transport
        self._tasks: set[asyncio.Task] = set()

    async def _on_connect(self) -> None:
        await self.transport.publish(
            topics.presence(self.federation, self.id),
            _presence(self.messenger, True, self.samples, self.reads_steps),
            retain=True,
        )

    async def _on_payload(self, topic: str, payload: bytes | bytearray) -> None:
        await self.messenger.receive(topic, payload, self._deliver)

    async def _deliver(self, inc: Incoming) -> None:
        msg = inc.message
        if not isinstance(msg, (RoundStart, RoundResult, GlobalModel)):
            return
        self.coordinator = inc.sender
        if isinstance(msg, RoundStart):
            if msg.delta is not None and not self.reads_steps:
                self.errors.append(f"round {msg.round}: a step, which an earlier release cannot read")
                return
            resolved, why = self.steps.resolve(msg, self.held)
            if resolved is None:  # connected from the start, it holds every model: a bug
                self.errors.append(f"round {msg.round}: {why}")
                return
            msg = resolved
            assert msg.weights is not None
            self.held = (msg.model_version, msg.weights)
        for cmd in self.participant.handle(msg):
            if isinstance(cmd, Train):
                t = asyncio.create_task(self._train(cmd))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _train(self, cmd: Train) -> None:
        try:
            rng = np.random.default_rng(hash((self.id, cmd.round)) & 0xFFFFFFFF)
            new = {
                k: (v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(self.step)).astype(v.dtype)
                if v.dtype.kind == "f" and self.step
                else v
                for k, v in cmd.weights.items()
            }
            for c in self.participant.handle(
                TrainingDone(cmd.round, cmd.base_version, self.samples, {"loss": 1.0}, new)
            ):
                if isinstance(c, SendUpdate) and self.coordinator:
                    comp = CompressionConfig(cmd.train.compression, cmd.train.topk_ratio)
                    if comp != self.compressor.config:
                        self.compressor = Compressor(comp)
                    del new
                    if self.whole or not cmd.train.stream:
                        await self.messenger.send(
                            topics.direct(self.federation, self.id, self.coordinator, "update"),
                            c.update,
                            round_=c.update.round,
                        )
                        self.rounds_sent += 1
                        continue
                    await self.messenger.send_update(
                        topics.direct(self.federation, self.id, self.coordinator, "update"),
                        c.update,
                        base=cmd.weights,
                        compressor=self.compressor,
                    )
                    self.rounds_sent += 1
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def run(self, ready: asyncio.Event) -> None:
        await self.transport.run(self._on_payload, ready)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(
                self.transport.close(
                    (topics.presence(self.federation, self.id), _presence(self.messenger, False, self.samples))
                ),
                5,
            )
        except Exception:
            pass


# ---- a whole federation ------------------------------------------------------------------
@dataclass
class RunResult:
    agents: int
    params: int
    compression: str
    rounds: list[dict]  # the coordinator's history records
    rss_samples: list[tuple[float, int]]  # (monotonic, coordinator RSS bytes)
    rss_idle: int  # coordinator RSS once connected, model loaded, before round 1
    rss_peak: int
    hwm: int  # VmHWM of the coordinator at the end
    setup_seconds: float
    round_cpu: list[float]  # coordinator CPU seconds (user+system) of each round after the first
    round_cpu_broker: list[float]  # the same for Mosquitto
    round_cpu_agents: list[float]  # the same for the swarm (this process, or the sum of its processes)
    errors: list[str]
    coordinator_log: str
    procs: int = 0  # swarm processes: 0 = the agents ran in this process
    # Wall seconds between the two marks each CPU figure above is the difference of
    # (one round plus the gap to the next): CPU / wall is the share of a core used.
    round_wall: list[float] = field(default_factory=list)
    round_cpu_swarm_max: list[float] = field(default_factory=list)  # the busiest swarm process
    connect_seconds: float = 0.0  # connecting the agents (part of setup_seconds)
    broker_rss_peak: int = 0
    broker_rss_idle: int = 0  # Mosquitto's RSS with only the coordinator connected
    broker_fds: int = 0  # Mosquitto's open file descriptors with every agent connected
    coordinator_fds: int = 0
    swarm_rss_peak: list[int] = field(default_factory=list)  # VmHWM of each swarm child process

    @property
    def model_bytes(self) -> int:
        return self.params * 4

    @property
    def round_seconds(self) -> list[float]:
        return [r["seconds"] for r in self.rounds if r.get("event") == "round"]


def _raise_nofile(n: int) -> None:
    """Raise this process's soft open-file limit to ``n`` (children, the broker among
    them, inherit it); never past the hard limit, never system-wide."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(max(soft, n), hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < n:
        raise RuntimeError(f"need {n} open files, the hard limit is {hard}: raise it (ulimit -Hn)")


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss(pid: int) -> tuple[int, int]:
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, hwm


def _fds(pid: int | None) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")) if pid else 0
    except OSError:
        return 0


WAVE = 50  # agents connecting at once: 1,000 TLS handshakes at once time out against each other


async def _connect(agents: list[LightAgent], wave_limit: float) -> list[asyncio.Task]:
    """Start every agent's connection, ``WAVE`` at a time, each wave connected within
    ``wave_limit`` seconds; an agent whose ``run`` ends (a refused certificate) fails it."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    try:
        for i in range(0, len(agents), WAVE):
            events = []
            for a in agents[i : i + WAVE]:
                ev = asyncio.Event()
                events.append(ev)
                tasks.append(asyncio.create_task(a.run(ev), name=f"swarm-{a.id}"))
            deadline = loop.time() + wave_limit
            while not all(e.is_set() for e in events):
                ended = next((t for t in tasks if t.done()), None)
                if ended is not None:
                    exc = None if ended.cancelled() else ended.exception()
                    raise RuntimeError(f"agent {ended.get_name()} stopped while connecting: {exc!r}")
                if loop.time() > deadline:
                    missing = sum(1 for e in events if not e.is_set())
                    raise TimeoutError(f"{missing} of {len(events)} agents not connected after {wave_limit:.0f} s")
                await asyncio.sleep(0.05)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return tasks


async def _stop_agents(agents: list[LightAgent], tasks: list[asyncio.Task]) -> None:
    await asyncio.gather(*(a.close() for a in agents))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- swarm child processes -------------------------------------------------------------
# The parent writes one JSON line (the spec) to the child's stdin; the child connects its
# agents and writes "ready"; on the line "stop" (or end of input) it closes them and
# writes one JSON line: {"errors": [the first ERRORS_SENT], "error_count": N, "sent": N}.
ERRORS_SENT = 50


async def _worker(spec: dict) -> dict:
    # [name, samples], or [name, samples, broker URI] for an agent of another broker than
    # the spec's (the agents of a tiered federation are spread over site brokers)
    members: list[list] = spec["agents"]
    _raise_nofile(2 * len(members) + 64)
    ca, certs = Path(spec["ca"]), Path(spec["certs"])
    agents = [
        LightAgent(
            str(m[0]),
            str(m[2] if len(m) > 2 else spec["broker"]),
            TlsFiles(ca=ca, cert=certs / f"{m[0]}.crt", key=certs / f"{m[0]}.key"),
            samples=int(m[1]),
            whole=bool(spec["whole"]),
        )
        for m in members
    ]
    for a in agents:
        a.messenger.max_chunk = int(spec["max_chunk"])
    tasks = await _connect(agents, float(spec["wave_limit"]))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.readline)
    await _stop_agents(agents, tasks)
    errors = [e for a in agents for e in a.errors]
    # One line back to the parent, which reads at most 64 KiB a line: 700 agents that
    # lost their connections once made it longer, and every error was lost.
    return {"errors": errors[:ERRORS_SENT], "error_count": len(errors), "sent": sum(a.rounds_sent for a in agents)}


def _worker_main() -> None:
    spec = json.loads(sys.stdin.readline())
    out = asyncio.run(_worker(spec))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


class _Children:
    """The swarm's child processes, as the parent sees them."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.errors: list[str] = []  # the first ERRORS_SENT of each child's, and the parent's own
        self.error_count = 0  # every error, also those not in ``errors``

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self, workdir: Path, shares: list[list[list]], common: dict, limit: float) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for k, share in enumerate(shares):
            with open(workdir / f"swarm-{k}.log", "wb") as log:
                # Each child leads a session of its own: with the kernel's autogroup
                # scheduling (sched_autogroup_enabled) a session is one scheduling group, and
                # in this process's session all 14 children of 10,000 agents together got
                # the CPU share of one process (one daemon, one process of other work on a
                # shared machine): connecting crawled at 10 agents a second, each child
                # runnable and given 0.02 of a core. It still ends with this process: on
                # "stop", or at the end of its input once this process is gone.
                p = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "bench.swarm",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
            self.procs.append(p)
            assert p.stdin is not None
            p.stdin.write(json.dumps({**common, "agents": share}).encode() + b"\n")
            await p.stdin.drain()
        for k, p in enumerate(self.procs):
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), limit)
            if line.strip() != b"ready":
                tail = (workdir / f"swarm-{k}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"swarm process {k} did not connect its agents:\n{tail}")

    async def stop(self) -> None:
        for p in self.procs:
            if p.returncode is None and p.stdin is not None:
                try:
                    p.stdin.write(b"stop\n")
                    await p.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
        for k, p in enumerate(self.procs):
            try:
                assert p.stdout is not None
                line = await asyncio.wait_for(p.stdout.readline(), 60)
                if line.strip():
                    out = json.loads(line)
                    self.errors += out.get("errors", [])
                    self.error_count += int(out.get("error_count", len(out.get("errors", []))))
                await asyncio.wait_for(p.wait(), 30)
            except (TimeoutError, ValueError) as exc:
                self.errors.append(f"swarm process {k}: {type(exc).__name__} {exc}")
                self.error_count += 1
            finally:
                if p.returncode is None:
                    p.kill()
                    await p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()


async def _federation(
    workdir: Path,
    n: int,
    params: int,
    rounds: int,
    compression: str,
    topk_ratio: float,
    tensors: int,
    max_chunk: int,
    progress: Callable[[str], None],
    timeout: float,
    whole: bool = False,
    procs: int = 0,
    connect_limit: float = 900.0,
    rounds_options: dict | None = None,
    downlink: str | None = None,
) -> RunResult:
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    # This process holds every agent's socket (procs=0); the broker, started from here,
    # inherits the limit and holds one per agent.
    _raise_nofile(2 * n + 256)
    ca_dir = workdir / "ca"
    pki.create_ca(ca_dir, FEDERATION)
    pki.issue(ca_dir, ca_dir, COORDINATOR, "coordinator")
    names = [f"a{i:04d}" for i in range(n)]
    progress(f"issuing {n} agent certificates")
    certs = await asyncio.to_thread(issue_many, ca_dir, workdir / "certs", names)
    broker = EmbeddedBroker(workdir / "broker", federations=[FEDERATION], coordinators=[COORDINATOR], ca_dir=ca_dir)
    broker.start()
    coord: subprocess.Popen | None = None
    agents: list[LightAgent] = []
    tasks: list[asyncio.Task] = []
    children = _Children()
    samples: list[tuple[float, int]] = []
    broker_peak = [0]
    sampler: asyncio.Task | None = None
    done: list[dict] = []
    marks: list[tuple[float, float, float, list[float]]] = []  # (wall, coordinator, broker, swarm CPUs)
    try:
        state = workdir / "state"
        cfg = {
            "id": COORDINATOR,
            "federation": FEDERATION,
            "mode": "fedavg",
            "state_dir": str(state),
            "runtime_dir": str(workdir / "run"),
            "metrics_port": -1,
            "torch_threads": 1,
            "broker": {"uri": broker.uri},
            "tls": {
                "ca": str(ca_dir / pki.CA_CERT),
                "cert": str(ca_dir / f"{COORDINATOR}.crt"),
                "key": str(ca_dir / f"{COORDINATOR}.key"),
            },
            "discovery": {"interfaces": ["127.0.0.1"], "advertise": False},
            "task": {"name": "synthetic", "params": params, "tensors": tensors, "train": False},
            "rounds": {
                "rounds": rounds,
                "min_agents": n,
                "expected_agents": n,
                "start_grace": 0.0,
                "round_timeout": max(120.0, timeout),
                **(rounds_options or {}),
            },
            "transfer": {
                "compression": compression,
                "topk_ratio": topk_ratio,
                "max_chunk_bytes": max_chunk,
                **({"downlink": downlink} if downlink else {}),
            },
        }
        (workdir / "coordinator.toml").write_text(tomli_w.dumps(cfg))
        log = open(workdir / "coordinator.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # FEDAGENT_SWARM_PROFILE=FILE runs the coordinator under cProfile (for finding where a round goes).
        prof = os.environ.get("FEDAGENT_SWARM_PROFILE")
        # FEDAGENT_SWARM_MEMRAY=FILE records its allocations with memray (``memray
        # flamegraph FILE`` then shows what was held at the peak); memray is not a dependency.
        memray = os.environ.get("FEDAGENT_SWARM_MEMRAY")
        coord = subprocess.Popen(
            [
                sys.executable,
                *(["-m", "cProfile", "-o", prof] if prof else []),
                *(["-m", "memray", "run", "--native", "-q", "-o", memray] if memray else []),
                "-m",
                "fedagent",
                "coordinator",
                "--config",
                str(workdir / "coordinator.toml"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        history = state / "coordinator" / FEDERATION / "history.jsonl"
        # Wait until the coordinator is connected and idle (model loaded, no agent yet):
        # its RSS then is the baseline the rounds' memory is measured against.
        ready_line = b"coordinator " + COORDINATOR.encode() + b" of federation"
        while ready_line not in (workdir / "coordinator.log").read_bytes():
            if coord.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(
                    "coordinator did not start:\n" + (workdir / "coordinator.log").read_text(errors="replace")[-3000:]
                )
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        rss_idle = max(_rss(coord.pid)[0] for _ in range(5))
        broker_idle = _rss(broker.pid)[0] if broker.pid else 0

        async def sample() -> None:
            assert coord is not None
            while True:
                samples.append((time.monotonic(), _rss(coord.pid)[0]))
                if broker.pid:
                    broker_peak[0] = max(broker_peak[0], _rss(broker.pid)[0])
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        samples_of = {a: 50 + i % 100 for i, a in enumerate(names)}
        t_connect = time.monotonic()
        if procs <= 0:
            agents = [LightAgent(a, broker.uri, certs[a], samples=samples_of[a], whole=whole) for a in names]
            for a in agents:
                a.messenger.max_chunk = max_chunk
            progress(f"connecting {n} agents")
            tasks = await asyncio.wait_for(_connect(agents, min(300.0, connect_limit)), connect_limit)
        else:
            progress(f"connecting {n} agents from {procs} process{'es' if procs > 1 else ''}")
            common = {
                "broker": broker.uri,
                "ca": str(ca_dir / pki.CA_CERT),
                "certs": str(workdir / "certs"),
                "whole": whole,
                "max_chunk": max_chunk,
                "wave_limit": min(300.0, connect_limit),
            }
            shares = [[[a, samples_of[a]] for a in names[k::procs]] for k in range(procs)]
            await children.start(workdir, shares, common, connect_limit)
        connect_seconds = time.monotonic() - t_connect
        setup = time.monotonic() - t0
        broker_fds, coordinator_fds = _fds(broker.pid), _fds(coord.pid)
        progress(f"{n} agents online ({setup:.1f}s); waiting for {rounds} rounds")

        def swarm_cpu() -> list[float]:
            return [_cpu(p) for p in children.pids] if procs > 0 else [time.process_time()]

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and coord.poll() is None:
            if history.exists():
                done = read_records(history)  # with its rotated files
            finished = sum(1 for r in done if r.get("event") == "round")
            if finished > len(marks):
                mark = (
                    time.monotonic(),
                    _cpu(coord.pid),
                    _cpu(broker.pid) if broker.pid else 0.0,
                    swarm_cpu(),
                )
                marks += [mark] * (finished - len(marks))
            if finished >= rounds:
                break
            if any(r.get("event") == "abandoned" for r in done):
                # Agents dropped out (a swarm process too slow for its keep-alives, say):
                # the rest would only wait for them to reconnect. Reported as incomplete.
                progress(f"a round was abandoned: {next(r for r in done if r.get('event') == 'abandoned')}")
                break
            await asyncio.sleep(0.02)
        hwm = _rss(coord.pid)[1]
        swarm_hwm = [_rss(pid)[1] for pid in children.pids]
    finally:
        if sampler is not None:
            sampler.cancel()
        if agents:
            await _stop_agents(agents, tasks)
        try:
            await children.stop()
        finally:
            children.kill()
            if coord is not None and coord.poll() is None:
                coord.send_signal(signal.SIGTERM)
                try:
                    coord.wait(10)
                except subprocess.TimeoutExpired:
                    coord.kill()
                    coord.wait()
            broker.stop()
    pairs = list(itertools.pairwise(marks))
    return RunResult(
        agents=n,
        params=params,
        compression=compression,
        rounds=done,
        rss_samples=samples,
        rss_idle=rss_idle,
        rss_peak=max((r for _, r in samples), default=0),
        hwm=hwm,
        setup_seconds=setup,
        round_cpu=[b[1] - a[1] for a, b in pairs],
        round_cpu_broker=[b[2] - a[2] for a, b in pairs],
        round_cpu_agents=[sum(b[3]) - sum(a[3]) for a, b in pairs],
        errors=[e for a in agents for e in a.errors] + children.errors,
        coordinator_log=(workdir / "coordinator.log").read_text(errors="replace")[-3000:],
        procs=max(procs, 0),
        round_wall=[b[0] - a[0] for a, b in pairs],
        round_cpu_swarm_max=[max(y - x for x, y in zip(a[3], b[3], strict=True)) for a, b in pairs],
        connect_seconds=connect_seconds,
        broker_rss_peak=broker_peak[0],
        broker_rss_idle=broker_idle,
        broker_fds=broker_fds,
        coordinator_fds=coordinator_fds,
        swarm_rss_peak=swarm_hwm,
    )


MAX_PER_PROCESS = 1000


def run_federation(
    workdir: Path,
    *,
    agents: int,
    params: int = 1000,
    rounds: int = 3,
    compression: str = "none",
    topk_ratio: float = 0.01,
    tensors: int = 4,
    max_chunk: int = 4 * 2**20,
    progress: Callable[[str], None] = lambda s: None,
    timeout: float = 600.0,
    whole: bool = False,
    procs: int = 0,
    connect_limit: float = 900.0,
    rounds_options: dict | None = None,
    downlink: str | None = None,
) -> RunResult:
    """``rounds_options``: more ``[rounds]`` keys for the coordinator (e.g.
    ``server_momentum``; none: the defaults). ``downlink``: the coordinator's ``[transfer]
    downlink`` (None: its default, int8 steps with int8 updates). ``whole``: agents send each update as one whole message (chunked and reassembled
    by the coordinator before it is aggregated) instead of a stream: the path streaming
    replaced. ``procs``: run the agents in that many child processes (0: in this one).
    ``timeout`` bounds the rounds, ``connect_limit`` the connecting of the agents.

    One process holds at most ``MAX_PER_PROCESS`` connections: the MQTT client waits on
    ``select()``, which cannot watch descriptors above 1,023."""
    per_process = -(-agents // max(procs, 1))
    if per_process > MAX_PER_PROCESS:
        need = -(-agents // MAX_PER_PROCESS)
        raise ValueError(
            f"{agents} agents in {max(procs, 1)} process(es) is {per_process} connections per process; "
            f"at most {MAX_PER_PROCESS} fit one process (select()): use procs >= {need}"
        )
    return asyncio.run(
        _federation(
            Path(workdir),
            agents,
            params,
            rounds,
            compression,
            topk_ratio,
            tensors,
            max_chunk,
            progress,
            timeout,
            whole,
            procs,
            connect_limit,
            rounds_options,
            downlink,
        )
    )


if __name__ == "__main__":
    _worker_main()
