"""What making the replay guard durable costs per delivered message: the journal
(``fedagent.security.replaylog``: one appended record + fdatasync) against the whole-snapshot
rewrite it replaced (temporary file, fsync, rename, directory fsync), both measured in
this run, on the same guard state, alternating message by message.

The guard holds N senders with 64 numbers each (every sender has sent 64 messages: the
snapshot's steady size). Each "message" is one new number from a random sender accepted
by the guard and then made durable. The journal's figure also carries its compaction,
amortized: the measured rewrite time divided by the number of appends that fit between
two compactions (the file is compacted when it has doubled, at least 1 MiB).

    nice -n 10 .venv/bin/python bench/replay_journal.py [--senders 10,1000] [--messages 200] [--dir DIR]

``--dir`` must be on the disk the state directory would be on (tmpfs makes fsync free);
the default is a temporary directory under ``bench/``.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.registry import Context, Row, section  # noqa: E402
from fedagent.security import replaylog  # noqa: E402
from fedagent.security.replaylog import ReplayJournal  # noqa: E402
from fedagent.security.signing import ReplayGuard  # noqa: E402
from fedagent.storage import statefile  # noqa: E402

KEEP = 64
NOW = 1.7e9


def _guard(senders: int) -> tuple[ReplayGuard, dict[str, int]]:
    g = ReplayGuard(keep=KEEP, max_skew=300)
    nxt = {}
    for i in range(senders):
        name = f"agent-{i:05d}"
        base = 1_732_000_000_000_000 + i * 10_000_000
        for k in range(KEEP):
            g.check(name, base + k, NOW, NOW)
        nxt[name] = base + KEEP
    return g, nxt


def measure(senders: int, messages: int, work: Path) -> dict:
    """Per-message seconds of the snapshot rewrite and of the journal, same run."""
    rng = random.Random(senders)
    old_g, old_next = _guard(senders)
    new_g, new_next = _guard(senders)
    old_path, new_path = work / f"snapshot-{senders}", work / f"journal-{senders}"
    statefile.atomic_write(old_path, old_g.snapshot())
    journal = ReplayJournal(new_path, new_g, lambda: NOW)
    journal.load()
    names = list(old_next)
    old_t, new_t = [], []
    for _ in range(messages):
        name = rng.choice(names)
        t0 = time.perf_counter()
        old_g.check(name, old_next[name], NOW, NOW)
        statefile.atomic_write(old_path, old_g.snapshot())
        old_t.append(time.perf_counter() - t0)
        old_next[name] += 1
        t0 = time.perf_counter()
        new_g.check(name, new_next[name], NOW, NOW)
        journal.commit()
        new_t.append(time.perf_counter() - t0)
        new_next[name] += 1
    appends = journal.appends
    record = (new_path.stat().st_size - journal._compacted) / max(1, appends)
    compact_t = []
    for _ in range(3):
        t0 = time.perf_counter()
        journal._compact()
        compact_t.append(time.perf_counter() - t0)
    snapshot_bytes = journal._compacted
    between = max(1.0, (max(replaylog.MIN_COMPACT, 2 * snapshot_bytes) - snapshot_bytes) / record)
    journal.close()
    return {
        "senders": senders,
        "snapshot_bytes": old_path.stat().st_size,
        "journal_snapshot_bytes": snapshot_bytes,
        "record_bytes": record,
        "old_median": statistics.median(old_t),
        "old_mean": statistics.fmean(old_t),
        "new_median": statistics.median(new_t),
        "new_mean": statistics.fmean(new_t),
        "compaction": statistics.median(compact_t),
        "appends_between": between,
        "new_amortized": statistics.fmean(new_t) + statistics.median(compact_t) / between,
        "messages": messages,
    }


@section("replay", rows=lambda ctx: 2)
def replay_section(ctx: Context, senders: tuple[int, ...] = (10, 1000), messages: int | None = None) -> list[Row]:
    """The journal's cost per delivered message against the snapshot rewrite."""
    messages = messages or (50 if ctx.quick else 200)
    rows = []
    work = ctx.work / "replay"
    work.mkdir(parents=True, exist_ok=True)
    for n in senders:
        m = measure(n, messages, work)
        ctx.log(
            f"replay guard, {n} senders: snapshot {m['old_median'] * 1e3:.2f} ms, journal "
            f"{m['new_median'] * 1e3:.2f} ms per message"
        )
        rows.append(
            Row(
                "replay",
                f"replay guard made durable per message, journal, {n} senders (mean, compaction amortized)",
                m["new_amortized"],
                "whole-snapshot rewrite (mean)",
                m["old_mean"],
                note=f"medians {m['new_median'] * 1e3:.2f} vs {m['old_median'] * 1e3:.2f} ms; snapshot "
                f"{m['snapshot_bytes'] / 1e3:.0f} KB, record {m['record_bytes']:.0f} B, compaction "
                f"{m['compaction'] * 1e3:.1f} ms every {m['appends_between']:.0f} messages; "
                f"n={messages}",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", default="10,1000")
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=".replay-bench-", dir=args.dir or Path(__file__).parent))
    try:
        results = [measure(int(n), args.messages, work) for n in args.senders.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = Table(
        title=f"Replay guard durability per delivered message ({args.messages} messages each, "
        "alternating; ratio = snapshot / journal)",
        title_justify="left",
    )
    for col in (
        "senders",
        "snapshot",
        "snapshot rewrite median / mean",
        "journal append median / mean",
        "compaction (every N msgs)",
        "journal amortized mean",
        "ratio (means)",
    ):
        t.add_column(col, justify="right")
    for m in results:
        t.add_row(
            str(m["senders"]),
            f"{m['snapshot_bytes'] / 1e3:.1f} KB",
            f"{m['old_median'] * 1e3:.2f} / {m['old_mean'] * 1e3:.2f} ms",
            f"{m['new_median'] * 1e3:.2f} / {m['new_mean'] * 1e3:.2f} ms",
            f"{m['compaction'] * 1e3:.1f} ms ({m['appends_between']:.0f})",
            f"{m['new_amortized'] * 1e3:.2f} ms",
            f"{m['old_mean'] / m['new_amortized']:.1f}x",
        )
    Console(width=160).print(t)
    with open("/proc/loadavg") as f:
        Console().print(f"load average {' '.join(f.read().split()[:3])}; directory on {work.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
