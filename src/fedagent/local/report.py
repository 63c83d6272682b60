"""``fedagent report``: a markdown page with PNG plots from the daemons' histories.

Reads the ``history.jsonl`` files daemons keep in their state directories (the
coordinator's rounds; each agent's updates and evaluations of the global models) and
plots loss/accuracy per round, bytes per round, round duration and participation.
Malformed lines are counted and skipped, never fatal. The plots need matplotlib (the
``report`` extra); without it the report has its tables and says how to get the plots.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fedagent.errors import FedagentError
from fedagent.extras import MissingExtra, require
from fedagent.storage import history as history_files

PLOTS_FEATURE = "plotting"


@dataclass
class History:
    path: Path
    role: str  # "coordinator" or "agent"
    name: str
    rounds: list[dict[str, Any]] = field(default_factory=list)
    abandoned: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    gossip: list[dict[str, Any]] = field(default_factory=list)  # gossip-mode evaluations
    stopped: list[dict[str, Any]] = field(default_factory=list)  # stopped early (privacy budget)
    malformed: int = 0


def find_histories(state_dir: Path) -> list[Path]:
    """Every daemon's history below ``state_dir``, named by its current file (its rotated
    files are read with it)."""
    return history_files.find(state_dir)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_history(path: Path) -> History:
    # Daemons keep <state_dir>/<role>/<federation>/history.jsonl.
    parts = path.parts
    role = parts[-3] if len(parts) >= 3 and parts[-3] in ("agent", "coordinator") else "unknown"
    h = History(path=path, role=role, name=parts[-4] if len(parts) >= 4 else path.stem)
    for line in history_files.read_lines(path):  # oldest first, rotated files included
        try:
            rec = json.loads(line)
            event = rec["event"]
            if not isinstance(rec, dict) or not isinstance(event, str):
                raise TypeError
            if event == "round":
                assert isinstance(rec["round"], int) and isinstance(rec["participants"], list)
                assert isinstance(rec.get("metrics", {}), dict)
                h.rounds.append(rec)
            elif event == "abandoned":
                h.abandoned.append(rec)
            elif event == "global_eval":
                assert isinstance(rec["model_version"], int) and isinstance(rec["metrics"], dict)
                h.evals.append(rec)
            elif event == "update":
                assert isinstance(rec["round"], int)
                h.updates.append(rec)
            elif event in ("stopped", "stopped_sending"):
                assert isinstance(rec["reason"], str)
                h.stopped.append(rec)
            elif event == "gossip_eval":
                assert isinstance(rec["period"], int) and isinstance(rec["metrics"], dict)
                h.gossip.append(rec)
            else:
                h.malformed += 1
        except (ValueError, KeyError, TypeError, AssertionError):
            h.malformed += 1
    return h


def pyplot(feature: str = PLOTS_FEATURE) -> ModuleType:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend: no display needed)."""
    require("matplotlib", "report", feature).use("Agg")
    return require("matplotlib.pyplot", "report", feature)


@functools.cache
def _pyplot_or_reason() -> ModuleType | str:
    """pyplot, or why there are no plots (the one-line missing-extra message)."""
    try:
        return pyplot()
    except MissingExtra as exc:
        return str(exc)


def plots_available() -> bool:
    """Whether reports get their plots (the ``report`` extra is installed)."""
    return not isinstance(_pyplot_or_reason(), str)


def _plots_section(plots: list[tuple[str, str]]) -> list[str]:
    plt = _pyplot_or_reason()
    if isinstance(plt, str):
        return ["## Plots", "", f"Not drawn: {plt}.", ""]
    lines = ["## Plots", ""]
    for f, caption in plots:
        lines += [f"### {caption}", "", f"![{caption}]({f})", ""]
    return lines


