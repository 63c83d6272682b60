"""Flower on the same shape as fedagent's round benchmark: FedAvg, 10 clients, the
same tensors, training off, a real multi-process deployment on loopback.

Flower runs from its own virtualenv (``bench/.venv-flower``, made on first use with
the pinned release below), so its dependencies never meet fedagent's.

Flower is run the way its documentation recommends for a deployment: one SuperLink,
one SuperNode per client and the app submitted with ``flwr run`` (bench/flower_app/deploy/),
over its HTTP transport. With TLS (the default here, :func:`server_tls`) the SuperLink
serves every API over HTTPS with a certificate of our CA, and the SuperNodes and the
``flwr`` CLI verify it (``--root-certificates``, ``root-certificates``); Flower has no
client certificates, so unlike fedagent's mutual TLS only the server is authenticated.
The same deployment without TLS (``--insecure``) is measured too, unless --quick.
The ``start_server``/``start_client`` gRPC mode that earlier runs measured (Flower
1.41) is deprecated since Flower 1.13 and its gRPC services are gone in 1.43: it is
not measured any more.

The ``secagg`` section calls :func:`secaggplus_rows` to run FedAvg under Flower's
SecAgg+ workflow in the same deployment (bench/flower_app/secaggplus/), with TLS,
behind byte-counting relays.

Rows compare fedagent's TLS round with its defaults (measured by the ``round`` section
in this run: updates streamed and int8-compressed, the model broadcast as int8 steps)
with Flower's with its defaults (float32 both ways): a ratio below 1 means fedagent is
faster.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.env import mb, model_sizes
from bench.procs import ProcessTree
from bench.registry import Context, Row, section, summary
from fedagent.protocols.compression import DEFAULT_MODE

if TYPE_CHECKING:
    from fedagent.protocols.secagg import SecAggParams

HERE = Path(__file__).resolve().parent
APP = HERE / "flower_app"
VENV = HERE / ".venv-flower"
#: The newest release the package index served when the bench moved to it (checked with
#: ``pip index versions flwr``); the apps' pyproject.toml files pin the same one.
FLWR_VERSION = "1.42.0"
CLIENTS = 10


def flower_python(log) -> Path:
    py = VENV / "bin" / "python"
    stamp = VENV / f".flwr-{FLWR_VERSION}"
    if not stamp.exists():
        log(f"installing flwr=={FLWR_VERSION} into {VENV} (once)")
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"flwr=={FLWR_VERSION}", "numpy"], check=True)
        stamp.touch()
    return py


def flower_version(py: Path) -> str:
    return subprocess.run(
        [str(py), "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, deadline: float, proc: subprocess.Popen, what: str) -> None:
    import socket

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} on start-up")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {port} in time") from None
            time.sleep(0.2)


#: (CA certificate, server certificate, server key) for a TLS deployment; None: --insecure
TLS = tuple[Path, Path, Path]


def deployment_dirs(
    py: Path, work: Path, src: Path, tag: str, tls: TLS | None = None
) -> tuple[Path, int, dict[str, str]]:
    """A fresh copy of the Flower app ``src`` (``work/flwr-app-TAG``), a Flower home whose
    default SuperLink is a free loopback port, and the environment that runs Flower's
    commands of ``py``'s virtualenv with that home: (app, port, env). With ``tls`` the
    ``flwr`` CLI verifies the SuperLink's certificate against ``tls[0]``, the CA."""
    import shutil

    home = work / f"flwr-home-{tag}"
    home.mkdir(parents=True, exist_ok=True)
    app = work / f"flwr-app-{tag}"
    shutil.rmtree(app, ignore_errors=True)
    shutil.copytree(src, app)
    link = _free_port()
    (home / "config.toml").write_text(superlink_config(link, tls))
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return app, link, env


def superlink_config(port: int, tls: TLS | None) -> str:
    """The ``flwr`` CLI's config.toml naming the SuperLink on ``port`` as its default."""
    trust = f'root-certificates = "{tls[0]}"' if tls is not None else "insecure = true"
    return f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\n{trust}\n'


