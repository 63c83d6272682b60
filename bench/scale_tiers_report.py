"""The tiered scale benchmark's analysis (:mod:`bench.scale_tiers` measures): fits of
the hub's, a site aggregator's and a broker's CPU against sites, agents and connections,
the targets, the projection to 100,000 and 1,000,000 agents, the markdown report and the
plot."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from bench.swarm import COORDINATOR

HUB = COORDINATOR


# ---- fits, targets, projection -------------------------------------------------------------
def _linear(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = a + b·x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def _quadratic0(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = b·x + c·x² (no constant: a broker without connections relays nothing)."""
    if len(set(xs)) < 2:
        return None
    x = np.asarray(xs, float)
    (b, c), *_ = np.linalg.lstsq(np.stack([x, x * x], axis=1), np.asarray(ys, float), rcond=None)
    return float(b), float(c)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("round_median_s") is not None and r.get("hub_cpu_per_round_s") is not None]


def fits(rows: list[dict]) -> dict[str, Any]:
    ok = _ok(rows)
    tiered = [r for r in ok if r["mode"] == "tiered"]
    flat = [r for r in ok if r["mode"] == "flat"]
    out: dict[str, Any] = {}
    out["hub_vs_sites"] = _linear([r["sites"] for r in tiered], [r["hub_cpu_per_round_s"] for r in tiered])
    most = max((r["sites"] for r in tiered), default=0)
    at_most = [r for r in tiered if r["sites"] == most]
    out["hub_vs_agents_tiered"] = _linear([r["agents"] for r in at_most], [r["hub_cpu_per_round_s"] for r in at_most])
    out["hub_vs_agents_flat"] = _linear([r["agents"] for r in flat], [r["hub_cpu_per_round_s"] for r in flat])
    pts = [
        (r["agents"] / r["sites"], v)
        for r in tiered
        for v in r["aggregators_cpu_per_round_s"].values()
        if v is not None
    ]
    out["aggregator_vs_agents"] = _linear([p[0] for p in pts], [p[1] for p in pts])
    bpts = [
        (r["agents"] / r["sites"] + 1, v)
        for r in tiered
        for k, v in r["brokers_cpu_per_round_s"].items()
        if k != "hub" and v is not None
    ] + [(r["agents"] + 1, r["brokers_cpu_per_round_s"]["broker"]) for r in flat]
    out["broker_vs_connections"] = _quadratic0([p[0] for p in bpts], [p[1] for p in bpts])
    out["hub_broker_vs_sites"] = _linear(
        [r["sites"] for r in tiered], [r["brokers_cpu_per_round_s"]["hub"] for r in tiered]
    )
    mem = [(r["agents"] / r["sites"], v) for r in tiered for k, v in r["peak_rss_mb"].items() if k.startswith("site-")]
    out["aggregator_rss_vs_agents"] = _linear([p[0] for p in mem], [p[1] for p in mem])
    bmem = [
        (r["agents"] / r["sites"] + 1, v)
        for r in tiered
        for k, v in r["peak_rss_mb"].items()
        if k.startswith("broker-site-")
    ] + [(r["agents"] + 1, r["peak_rss_mb"]["broker-broker"]) for r in flat]
    out["broker_rss_vs_connections"] = _linear([p[0] for p in bmem], [p[1] for p in bmem])
    sw = [(r["agents"] / r["sites"], r["swarm_cpu_per_agent_ms"]) for r in tiered] + [
        (r["agents"], r["swarm_cpu_per_agent_ms"]) for r in flat
    ]
    out["swarm_per_agent_vs_cohort"] = _linear([p[0] for p in sw], [p[1] for p in sw])
    out["hub_peak_rss_mb"] = max((r["peak_rss_mb"].get(HUB, 0) for r in tiered), default=None)
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The two targets, against the largest tiered case and the largest flat one."""
    ok = _ok(rows)
    tiered = [r for r in ok if r["mode"] == "tiered"]
    flat = [r for r in ok if r["mode"] == "flat"]
    out = []
    if tiered and flat:
        t = max(tiered, key=lambda r: (r["agents"], r["sites"]))
        f = max(flat, key=lambda r: r["agents"])
        ratio = t["hub_cpu_per_round_s"] / f["hub_cpu_per_round_s"] if f["hub_cpu_per_round_s"] else math.nan
        out.append(
            {
                "target": f"hub CPU per round at {t['agents']:,} tiered ≤ 1/10 of the flat coordinator's at "
                f"{f['agents']:,}",
                "measured": f"{t['hub_cpu_per_round_s']:.3f} s / {f['hub_cpu_per_round_s']:.3f} s = {ratio:.3f}",
                "met": bool(ratio <= 0.1),
            }
        )
    if tiered:
        t = max(tiered, key=lambda r: (r["agents"], r["sites"]))
        share = t.get("swarm_cpu_share") or 0.0
        others = t["total_cpu_per_round_s"] - t["swarm_cpu_per_round_s"]
        biggest = max(
            [
                t["hub_cpu_per_round_s"],
                *t["aggregators_cpu_per_round_s"].values(),
                *t["brokers_cpu_per_round_s"].values(),
            ]
        )
        out.append(
            {
                "target": f"a {t['agents']:,}-agent round is bounded by the agents' own CPU",
                "measured": f"swarm {t['swarm_cpu_per_round_s']:.1f} s of {t['total_cpu_per_round_s']:.1f} s CPU "
                f"per round ({100 * share:.0f}%; every other process together {others:.1f} s, the "
                f"largest {biggest:.1f} s); {_f(t.get('cores_busy'))} of {os.cpu_count()} cores busy over the round",
                "met": share > 0.5,
            }
        )
    return out


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def table_md(rows: list[dict]) -> str:
    head = (
        "| case | swarm procs | rounds | median / max round | hub CPU / round | site aggregator CPU / round "
        "(median / max) | hub broker CPU / round | site broker CPU / round (median / max) | swarm CPU / round | "
        "swarm share of CPU | cores busy | connect |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        case = f"flat {r['agents']:,}" if r["mode"] == "flat" else f"tiered {r['agents']:,} / {r['sites']} sites"
        if r.get("round_median_s") is None or r.get("hub_cpu_per_round_s") is None:
            why = r.get("failed") or f"{r.get('errors', 0)} errors, {r.get('error_sample')}"
            lines.append(f"| {case} | {r.get('procs', '–')} | {r.get('rounds', 0)} | failed: {why[:120]} |")
            continue
        lines.append(
            f"| {case} | {r['procs']} | {r['rounds']} | {r['round_median_s']:.2f} / {r['round_max_s']:.2f} s | "
            f"{_f(r['hub_cpu_per_round_s'])} s | "
            + (
                f"{_f(r['aggregator_cpu_per_round_median_s'])} / {_f(r['aggregator_cpu_per_round_max_s'])} s"
                if r["mode"] == "tiered"
                else "–"
            )
            + f" | {_f(r['hub_broker_cpu_per_round_s'])} s | "
            + (
                f"{_f(r['site_broker_cpu_per_round_median_s'])} / {_f(r['site_broker_cpu_per_round_max_s'])} s"
                if r["mode"] == "tiered"
                else "–"
            )
            + f" | {_f(r['swarm_cpu_per_round_s'])} s | {_f(r.get('swarm_cpu_share'), '{:.0%}')} | "
            f"{_f(r.get('cores_busy'))} | {r['connect_s']:.0f} s |"
        )
    return "\n".join(lines)


def rss_md(rows: list[dict]) -> str:
    kinds = ["hub coordinator", "site aggregator", "hub broker", "site broker", "swarm process"]
    lines = [
        "| case | " + " | ".join(f"{k} peak RSS" for k in kinds) + " | all processes |",
        "|---|" + "---:|" * (len(kinds) + 1),
    ]
    for r in _ok(rows):
        case = f"flat {r['agents']:,}" if r["mode"] == "flat" else f"tiered {r['agents']:,} / {r['sites']} sites"
        by = r["peak_rss_by_kind_mb"]
        cells = []
        for k in kinds:
            v = by.get(k)
            if v is None:
                cells.append("–")
            elif v["count"] == 1:
                cells.append(f"{v['max']:.0f} MiB")
            else:
                cells.append(f"{v['median']:.0f} / {v['max']:.0f} MiB (×{v['count']})")
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {r['peak_rss_total_mb'] / 1024:.2f} GiB |")
    return (
        "\n".join(lines) + "\n\n(median / max over the processes of a kind; flat: the coordinator is the hub's column)"
    )


def projection(fit: dict[str, Any], site_agents: int = 1000, fan_in: int | None = None) -> str:
    """What 100,000 and 1,000,000 agents would need, from the fitted constants, with the
    arithmetic: sites of ``site_agents`` agents, at most ``fan_in`` members per
    coordinator above the sites (regions between the hub and the sites beyond that).
    ``fan_in`` None: as many members as keep a tier above the sites within a site
    aggregator's CPU per round, so that no tier above paces the round."""
    hub, agg, brk = fit.get("hub_vs_sites"), fit.get("aggregator_vs_agents"), fit.get("broker_vs_connections")
    amem, bmem = fit.get("aggregator_rss_vs_agents"), fit.get("broker_rss_vs_connections")
    if not (hub and agg and brk and amem and bmem):
        return "(not enough measured cases to fit the curves)"
    a_h, b_h = hub
    a_s, b_s = agg
    b_b, c_b = brk
    a_m, b_m = amem
    a_bm, b_bm = bmem
    lines = []
    n_s = site_agents
    site_cpu = a_s + b_s * n_s
    if fan_in is None:
        fan_in = max(2, int((site_cpu - a_h) / b_h)) if b_h > 0 else 10**6
        lines.append(
            f"Members per coordinator above the sites: at most ({site_cpu:.2f} s − {a_h:.3f} s) / "
            f"{b_h * 1000:.2f} ms = {fan_in:,}, the number whose CPU per round equals a site aggregator's at "
            f"{n_s:,} agents ({a_s:.3f} s + {b_s * 1000:.3f} ms × {n_s:,} = {site_cpu:.2f} s).\n"
        )
    broker_cpu = b_b * (n_s + 1) + c_b * (n_s + 1) ** 2
    site_mem = a_m + b_m * n_s
    broker_mem = a_bm + b_bm * (n_s + 1)
    for total in (100_000, 1_000_000):
        sites = total // n_s
        lines.append(f"**{total:,} agents**, sites of {n_s:,} agents: S = {total:,} / {n_s:,} = {sites:,} sites.")
        lines.append(
            f"- per site: aggregator CPU per round {a_s:.3f} s + {b_s * 1000:.3f} ms × {n_s:,} = {site_cpu:.2f} s; "
            f"its Mosquitto {b_b * 1000:.4f} ms × {n_s + 1:,} + {c_b * 1e6:.5f} µs × {n_s + 1:,}² = {broker_cpu:.2f} s; "
            f"memory {a_m:.0f} MiB + {b_m * 1024:.1f} KiB × {n_s:,} = {site_mem:.0f} MiB (aggregator) + "
            f"{a_bm:.1f} MiB + {b_bm * 1024:.1f} KiB × {n_s + 1:,} = {broker_mem:.0f} MiB (broker)"
        )
        if sites <= fan_in:
            hub_cpu = a_h + b_h * sites
            lines.append(
                f"- two tiers: {sites:,} site brokers + 1 hub broker ({sites + 1:,} Mosquittos); the hub's CPU per "
                f"round {a_h:.3f} s + {b_h * 1000:.2f} ms × {sites:,} = {hub_cpu:.2f} s; the hub broker holds "
                f"{sites:,} connections"
            )
        else:
            regions = math.ceil(sites / fan_in)
            per_region = math.ceil(sites / regions)
            region_cpu = a_h + b_h * per_region
            hub_cpu = a_h + b_h * regions
            lines.append(
                f"- {sites:,} members at one hub would cost {a_h:.3f} s + {b_h * 1000:.2f} ms × {sites:,} = "
                f"{a_h + b_h * sites:.2f} s a round; with at most {fan_in} members per coordinator: three tiers, "
                f"{regions} regions of {per_region} sites (⌈{sites:,} / {fan_in}⌉ = {regions}); a region aggregator "
                f"{a_h:.3f} s + {b_h * 1000:.2f} ms × {per_region} = {region_cpu:.2f} s a round, the hub {a_h:.3f} s + "
                f"{b_h * 1000:.2f} ms × {regions} = {hub_cpu:.2f} s; Mosquittos: {sites:,} site + {regions} region + "
                f"1 hub = {sites + regions + 1:,}"
            )
        total_mem = sites * (site_mem + broker_mem) / 1024
        lines.append(
            f"- memory over the sites: {sites:,} × ({site_mem:.0f} + {broker_mem:.0f}) MiB = {total_mem:,.0f} GiB "
            f"(one site per machine: {site_mem + broker_mem:.0f} MiB each); the hub "
            f"{_f(fit.get('hub_peak_rss_mb'), '{:.0f}')} MiB as measured (its members' updates are one model each)"
        )
        lines.append("")
    return "\n".join(lines)


