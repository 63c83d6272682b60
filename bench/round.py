"""A FedAvg round through Mosquitto with mutual TLS, training off, against the raw
Mosquitto C clients moving the same bytes through the same broker.

fedagent's round: the coordinator (this process) broadcasts a RoundStart with the
model; ten agent processes (``bench/fed_agent.py``) each answer with an Update of the
same size; the coordinator validates each update and folds it into the running
FedAvg mean as it arrives. The round ends when the mean is computed.

The C clients' round, through the same broker, each client with a certificate of its own
(``c-<name>``: one identity, one connection) and the same kind of topics:
fan-out (one ``mosquitto_pub`` of the encoded RoundStart, ten ``mosquitto_sub`` that
are already subscribed) followed by fan-in (ten ``mosquitto_pub`` of the encoded
Update at once, one ``mosquitto_sub``), QoS 1, each model as one MQTT message. It
decodes, validates and aggregates nothing: it is the floor the broker allows.

The two kinds of round alternate, so both see the same machine load.

The C-client rows compare like for like: fedagent's agents send whole uncompressed
float32 updates, as the C clients do (``TrainConfig(stream=False)``). A third kind of
round, alternating with the other two, runs fedagent **with its defaults**: updates
streamed and folded chunk by chunk, compressed as :data:`DEFAULT_MODE` says (int8
deltas; the coordinator's broadcast is uncompressed either way). Its times are what the
``flower`` section compares with Flower, and a row here compares it with the
uncompressed round of the same run.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.env import COORDINATOR, FEDERATION, BenchBroker, bench_broker, mb, model_weights, round_sizes, round_target
from bench.registry import Context, Row, section, summary
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import Transport
from fedagent.protocols import topics
from fedagent.protocols.aggregation import WeightedMean, check_update
from fedagent.protocols.codec import Envelope, encode
from fedagent.protocols.compression import DEFAULT_MODE
from fedagent.protocols.downlink import quantize_step
from fedagent.protocols.messages import Presence, RoundStart, TrainConfig, Update
from fedagent.protocols.streaming import StreamEvent, UpdateEnd, UpdateHead, UpdatePart
from fedagent.security import pki
from fedagent.security.signing import Identity

ROOT = Path(__file__).resolve().parent.parent
AGENTS = 10
ROUND_TIMEOUT = 180.0
# Mosquitto drops a client after 1.5 keep-alives without a complete packet from it; on a
# machine shared with other work, 10 x 44.8 MB through one broker thread took longer
# than that with the default 10 s (measured: every agent dropped once).
KEEPALIVE = 30
READY_TOPIC = topics.broadcast(FEDERATION, "bench_ready")
C_RECEIVER = "cbench"  # the C fan-in's addressee: the coordinator identity reads it
# The round as the C clients do it: whole float32 updates, no compression.
LIKE_C = TrainConfig(stream=False)
# The round with fedagent's defaults: streamed updates, compressed as the daemons do.
DEFAULTS = TrainConfig(compression=DEFAULT_MODE, stream=True)
BENCH_DELTA = 0.001  # what bench/fed_agent.py adds to every coordinate of a streamed update


def chunk_bytes() -> int:
    """The chunk size the benchmark's fedagent clients use (FEDAGENT_BENCH_CHUNK)."""
    return int(os.environ.get("FEDAGENT_BENCH_CHUNK", str(4 * 2**20)))


