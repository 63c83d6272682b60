"""Flower on the same shape as fedagent's round benchmark: FedAvg, 10 clients, the
same tensors, training off, a real multi-process deployment on loopback.

Flower runs from its own virtualenv (``bench/.venv-flower``, made on first use with
the pinned release below), so its dependencies never meet fedagent's.

Modes:
* ``grpc``: the deprecated ``start_server`` + ``start_client`` deployment (its
  fastest), without TLS and with TLS (our federation CA and broker certificate).
* ``deployment``: the current one (SuperLink + SuperNodes + ``flwr run``), see
  bench/flower_app/deployment.py.

Rows compare fedagent's TLS round (measured by the ``round`` section in this run) with
Flower's: a ratio below 1 means fedagent is faster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.env import mb, model_sizes
from bench.procs import ProcessTree
from bench.registry import Context, Row, section, summary

HERE = Path(__file__).resolve().parent
APP = HERE / "flower_app"
VENV = HERE / ".venv-flower"
FLWR_VERSION = "1.41.0"
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_grpc(
    py: Path,
    work: Path,
    params: int,
    rounds: int,
    tls: tuple[Path, Path, Path] | None,
    timeout: float,
    clients: int = CLIENTS,
) -> list[float]:
    """Round times of one start_server run with ``clients`` start_client processes; the
    first round (clients still connecting) is dropped."""
    port = _free_port()
    out = work / f"flower-grpc-{params}-{port}.json"
    server_cmd = [
        str(py),
        str(APP / "grpc_server.py"),
        "--port",
        str(port),
        "--clients",
        str(clients),
        "--params",
        str(params),
        "--rounds",
        str(rounds + 1),
        "--out",
        str(out),
    ]
    client_cmd = [str(py), str(APP / "grpc_client.py"), "--port", str(port)]
    if tls is not None:
        server_cmd += ["--tls", *map(str, tls)]
        client_cmd += ["--ca", str(tls[0])]
    with open(work / f"flower-grpc-{port}.log", "wb") as logf, ProcessTree() as tree:
        server = tree.spawn(server_cmd, stdout=logf, stderr=subprocess.STDOUT)
        time.sleep(0.5)  # clients retry their connection; this only avoids noise
        for _ in range(clients):
            tree.spawn(client_cmd, stdout=logf, stderr=subprocess.STDOUT)
        server.wait(timeout=timeout)
        if server.returncode != 0:
            raise RuntimeError(f"Flower server exited {server.returncode}; see {logf.name}")
        times = json.loads(out.read_text())["times"]
        if len(times) != rounds + 1:
            raise RuntimeError(f"Flower ran {len(times)} rounds, not {rounds + 1}")
        return times[1:]


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


def run_deployment(
    py: Path, work: Path, params: int, rounds: int, timeout: float, log, clients: int = CLIENTS
) -> list[float]:
    """Round times of Flower's current deployment: one SuperLink, ``clients`` SuperNodes
    (each starting a ClientApp process per message), the app submitted with
    ``flwr run``; the first round is dropped, as in the gRPC mode."""
    import shutil

    bindir = py.parent
    home = work / f"flwr-home-{params}"
    home.mkdir(parents=True, exist_ok=True)
    app = work / f"flwr-app-{params}"
    if app.exists():
        shutil.rmtree(app)
    shutil.copytree(APP / "deploy", app)
    link = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    out = work / f"flower-deploy-{params}.json"
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    logf = open(work / f"flower-deploy-{params}.log", "wb")
    # Every process of the deployment, also the ones Flower starts itself (SuperExec,
    # flwr-serverapp, ClientApps), ends with this block, by PID: on success, on an
    # error and on KeyboardInterrupt (bench/run.py turns SIGTERM into one).
    with logf, ProcessTree() as tree:
        # Without this flag the SuperLink builds a fresh environment per run with uv
        # (15 s here); the app needs nothing beyond this virtualenv.
        superlink = tree.spawn(
            [
                str(bindir / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(link),
                "--disable-runtime-dependency-installation",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
        _wait_port(link, time.monotonic() + 120, superlink, "flower-superlink")
        for _ in range(clients):
            tree.spawn(
                [
                    str(bindir / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{link}",
                    "--port",
                    str(_free_port()),
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=work,
            )
        cfg = f'params={params} rounds={rounds + 1} clients={clients} out="{out}"'
        run = tree.spawn(
            [str(bindir / "flwr"), "run", str(app), "bench", "--stream", "--run-config", cfg],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
        if run.wait(timeout=timeout) != 0:
            raise RuntimeError(f"flwr run exited {run.returncode}; see {logf.name}")
        deadline = time.monotonic() + timeout
        while True:
            tree.sweep()
            times = json.loads(out.read_text())["times"] if out.exists() else []
            if len(times) == rounds + 1:
                return times[1:]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Flower deployment finished {len(times)} of {rounds + 1} rounds "
                    f"in {timeout:.0f} s; see {logf.name}"
                )
            time.sleep(0.5)


def server_tls(d: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate, key) for Flower's TLS mode, from fedagent's own CA code
    (ECDSA P-256, SAN 127.0.0.1, as the broker's)."""
    from fedagent import pki

    pki.create_ca(d / "ca", "flowerbench")
    cert, key = pki.issue(d / "ca", d / "certs", "flower-server", "broker", sans=["127.0.0.1"])
    return d / "ca" / pki.CA_CERT, cert, key