def fits_md(fit: dict[str, Any]) -> str:
    def lin(name: str, what: str, x: str, unit_b: str, scale_b: float) -> str:
        v = fit.get(name)
        if not v:
            return f"- {what}: not enough points"
        a, b = v
        return f"- {what}: {a:.3f} s + {b * scale_b:.4g} {unit_b} × {x}"

    lines = [
        lin("hub_vs_sites", "hub coordinator CPU per round against sites S (tiered)", "S", "ms", 1000),
        lin(
            "hub_vs_agents_tiered",
            "hub coordinator CPU per round against agents N (tiered, most sites)",
            "N",
            "ms",
            1000,
        ),
        lin("hub_vs_agents_flat", "flat coordinator CPU per round against agents N", "N", "ms", 1000),
        lin("aggregator_vs_agents", "site aggregator CPU per round against its agents n", "n", "ms", 1000),
        lin("hub_broker_vs_sites", "hub broker CPU per round against sites S", "S", "ms", 1000),
    ]
    q = fit.get("broker_vs_connections")
    lines.append(
        f"- Mosquitto CPU per round against its connections c (site brokers and the flat broker): "
        f"{q[0] * 1000:.4f} ms × c + {q[1] * 1e6:.5f} µs × c²"
        if q
        else "- broker: not enough points"
    )
    m = fit.get("aggregator_rss_vs_agents")
    if m:
        lines.append(f"- site aggregator peak RSS against its agents n: {m[0]:.0f} MiB + {m[1] * 1024:.1f} KiB × n")
    m = fit.get("broker_rss_vs_connections")
    if m:
        lines.append(f"- Mosquitto peak RSS against its connections c: {m[0]:.1f} MiB + {m[1] * 1024:.1f} KiB × c")
    m = fit.get("swarm_per_agent_vs_cohort")
    if m:
        lines.append(
            f"- swarm CPU per agent and round against the agents of its coordinator n: {m[0]:.2f} ms + "
            f"{m[1] * 1000:.3f} µs × n (small since round starts and results stopped carrying the cohort's ids)"
        )
    return "\n".join(lines)


