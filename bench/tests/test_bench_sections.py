"""Every benchmark section still measures something (no timing is asserted).

The ``round`` section was broken for days once (its Messenger needed a signing identity)
and nothing noticed: a benchmark only runs when someone measures. Here each section's
own measuring function runs at a tiny size — the broker sections against the suite's
real Mosquitto with mutual TLS (a private one for federation ``bench``, with that
federation's CA) — and its rows must be well formed: a subject, a baseline, finite
values, positive wall times, the ratio being value / baseline.

What is not run here, and why:

* ``flower`` needs Flower, which lives in its own virtualenv (``bench/.venv-flower``,
  made by ``bench/flower.py`` with pip on first use; ``scripts/bootstrap.sh`` does not
  install it, so a fresh CI clone has no Flower, and installing it takes minutes of
  network and CPU). :func:`test_flower_section_tiny` runs its TLS deployment at a tiny
  size when that virtualenv exists and is marked ``slow``; in CI only the Flower apps
  are compiled.
* ``scale`` runs the same swarm federation (``bench.swarm``) as ``memory``,
  which runs here; ``compression`` uses no broker (the in-memory harness with real digits
  training, minutes of CPU); its wire path is tested in tests/protocols/test_streaming.py.
"""

from __future__ import annotations

import math
import py_compile
from pathlib import Path

import pytest

from bench.env import COORDINATOR, FEDERATION, BenchBroker
from bench.registry import Context, Row, check_rows
from fedagent.mosquitto import EmbeddedBroker
from fedagent.security import pki

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
TINY = 4096  # parameters: 16 KB of float32 in 16 tensors


@pytest.fixture
def bench_ctx(tmp_path):
    """A Context whose broker sections run on a private broker for federation ``bench``,
    with a CA of that federation (certificates name their federation, and the shared
    test CA's are ``testfed``'s)."""
    made: dict[str, BenchBroker] = {}
    ca_dir, certs = tmp_path / "bench-ca", tmp_path / "bench-certs"
    pki.create_ca(ca_dir, FEDERATION)
    pki.issue(ca_dir, certs, COORDINATOR, "coordinator")
    broker = EmbeddedBroker(
        tmp_path / "bench-broker", federations=[FEDERATION], coordinators=[COORDINATOR], ca_dir=ca_dir
    )

    def on_fixture(agents: int) -> BenchBroker:
        if not broker.running:
            broker.start()
        # BenchBroker issues the agents' certificates it misses.
        bb = BenchBroker(tmp_path / f"bb-{agents}", agents, external=broker, ca_dir=ca_dir, certs=certs)
        made[str(agents)] = bb
        return bb

    logs: list[str] = []
    ctx = Context(quick=True, work=tmp_path, repeats=1, sizes=[TINY], log=logs.append, broker=on_fixture)
    ctx.logs = logs  # type: ignore[attr-defined]  (for failure messages)
    try:
        yield ctx
    finally:
        broker.stop()


def well_formed(rows: list[Row], section: str, count: int, *, cpu_rows: tuple[str, ...] = (), ctx=None) -> None:
    assert len(rows) == count, rows
    if ctx is not None:
        # What bench/run.py checks: as many rows as the section declares, all measurements.
        assert check_rows(section, ctx, rows) == []
    for r in rows:
        assert r.section == section and r.subject and r.baseline, r
        assert math.isfinite(r.value) and math.isfinite(r.baseline_value), r
        if any(k in r.subject for k in cpu_rows):
            # CPU seconds are counted in clock ticks (10 ms): a tiny run may use none.
            assert r.value >= 0 and r.baseline_value >= 0, r
        else:
            assert r.value > 0 and r.baseline_value > 0, r
            assert r.ratio == pytest.approx(r.value / r.baseline_value), r


def test_codec_section_tiny(bench_ctx):
    from bench.codec import codec

    rows = codec(bench_ctx)
    well_formed(rows, "codec", 2, ctx=bench_ctx)
    assert all(r.baseline == "memcpy" for r in rows)


def test_round_section_tiny(bench_ctx):
    from bench.round import fedavg_round

    rows = fedavg_round(bench_ctx, agents=2)
    well_formed(rows, "round", 5, cpu_rows=("CPU",), ctx=bench_ctx)
    assert "2 agents" in rows[0].subject
    # The fifth row: the round with the daemons' defaults (streamed int8 updates, whose
    # mean the section checks), against the uncompressed round the C-client rows use.
    assert "with its defaults (int8 updates, streamed)" in rows[4].subject
    assert rows[4].baseline.startswith("the same round with whole float32 updates")
    # No round may have timed out (a lost update is reported, not raised).
    assert not bench_ctx.shared.get("failures"), bench_ctx.shared["failures"]
    assert len(bench_ctx.shared[("fedagent_round", TINY)]) == 1
    assert len(bench_ctx.shared[("fedagent_round_defaults", TINY)]) == 1