def _plot(
    path: Path,
    title: str,
    xlabel: str,
    series: dict[str, tuple[list[Any], list[Any]]],
    ylabel: str,
    kind: str = "line",
    marks: list[float] | None = None,
) -> None:
    plt = _pyplot_or_reason()
    if isinstance(plt, str):
        return  # the report's Plots section says once how to get them
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, (xs, ys) in series.items():
        if kind == "bar":
            ax.bar(xs, ys, label=label, alpha=0.8)
        elif kind == "scatter":
            ax.scatter(xs, ys, s=14, label=label, alpha=0.8)
        else:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    for m in marks or []:
        ax.axvline(m, color="red", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(histories: Path | list[Path], out_dir: Path, *, title: str | None = None) -> Path:
    paths = [histories] if isinstance(histories, Path) else list(histories)
    loaded = [read_history(p) for p in paths]
    coords = [h for h in loaded if h.rounds or h.abandoned]
    agents = [h for h in loaded if h.evals or h.updates]
    if not coords and not agents and any(h.gossip for h in loaded):
        return write_gossip_report(paths, out_dir, title=title)
    if not coords and not agents:
        raise FedagentError(f"no rounds recorded in {', '.join(map(str, paths)) or '(no history files)'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title or 'fedagent report'}", ""]
    plots: list[tuple[str, str]] = []

    for c in coords:
        rounds = sorted(c.rounds, key=lambda r: r["round"])
        xs = [r["round"] for r in rounds]
        keys = sorted({k for r in rounds for k, v in r.get("metrics", {}).items() if _is_number(v)})
        marks = [a["round"] for a in c.abandoned if isinstance(a.get("round"), int)]
        if keys:
            f = "metrics.png"
            _plot(
                out_dir / f,
                "training metrics reported by the agents (sample-weighted)",
                "round",
                {
                    k: (
                        [r["round"] for r in rounds if k in r["metrics"]],
                        [r["metrics"][k] for r in rounds if k in r["metrics"]],
                    )
                    for k in keys
                },
                "value",
                marks=marks,
            )
            plots.append((f, "Training metrics per round (dotted red: abandoned rounds)"))
        bytes_in = [r.get("bytes_in", 0) for r in rounds]
        bytes_out = [r.get("bytes_out", 0) for r in rounds]
        per_in = [b - a for a, b in zip([0] + bytes_in[:-1], bytes_in)]
        per_out = [b - a for a, b in zip([0] + bytes_out[:-1], bytes_out)]
        f = "bytes.png"
        _plot(
            out_dir / f,
            "coordinator traffic per round",
            "round",
            {"in (updates)": (xs, [b / 1e6 for b in per_in]), "out (models)": (xs, [b / 1e6 for b in per_out])},
            "MB",
        )
        plots.append((f, "Bytes per round at the coordinator"))
        secs = [float(r.get("seconds", 0.0)) for r in rounds]
        f = "round_time.png"
        _plot(out_dir / f, "round duration", "round", {"seconds": (xs, secs)}, "seconds", marks=marks)
        plots.append((f, "Round duration"))
        f = "participation.png"
        _plot(
            out_dir / f,
            "participants per round",
            "round",
            {"agents": (xs, [len(r["participants"]) for r in rounds])},
            "agents",
            kind="bar",
            marks=marks,
        )
        plots.append((f, "Participation per round"))
        private = [r for r in rounds if isinstance(r.get("privacy"), dict) and _is_number(r["privacy"].get("epsilon"))]
        if private:
            f = "privacy.png"
            budget = private[-1]["privacy"].get("epsilon_budget")
            series = {"ε spent": ([r["round"] for r in private], [r["privacy"]["epsilon"] for r in private])}
            if _is_number(budget):
                series["budget"] = ([private[0]["round"], private[-1]["round"]], [budget, budget])
            _plot(out_dir / f, f"privacy spent (δ = {private[-1]['privacy'].get('delta', 0):g})", "round", series, "ε")
            plots.append((f, "Differential privacy: ε spent after each round"))
        final = rounds[-1].get("metrics", {}) if rounds else {}
        lines += [
            "## Summary",
            "",
            "| | |",
            "|---|---|",
            f"| rounds aggregated | {len(rounds)} |",
            f"| final model version | {rounds[-1].get('model_version', '-') if rounds else '-'} |",
            f"| final metrics | {', '.join(f'{k} = {v:.4f}' for k, v in final.items()) or '-'} |",
            f"| bytes in / out | {sum(per_in):,} / {sum(per_out):,} |",
            f"| round time median / max | {statistics.median(secs):.3f} s / {max(secs):.3f} s |"
            if secs
            else "| round time | - |",
            f"| agents seen | {', '.join(sorted({p for r in rounds for p in r['participants']})) or '-'} |",
            f"| abandoned rounds | {len(c.abandoned)} |",
        ]
        if private:
            p = private[-1]["privacy"]
            budget = p.get("epsilon_budget")
            lines.append(
                f"| differential privacy | ε = {p['epsilon']:.3f} spent at δ = {p.get('delta', 0):g}"
                + (f" of a budget of {budget:g}" if _is_number(budget) else "")
                + f"; noise multiplier {p.get('noise_multiplier', float('nan')):.3g}, "
                f"clip norm {p.get('clip_norm', float('nan')):.3g} |"
            )
        lines += [f"| stopped early | {s['reason']} |" for s in c.stopped]
        lines.append("")
        if c.abandoned:
            lines += ["| abandoned round | reason |", "|---|---|"]
            lines += [f"| {a.get('round')} | {a.get('reason', '')} |" for a in c.abandoned]
            lines.append("")

    if agents:
        keys = sorted({k for a in agents for e in a.evals for k, v in e["metrics"].items() if _is_number(v)})
        for k in keys:
            f = f"agents_{k}.png"
            _plot(
                out_dir / f,
                f"global model {k}, evaluated by each agent on its task's held-out data",
                "model version",
                {
                    a.name: (
                        [e["model_version"] for e in a.evals if k in e["metrics"]],
                        [e["metrics"][k] for e in a.evals if k in e["metrics"]],
                    )
                    for a in agents
                },
                k,
            )
            plots.append((f, f"Global model {k}, evaluated by each agent"))
        lines += [
            "## Agents",
            "",
            "| agent | updates sent | last local metrics | last global-model evaluation |",
            "|---|---|---|---|",
        ]
        for a in agents:
            lu = a.updates[-1].get("metrics", {}) if a.updates else {}
            le = a.evals[-1]["metrics"] if a.evals else {}
            fmt = lambda m: ", ".join(f"{k} = {v:.4f}" for k, v in m.items() if _is_number(v)) or "-"  # noqa: E731
            lines.append(f"| {a.name} | {len(a.updates)} | {fmt(lu)} | {fmt(le)} |")
        lines.append("")

    lines += _plots_section(plots)
    skipped = sum(h.malformed for h in loaded)
    lines += ["## Sources", ""] + [f"- `{h.path}` ({h.role})" for h in loaded]
    if skipped:
        lines.append(f"\n{skipped} malformed history lines were skipped.")
    md = out_dir / "report.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def write_gossip_report(
    paths: list[Path],
    out_dir: Path,
    *,
    title: str | None = None,
    final: dict[str, float] | None = None,
    local: dict[str, float] | None = None,
    centralized: float | None = None,
    margin: float | None = None,
) -> Path:
    """Report of a gossip federation from its agents' histories: each agent's own model
    (accuracy, loss) per period, the disagreement between agents, traffic; with the
    demo's final comparison when given."""
    loaded = [h for h in (read_history(p) for p in paths) if h.gossip]
    if not loaded:
        raise FedagentError(f"no gossip evaluations recorded in {', '.join(map(str, paths)) or '(no history files)'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title or 'fedagent gossip report'}", ""]
    plots: list[tuple[str, str]] = []
    keys = sorted({k for h in loaded for e in h.gossip for k, v in e["metrics"].items() if _is_number(v)})
    for k in keys:
        f = f"gossip_{k}.png"
        _plot(
            out_dir / f,
            f"each agent's own model: {k} on held-out data",
            "exchange period",
            {
                h.name: (
                    [e["period"] for e in h.gossip if k in e["metrics"]],
                    [e["metrics"][k] for e in h.gossip if k in e["metrics"]],
                )
                for h in loaded
            },
            k,
        )
        plots.append((f, f"{k} of each agent's model per exchange period"))
    series = {
        h.name: (
            [e["period"] for e in h.gossip if _is_number(e.get("disagreement"))],
            [e["disagreement"] for e in h.gossip if _is_number(e.get("disagreement"))],
        )
        for h in loaded
    }
    if any(xs for xs, _ in series.values()):
        f = "gossip_disagreement.png"
        _plot(
            out_dir / f,
            "distance of each agent's model from the models it last received",
            "exchange period",
            series,
            "L2 distance",
        )
        plots.append((f, "Disagreement between agents (L2 distance to the last received models)"))
    f = "gossip_bytes.png"
    _plot(
        out_dir / f,
        "bytes sent by each agent (cumulative)",
        "exchange period",
        {h.name: ([e["period"] for e in h.gossip], [e.get("bytes_out", 0) / 1e6 for e in h.gossip]) for h in loaded},
        "MB",
    )
    plots.append((f, "Traffic sent per agent"))
    lines += [
        "## Agents",
        "",
        "| agent | periods | sent | received | dropped | last evaluation | ε spent (local DP) |",
        "|---|---|---|---|---|---|---|",
    ]
    for h in loaded:
        e = h.gossip[-1]
        m = ", ".join(f"{k} = {v:.4f}" for k, v in e["metrics"].items() if _is_number(v)) or "-"
        p = e.get("privacy")
        eps = (
            f"{p['epsilon']:.3f} at δ = {p.get('delta', 0):g}" + (" (budget reached)" if h.stopped else "")
            if isinstance(p, dict) and _is_number(p.get("epsilon"))
            else "-"
        )
        lines.append(
            f"| {h.name} | {e['period']} | {e.get('sent', '-')} | {e.get('received', '-')} | "
            f"{e.get('dropped', '-')} | {m} | {eps} |"
        )
    lines.append("")
    if final:
        lines += ["## Final test accuracy", "", "| model | accuracy |", "|---|---|"]
        lines += [f"| gossip: {k}'s own model | {v:.3f} |" for k, v in final.items()]
        lines += [f"| local only: {k} | {v:.3f} |" for k, v in (local or {}).items()]
        if centralized is not None:
            lines.append(f"| centralized (same total mini-batches) | {centralized:.3f} |")
            worst = min(final.values())
            lines += [
                "",
                f"Worst agent {worst:.3f}, {centralized - worst:+.3f} below centralized"
                + (f" (margin {margin})." if margin is not None else "."),
            ]
        lines.append("")
    lines += _plots_section(plots)
    lines += ["## Sources", ""] + [f"- `{h.path}`" for h in loaded]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines) + "\n")
    return md