def superlink_command(py: Path, link: int, tls: TLS | None, *extra: str) -> list[str]:
    """``flower-superlink`` serving all its APIs (Fleet, Control, Runtime) on ``link``,
    over HTTPS with the certificate and key of ``tls`` (``--insecure`` without).
    Without ``--disable-runtime-dependency-installation`` it builds a fresh environment
    per run with uv (15 s here); the apps need nothing beyond this virtualenv."""
    security = (
        ["--ssl-ca-certfile", str(tls[0]), "--ssl-certfile", str(tls[1]), "--ssl-keyfile", str(tls[2])]
        if tls is not None
        else ["--insecure"]
    )
    return [
        str(py.parent / "flower-superlink"),
        *security,
        *extra,
        "--host",
        "127.0.0.1",
        "--port",
        str(link),
        "--disable-runtime-dependency-installation",
    ]


def supernode_command(py: Path, link: int, tls: TLS | None, partition: int | None = None) -> list[str]:
    """``flower-supernode`` connecting to the SuperLink's Fleet API at ``link``, checking
    its certificate against the CA of ``tls`` (``--insecure`` without). Its own Runtime
    API, which only its ClientApp processes on the same machine use, stays plain HTTP,
    Flower's default: fedagent's agents have no such link to pay for."""
    security = ["--root-certificates", str(tls[0])] if tls is not None else ["--insecure"]
    return [
        str(py.parent / "flower-supernode"),
        *security,
        "--superlink",
        f"127.0.0.1:{link}",
        "--port",
        str(_free_port()),
        *(["--node-config", f"partition-id={partition}"] if partition is not None else []),
    ]


def spawn_superlink(
    tree: ProcessTree,
    py: Path,
    link: int,
    logf: Any,
    env: dict[str, str],
    work: Path,
    *extra: str,
    tls: TLS | None = None,
) -> subprocess.Popen:
    """Start a SuperLink on ``link`` (``extra``: more of its options) and wait for its port."""
    superlink = tree.spawn(
        superlink_command(py, link, tls, *extra), stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=work
    )
    _wait_port(link, time.monotonic() + 120, superlink, "flower-superlink")
    return superlink


def spawn_supernodes(
    tree: ProcessTree,
    py: Path,
    link: int,
    clients: int,
    logf: Any,
    env: dict[str, str],
    work: Path,
    *,
    partitions: bool = False,
    tls: TLS | None = None,
) -> None:
    """Start ``clients`` SuperNodes connecting to the SuperLink's fleet port ``link``
    (``partitions``: each told its ``partition-id``, 0 to clients - 1)."""
    for i in range(clients):
        tree.spawn(
            supernode_command(py, link, tls, i if partitions else None),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )


def spawn_flwr_run(
    tree: ProcessTree, py: Path, app: Path, cfg: str, logf: Any, env: dict[str, str], work: Path
) -> subprocess.Popen:
    """Submit ``app`` with run config ``cfg`` (``flwr run --stream``: returns when the run ends)."""
    return tree.spawn(
        [str(py.parent / "flwr"), "run", str(app), "bench", "--stream", "--run-config", cfg],
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=work,
    )


def run_deployment(
    py: Path,
    work: Path,
    params: int,
    rounds: int,
    timeout: float,
    log,
    clients: int = CLIENTS,
    tls: TLS | None = None,
) -> list[float]:
    """Round times of Flower's deployment: one SuperLink, ``clients`` SuperNodes (each
    starting a ClientApp process per message), the app submitted with ``flwr run``,
    with TLS when ``tls`` is given; the first round (the processes still starting) is
    dropped."""
    tag = f"{params}-{'tls' if tls else 'plain'}"
    app, link, env = deployment_dirs(py, work, APP / "deploy", tag, tls)
    out = work / f"flower-deploy-{tag}.json"
    out.unlink(missing_ok=True)
    logf = open(work / f"flower-deploy-{tag}.log", "wb")
    watch = LogWatch(Path(logf.name))
    what = f"Flower deployment{' (TLS)' if tls else ''}, {params} params"
    # Every process of the deployment, also the ones Flower starts itself (SuperExec,
    # flwr-serverapp, ClientApps), ends with this block, by PID: on success, on an
    # error and on KeyboardInterrupt (bench/run.py turns SIGTERM into one).
    with logf, ProcessTree() as tree:
        spawn_superlink(tree, py, link, logf, env, work, tls=tls)
        spawn_supernodes(tree, py, link, clients, logf, env, work, tls=tls)
        cfg = f'params={params} rounds={rounds + 1} clients={clients} out="{out}"'
        run = spawn_flwr_run(tree, py, app, cfg, logf, env, work)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            tree.sweep()
            times = read_result(out)["times"]
            if len(times) > seen:
                log(f"{what}: round {len(times)} of {rounds + 1}: {times[-1]:.1f} s")
                seen = len(times)
            if len(times) == rounds + 1:
                return times[1:]
            if run.poll() is not None or watch.fatal():
                # The run ended (the app raises when a round lost a reply) or failed.
                times = read_result(out)["times"]
                if len(times) == rounds + 1:
                    return times[1:]
                raise RuntimeError(
                    f"Flower's run failed after {len(times)} of {rounds + 1} rounds"
                    f"{_flower_error(logf.name)}; see {logf.name}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Flower deployment finished {len(times)} of {rounds + 1} rounds "
                    f"in {timeout:.0f} s; see {logf.name}"
                )
            time.sleep(0.5)