def _ours(ctx: Context, params: int) -> list[float] | None:
    return ctx.shared.get(("fedagent_round", params))


def _expected_rows(ctx: Context) -> int:
    """One row per model size and Flower mode (gRPC without TLS; with TLS and deployment
    mode unless --quick). Each is a ratio to the ``round`` section's fedagent round, so
    a run of ``flower`` without ``round`` measures none of them and fails."""
    return len(model_sizes(ctx)) * (1 if ctx.quick else 3)


@section("flower", rows=_expected_rows)
def flower(ctx: Context) -> list[Row]:
    py = flower_python(ctx.log)
    version = subprocess.run(
        [str(py), "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = []
    tls = server_tls(ctx.work / "flower-pki")
    for params in model_sizes(ctx):
        ours = _ours(ctx, params)
        if ours is None:
            ctx.log("no fedagent round in this run (run the round section too): Flower rows have no ratio")
        modes = [("gRPC start_server/start_client, no TLS", None)]
        if not ctx.quick:
            modes.append(("gRPC start_server/start_client, TLS", tls))
        for label, cert in modes:
            times = run_grpc(py, ctx.work, params, ctx.repeats, cert, timeout=600)
            med, mx = summary(times)
            ctx.log(f"Flower {version} {label}, {mb(params)}: median {med:.2f} s, max {mx:.2f} s")
            ctx.shared[("flower", label, params)] = times
            if ours is not None:
                o_med, o_max = summary(ours)
                rows.append(
                    Row(
                        "flower",
                        f"fedagent TLS round, {mb(params)} (median)",
                        o_med,
                        f"Flower {version} {label} (median)",
                        med,
                        note=f"target <= 0.67x; max {o_max:.2f} s vs {mx:.2f} s; n={len(times)}",
                    )
                )
    if ctx.quick:
        ctx.log("--quick: Flower's deployment mode (SuperLink + SuperNodes + flwr run) skipped")
        return rows
    for params in model_sizes(ctx):
        rounds = min(ctx.repeats, 3)  # about a minute per round: a few are enough
        label = "SuperLink + SuperNodes + flwr run, no TLS"
        try:
            times = run_deployment(py, ctx.work, params, rounds, timeout=300 + 120 * rounds, log=ctx.log)
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            ctx.log(f"Flower {version} {label}, {mb(params)}: did not complete: {exc}")
            ctx.shared.setdefault("failures", []).append(f"Flower {label}, {mb(params)}: {exc}")
            continue
        med, mx = summary(times)
        ctx.log(f"Flower {version} {label}, {mb(params)}: median {med:.2f} s, max {mx:.2f} s")
        ours = _ours(ctx, params)
        if ours is not None:
            o_med, o_max = summary(ours)
            rows.append(
                Row(
                    "flower",
                    f"fedagent TLS round, {mb(params)} (median)",
                    o_med,
                    f"Flower {version} {label} (median)",
                    med,
                    note=f"target <= 0.1x; max {o_max:.2f} s vs {mx:.2f} s; n={len(times)}",
                )
            )
    return rows