def proc_cpu(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these live processes (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# --- the raw C clients --------------------------------------------------------------


class CClients:
    """The C clients, each under an identity of its own (``c-<name>``, certificate and
    ACL entry made here): the broker takes the client id from the certificate, so a C
    client holding a fedagent process's certificate would log in as that process and
    disconnect it."""

    def __init__(self, bb: BenchBroker, work: Path) -> None:
        for tool in ("mosquitto_pub", "mosquitto_sub"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is missing: apt-get install mosquitto-clients (scripts/bench.sh does it)")
        self.bb = bb
        self.work = work
        self.port = str(bb.broker.port)
        for name, tx in [(COORDINATOR, False), *((a, tx) for a in bb.agent_ids for tx in (False, True))]:
            if not (bb.certs / f"{self.c(name, tx)}.crt").exists():
                pki.issue(bb.ca_dir, bb.certs, self.c(name, tx), "coordinator" if name == COORDINATOR else "agent")
        if self.c(COORDINATOR) not in bb.broker.coordinators:
            bb.broker.reload_acl(coordinators=[*bb.broker.coordinators, self.c(COORDINATOR)])
        self._pub(COORDINATOR, READY_TOPIC, ["-m", "ready", "-r"])

    @staticmethod
    def c(name: str, tx: bool = False) -> str:
        """The C clients' identity standing in for ``name`` (``tx``: a second one, for a
        publisher running while ``name``'s subscriber is connected)."""
        return f"c-{name}-tx" if tx else f"c-{name}"

    def _common(self, name: str, tx: bool = False) -> list[str]:
        tls = self.bb.tls(self.c(name, tx))
        return [
            "-h",
            "127.0.0.1",
            "-p",
            self.port,
            "-V",
            "mqttv5",
            "-q",
            "1",
            "--cafile",
            str(tls.ca),
            "--cert",
            str(tls.cert),
            "--key",
            str(tls.key),
        ]

    def _pub(self, name: str, topic: str, what: list[str]) -> None:
        subprocess.run(["mosquitto_pub", *self._common(name), "-t", topic, *what], check=True, timeout=60)

    def _subs(self, names: list[str], data_topic: str, count: int) -> list[subprocess.Popen]:
        subs = [
            subprocess.Popen(
                [
                    "mosquitto_sub",
                    *self._common(n),
                    "-t",
                    READY_TOPIC,
                    "-t",
                    data_topic,
                    "-C",
                    str(count),
                    "-F",
                    "%t %l",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in names
        ]
        # The retained ready message arrives only once the subscription is in place.
        for s in subs:
            line = s.stdout.readline()
            if not line.startswith(READY_TOPIC):
                raise RuntimeError(f"mosquitto_sub did not get ready: {line!r}")
        return subs

    @staticmethod
    def _collect(subs: list[subprocess.Popen], expect_len: int, expect_count: int) -> None:
        for s in subs:
            out, _ = s.communicate(timeout=ROUND_TIMEOUT)
            sizes = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.strip()]
            if s.returncode != 0 or len(sizes) != expect_count or any(x != expect_len for x in sizes):
                raise RuntimeError(f"mosquitto_sub exited {s.returncode} with sizes {sizes}")

    def round(self, down: Path, up: Path, agents: list[str]) -> tuple[float, float, float, float]:
        """(fan-out seconds, fan-in seconds, CPU seconds of the C clients, CPU seconds of
        the broker) of one round."""
        broker = [self.bb.broker.pid]
        c0, b0 = children_cpu(), proc_cpu(broker)
        # Topics no fedagent process in this benchmark subscribes to: the agents and the
        # coordinator stay connected while the C clients run and must not receive this.
        down_topic = topics.broadcast(FEDERATION, "c_round_start")
        subs = self._subs(agents, down_topic, 2)
        t0 = time.perf_counter()
        self._pub(COORDINATOR, down_topic, ["-f", str(down)])
        self._collect(subs, down.stat().st_size, 1)
        fan_out = time.perf_counter() - t0

        sub = self._subs([COORDINATOR], topics.inbox(FEDERATION, C_RECEIVER), len(agents) + 1)
        t0 = time.perf_counter()
        pubs = [
            subprocess.Popen(
                [
                    "mosquitto_pub",
                    *self._common(a),
                    "-t",
                    topics.direct(FEDERATION, self.c(a), C_RECEIVER, "update"),
                    "-f",
                    str(up),
                ]
            )
            for a in agents
        ]
        self._collect(sub, up.stat().st_size, len(agents))
        fan_in = time.perf_counter() - t0
        for p in pubs:
            if p.wait(timeout=ROUND_TIMEOUT) != 0:
                raise RuntimeError(f"mosquitto_pub exited {p.returncode}")
        return fan_out, fan_in, children_cpu() - c0, proc_cpu(broker) - b0


# --- fedagent ----------------------------------------------------------------------


class FedRounds:
    """The coordinator side of fedagent rounds, with ten agent processes."""

    def __init__(self, bb: BenchBroker, params: int, log) -> None:
        self.bb = bb
        self.log = log
        self.weights = model_weights(params)
        self.agents = bb.agent_ids
        self.online: set[str] = set()
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self.procs: list[subprocess.Popen] = []
        self.transport = Transport(
            uri=bb.uri,
            tls=bb.tls(COORDINATOR),
            subscriptions=[topics.inbox(FEDERATION, COORDINATOR), topics.all_presence(FEDERATION)],
            session_expiry=0,
            keepalive=KEEPALIVE,
        )
        tls = bb.tls(COORDINATOR)
        self.messenger = Messenger(
            federation=FEDERATION,
            node_id=COORDINATOR,
            transport=self.transport,
            identity=Identity.load(tls.cert, tls.key, tls.ca),
            max_chunk_bytes=chunk_bytes(),
        )
        # Streamed updates (the default round) are folded as their parts arrive.
        self.messenger.on_stream = self._on_stream
        self._acc: WeightedMean | None = None
        self._heads: dict[tuple[str, str], UpdateHead] = {}
        self.runner: asyncio.Task | None = None
        self.lost: list[str] = []
        # Per-phase timestamps of the latest round (time.time(): the agents stamp their
        # updates' metrics with the same clock; one machine, so they compare).
        self.phases: dict[str, float] = {}
        self._first_update_frame: float | None = None
        self._arrivals: list[float] = []
        self._agent_stamps: list[tuple[float, float]] = []  # (RoundStart decoded, Update send begun)

    async def _deliver(self, inc: Incoming) -> None:
        msg = inc.message
        if isinstance(msg, Presence):
            (self.online.add if msg.online else self.online.discard)(inc.sender)
        elif isinstance(msg, Update):
            self._arrivals.append(time.time())
            got, sending = msg.metrics.get("bench_got_at"), msg.metrics.get("bench_send_at")
            if got is not None and sending is not None:
                self._agent_stamps.append((got, sending))
            self.updates.put_nowait(msg)

    async def _on_stream(self, events: list[StreamEvent]) -> None:
        """As the coordinator daemon does: each part folded into the round's sum when it
        arrives (there through the round machine's queue, here directly)."""
        for ev in events:
            if isinstance(ev, UpdateHead):
                self._heads[(ev.sender, ev.tid)] = ev
            elif isinstance(ev, UpdatePart):
                if self._acc is not None and (ev.sender, ev.tid) in self._heads:
                    self._acc.fold(ev.name, ev.start, ev.values, ev.indices, 1.0, delta=ev.delta)
            elif isinstance(ev, UpdateEnd):
                head = self._heads.pop((ev.sender, ev.tid), None)
                if head is None or not ev.ok:
                    self.lost.append(f"stream from {ev.sender} failed: {ev.reason}")
                    continue
                self._arrivals.append(time.time())
                got, sending = head.metrics.get("bench_got_at"), head.metrics.get("bench_send_at")
                if got is not None and sending is not None:
                    self._agent_stamps.append((got, sending))
                self.updates.put_nowait(
                    Update(round=head.round, base_version=head.base_version, num_samples=1, metrics={}, weights={})
                )

    async def _on_payload(self, topic: str, payload: bytes) -> None:
        if self._first_update_frame is None and topic.endswith("/update"):
            self._first_update_frame = time.time()
        await self.messenger.receive(topic, payload, self._deliver)

    async def start(self) -> None:
        ready = asyncio.Event()
        self.runner = asyncio.create_task(self.transport.run(self._on_payload, ready))
        await asyncio.wait_for(ready.wait(), 30)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for a in self.agents:
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.fed_agent",
                        "--uri",
                        self.bb.uri,
                        "--id",
                        a,
                        "--certs",
                        str(self.bb.certs),
                        "--ca",
                        str(self.bb.tls(a).ca),
                        "--chunk",
                        str(chunk_bytes()),
                        "--keepalive",
                        str(KEEPALIVE),
                    ],
                    env=env,
                    cwd=ROOT,
                )
            )
        deadline = time.monotonic() + 90
        while self.online != set(self.agents):
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"an agent process exited with {p.returncode} on start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {sorted(self.online)} came online")
            await asyncio.sleep(0.05)

    async def round(self, r: int, train: TrainConfig = LIKE_C) -> tuple[float, float, float]:
        """(seconds, CPU seconds of coordinator + agents, CPU seconds of the broker).
        ``train``: LIKE_C (whole float32 updates) or DEFAULTS (streamed, compressed)."""
        pids = [p.pid for p in self.procs]
        broker = [self.bb.broker.pid]
        c0, b0 = time.process_time() + proc_cpu(pids), proc_cpu(broker)
        own0 = time.process_time()
        self._first_update_frame = None
        self._arrivals, self._agent_stamps = [], []
        w0 = time.time()
        t0 = time.perf_counter()
        # float32 sums of the deltas, as the coordinator's round machine keeps them
        acc = WeightedMean(self.weights, compact=True)
        self._acc = acc if train.stream else None
        delta = None
        if train.stream and train.compression == "int8" and r > 1:
            # As the daemons do by default ([transfer] downlink): the model as the int8
            # step from the previous round start's, which every agent holds. This
            # bench's model does not move, so the step is zeros: the same bytes.
            _, delta = quantize_step(self.weights, dict(self.weights), base_version=r - 2)
        start = RoundStart(
            round=r,
            model_version=r - 1,
            selected=tuple(self.agents),
            deadline_s=600,
            train=train,
            weights=None if delta is not None else self.weights,
            delta=delta,
        )
        # stable: as the coordinator daemon sends it (its model is never changed in place).
        await self.messenger.send(topics.broadcast(FEDERATION, "round_start"), start, round_=r, stable=True)
        sent = time.time()
        got = 0
        deadline = time.monotonic() + ROUND_TIMEOUT
        while got < len(self.agents):
            try:
                u = await asyncio.wait_for(self.updates.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                # Reported as a round of ROUND_TIMEOUT seconds: it shows in the maximum.
                self.lost.append(
                    f"round {r}: {len(self.agents) - got} of {len(self.agents)} updates "
                    f"missing after {ROUND_TIMEOUT:.0f} s"
                )
                self.log(self.lost[-1])
                return ROUND_TIMEOUT, time.process_time() + proc_cpu(pids) - c0, proc_cpu(broker) - b0
            if u.round != r:
                continue
            if train.stream:
                acc.count_in(1.0)  # its parts are folded already (_on_stream)
            else:
                await asyncio.to_thread(self._fold, acc, u)
            got += 1
        self._acc = None
        mean = await asyncio.to_thread(acc.result)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() + proc_cpu(pids) - c0
        self._note_phases(w0, sent, time.time(), time.process_time() - own0, cpu)
        first = next(iter(self.weights))
        if not train.stream and not np.array_equal(mean[first], self.weights[first]):
            raise RuntimeError("the FedAvg mean of identical updates differs from them")
        # Streamed: each agent sent the model + BENCH_DELTA, quantised (int8: within half
        # a step of max|delta| / 127, plus float32 rounding of the weights).
        if train.stream and not np.allclose(mean[first], self.weights[first] + BENCH_DELTA, rtol=1e-6, atol=1e-4):
            raise RuntimeError("the FedAvg mean of identical streamed updates differs from them")
        return elapsed, cpu, proc_cpu(broker) - b0

    def _note_phases(self, w0: float, sent: float, end: float, own_cpu: float, cpu: float) -> None:
        """Where the round's time went, in seconds from its start (see docs/benchmarks.md):
        ``published`` the RoundStart's last chunk acknowledged by the broker; ``decoded``
        the last agent holding the decoded RoundStart; ``first_frame`` the first update
        frame at the coordinator; ``last_update`` the last update decoded there; ``end``
        the mean computed. ``coord_cpu``/``agents_cpu``: CPU seconds of each side."""
        stamps = self._agent_stamps
        self.phases = {
            "published": sent - w0,
            "decoded": max((g for g, _ in stamps), default=float("nan")) - w0,
            "first_frame": (self._first_update_frame or float("nan")) - w0,
            "last_update": max(self._arrivals, default=float("nan")) - w0,
            "end": end - w0,
            "coord_cpu": own_cpu,
            "agents_cpu": cpu - own_cpu,
        }

    def _fold(self, acc: WeightedMean, u: Update) -> None:
        check_update(self.weights, u.weights)
        acc.add(u.weights, u.num_samples)

    def payloads(self, work: Path) -> tuple[Path, Path]:
        """The encoded RoundStart and Update, as files for the C clients."""
        start = RoundStart(
            round=1,
            model_version=0,
            selected=tuple(self.agents),
            deadline_s=600,
            train=LIKE_C,
            weights=self.weights,
        )
        upd = Update(round=1, base_version=0, num_samples=1, metrics={}, weights=self.weights)
        down, up = work / "round_start.bin", work / "update.bin"
        for path, msg, sender in ((down, start, COORDINATOR), (up, upd, self.agents[0])):
            path.write_bytes(
                encode(
                    Envelope(
                        kind=msg.kind,
                        federation=FEDERATION,
                        sender=sender,
                        round=1,
                        seq=1,
                        ts=time.time(),
                        body=msg.to_body(),
                    )
                )
            )
        return down, up

    async def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, 10)
            except subprocess.TimeoutExpired:
                p.kill()
        await self.transport.close()
        if self.runner is not None:
            self.runner.cancel()
            try:
                await self.runner
            except (asyncio.CancelledError, Exception):
                pass