def durations_md(rows: list[dict]) -> str:
    """Where each case's wall time went: what a run of these cases takes, for planning one.
    Steps of a tiered case: issuing the certificates, starting the brokers and the daemons,
    connecting the agents, the rounds (the first one's start included), stopping."""
    steps = ["certificates", "brokers", "daemons", "connect", "rounds", "stop"]
    lines = [
        "| case | wall | " + " | ".join(steps) + " | load (1 min) before / after |",
        "|---|" + "---:|" * (len(steps) + 2),
    ]
    for r in rows:
        case = f"flat {r['agents']:,}" if r["mode"] == "flat" else f"tiered {r['agents']:,} / {r['sites']} sites"
        ph = r.get("phases_s") or {}
        if not ph and r.get("connect_s") is not None:
            ph = {"connect": r["connect_s"]}
        cells = [_f(ph.get(k), "{:.0f} s") for k in steps]
        load = [(r.get(k) or [None])[0] for k in ("loadavg_before", "loadavg_after")]
        lines.append(
            f"| {case} | {_f(r.get('wall_s'), '{:.0f} s')} | "
            + " | ".join(cells)
            + f" | {_f(load[0], '{:.1f}')} / {_f(load[1], '{:.1f}')} |"
        )
    return "\n".join(lines)