def read_result(path: Path) -> dict[str, Any]:
    """The round times a Flower app has written so far (``{"times": []}`` before its
    first). The apps replace the file whole (a temporary file renamed over it), so a
    read sees one version or the other; a file that does not parse is taken as not yet
    written rather than failing the run."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"times": []}


#: What Flower logs (1.41 and 1.42) when a round lost a client's reply, most telling first: a
#: ClientApp that did not claim its task within the SuperNode's heartbeat window (30 s),
#: one whose upload stalled past its HTTP client's 30 s timeout (``ClientDisconnect``;
#: both seen on a machine loaded far beyond its cores), and what the ServerApp then
#: reports.
FLOWER_ERRORS = (
    "task-token authentication failed",
    "ClientApp crashed",
    "ClientDisconnect",
    "Insufficient available nodes",
    "replies of",
    "results of",
    "Traceback",
)


#: Lines after which a Flower run cannot give all its rounds: the ServerApp has exited
#: with an error (its last status update may fail too, and then ``flwr run --stream``
#: never returns), or SecAgg+ gave a round up because a client's reply was lost (the
#: workflow logs it and goes on to the next round without aggregating).
FLOWER_FATAL = (
    b"ServerApp raised an exception",
    b"An unhandled exception occurred in the ServerApp",
    b"Secure aggregation halted",
)


class LogWatch:
    """Reads a growing Flower log from where it left off and says whether a line of
    :data:`FLOWER_FATAL` has appeared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0

    def fatal(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(max(self.pos - 100, 0))  # a marker may straddle two reads
                data = f.read()
        except OSError:
            return False
        self.pos = max(self.pos - 100, 0) + len(data)
        return any(m in data for m in FLOWER_FATAL)


def _flower_error(log_path: str) -> str:
    """``: <first known error line>`` from a Flower run's log, or ``""``."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for needle in FLOWER_ERRORS:
        for line in lines:
            if needle in line:
                return ": " + re.sub(r"\x1b\[[0-9;]*m", "", line).strip()[:300]  # (without colours)
    return ""


def server_tls(d: Path) -> TLS:
    """(CA, server certificate, key) for Flower's TLS mode, from fedagent's own CA code
    (ECDSA P-256, SAN 127.0.0.1, as the broker's)."""
    from fedagent.security import pki

    pki.create_ca(d / "ca", "flowerbench")
    cert, key = pki.issue(d / "ca", d / "certs", "flower-server", "broker", sans=["127.0.0.1"])
    return d / "ca" / pki.CA_CERT, cert, key


def _ours(ctx: Context, params: int) -> list[float] | None:
    """fedagent's round with its defaults (the round section's DEFAULTS rounds)."""
    return ctx.shared.get(("fedagent_round_defaults", params))


#: Flower's deployment with TLS (how its documentation has it run) and, unless --quick,
#: without (its ``--insecure`` prototyping set-up, what the earlier Flower rows measured):
#: (label, with TLS)
MODES = (("SuperLink + SuperNodes + flwr run, TLS", True), ("SuperLink + SuperNodes + flwr run, no TLS", False))


def modes(ctx: Context) -> tuple[tuple[str, bool], ...]:
    return MODES[:1] if ctx.quick else MODES


def _expected_rows(ctx: Context) -> int:
    """Two rows (median, max) per model size and Flower mode (:func:`modes`). Each is a
    ratio to the ``round`` section's fedagent round, so a run of ``flower`` without
    ``round`` measures none of them and fails."""
    return 2 * len(model_sizes(ctx)) * len(modes(ctx))


def deployment_timeout(params: int, rounds: int) -> float:
    """How long a deployment-mode run of ``rounds`` + 1 rounds may take before it counts
    as failed: start-up (SuperLink, SuperNodes, the app's FAB) plus a per-round
    allowance that grows with the model. Each round carries the model six times through
    Flower's Python processes (ServerApp, SuperLink, SuperNode, ClientApp and back),
    hashing every object, and starts ten ClientApp processes: 33 s a round at 44.8 MB on
    an idle 2-core machine (Flower 1.41), 5-10x that at a load of 20. The allowance is
    90 s plus 10 s per MB of model a round (538 s at 44.8 MB, 134 s at 4.4 MB)."""
    return 300 + (rounds + 1) * (90 + 10 * params * 4 / 1e6)


def _pair(label: str, version: str, size: str, ours: list[float], theirs: list[float], target: str) -> list[Row]:
    """A median row and a max row: fedagent's TLS round against one Flower mode."""
    o_med, o_max = summary(ours)
    med, mx = summary(theirs)
    n = f"n={len(ours)} vs {len(theirs)}"
    return [
        Row(
            "flower",
            f"fedagent TLS round, defaults ({DEFAULT_MODE} updates), {size} (median)",
            o_med,
            f"Flower {version} {label} (median)",
            med,
            note=f"target {target}; {n}",
        ),
        Row(
            "flower",
            f"fedagent TLS round, defaults ({DEFAULT_MODE} updates), {size} (max)",
            o_max,
            f"Flower {version} {label} (max)",
            mx,
            note=f"target {target}; {n}",
        ),
    ]


@section("flower", rows=_expected_rows)
def flower(ctx: Context) -> list[Row]:
    py = flower_python(ctx.log)
    version = flower_version(py)
    rows: list[Row] = []
    cert = server_tls(ctx.work / "flower-pki")
    if ctx.quick:
        ctx.log("--quick: Flower's deployment without TLS skipped")
    for params in model_sizes(ctx):
        ours = _ours(ctx, params)
        if ours is None:
            ctx.log("no fedagent round in this run (run the round section too): Flower rows have no ratio")
        for label, with_tls in modes(ctx):
            rounds = ctx.repeats
            timeout = deployment_timeout(params, rounds)
            tls = cert if with_tls else None
            try:
                times = run_deployment(py, ctx.work, params, rounds, timeout=timeout, log=ctx.log, tls=tls)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                ctx.log(f"Flower {version} {label}, {mb(params)}: did not complete: {exc}")
                ctx.shared.setdefault("failures", []).append(f"Flower {label}, {mb(params)}: {exc}")
                continue
            med, mx = summary(times)
            ctx.log(f"Flower {version} {label}, {mb(params)}: median {med:.2f} s, max {mx:.2f} s")
            ctx.shared[("flower", label, params)] = times
            if ours is not None:
                rows += _pair(label, version, mb(params), ours, times, "<= 0.1x")
    return rows


# ---- Flower SecAgg+ (rows of the ``secagg`` section) ------------------------------------
class ByteRelay:
    """A TCP relay on 127.0.0.1 in front of ``target_port`` that counts the bytes it
    carries, both directions together, with a (``time.monotonic``, running total) mark
    per transfer so the bytes of a time span (one round) can be read off afterwards.
    Bytes move with ``splice`` through a pipe (no copy into Python), so the relay costs
    little CPU next to what it measures."""

    CHUNK = 1 << 20

    def __init__(self, target_port: int) -> None:
        import socket

        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port: int = self.listener.getsockname()[1]
        self.total = 0
        self.connections = 0
        self._times: list[float] = [time.monotonic()]
        self._totals: list[int] = [0]
        self._lock = threading.Lock()
        self._socks: list = []
        self._closed = False
        threading.Thread(target=self._accept, name=f"relay-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        import fcntl
        import socket

        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, self.CHUNK)  # F_SETPIPE_SZ (best effort)
        except OSError:
            pass
        try:
            while True:
                n = os.splice(src.fileno(), w, self.CHUNK)
                if n == 0:
                    break
                left = n
                while left:
                    left -= os.splice(r, dst.fileno(), left)
                with self._lock:
                    self.total += n
                    self._times.append(time.monotonic())
                    self._totals.append(self.total)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def bytes_between(self, t0: float, t1: float) -> int:
        """Bytes carried from monotonic time ``t0`` to ``t1`` (to the marks at or before each)."""
        with self._lock:
            i0 = bisect_right(self._times, t0) - 1
            i1 = bisect_right(self._times, t1) - 1
            return self._totals[max(i1, 0)] - self._totals[max(i0, 0)]

    def close(self) -> None:
        import socket

        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        for s in (self.listener, *socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self) -> ByteRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tree_cpu(pids) -> float:
    """CPU seconds (user + system, with those of reaped children) of the live processes
    ``pids``: a ClientApp that has ended counts once its parent has reaped it."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    return total / tick


def secaggplus_config(sp: SecAggParams, clients: int) -> dict[str, float | int]:
    """Flower SecAggPlusWorkflow settings for fedagent's SecAggParams ``sp`` and
    ``clients`` agents: the same share holders, threshold, clipping range and
    quantisation levels, the same modulus (2³²). What does not map is stated in
    docs/benchmarks.md ("Flower SecAgg+")."""
    from fedagent.protocols.secagg import MODULUS_BITS

    k = sp.neighbours or 2 * math.ceil(math.log2(clients))
    holders = min(k, clients - 1) + 1  # fedagent: itself and its neighbours
    return {
        # Flower: a node's neighbourhood, itself included, is num_shares wide (odd).
        "num-shares": holders if holders % 2 or holders == clients else holders + 1,
        "threshold": sp.threshold_of(holders),
        "clip": float(sp.clip),
        # Flower maps [-clip, clip] onto [0, quantization_range]; fedagent onto 2^bits levels.
        "quantization-range": 1 << sp.bits,
        "modulus-range": 1 << MODULUS_BITS,
    }


def run_secaggplus(
    py: Path,
    work: Path,
    params: int,
    rounds: int,
    config: dict[str, float | int],
    timeout: float,
    clients: int = CLIENTS,
    tls: TLS | None = None,
) -> dict[str, list]:
    """Rounds of FedAvg under Flower's SecAgg+ workflow in its deployment mode (with TLS
    when ``tls`` is given; the relays pass it through untouched): one
    SuperLink, ``clients`` SuperNodes (a ClientApp process per message, so per SecAgg+
    stage), the app submitted with ``flwr run``. The SuperNodes reach the SuperLink
    through one :class:`ByteRelay` ("fleet": the clients' links) and the ServerApp
    through another ("serverapp": the coordinator's link; the SuperLink runs with
    ``--isolation process`` so that the SuperExec that starts the ServerApp can be
    pointed at the relay). Returns per round (the first, warm-up, dropped): seconds,
    fleet bytes, ServerApp bytes."""
    bindir = py.parent
    app, link, env = deployment_dirs(py, work, APP / "secaggplus", f"sa-{params}", tls)
    out = work / f"flower-secaggplus-{params}.json"
    out.unlink(missing_ok=True)
    logf = open(work / f"flower-secaggplus-{params}.log", "wb")
    watch = LogWatch(Path(logf.name))
    with logf, ProcessTree() as tree, ByteRelay(link) as fleet, ByteRelay(link) as server:
        spawn_superlink(tree, py, link, logf, env, work, "--isolation", "process", tls=tls)
        # What the SuperLink starts itself in its default (subprocess) isolation, but
        # connected through the relay.
        tree.spawn(
            [
                str(bindir / "flower-superexec"),
                *(["--root-certificates", str(tls[0])] if tls is not None else ["--insecure"]),
                "--runtime-api-address",
                f"127.0.0.1:{server.port}",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
        spawn_supernodes(tree, py, fleet.port, clients, logf, env, work, tls=tls)
        cfg = " ".join(
            f"{k}={json.dumps(v)}"
            for k, v in {**config, "params": params, "rounds": rounds + 1, "clients": clients, "out": str(out)}.items()
        )
        run = spawn_flwr_run(tree, py, app, cfg, logf, env, work)
        deadline = time.monotonic() + timeout
        cpu_t: list[float] = []
        cpu: list[float] = []
        while True:
            pids = tree.sweep()
            cpu_t.append(time.monotonic())
            cpu.append(tree_cpu(pids))
            res = read_result(out)
            if len(res["times"]) == rounds + 1:
                break
            if run.poll() is not None or watch.fatal():
                res = read_result(out)
                if len(res["times"]) == rounds + 1:
                    break
                failed = (
                    f"Flower's run failed after {len(res['times'])} of {rounds + 1} rounds{_flower_error(logf.name)}"
                )
                if len(res["times"]) < 2:  # not one measured round after the warm-up
                    raise RuntimeError(f"{failed}; see {logf.name}")
                # The rounds that did complete are measured; the rows say the run failed.
                res["partial"] = failed
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Flower SecAgg+ finished {len(res['times'])} of {rounds + 1} rounds in {timeout:.0f} s; see {logf.name}"
                )
            time.sleep(0.5)
        spans = res["spans"][1:]
        return {
            "times": res["times"][1:],
            "fleet_bytes": [fleet.bytes_between(a, b) for a, b in spans],
            "server_bytes": [server.bytes_between(a, b) for a, b in spans],
            "cpu": [
                cpu[min(bisect_right(cpu_t, b), len(cpu) - 1)] - cpu[max(bisect_right(cpu_t, a) - 1, 0)]
                for a, b in spans
            ],
            "max_error": [res["max_error"]],
            "partial": res.get("partial", ""),
        }


#: rows :func:`secaggplus_rows` adds per model size (the ``secagg`` section declares them)
SECAGGPLUS_ROWS = 4


def secaggplus_rows(ctx: Context, params: int, agents: int, sp: SecAggParams, ours: dict[str, list]) -> list[Row]:
    """The ``secagg`` section's Flower rows for one model size: fedagent's secure rounds
    as bench/secagg.py measured them in this run (``ours``: ``secure`` seconds,
    ``secure_bytes`` through its coordinator, ``secure_cpu`` of coordinator + agents)
    against FedAvg under Flower's SecAgg+ workflow with the same number of clients and
    the parameters :func:`secaggplus_config` maps from ``sp``, over ``ctx.repeats``
    rounds after a warm-up one. A run that does not finish is reported as not measured
    (bench/run.py then exits 1) and gives no rows."""
    py = flower_python(ctx.log)
    version = flower_version(py)
    config = secaggplus_config(sp, agents)
    rounds = ctx.repeats
    timeout = secaggplus_timeout(params, rounds)
    label = f"Flower {version} SecAgg+ (SuperLink + SuperNodes + flwr run, TLS)"
    tls = server_tls(ctx.work / f"flower-secaggplus-pki-{params}")
    try:
        res = run_secaggplus(py, ctx.work, params, rounds, config, timeout=timeout, clients=agents, tls=tls)
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        ctx.log(f"{label}, {mb(params)}: did not complete: {exc}")
        ctx.shared.setdefault("failures", []).append(f"{label}, {mb(params)}: {exc}")
        return []
    med, mx = summary(res["times"])
    fleet = summary(res["fleet_bytes"])[0]
    ctx.log(
        f"{label}, {mb(params)}: median {med:.2f} s, max {mx:.2f} s; ServerApp "
        f"{summary(res['server_bytes'])[0] / 1e6:.1f} MB, SuperNodes {fleet / 1e6:.1f} MB, "
        f"CPU {summary(res['cpu'])[0]:.1f} s per round (median)"
    )
    ctx.shared[("flower_secaggplus", params)] = res
    o_med, o_max = summary(ours["secure"])
    n = f"n={len(ours['secure'])} vs {len(res['times'])}"
    if res["partial"]:
        ctx.log(f"{label}, {mb(params)}: only {len(res['times'])} measured rounds: {res['partial']}")
        n += f" (Flower's completed rounds only: {res['partial']})"
    what = f"{agents} agents, {mb(params)}"
    return [
        Row(
            "secagg",
            f"fedagent secure round, TLS, {what} (median)",
            o_med,
            f"{label} (median)",
            med,
            note=f"goal < 1x; {n}; Flower: {config['num-shares']} shares, threshold {config['threshold']}",
        ),
        Row("secagg", f"fedagent secure round, TLS, {what} (max)", o_max, f"{label} (max)", mx, note=n),
        Row(
            "secagg",
            f"CPU of fedagent's coordinator + {agents} agents per secure round, {mb(params)} (median)",
            summary(ours["secure_cpu"])[0],
            "CPU of all Flower SecAgg+ processes per round (median)",
            summary(res["cpu"])[0],
            note="Flower's includes its SuperLink (the broker's part, not in fedagent's figure)",
        ),
        Row(
            "secagg",
            f"fedagent coordinator bytes per secure round, {what} (median)",
            summary(ours["secure_bytes"])[0],
            "Flower SecAgg+ ServerApp bytes per round, via a relay (median)",
            summary(res["server_bytes"])[0],
            unit="B",
            note=f"Flower's SuperNodes moved {fleet:.3g} B per round (all {agents} links)",
        ),
    ]


def secaggplus_timeout(params: int, rounds: int) -> float:
    """How long a Flower SecAgg+ run of ``rounds`` + 1 rounds may take: start-up plus a
    per-round allowance that grows with the model (each round moves it through four
    ClientApp processes per client)."""
    return 300 + (rounds + 1) * (120 + 8 * params * 4 / 1e6)