async def _measure(bb: BenchBroker, cc: CClients, params: int, repeats: int, work: Path, log) -> dict:
    fed = FedRounds(bb, params, log)
    try:
        await fed.start()
        down, up = fed.payloads(work)
        await fed.round(1)  # warm-up: connections, page cache
        await fed.round(2, DEFAULTS)  # and the agents' streamed update, made once
        await asyncio.to_thread(cc.round, down, up, fed.agents)
        res: dict[str, list[float]] = {
            k: []
            for k in (
                "fedagent",
                "c",
                "c_out",
                "c_in",
                "fed_cpu",
                "c_cpu",
                "fed_broker",
                "c_broker",
                "defaults",
                "defaults_cpu",
                "defaults_broker",
            )
        }
        for i in range(repeats):
            t, cpu, bcpu = await fed.round(2 * i + 3)
            for k, v in fed.phases.items():
                res.setdefault(f"phase_{k}", []).append(v)
            o, n, ccpu, cbcpu = await asyncio.to_thread(cc.round, down, up, fed.agents)
            dt, dcpu, dbcpu = await fed.round(2 * i + 4, DEFAULTS)
            res["defaults"].append(dt)
            res["defaults_cpu"].append(dcpu)
            res["defaults_broker"].append(dbcpu)
            for k, v in (
                ("fedagent", t),
                ("c", o + n),
                ("c_out", o),
                ("c_in", n),
                ("fed_cpu", cpu),
                ("c_cpu", ccpu),
                ("fed_broker", bcpu),
                ("c_broker", cbcpu),
            ):
                res[k].append(v)
            log(
                f"{mb(params)} round {i + 1}/{repeats}: fedagent {t:.2f} s (CPU {cpu:.2f} s, broker "
                f"{bcpu:.2f} s), C clients {o + n:.2f} s (fan-out {o:.2f} + fan-in {n:.2f}; CPU "
                f"{ccpu:.2f} s, broker {cbcpu:.2f} s)"
            )
            log(
                f"  fedagent with its defaults ({DEFAULT_MODE} updates, streamed): {dt:.2f} s "
                f"(CPU {dcpu:.2f} s, broker {dbcpu:.2f} s)"
            )
        return res | {"bytes": down.stat().st_size, "lost": fed.lost}
    finally:
        await fed.stop()


