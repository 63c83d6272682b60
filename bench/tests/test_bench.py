"""The benchmark entry command runs and prints a ratio table (no timing is asserted:
CI machines are too noisy for that; bench/run.py is for measuring)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.procs
def test_quick_codec_bench_prints_a_ratio_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "run.py"),
            "--quick",
            "--only",
            "codec",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ratio" in out.stdout
    # One row per measurement, each with a ratio printed as "N.NNx".
    ratios = re.findall(r"(\d+\.\d\d)x", out.stdout)
    assert len(ratios) == 2, out.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert [r["section"] for r in rows] == ["codec", "codec"]
    assert all(r["baseline"] == "memcpy" and r["baseline_value"] > 0 and r["value"] > 0 for r in rows)
    assert all(abs(r["ratio"] - r["value"] / r["baseline_value"]) < 1e-9 for r in rows)
    assert results["machine"]["cpus"]
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n") == 2 + len(rows)


@pytest.mark.procs
def test_unknown_section_is_refused():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--only", "nosuch"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "unknown section" in out.stderr and "codec" in out.stderr


# ---- a row that stops appearing fails the run ---------------------------------------------
def _run_fake(monkeypatch, tmp_path, rows, *, expected: int, not_measured: tuple[str, ...] = ()):
    """bench/run.py's main() with one registered section ``fake`` that returns ``rows``
    and declares ``expected``; returns (exit code, results.json)."""
    import signal

    from bench import registry
    from bench import run as bench_run

    def fake(ctx):
        for what in not_measured:
            ctx.shared.setdefault("failures", []).append(what)
        return list(rows)

    monkeypatch.setitem(registry.SECTIONS, "fake", fake)
    monkeypatch.setitem(registry.EXPECTED_ROWS, "fake", lambda ctx: expected)
    old = signal.getsignal(signal.SIGTERM)
    try:
        code = bench_run.main(["--only", "fake", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, old)
    return code, json.loads((tmp_path / "results.json").read_text())


def _row(value=1.0, baseline=2.0, subject="a thing"):
    from bench.registry import Row

    return Row("fake", subject, value, "the baseline", baseline)


@pytest.mark.procs
def test_run_exits_zero_when_every_declared_row_is_measured(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row(), _row(subject="another")], expected=2)
    assert code == 0, capsys.readouterr().out
    assert results["missing"] == [] and results["not_measured"] == [] and len(results["rows"]) == 2


@pytest.mark.procs
def test_run_exits_non_zero_when_a_declared_row_is_missing(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row()], expected=2)
    out = capsys.readouterr().out
    assert code == 1
    assert "MISSING: section fake: 1 of the 2 rows it should measure" in out
    assert results["missing"] == ["section fake: 1 of the 2 rows it should measure"]
    assert "Missing: section fake" in (tmp_path / "table.md").read_text()


@pytest.mark.procs
def test_run_exits_non_zero_for_a_row_that_is_not_a_measurement(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(monkeypatch, tmp_path, [_row(), _row(value=float("nan"), subject="broken")], expected=2)
    assert code == 1
    assert any("broken: value nan is not a measurement" in m for m in results["missing"]), results["missing"]
    code, results = _run_fake(monkeypatch, tmp_path, [_row(baseline=0.0), _row()], expected=2)
    assert code == 1 and any("baseline 0.0" in m for m in results["missing"]), results["missing"]


@pytest.mark.procs
def test_run_exits_non_zero_when_a_section_reports_a_case_not_measured(monkeypatch, tmp_path, capsys):
    code, results = _run_fake(
        monkeypatch, tmp_path, [_row(), _row()], expected=2, not_measured=("Flower deployment, 44.8 MB: timed out",)
    )
    assert code == 1
    assert "NOT MEASURED: Flower deployment, 44.8 MB: timed out" in capsys.readouterr().out
    assert results["not_measured"] == ["Flower deployment, 44.8 MB: timed out"]


def test_every_section_declares_the_rows_it_measures():
    import importlib

    from bench.registry import EXPECTED_ROWS, MODULES, SECTIONS, Context

    for mod in MODULES:
        importlib.import_module(mod)
    assert set(SECTIONS) == set(EXPECTED_ROWS) and len(SECTIONS) >= 9, sorted(SECTIONS)
    for quick in (False, True):
        ctx = Context(quick=quick, work=Path("."), repeats=1)
        for name, rows in EXPECTED_ROWS.items():
            assert rows(ctx) >= 1, (name, quick)


# ---- Flower helpers that need no Flower ------------------------------------------------------
def test_byte_relay_counts_both_directions_and_splits_by_time():
    """The relay that counts Flower SecAgg+'s bytes: everything sent through it arrives
    unchanged, both directions are counted, and bytes_between reads one span's bytes."""
    import socket
    import threading
    import time

    from bench.flower import ByteRelay

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    payload = bytes(range(256)) * 4096  # 1 MiB
    with ByteRelay(server.getsockname()[1]) as relay, socket.create_connection(("127.0.0.1", relay.port)) as c:
        t0 = time.monotonic()
        c.sendall(payload)
        got = bytearray()
        while len(got) < len(payload):
            got += c.recv(1 << 20)
        assert bytes(got) == payload
        deadline = time.monotonic() + 30
        while relay.total < 2 * len(payload) and time.monotonic() < deadline:
            time.sleep(0.01)
        t1 = time.monotonic()
        assert relay.total == 2 * len(payload) and relay.connections == 1
        assert relay.bytes_between(t0, t1) == 2 * len(payload)
        assert relay.bytes_between(t1, time.monotonic()) == 0
    server.close()


