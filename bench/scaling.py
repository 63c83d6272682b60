"""Benchmark sections for ``bench/run.py``: coordinator memory, scale, compression.

Each wraps the standalone script of the same subject (``bench/memory.py``,
``bench/scale.py``, ``bench/compression.py``; run those alone for their own tables) and
reports rows against a baseline measured in the same run.
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