def _med(res: dict, key: str) -> float:
    return summary(res[key])[0] if res.get(key) else float("nan")


def phase_note(res: dict) -> str:
    """fedagent's rounds split by phase (medians, seconds from the round's start)."""
    return (
        f"fedagent at (median): RoundStart published {_med(res, 'phase_published'):.2f} s, "
        f"decoded by the last agent {_med(res, 'phase_decoded'):.2f} s, first update frame "
        f"{_med(res, 'phase_first_frame'):.2f} s, last update {_med(res, 'phase_last_update'):.2f} s, "
        f"mean {_med(res, 'phase_end'):.2f} s"
    )


@section("round", rows=lambda ctx: 5 * len(round_sizes(ctx)))
def fedavg_round(ctx: Context, agents: int = AGENTS) -> list[Row]:
    rows = []
    with bench_broker(ctx, ctx.work / "round", agents) as bb:
        cc = CClients(bb, ctx.work)
        for params in round_sizes(ctx):
            res = asyncio.run(_measure(bb, cc, params, ctx.repeats, ctx.work, ctx.log))
            ours_med, ours_max = summary(res["fedagent"])
            c_med, c_max = summary(res["c"])
            ctx.shared[("fedagent_round", params)] = res["fedagent"]
            # What the flower section compares with Flower: fedagent as installed.
            ctx.shared[("fedagent_round_defaults", params)] = res["defaults"]
            for what in res["lost"]:
                ctx.shared.setdefault("failures", []).append(f"fedagent {mb(params)} {what}")
            rows.append(
                Row(
                    "round",
                    f"fedagent FedAvg round, TLS, {agents} agents, {mb(params)} (median)",
                    ours_med,
                    "mosquitto_pub/sub fan-out + fan-in (median)",
                    c_med,
                    note=f"target <= {round_target(params)}x; max {ours_max:.2f} s vs {c_max:.2f} s; n={len(res['c'])}; "
                    f"C fan-out {summary(res['c_out'])[0]:.2f} s, fan-in {summary(res['c_in'])[0]:.2f} s; "
                    + phase_note(res),
                )
            )
            rows.append(
                Row(
                    "round",
                    f"fedagent FedAvg round, TLS, {agents} agents, {mb(params)} (max)",
                    ours_max,
                    "mosquitto_pub/sub fan-out + fan-in (max)",
                    c_max,
                )
            )
            # CPU time is far less disturbed than wall time by other work on the machine.
            rows.append(
                Row(
                    "round",
                    f"CPU of coordinator + {agents} agents per round, {mb(params)} (median)",
                    summary(res["fed_cpu"])[0],
                    "CPU of the mosquitto_pub/sub processes (median)",
                    summary(res["c_cpu"])[0],
                    note="client side only; excludes the broker; coordinator "
                    f"{_med(res, 'phase_coord_cpu'):.2f} s + agents {_med(res, 'phase_agents_cpu'):.2f} s",
                )
            )
            rows.append(
                Row(
                    "round",
                    f"broker CPU per fedagent round, {mb(params)} (median)",
                    summary(res["fed_broker"])[0],
                    "broker CPU per C-client round (median)",
                    summary(res["c_broker"])[0],
                    note="the same Mosquitto process",
                )
            )
            d_med, d_max = summary(res["defaults"])
            rows.append(
                Row(
                    "round",
                    f"fedagent FedAvg round with its defaults ({DEFAULT_MODE} updates, streamed), TLS, "
                    f"{agents} agents, {mb(params)} (median)",
                    d_med,
                    "the same round with whole float32 updates (median)",
                    ours_med,
                    note=f"max {d_max:.2f} s; n={len(res['defaults'])}; CPU of coordinator + agents "
                    f"{summary(res['defaults_cpu'])[0]:.2f} s vs {summary(res['fed_cpu'])[0]:.2f} s, broker "
                    f"{summary(res['defaults_broker'])[0]:.2f} s vs {summary(res['fed_broker'])[0]:.2f} s; "
                    "the rows against Flower use this round",
                )
            )
    return rows
