"""SEEC over seeds: one table and one plot from several runs of ``fedagent experiment seec``.

Reads the ``results.json`` of each report folder (one run of the whole experiment each,
joint learning and the live mapped search through the daemons), and writes ``report.md``
and ``seeds.png`` to ``--out``: every row's figure per seed, mean ± sample standard
deviation, the 95 % interval of the mean (Student t), the paper's number and the gap, and
each run's wall time and command.

    .venv/bin/python experiments/scripts/seec_seeds.py --out results/seec/manpages-seeds \\
        results/seec/manpages results/seec/manpages-seed1 results/seec/manpages-seed2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from fedagent_experiments.seec import PAPER, command_line

from fedagent.local.report import pyplot

# two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# the paper's number each row is compared with (shared/seeds/002, Sec. V)
PAPER_OF = {"joint": ("joint", "Slack"), "mapping": ("mapped_wiki", "Wikipedia")}
RANDOM_ROW = "random ranking"


def paper_number(row: str) -> tuple[float, str] | None:
    for prefix, (key, corpus) in PAPER_OF.items():
        if row.startswith(prefix):
            return PAPER[key], corpus
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="report folders of fedagent experiment seec")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [(d, json.loads((d / "results.json").read_text())) for d in args.runs]
    runs.sort(key=lambda dr: dr[1]["scale"]["seed"])
    seeds = [r["scale"]["seed"] for _, r in runs]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"two runs with the same seed: {seeds}")
    rows = list(runs[0][1]["sim_k"])
    if any(list(r["sim_k"]) != rows for _, r in runs):
        raise SystemExit("the runs do not have the same rows")
    k, n = runs[0][1]["k"], runs[0][1]["documents"]
    table: dict[str, list[float]] = {row: [r["sim_k"][row] for _, r in runs] for row in rows}
    table[RANDOM_ROW] = [r["random_expectation"] for _, r in runs]
    args.out.mkdir(parents=True, exist_ok=True)

    def cell(values: list[float]) -> tuple[str, str, float]:
        mean = statistics.fmean(values)
        if len(values) < 2:
            return f"{mean:.3f}", "-", mean
        sd = statistics.stdev(values)
        half = T95.get(len(values) - 1, 1.96) * sd / len(values) ** 0.5
        return f"{mean:.3f} ± {sd:.3f}", f"{mean - half:.3f} - {mean + half:.3f}", mean

    lines = [
        f"# SEEC on {n} documents over {len(seeds)} seeds (joint learning and live mapping through the daemons)",
        "",
        f"sim_{k} against each run's own centralized model; every run is the whole experiment "
        "(a centralized model, a second one with another seed, joint learning through a Mosquitto, "
        "a coordinator and the agents, in-process mapping, live mapped search through the agents). "
        "Mean ± sample standard deviation over the seeds; the interval is the 95 % interval of the mean "
        "(Student t).",
        "",
        f"| search | {' | '.join(f'seed {s}' for s in seeds)} | mean ± sd | 95 % interval | paper | gap to the paper |",
        f"|---|{'---|' * len(seeds)}---|---|---|---|",
    ]
    for row, values in table.items():
        mean_sd, interval, mean = cell(values)
        paper = paper_number(row)
        paper_txt, gap = ("-", "-") if paper is None else (f"{paper[0]:.3f} ({paper[1]})", f"{mean - paper[0]:+.3f}")
        lines.append(
            f"| {row} | {' | '.join(f'{v:.3f}' for v in values)} | {mean_sd} | {interval} | {paper_txt} | {gap} |"
        )
    ceiling = table.get("second centralized model (other seed)")
    joint = next((v for row, v in table.items() if row.startswith("joint")), None)
    if ceiling and joint:
        ratios = [j / c for j, c in zip(joint, ceiling)]
        lines += ["", f"Joint learning / ceiling per seed: {', '.join(f'{x:.3f}' for x in ratios)}."]
    same = [r.get("live_mapped_meta", {}).get("same_top_k_as_in_process") for _, r in runs]
    if all(s is not None for s in same):
        lines.append(
            f"Live mapped search = in process: the same top {k} for {', '.join(f'{s} of {n}' for s in same)} "
            "documents (seeds in order)."
        )
    lines += ["", "## Runs", ""]
    for (d, r), seed in zip(runs, seeds):
        rel = os.path.relpath(d / "report.md", args.out)
        lines.append(
            f"* seed {seed}: `{command_line(r['scale'], d)}`, {r['seconds']:.0f} s "
            f"(joint learning through the daemons {r['joint_meta'].get('seconds', 0):.0f} s), [report]({rel})"
        )
    lines += [
        "",
        "![seeds](seeds.png)",
        "",
        f"Written by `experiments/scripts/seec_seeds.py --out {args.out} {' '.join(str(d) for d, _ in runs)}`.",
        "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(table)
    for y, name in enumerate(names):
        ax.scatter(table[name], [y] * len(seeds), color="C0", s=18, zorder=3)
        ax.plot([min(table[name]), max(table[name])], [y, y], color="C0", lw=1)
        ax.text(max(table[name]) + 0.008, y, f"{statistics.fmean(table[name]):.3f}", va="center", fontsize=8)
    ax.axvline(PAPER["joint"], color="C1", ls="--", lw=1, label=f"paper joint {PAPER['joint']}")
    ax.axvline(
        PAPER["mapped_wiki"], color="C2", ls="--", lw=1, label=f"paper mapped (Wikipedia) {PAPER['mapped_wiki']}"
    )
    ax.set_yticks(range(len(names)), [nm[:60] for nm in names], fontsize=8)
    ax.set_xlabel(f"sim_{k} against the centralized model (one dot a seed: {', '.join(map(str, seeds))})")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out / "seeds.png", dpi=110)
    plt.close(fig)
    print(args.out / "report.md")


if __name__ == "__main__":
    main()
