"""bench/scale_tiers.py: the section's rows, the fits, targets, report and plot from rows
shaped like a measured run, and the section's ``--quick`` variant for real (a flat
federation and a tiered one over two site aggregators, 12 light agents each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import scale_tiers, scale_tiers_report, scaling
from bench.registry import Context, check_rows


def _tiered(n: int, sites: int, hub_cpu: float = 0.05) -> dict:
    per_site = n // sites
    names = [f"site-{s + 1}" for s in range(sites)]
    return {
        "mode": "tiered",
        "agents": n,
        "sites": sites,
        "agents_per_site": per_site,
        "procs": 2,
        "rounds": 3,
        "errors": 0,
        "round_s": [n / 400, n / 350, n / 380],
        "wall_per_round_s": n / 360,
        "hub_cpu_per_round_s": hub_cpu + 0.002 * sites,
        "aggregators_cpu_per_round_s": {s: 0.1 + 0.0015 * per_site for s in names},
        "brokers_cpu_per_round_s": {"hub": 0.001 * sites, **{s: 1e-4 * per_site for s in names}},
        "swarm_cpu_per_round_s": 0.004 * n,
        "peak_rss_mb": {
            "coordinator": 260.0,
            **{s: 250.0 + per_site / 100 for s in names},
            "broker-hub": 10.0,
            **{f"broker-{s}": 10.0 + per_site * 0.034 for s in names},
            "swarm-0": 120.0,
            "swarm-1": 121.0,
        },
        "connect_s": n / 100,
    }


def _flat(n: int) -> dict:
    return {
        "mode": "flat",
        "agents": n,
        "sites": 0,
        "agents_per_site": n,
        "procs": 2,
        "rounds": 3,
        "errors": 0,
        "round_s": [n / 200, n / 190, n / 210],
        "wall_per_round_s": n / 195,
        "hub_cpu_per_round_s": 0.0017 * n,
        "aggregators_cpu_per_round_s": {},
        "brokers_cpu_per_round_s": {"broker": 1.1e-4 * n + 2.7e-8 * n * n},
        "swarm_cpu_per_round_s": 0.004 * n,
        "peak_rss_mb": {"coordinator": 255.0, "broker-broker": 10.0 + n * 0.034, "swarm-0": 120.0},
        "connect_s": n / 150,
    }


def _rows() -> list[dict]:
    raw = [_flat(1000), _flat(3000), _tiered(1000, 10), _tiered(1000, 2), _tiered(1000, 5)]
    raw += [_tiered(3000, 10), _tiered(10000, 10)]
    return [scale_tiers.derive(r) for r in raw]


def test_section_makes_the_rows_it_declares_and_reports_a_failed_case(monkeypatch, tmp_path):
    ctx = Context(quick=False, work=tmp_path, repeats=1, log=lambda s: None)
    monkeypatch.setattr(scale_tiers, "measure", lambda *a, **k: _rows())
    rows = scaling.scale_tiers(ctx)
    assert check_rows("scale_tiers", ctx, rows) == []
    assert len(rows) == 7
    # Round time against flat of the same size; 10,000 against the largest flat (3,000).
    assert rows[2].baseline == "flat round, 3000 agents"
    # Hub CPU: (0.05 + 0.002 x 10) / (0.0017 x 3000) at 10,000 agents.
    assert rows[5].ratio == pytest.approx(0.07 / 5.1)
    assert "target" in rows[5].note
    # The swarm against every other process at 10,000 agents.
    assert rows[6].value == pytest.approx(40.0) and rows[6].ratio > 1
    assert "failures" not in ctx.shared

    ctx = Context(quick=False, work=tmp_path, repeats=1, log=lambda s: None)
    failed = {"mode": "tiered", "agents": 10000, "sites": 10, "procs": 14, "rounds": 0, "failed": "not connected"}
    monkeypatch.setattr(scale_tiers, "measure", lambda *a, **k: [*_rows()[:-1], scale_tiers.derive(failed)])
    rows = scaling.scale_tiers(ctx)
    problems = check_rows("scale_tiers", ctx, rows)
    assert any("10000 agents over 10 sites" in p and "not a measurement" in p for p in problems), problems
    assert ctx.shared["failures"] == ["scale_tiers 10000 agents over 10 sites: 0 rounds; not connected"]


def test_fits_recover_the_constants_the_rows_were_made_with():
    fit = scale_tiers_report.fits(_rows())
    a, b = fit["hub_vs_sites"]
    assert a == pytest.approx(0.05) and b == pytest.approx(0.002)
    a, b = fit["aggregator_vs_agents"]
    assert a == pytest.approx(0.1) and b == pytest.approx(0.0015)
    assert fit["hub_vs_agents_flat"][1] == pytest.approx(0.0017)
    assert fit["hub_vs_agents_tiered"][1] == pytest.approx(0.0, abs=1e-12)
    assert fit["broker_rss_vs_connections"][1] == pytest.approx(0.034, rel=1e-3)


def test_targets_report_and_projection():
    rows = _rows()
    t = scale_tiers_report.targets(rows)
    assert [x["met"] for x in t] == [True, True], t
    text = scale_tiers_report.report(rows, "python bench/scale_tiers.py")
    assert "**100,000 agents**" in text and "**1,000,000 agents**" in text
    # 1,000,000 agents in sites of 1,000: 1,000 sites; a tier above the sites may have as
    # many members as cost what a site of 1,000 costs: (1.6 - 0.05) / 0.002 = 775, so regions.
    assert "= 775," in text and "2 regions of 500 sites" in text
    assert "| tiered 10,000 / 10 sites |" in text and "| flat 3,000 |" in text
    # A failed case is a line of the table, not a crash.
    failed = scale_tiers.derive(
        {"mode": "tiered", "agents": 20000, "sites": 10, "procs": 27, "rounds": 0, "failed": "x"}
    )
    assert "failed: x" in scale_tiers_report.report([*rows, failed])


def test_report_says_where_each_case_s_time_went():
    rows = _rows()
    steps = {"certificates": 20.0, "brokers": 3.0, "daemons": 41.0, "connect": 400.0, "rounds": 200.0, "stop": 30.0}
    rows[-1] = {**rows[-1], "wall_s": 700.0, "phases_s": steps, "loadavg_before": [1.0, 1.0, 1.0]}
    rows[-1]["loadavg_after"] = [12.5, 5.0, 3.0]
    text = scale_tiers_report.report(rows)
    assert "| tiered 10,000 / 10 sites | 700 s | 20 s | 3 s | 41 s | 400 s | 200 s | 30 s | 1.0 / 12.5 |" in text
    # A flat case (bench/swarm.py) says how long its agents took to connect, nothing more.
    assert "| flat 1,000 | – | – | – | – | 7 s | – | – | – / – |" in text


def test_plot_draws_every_case(tmp_path: Path):
    out = tmp_path / "tiers.png"
    scale_tiers_report.plot(_rows(), out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000


def test_connections_are_the_descriptors_a_broker_opened_since_the_start(tmp_path):
    counted = scale_tiers.Connections([os.getpid(), 0])  # 0: a broker that did not start
    assert counted.held() == 0
    files = [(tmp_path / f"f{i}").open("w") for i in range(5)]
    try:
        assert counted.sample(12.0) == 5
    finally:
        for f in files:
            f.close()
    assert counted.sample(17.0) == 0
    assert counted.samples == [[12.0, 5], [17.0, 0]]


def test_connecting_has_its_own_limit_beside_the_rounds(monkeypatch, tmp_path):
    seen: list[tuple[str, float, float]] = []

    def tiered(workdir, *, agents, sites, timeout, connect_limit, **kw):
        seen.append(("tiered", timeout, connect_limit))
        return _tiered(agents, sites)

    def flat(workdir, n, params, rounds, compression, procs, progress, limit, connect_limit):
        seen.append(("flat", limit, connect_limit))
        return _flat(n)

    monkeypatch.setattr(scale_tiers, "run_tiers", tiered)
    monkeypatch.setattr(scale_tiers, "_flat", flat)

    class Quiet:
        def log(self, *a) -> None:
            pass

    rows = scale_tiers.measure([1000], [1000], 10, Quiet(), case_limit=600, connect_limit=1500, tmp=tmp_path)
    assert seen == [("flat", 600, 1500), ("tiered", 600, 1500)] and len(rows) == 2
    seen.clear()
    scale_tiers.measure([], [1000], 10, Quiet(), case_limit=600, tmp=tmp_path)
    assert seen == [("tiered", 600, 600)]


@pytest.mark.procs
def test_quick_section_runs_flat_and_tiered_for_real(tmp_path):
    """The ``--quick`` variant: 12 light agents on one broker, then over two site brokers
    with a real ``fedagent aggregator`` each and the hub's coordinator."""
    logs: list[str] = []
    ctx = Context(quick=True, work=tmp_path, repeats=1, log=logs.append)
    rows = scaling.scale_tiers(ctx)
    assert check_rows("scale_tiers", ctx, rows) == [], logs[-20:]
    assert not ctx.shared.get("failures"), (ctx.shared["failures"], logs[-20:])
    flat, tiered = ctx.shared["scale_tiers"]
    assert flat["mode"] == "flat" and flat["participants"] == [12, 12]
    # The hub's rounds had both sites, every site aggregator and Mosquitto was measured.
    assert tiered["participants"] == [2, 2]
    assert sorted(tiered["aggregators_cpu_per_round_s"]) == ["site-1", "site-2"]
    assert sorted(tiered["brokers_cpu_per_round_s"]) == ["hub", "site-1", "site-2"]
    assert all(v is not None for v in tiered["site_round_median_s"].values())
    # One process per kind and site, each with a peak RSS: hub, 2 aggregators, 3 brokers, the swarm.
    peaks = tiered["peak_rss_mb"]
    assert {"coordinator", "site-1", "site-2", "broker-hub", "broker-site-1", "broker-site-2", "swarm-0"} <= set(peaks)
    assert all(v > 0 for v in peaks.values()), peaks
    # Each site broker held its 6 agents and its aggregator.
    assert all(tiered["broker_fds"][s] >= 7 for s in ("site-1", "site-2")), tiered["broker_fds"]
    assert any("hub round 2/2" in line for line in logs), logs[-20:]
