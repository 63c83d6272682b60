"""Long run: the digits federation for hours, and what its processes and files do meanwhile.

    nice -n 10 .venv/bin/python bench/soak.py --hours 2 --out DIR
    .venv/bin/python bench/soak.py --minutes 3 --out DIR          # a look at the set-up

A coordinator and ``--agents`` (4) agents on loopback, FedAvg on digits (the chaos soak's
federation, bench/chaos.py, without faults), until ``--hours`` pass or ``--rounds``
rounds are aggregated. Every ``--sample-every`` seconds it records the RSS and the open
file descriptors of every process (the broker included) and the disk use of every
node's state directory. The histories rotate at ``--history-max-bytes`` with
``--history-keep`` rotated files (the settings ``history_max_bytes``/``history_keep``),
so that a run of hours shows the rotation at work.

``--out`` gets ``soak.md`` (a table: each figure after start-up, at the end, its
maximum and the bound it has to stay under), ``soak.json`` (every sample) and
``soak.png`` (the three over time; matplotlib, the ``report`` extra). The bounds: RSS
at most 1.1 x its value after start-up + 20 MB; open files at most their number after
start-up + 8; disk use at most the checkpoint and journals plus ``(history_keep + 1) x
history_max_bytes`` and one record per history (what rotation promises). Exit status 1
if a figure passed its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos import MB, FedAvgSetup, Sampler, Site, log, stop_site
from fedagent.storage.history import history_files

# Room on disk beyond the histories: the checkpoint (~30 KB for digits), the round and
# replay journals (compacted at 1 MiB), sequence numbers, keys: generous.
OTHER_STATE = 4 * MB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--minutes", type=float, help="instead of --hours")
    p.add_argument("--rounds", type=int, default=100_000, help="stop once this many rounds are aggregated")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument(
        "--warmup-rounds", type=int, default=100, help="the reference figures are the first ones after this many rounds"
    )
    p.add_argument("--history-max-bytes", type=int, default=2 * MB)
    p.add_argument("--history-keep", type=int, default=3)
    p.add_argument("--work", type=Path)
    a = p.parse_args(argv)
    seconds = a.minutes * 60 if a.minutes is not None else a.hours * 3600
    args = argparse.Namespace(
        agents=a.agents,
        alpha=0.5,
        round_timeout=20.0,
        netns=False,
        faults=[],
        restart_sec=5.0,
        disk_mb=0,
        mode="fedavg",
    )
    with tempfile.TemporaryDirectory(prefix="fedagent-soak-") as tmp:
        work = a.work or Path(tmp)
        setup = FedAvgSetup()
        site = Site(work, args, setup, random.Random(1))
        sampler = Sampler(site, a.sample_every)
        progress: list[tuple[float, int]] = []
        try:
            site.prepare()
            for name in site.names:
                path = site.fed.config_path(name)
                doc = tomllib.loads(path.read_text())
                doc.update(history_max_bytes=a.history_max_bytes, history_keep=a.history_keep)
                path.write_text(tomli_w.dumps(doc))
            site.start_all()
            sampler.start()
            last_log = 0.0
            while site.now() < seconds:
                site.supervise()
                version = setup.poll(site)["version"]
                if not progress or progress[-1][1] != version:
                    progress.append((round(site.now(), 1), version))
                if version >= a.rounds:
                    break
                if site.now() - last_log > 60:
                    last_log = site.now()
                    s = sampler.samples[-1] if sampler.samples else {"rss": {}, "fds": {}}
                    log(
                        f"{site.now() / 60:6.1f} min: version {version}; RSS MB "
                        + " ".join(f"{k}={v / MB:.0f}" for k, v in sorted(s["rss"].items()))
                        + "; fds "
                        + " ".join(f"{k}={v}" for k, v in sorted(s["fds"].items()))
                    )
                time.sleep(1.0)
            alive = {n: site.alive(n) for n in site.names}
            sampler.stopped.set()
            sampler.join()
            histories = {
                n: [(f.name, f.stat().st_size) for f in history_files(setup.history_path(site, n))] for n in site.names
            }
            stop_site(site, setup)
        finally:
            sampler.stopped.set()
            site.close()
        out = report(a, sampler.samples, progress, histories, alive, site.exits)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak.json").write_text(json.dumps(out, indent=1, default=str))
    write_md(a.out / "soak.md", out)
    plot(a.out / "soak.png", out)
    log(f"report: {a.out / 'soak.md'}")
    return 0 if out["ok"] else 1


def report(a, samples, progress, histories, alive, exits) -> dict[str, Any]:
    warm = next((t for t, v in progress if v >= a.warmup_rounds), progress[-1][0] if progress else 0)
    after = [s for s in samples if s["t"] >= warm] or samples
    first, last = after[0], after[-1]
    disk_bound = OTHER_STATE + (a.history_keep + 1) * a.history_max_bytes + 64 * 1024
    rows = []
    for kind, bound in (
        ("rss", lambda v: int(1.1 * v + 20 * MB)),
        ("fds", lambda v: v + 8),
        ("disk", lambda v: disk_bound),
    ):
        for name in sorted({n for s in after for n in s[kind]}):
            values = [s[kind][name] for s in after if name in s[kind]]
            start = first[kind].get(name, values[0])
            b = bound(start)
            rows.append(
                {
                    "figure": kind,
                    "process": name,
                    "after_warmup": start,
                    "end": last[kind].get(name),
                    "max": max(values),
                    "bound": b,
                    "ok": max(values) <= b,
                }
            )
    load = os.getloadavg()
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "seconds": samples[-1]["t"] if samples else 0,
        "rounds": progress[-1][1] if progress else 0,
        "progress": progress,
        "rows": rows,
        "histories": histories,
        "alive_at_end": alive,
        "exits": [e.__dict__ for e in exits],
        "load_end": [round(x, 1) for x in load],
        "samples": samples,
        "ok": all(r["ok"] for r in rows) and all(alive.values()) and not exits,
    }


def _fmt(kind: str, v: Any) -> str:
    if v is None:
        return "—"
    return f"{v / MB:.1f} MB" if kind in ("rss", "disk") else str(v)


def write_md(path: Path, out: dict[str, Any]) -> None:
    s = out["settings"]
    lines = [
        f"# Soak: {out['rounds']} rounds in {out['seconds'] / 3600:.2f} h",
        "",
        f"{s['agents']} agents, digits, FedAvg; history rotated at {s['history_max_bytes'] / MB:g} MiB, "
        f"{s['history_keep']} kept; samples every {s['sample_every']:g} s; 'after start-up': the first sample "
        f"after round {s['warmup_rounds']}. Load average at the end {out['load_end']}.",
        "",
        "| figure | process / node | after start-up | end | max | bound | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        k = r["figure"]
        lines.append(
            f"| {k} | {r['process']} | {_fmt(k, r['after_warmup'])} | {_fmt(k, r['end'])} | {_fmt(k, r['max'])} "
            f"| {_fmt(k, r['bound'])} | {'yes' if r['ok'] else '**no**'} |"
        )
    lines += ["", "Histories at the end (file, bytes):", ""]
    for n, files in out["histories"].items():
        lines.append(f"- {n}: " + ", ".join(f"{f} {b}" for f, b in files))
    lines += [
        "",
        f"Daemons alive at the end: {out['alive_at_end']}; exits: {out['exits']}.",
        "",
        "![soak](soak.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def plot(path: Path, out: dict[str, Any]) -> None:
    from fedagent.extras import require

    require("matplotlib", "report", "the plot of bench/soak.py")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = out["samples"]
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    hours = [s["t"] / 3600 for s in samples]
    for ax, kind, label, scale in (
        (axes[0], "rss", "RSS (MB)", MB),
        (axes[1], "fds", "open files", 1),
        (axes[2], "disk", "state directory (MB)", MB),
    ):
        for name in sorted({n for s in samples for n in s[kind]}):
            ax.plot(hours, [s[kind].get(name, float("nan")) / scale for s in samples], lw=1, label=name)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, ncol=3, loc="upper left")
    prog = out["progress"]
    axes[3].plot([t / 3600 for t, _ in prog], [v for _, v in prog], color="black", lw=1)
    axes[3].set_ylabel("model version")
    axes[3].set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
