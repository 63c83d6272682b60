"""Benchmark sections for ``bench/run.py``: coordinator memory, scale, scale over tiers,
compression.

Each wraps the standalone script of the same subject (``bench/memory.py``,
``bench/scale.py``, ``bench/scale_tiers.py``, ``bench/compression.py``; run those alone
for their own tables) and reports rows against a baseline measured in the same run.
"""

from __future__ import annotations

from bench.registry import Context, Row, section

# The scripts (and torch, through the digits task) are imported when a section runs, so
# listing or refusing sections stays fast.


class _Log:
    """The standalone scripts log through a rich Console; here through ctx.log."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def log(self, *parts) -> None:
        self.ctx.log(" ".join(str(p) for p in parts))


def _memory_cases(ctx: Context) -> list[tuple[int, int]]:
    from bench import memory as memory_bench

    return [(10, 1_100_000)] if ctx.quick else list(memory_bench.DEFAULT_CASES)


@section("memory", rows=lambda ctx: len(_memory_cases(ctx)))
def memory(ctx: Context, cases: list[tuple[int, int]] | None = None, whole_too: bool = True) -> list[Row]:
    """Coordinator peak RSS as a multiple of the model, against the memory target (3x).
    Whole-message updates (the path streaming replaced; robust aggregators still use it)
    are measured next to streams for the 1.1M model only: at 44.8 MB they cost 10 buffered
    updates and minutes of this section for a figure (14.5x) that is not in question."""
    from bench import memory as memory_bench

    if cases is None:
        cases = _memory_cases(ctx)
    rows: list[dict] = []
    for n, params in cases:
        rows += memory_bench.measure(
            [(n, params)], rounds=2, whole_too=whole_too and params <= 1_100_000, console=_Log(ctx)
        )
    out = []
    for r in rows:
        if r["rounds"] < 2 or r["errors"]:
            what = f"memory {r['agents']} agents x {r['params'] * 4 / 1e6:.1f} MB, {r['path']}"
            ctx.shared.setdefault("failures", []).append(
                f"{what}: {r['rounds']} of 2 rounds{'; ' + '; '.join(r['errors']) if r['errors'] else ''}"
            )
    for n, params in cases:
        s = next(r for r in rows if (r["agents"], r["params"], r["path"]) == (n, params, "stream"))
        w = next((r for r in rows if (r["agents"], r["params"], r["path"]) == (n, params, "whole")), None)
        whole = f"; whole-message updates {w['peak_over_model']:.1f}x (peak {w['peak_rss_mb']:.0f} MB)" if w else ""
        out.append(
            Row(
                "memory",
                f"coordinator peak RSS / model, {n} agents x {params * 4 / 1e6:.1f} MB, streamed",
                s["peak_over_model"],
                "memory target",
                3.0,
                unit="x model",
                note=f"(peak - idle + model) / model; peak {s['peak_rss_mb']:.0f} MB, idle "
                f"{s['idle_rss_mb']:.0f} MB{whole}",
            )
        )
    return out


def _scale_agents(ctx: Context) -> list[int]:
    return [10, 100] if ctx.quick else [10, 100, 1000]


@section("scale", rows=lambda ctx: 2 * len(_scale_agents(ctx)))
def scale(ctx: Context) -> list[Row]:
    """Round time and coordinator peak RSS at N agents against the same at 10 agents;
    the notes carry each side's share of a core (coordinator, Mosquitto, the swarm in a
    process of its own), which says what limits (bench/scale.py draws the plot)."""
    from bench import scale as scale_bench

    agents = _scale_agents(ctx)
    rows = scale_bench.measure(
        agents, params=1000, rounds=2 if ctx.quick else 3, compression="none", console=_Log(ctx), procs=1
    )
    for r in rows:
        if r["rounds"] < (2 if ctx.quick else 3) or r.get("errors") or r.get("failed"):
            ctx.shared.setdefault("failures", []).append(
                f"scale {r['agents']} agents: {r['rounds']} rounds; {r.get('failed') or str(r.get('errors')) + ' errors'}"
            )
    base = rows[0]

    def shares(r: dict) -> str:
        if r.get("round_median_s") is None:
            return "incomplete"
        return (
            f"max {r['round_max_s']:.2f} s; share of a core: coordinator {r['coordinator_core_share']:.2f}, "
            f"Mosquitto {r['broker_core_share']:.2f}, swarm {r['swarm_core_share']:.2f}; coordinator CPU "
            f"{r['coordinator_cpu_per_update_ms']:.2f} ms per update"
        )

    out = [
        Row(
            "scale",
            f"FedAvg round, {r['agents']} agents (1000 params, training off)",
            r.get("round_median_s"),
            "the same round with 10 agents",
            base.get("round_median_s"),
            note=shares(r),
        )
        for r in rows
    ]
    out += [
        Row(
            "scale",
            f"coordinator peak RSS, {r['agents']} agents (1000 params)",
            r.get("coordinator_peak_rss_mb"),
            "the same with 10 agents",
            base.get("coordinator_peak_rss_mb"),
            unit="MiB",
            note=f"Mosquitto peak {r['broker_peak_rss_mb']:.0f} MiB, {r['broker_fds']} open files"
            if r.get("broker_peak_rss_mb") is not None
            else "incomplete",
        )
        for r in rows
    ]
    return out


def _tier_cases(ctx: Context) -> dict:
    if ctx.quick:
        return {"flat": [12], "tiered": [12], "sites": 2, "sweep": [], "rounds": 2}
    return {"flat": [1000, 3000], "tiered": [1000, 3000, 10000], "sites": 10, "sweep": [2, 5], "rounds": 3}


@section("scale_tiers", rows=lambda ctx: 2 * len(_tier_cases(ctx)["tiered"]) + 1)
def scale_tiers(ctx: Context) -> list[Row]:
    """Tiered rounds (agents over site brokers, a site aggregator each) against flat ones:
    round time and the top coordinator's CPU per round, each against the flat case of the
    same size (the largest flat one above it), and in the largest tiered case the swarm's
    CPU against every other process's (above 1: the agents' own work bounds the round).
    bench/scale_tiers.py writes the report, the fits and the plot."""
    from bench import scale_tiers as tiers_bench

    c = _tier_cases(ctx)
    rows = tiers_bench.measure(c["flat"], c["tiered"], c["sites"], _Log(ctx), sweep=c["sweep"], rounds=c["rounds"])
    ctx.shared["scale_tiers"] = rows
    for r in rows:
        if r["rounds"] < c["rounds"] or r.get("errors") or r.get("failed"):
            where = f"{r['agents']} agents" + (f" over {r['sites']} sites" if r["sites"] else " flat")
            ctx.shared.setdefault("failures", []).append(
                f"scale_tiers {where}: {r['rounds']} rounds; {r.get('failed') or str(r.get('errors')) + ' errors'}"
            )
    flat = {r["agents"]: r for r in rows if r["mode"] == "flat"}
    tiered = {r["agents"]: r for r in rows if r["mode"] == "tiered" and r["sites"] == c["sites"]}
    out: list[Row] = []
    cpu_rows: list[Row] = []
    for n in c["tiered"]:
        t = tiered.get(n, {})
        base_n = n if n in flat else max((m for m in flat if m <= n), default=max(flat, default=0))
        f = flat.get(base_n, {})
        where = f"{n} agents over {c['sites']} sites"
        out.append(
            Row(
                "scale_tiers",
                f"tiered round, {where} (1000 params, training off)",
                t.get("round_median_s"),
                f"flat round, {base_n} agents",
                f.get("round_median_s"),
                note=f"max {t['round_max_s']:.2f} s; site aggregator CPU per round median "
                f"{t['aggregator_cpu_per_round_median_s']:.2f} s, max {t['aggregator_cpu_per_round_max_s']:.2f} s"
                if t.get("round_median_s") is not None
                else "incomplete",
            )
        )
        cpu_rows.append(
            Row(
                "scale_tiers",
                f"hub coordinator CPU per round, {where}",
                t.get("hub_cpu_per_round_s"),
                f"flat coordinator CPU per round, {base_n} agents",
                f.get("hub_cpu_per_round_s"),
                note="target ≤ 0.1x at the largest case" if n == max(c["tiered"]) else "",
            )
        )
    big = tiered.get(max(c["tiered"]), {})
    swarm = big.get("swarm_cpu_per_round_s")
    total = big.get("total_cpu_per_round_s")
    out += cpu_rows
    out.append(
        Row(
            "scale_tiers",
            f"swarm CPU per round, {max(c['tiered'])} agents over {c['sites']} sites",
            swarm,
            "every other process's CPU per round (hub, site aggregators, Mosquittos)",
            None if swarm is None or total is None else total - swarm,
            note=f"{big['cores_busy']:.2f} cores busy over the round; above 1x the agents' own CPU bounds it"
            if big.get("cores_busy") is not None
            else "incomplete",
        )
    )
    return out


@section("compression", rows=lambda ctx: 4)  # fp16, int8, top-k 0.1 and 0.01
def compression(ctx: Context) -> list[Row]:
    from bench import compression as compression_bench

    # 12 rounds, one seed: the full 15 x 2 seeds of bench/compression.py took ~30 min
    # on the loaded 2-core machine; run that script alone for the longer figure.
    rounds, seeds = (4, 1) if ctx.quick else (12, 1)
    results = []
    for mode, ratio in compression_bench.MODES:
        runs = [compression_bench.federation(mode, ratio, 5, rounds, 0.3, seed=s) for s in range(seeds)]
        acc = sum(r["accuracy"] for r in runs) / len(runs)
        results.append({**runs[0], "accuracy": acc})
    none = results[0]
    out = []
    for r in results[1:]:
        out.append(
            Row(
                "compression",
                f"update bytes, {r['mode']}",
                r["bytes_per_update"],
                "compression none",
                none["bytes_per_update"],
                unit="B",
                note=f"saved {100 * (1 - r['bytes_per_update'] / none['bytes_per_update']):.1f}%; digits "
                f"accuracy {r['accuracy']:.4f} vs {none['accuracy']:.4f}: cost "
                f"{100 * (none['accuracy'] - r['accuracy']):.2f} points; {rounds} rounds, {seeds} seed(s)",
            )
        )
    return out
