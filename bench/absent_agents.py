"""Broker memory while agents are away: the scenario of tests/faults/test_absent_agents.py, for a
before/after comparison across checkouts.

    .venv/bin/python bench/absent_agents.py run --out after.json          # this checkout
    OTHER/.venv/bin/python bench/absent_agents.py run --out before.json   # another one
    .venv/bin/python bench/absent_agents.py plot before.json after.json --out DIR

``run`` uses the ``fedagent`` of the interpreter that runs it (an editable install points
at its own checkout) and this checkout's test scenario: 10 agents, 3 of them stopped for
50 rounds of a 4 MiB model, then started again (``--agents/--absent/--rounds-away``).
``plot`` writes ``rss.png`` (the broker's RSS over each run) and ``report.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _scenario():
    sys.path.insert(0, str(TESTS))
    spec = importlib.util.spec_from_file_location("absent_agents_scenario", TESTS / "test_absent_agents.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.scenario


def run(args: argparse.Namespace) -> None:
    import fedagent

    with tempfile.TemporaryDirectory(prefix="absent-agents-") as work:
        out = _scenario()(Path(work), agents=args.agents, absent=args.absent, rounds_away=args.rounds_away)
    out["fedagent"] = str(Path(fedagent.__file__).resolve().parent)
    out["label"] = args.label
    # What the returning agents did first: model fetched, or stale round starts evaluated.
    out["returned_first"] = {
        a: [f"{r['event']} v{r.get('model_version', r.get('base_version'))}" for r in recs[:6]]
        for a, recs in out.pop("returned").items()
    }
    out.pop("returned_status", None)
    out["model_requests"] = out.pop("coordinator").get("model_requests")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "timeline"}, indent=1))


def _mb(kb: int) -> str:
    return f"{kb / 1024:.0f} MB"


def plot(args: argparse.Namespace) -> None:
    from fedagent.extras import require

    require("matplotlib", "report", "the plot of bench/absent_agents.py")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[dict[str, Any]] = [json.loads(Path(p).read_text()) for p in args.runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        t = [s[0] for s in r["timeline"]]
        ax.plot(t, [s[1] / 1024 for s in r["timeline"]], label=r.get("label") or r["fedagent"], lw=1)
        away = [s[0] for s in r["timeline"] if s[2] == "away"]
        if away:
            ax.axvspan(min(away), max(away), alpha=0.08, color=ax.lines[-1].get_color())
    ax.set_xlabel("seconds since the federation started")
    ax.set_ylabel("broker RSS (MB)")
    first = runs[0]
    ax.set_title(
        f"Mosquitto RSS: {first['agents']} agents, {first['absent']} away for {first['rounds_away']} rounds "
        f"(shaded), {first['model_bytes'] / 2**20:.0f} MiB model"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=110)
    rows = [
        "| run | idle | peak, all online | peak while away | at the end of the absence | peak over the run | returning agents first saw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        first_seen = "; ".join(f"{a}: {', '.join(v[:3])}" for a, v in sorted(r["returned_first"].items())[:1])
        rows.append(
            f"| {r.get('label') or r['fedagent']} | {_mb(r['rss_idle_kb'])} | {_mb(r['hwm_all_online_kb'])} | "
            f"{_mb(r['hwm_away_kb'])} | {_mb(r['rss_end_of_absence_kb'])} | {_mb(r['hwm_total_kb'])} | {first_seen} |"
        )
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--label", default="")
    r.add_argument("--agents", type=int, default=10)
    r.add_argument("--absent", type=int, default=3)
    r.add_argument("--rounds-away", type=int, default=50)
    p = sub.add_parser("plot")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    args = ap.parse_args()
    run(args) if args.cmd == "run" else plot(args)


if __name__ == "__main__":
    main()
