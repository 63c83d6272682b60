#!/usr/bin/env python3
"""Run fedagent's benchmarks and print each measurement as a ratio to a baseline
measured in the same run.

    .venv/bin/python bench/run.py [--quick] [--only NAME ...] [--out DIR]

Sections (see bench/registry.py to add one): codec, round, flower, syncopt, gossip, memory,
scale, scale_tiers, compression, replay. ``--quick`` uses the 1.1M-parameter model, 2 repetitions, Flower's gRPC mode
without TLS only and small memory/scale/scale_tiers/compression runs (a few minutes on an idle 2-core machine).
The table is also written as ``table.md`` and ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.registry import MODULES, SECTIONS, Context, Row, check_rows  # noqa: E402


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mosq = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True, timeout=5).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        try:
            mosq = subprocess.run(
                ["/usr/sbin/mosquitto", "-h"], capture_output=True, text=True, timeout=5
            ).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            mosq = "unknown"
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "mosquitto": mosq,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg": load,
    }


def markdown(rows: list[Row]) -> str:
    lines = [
        "| section | subject | value | baseline | baseline value | ratio | note |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.section} | {r.subject} | {_fmt(r.value, r.unit)} | {r.baseline} | "
            f"{_fmt(r.baseline_value, r.unit)} | {r.ratio:.2f}x | {r.note} |"
        )
    return "\n".join(lines)


def _fmt(v: float, unit: str) -> str:
    if not isinstance(v, (int, float)):
        return repr(v)
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:.3g} {unit}"


def print_table(rows: list[Row]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(rows))
        return
    t = Table(title="fedagent benchmarks (ratio = subject / baseline, same run; >1 = slower)")
    for col, justify in [
        ("section", "left"),
        ("subject", "left"),
        ("value", "right"),
        ("baseline", "left"),
        ("baseline value", "right"),
        ("ratio", "right"),
        ("note", "left"),
    ]:
        t.add_column(col, justify=justify)
    for r in rows:
        t.add_row(
            r.section,
            r.subject,
            _fmt(r.value, r.unit),
            r.baseline,
            _fmt(r.baseline_value, r.unit),
            f"{r.ratio:.2f}x",
            r.note,
        )
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this section (repeatable)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds/repetitions per measurement")
    ap.add_argument(
        "--params",
        type=float,
        action="append",
        default=[],
        metavar="N",
        help="model size in parameters, e.g. 11.2e6 (repeatable; default 11.2M and 1.1M)",
    )
    ap.add_argument("--out", type=Path, default=None, help="directory for table.md and results.json")
    args = ap.parse_args(argv)
    # A plain SIGTERM would skip the finally blocks that stop brokers and agent processes.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    for mod in MODULES:
        importlib.import_module(mod)
    unknown = [n for n in args.only if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    names = args.only or list(SECTIONS)
    repeats = args.repeats or (2 if args.quick else 5)
    info = machine()
    print(f"machine: {info['cpus']} CPUs, {info['cpu']}; {info['mosquitto']}; load {info['loadavg']}", flush=True)
    rows: list[Row] = []
    failures: dict[str, str] = {}
    missing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fedagent-bench-") as tmp:
        ctx = Context(
            quick=args.quick,
            work=Path(tmp),
            repeats=repeats,
            sizes=[int(p) for p in args.params] or None,
            log=lambda s: print(f"  {s}", flush=True),
        )
        for name in names:
            print(f"[{name}]", flush=True)
            t0 = time.monotonic()
            try:
                got = SECTIONS[name](ctx)
                rows += got
                missing += check_rows(name, ctx, got)
            except Exception as exc:
                failures[name] = f"{type(exc).__name__}: {exc}"
                print(f"  section {name} failed: {failures[name]}", flush=True)
            except KeyboardInterrupt:
                # Interrupted (Ctrl-C, SIGTERM): still print what the finished sections measured.
                failures[name] = "interrupted"
                print(f"  section {name} interrupted", flush=True)
                break
            print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
        not_measured = list(ctx.shared.get("failures", []))
    info["loadavg_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print_table(rows)
    if not rows:
        print("(no rows)")
    for what in not_measured:
        print(f"NOT MEASURED: {what}")
    for name, why in failures.items():
        print(f"FAILED section {name}: {why}")
    for what in missing:
        print(f"MISSING: {what}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        notes = "".join(f"\nNot measured: {w}\n" for w in not_measured)
        notes += "".join(f"\nMissing: {w}\n" for w in missing)
        (args.out / "table.md").write_text(markdown(rows) + "\n" + notes)
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "machine": info,
                    "quick": args.quick,
                    "repeats": repeats,
                    "failures": failures,
                    "not_measured": not_measured,
                    "missing": missing,
                    "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                },
                indent=2,
            )
        )
    # A row that should have been measured and was not fails the run, whatever the reason
    # (a section that raised, one that gave up on a case, one that returned fewer rows).
    return 1 if failures or not_measured or missing else 0


if __name__ == "__main__":
    sys.exit(main())