def test_secaggplus_config_maps_fedagent_parameters():
    """Flower's SecAgg+ settings from fedagent's: the same share holders (itself and its
    neighbours), threshold, clipping range, quantisation levels and modulus."""
    from bench.flower import secaggplus_config
    from fedagent.protocols.secagg import SecAggParams

    sp = SecAggParams()
    cfg = secaggplus_config(sp, 10)
    # 10 agents: 2*ceil(log2 10) = 8 neighbours, so 9 holders and 5 shares to rebuild.
    assert cfg == {
        "num-shares": 9,
        "threshold": 5,
        "clip": 1.0,
        "quantization-range": 2**20,
        "modulus-range": 2**32,
    }
    assert sp.threshold_of(9) == 5
    small = secaggplus_config(SecAggParams(clip=0.5, bits=16), 3)  # complete graph
    assert small["num-shares"] == 3 and small["threshold"] == 2 and small["clip"] == 0.5
    assert small["quantization-range"] == 2**16


def test_flower_limits_grow_with_the_model():
    from bench.flower import deployment_timeout, secaggplus_timeout

    for fn in (deployment_timeout, secaggplus_timeout):
        assert fn(11_200_000, 5) > fn(1_100_000, 5) > fn(1_100_000, 2)
    # The 11.2M deployment run of 5 + 1 rounds gets far more than the 660 s it used to.
    assert deployment_timeout(11_200_000, 5) >= 6 * 500


def test_flower_section_reports_a_deployment_run_that_fails(monkeypatch, tmp_path):
    """A deployment run that does not finish is NOT MEASURED (bench/run.py exits 1 on it)
    and its rows are missing; the others come in median/max pairs, TLS first."""
    from bench import flower
    from bench.registry import Context, check_rows

    cert = (tmp_path / "ca", tmp_path / "cert", tmp_path / "key")

    def deployment(py, work, params, rounds, timeout, log, clients=flower.CLIENTS, tls=None):
        assert rounds >= 5 and timeout == flower.deployment_timeout(params, rounds)
        if tls is None:
            raise RuntimeError(f"Flower deployment finished 2 of {rounds + 1} rounds in {timeout:.0f} s")
        assert tls == cert
        return [0.5, 0.7] * rounds

    monkeypatch.setattr(flower, "flower_python", lambda log: tmp_path / "python")
    monkeypatch.setattr(flower, "flower_version", lambda py: "1.42.0")
    monkeypatch.setattr(flower, "server_tls", lambda d: cert)
    monkeypatch.setattr(flower, "run_deployment", deployment)
    ctx = Context(quick=False, work=tmp_path, repeats=5, sizes=[11_200_000], log=lambda s: None)
    ctx.shared[("fedagent_round_defaults", 11_200_000)] = [0.2, 0.3, 0.25, 0.2, 0.4]
    rows = flower.flower(ctx)
    assert len(rows) == 2  # the TLS deployment, median and max
    assert [r.subject.rsplit(" ", 1)[1] for r in rows] == ["(median)", "(max)"]
    assert rows[0].baseline == "Flower 1.42.0 SuperLink + SuperNodes + flwr run, TLS (median)"
    assert rows[1].value == 0.4 and rows[1].baseline_value == 0.7
    assert "defaults (int8 updates)" in rows[0].subject  # fedagent as installed, and says so
    assert ctx.shared["failures"] == [
        "Flower SuperLink + SuperNodes + flwr run, no TLS, 11.2M params = 44.8 MB: "
        f"Flower deployment finished 2 of 6 rounds in {flower.deployment_timeout(11_200_000, 5):.0f} s"
    ]
    assert check_rows("flower", ctx, rows) == ["section flower: 2 of the 4 rows it should measure"]