def report(rows: list[dict], command: str = "") -> str:
    fit = fits(rows)
    ok = _ok(rows)
    loads = [x for r in rows for x in (r.get("loadavg_before") or [])[:1] + (r.get("loadavg_after") or [])[:1]]
    parts = [
        "# Flat vs tiered: how cost grows over site aggregators",
        "",
        "Set-up: `bench/scale_tiers.py` (its module text says what runs and how each figure is read).",
        "",
        f"Cases: {len(ok)} measured of {len(rows)}; load average (1 min) at the cases' starts and ends: "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} on {os.cpu_count()} CPUs.",
        "",
    ]
    if command:
        parts += ["```", command, "```", ""]
    parts += [
        "![round time and hub CPU per round against agents, flat vs tiered; peak RSS](scale-tiers.png)",
        "",
        "## Round and CPU per round",
        "",
        table_md(rows),
        "",
        "## Peak RSS",
        "",
        rss_md(rows),
        "",
        "## How long each case took",
        "",
        durations_md(rows),
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in targets(rows)],
        "",
        "## Fitted curves",
        "",
        fits_md(fit),
        "",
        "## Projection (on paper, from the fits)",
        "",
        projection(fit),
    ]
    return "\n".join(parts) + "\n"


# ---- plot ----------------------------------------------------------------------------------
def plot(rows: list[dict], out: Path, title: str = "") -> None:
    """Round time and hub CPU per round against agents (flat vs tiered), the CPU per round
    of each kind of process, and every kind of process's peak RSS."""
    from fedagent.extras import require

    require("matplotlib", "report", "the plot of bench/scale_tiers.py")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(rows)
    flat = sorted((r for r in ok if r["mode"] == "flat"), key=lambda r: r["agents"])
    most = max((r["sites"] for r in ok if r["mode"] == "tiered"), default=0)
    tiered = sorted((r for r in ok if r["mode"] == "tiered" and r["sites"] == most), key=lambda r: r["agents"])
    sweep = [r for r in ok if r["mode"] == "tiered" and r["sites"] != most]
    fig, ((ax_t, ax_h), (ax_c, ax_m)) = plt.subplots(2, 2, figsize=(13, 9.5))
    for rs, label, color, m in (
        (flat, "flat (one broker)", "tab:red", "o"),
        (tiered, f"tiered ({most} sites)", "tab:blue", "s"),
    ):
        n = [r["agents"] for r in rs]
        ax_t.plot(n, [r["round_median_s"] for r in rs], marker=m, color=color, label=f"{label}, median")
        ax_t.plot(n, [r["round_max_s"] for r in rs], marker=m, ls="none", alpha=0.4, color=color, label=f"{label}, max")
        ax_h.plot(n, [r["hub_cpu_per_round_s"] for r in rs], marker=m, color=color, label=f"{label}: top coordinator")
    for r in sweep:
        ax_t.plot([r["agents"]], [r["round_median_s"]], marker="^", color="tab:green", ls="none")
        ax_t.annotate(f"{r['sites']} sites", (r["agents"], r["round_median_s"]), fontsize=7)
        ax_h.plot([r["agents"]], [r["hub_cpu_per_round_s"]], marker="^", color="tab:green", ls="none")
        ax_h.annotate(f"{r['sites']} sites", (r["agents"], r["hub_cpu_per_round_s"]), fontsize=7)
    if tiered:
        ax_h.plot(
            [r["agents"] for r in tiered],
            [r["aggregator_cpu_per_round_max_s"] for r in tiered],
            marker="s",
            ls="--",
            color="tab:cyan",
            label="tiered: busiest site aggregator",
        )
    if flat:
        goal = flat[-1]["hub_cpu_per_round_s"] / 10
        ax_h.axhline(goal, color="grey", ls=":", lw=1)
        ax_h.text(
            ax_h.get_xlim()[0] if ok else 1, goal * 1.05, f"target: 1/10 of flat at {flat[-1]['agents']:,}", fontsize=7
        )
    # CPU per round by kind of process, stacked, one bar per case
    cases = flat + sorted([*tiered, *sweep], key=lambda r: (r["agents"], r["sites"]))
    labels = [
        f"flat\n{r['agents']:,}" if r["mode"] == "flat" else f"{r['sites']} sites\n{r['agents']:,}" for r in cases
    ]
    parts = [
        ("top coordinator", "tab:red", lambda r: r["hub_cpu_per_round_s"]),
        ("site aggregators", "tab:cyan", lambda r: sum(v for v in r["aggregators_cpu_per_round_s"].values() if v)),
        ("Mosquittos", "tab:purple", lambda r: sum(v for v in r["brokers_cpu_per_round_s"].values() if v)),
        ("swarm (the agents)", "tab:green", lambda r: r["swarm_cpu_per_round_s"]),
    ]
    bottom = np.zeros(len(cases))
    x = np.arange(len(cases))
    for name, color, get in parts:
        vals = np.array([get(r) or 0.0 for r in cases])
        ax_c.bar(x, vals, bottom=bottom, color=color, label=name)
        bottom += vals
    ax_c.set_xticks(x, labels, fontsize=7)
    kinds = ["hub coordinator", "site aggregator", "hub broker", "site broker", "swarm process"]
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        rss = [r["peak_rss_by_kind_mb"].get(kind, {}).get("max", 0.0) for r in cases]
        ax_m.bar(x + (k - len(kinds) / 2 + 0.5) * width, rss, width, label=kind + " (max)")
    ax_m.set_xticks(x, labels, fontsize=7)
    for ax in (ax_t, ax_h):
        ax.set_xscale("log")
        ax.set_xlabel("agents")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds per round")
    ax_t.set_title("Round time (hub round)")
    ax_h.set_yscale("log")
    ax_h.set_ylabel("CPU seconds per round")
    ax_h.set_title("CPU per round: the top coordinator (flat: the only one)")
    ax_c.set_ylabel("CPU seconds per round")
    ax_c.set_title("CPU per round by kind of process")
    ax_m.set_ylabel("MiB (VmHWM)")
    ax_m.set_title("Peak RSS, the largest process of each kind")
    for ax in (ax_t, ax_h, ax_c, ax_m):
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