def test_secagg_section_tiny(bench_ctx):
    """Secure rounds through the stages with 3 agent processes; the section itself checks
    the unmasked mean against the bound and raises if it is off."""
    from bench.secagg import secure_aggregation

    rows = secure_aggregation(bench_ctx, agents=3)
    well_formed(rows, "secagg", 4, cpu_rows=("CPU",), ctx=bench_ctx)
    assert "3 agents" in rows[0].subject and "unmask" in rows[0].note
    # (the section raises unless every measured secure round had its keys ahead)
    assert "keys advertised a round ahead" in rows[0].note and "with a key stage" in rows[0].note
    assert "(max)" in rows[1].subject and "coordinator" in rows[2].note


@pytest.mark.parametrize("peers", ["processes", "one-process"])
def test_gossip_section_tiny(bench_ctx, monkeypatch, peers):
    """Each peer in a process of its own (the default), and both in this process."""
    from bench.gossip import ARRANGEMENT_ENV, gossip_exchange

    monkeypatch.setenv(ARRANGEMENT_ENV, peers)
    rows = gossip_exchange(bench_ctx)
    well_formed(rows, "gossip", 3, cpu_rows=("CPU",), ctx=bench_ctx)
    assert f"fedagent peers: {peers}" in rows[2].note


def test_syncopt_section_tiny(bench_ctx):
    """A real Sync-Opt federation (its own private Mosquitto with mutual TLS: the demo's
    Federation makes its CA and broker), 2 agents, a 300-term ProdLDA, 4 steps."""
    from bench.syncopt_step import syncopt_section

    options = {
        "corpus": "synthetic",
        "vocab_size": 300,
        "true_topics": 4,
        "shared_topics": 2,
        "eta": 1.0,
        "docs": 40,
        "val_docs": 4,
        "n_topics": 4,
        "batch_size": 8,
        "seed": 0,
        "data_seed": 0,
    }
    rows = syncopt_section(bench_ctx, agents=2, options=options, steps=(4, 1))
    well_formed(rows, "syncopt", 1, ctx=bench_ctx)
    assert "2 agents" in rows[0].subject and "V=300" in rows[0].subject, rows[0]
    assert "3 steps" in rows[0].note, rows[0]


def test_memory_section_tiny(bench_ctx):
    from bench.scaling import memory

    rows = memory(bench_ctx, cases=[(2, TINY)], whole_too=False)  # one federation, not two
    assert len(rows) == 1
    r = rows[0]
    assert r.section == "memory" and r.unit == "x model" and r.baseline_value == 3.0
    # (peak - idle + model) / model: at least the model itself is held.
    assert math.isfinite(r.value) and r.value >= 1.0, r
    assert "whole-message" not in r.note
    assert check_rows("memory", bench_ctx, rows) == []
    # Both rounds completed, nothing reported as not measured.
    assert not bench_ctx.shared.get("failures"), bench_ctx.shared["failures"]


def test_replay_section_tiny(bench_ctx):
    from bench.replay_journal import replay_section

    rows = replay_section(bench_ctx, senders=(3, 50), messages=5)
    well_formed(rows, "replay", 2, ctx=bench_ctx)
    assert "3 senders" in rows[0].subject and "50 senders" in rows[1].subject


def test_flower_apps_compile():
    apps = sorted((ROOT / "bench" / "flower_app").rglob("*.py"))
    assert len(apps) >= 3, apps
    for app in apps:
        py_compile.compile(str(app), doraise=True)


@pytest.mark.slow
@pytest.mark.flower
def test_flower_section_tiny(tmp_path, flower_python):
    from bench import flower

    py = flower_python
    tls = flower.server_tls(tmp_path / "pki")
    times = flower.run_deployment(py, tmp_path, TINY, 1, timeout=600, log=print, clients=2, tls=tls)
    assert len(times) == 1 and times[0] > 0
    assert "Uvicorn running on https://" in (tmp_path / f"flower-deploy-{TINY}-tls.log").read_text()


@pytest.mark.slow
@pytest.mark.flower
def test_flower_secaggplus_tiny(tmp_path, flower_python):
    """Flower's SecAgg+ workflow in its deployment mode with TLS, 3 SuperNodes, one measured round
    (2-4 minutes on a loaded machine): the round's unmasked mean matched what the
    clients sent (the app raises otherwise) and the relays counted its bytes."""
    from bench import flower
    from fedagent.protocols.secagg import SecAggParams

    py = flower_python
    cfg = flower.secaggplus_config(SecAggParams(), 3)
    tls = flower.server_tls(tmp_path / "pki")
    res = flower.run_secaggplus(py, tmp_path, TINY, 1, cfg, timeout=900, clients=3, tls=tls)
    assert len(res["times"]) == 1 and res["times"][0] > 0
    # At least each client's masked vector (int64 per parameter) came in through the relays.
    assert res["fleet_bytes"][0] > 3 * TINY * 8 and res["server_bytes"][0] > 3 * TINY * 8
    assert res["cpu"][0] > 0
    assert res["max_error"][0] < 4 * cfg["clip"] / cfg["quantization-range"]