def test_quick_flower_runs_the_tls_deployment_only(monkeypatch, tmp_path):
    from bench import flower
    from bench.registry import Context, check_rows

    seen = []
    monkeypatch.setattr(flower, "flower_python", lambda log: tmp_path / "python")
    monkeypatch.setattr(flower, "flower_version", lambda py: "1.42.0")
    monkeypatch.setattr(flower, "server_tls", lambda d: (d / "ca", d / "cert", d / "key"))
    monkeypatch.setattr(flower, "run_deployment", lambda *a, tls=None, **kw: seen.append(tls is not None) or [0.5, 0.6])
    ctx = Context(quick=True, work=tmp_path, repeats=2, sizes=[1_100_000], log=lambda s: None)
    ctx.shared[("fedagent_round_defaults", 1_100_000)] = [0.2, 0.3]
    rows = flower.flower(ctx)
    assert seen == [True]
    assert check_rows("flower", ctx, rows) == []


def test_flower_runs_with_tls_on_both_sides(tmp_path):
    """The SuperLink serves HTTPS with our certificate; the SuperNodes and the ``flwr``
    CLI trust our CA; nothing says ``--insecure``. Without TLS every part says it."""
    from bench import flower

    py = tmp_path / "bin" / "python"
    tls = (tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem")
    link = flower.superlink_command(py, 9093, tls)
    assert "--insecure" not in link
    for flag, path in zip(("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"), tls, strict=True):
        assert link[link.index(flag) + 1] == str(path)
    node = flower.supernode_command(py, 9093, tls, partition=3)
    assert "--insecure" not in node and node[node.index("--root-certificates") + 1] == str(tls[0])
    assert node[node.index("--superlink") + 1] == "127.0.0.1:9093"
    assert node[node.index("--node-config") + 1] == "partition-id=3"
    cli = flower.superlink_config(9093, tls)
    assert f'root-certificates = "{tls[0]}"' in cli and "insecure" not in cli
    assert "--insecure" in flower.superlink_command(py, 9093, None)
    assert "--insecure" in flower.supernode_command(py, 9093, None)
    assert "insecure = true" in flower.superlink_config(9093, None)


def test_flower_apps_pin_the_release_the_bench_installs():
    from bench import flower

    apps = sorted(flower.APP.rglob("pyproject.toml"))
    assert len(apps) == 3, apps
    for app in apps:
        assert f'"flwr=={flower.FLWR_VERSION}"' in app.read_text(), app


def test_a_failed_flower_run_names_flowers_error(tmp_path):
    from bench.flower import _flower_error

    log = tmp_path / "flower.log"
    log.write_text(
        "INFO : Start `flwr-clientapp` process\n"
        "ERROR : ServerApp raised: RuntimeError: round 2: 9 replies of 10\n"
        "\x1b[91mERROR \x1b[0m: Runtime task-token authentication failed.\n"
    )
    assert _flower_error(str(log)) == ": ERROR : Runtime task-token authentication failed."
    log.write_text("INFO : nothing wrong\n")
    assert _flower_error(str(log)) == ""
    assert _flower_error(str(tmp_path / "absent.log")) == ""


def test_log_watch_sees_a_serverapp_failure_once_it_is_logged(tmp_path):
    """A Flower run whose ServerApp failed may never end (``flwr run --stream`` waits for
    a status that was not delivered): the benchmark watches the log for it."""
    from bench.flower import LogWatch

    log = tmp_path / "flower.log"
    log.write_bytes(b"INFO : Start `flwr-clientapp` process\n" * 1000)
    watch = LogWatch(log)
    assert not watch.fatal() and not watch.fatal()
    with open(log, "ab") as f:
        f.write(b"ERROR :     ServerApp raised an exception\nTraceback (most recent call last):\n")
    assert watch.fatal()
    assert not LogWatch(tmp_path / "absent.log").fatal()
    # SecAgg+ gives a round up without raising; the round is lost all the same.
    halted = tmp_path / "halted.log"
    halted.write_bytes(b"ERROR :     Insufficient available nodes.\nINFO :      Secure aggregation halted.\n")
    assert LogWatch(halted).fatal()


def test_a_half_written_flower_result_counts_as_not_yet_written(tmp_path):
    """A loaded run once read the round times while the app was writing them and
    failed the whole section on the parse error."""
    from bench.flower import read_result

    out = tmp_path / "times.json"
    assert read_result(out) == {"times": []}
    out.write_text('{"times": [1.5, 2.')
    assert read_result(out) == {"times": []}
    out.write_text('{"times": [1.5, 2.5]}')
    assert read_result(out) == {"times": [1.5, 2.5]}
