"""Human rendering of a daemon's status reply (``fedagent status`` without --json)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(value: Any) -> str:
    if value is None or value == {} or value == []:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _ago(ts: float | None) -> str:
    return "-" if not ts else f"{max(0.0, time.time() - ts):.0f}s ago"


def render_status(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"fedagent {s.get('role', '?')} {s.get('id', '')}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    if s.get("mode") == "gossip" and "gossip" in s:
        return _render_gossip(s, t, console)
    rows = [
        ("federation", s.get("federation")),
        ("mode", s.get("mode")),
        ("role", s.get("role")),
        ("connection", s.get("connection")),
        ("broker", s.get("broker")),
        ("coordinator", s.get("coordinator")),
        ("phase", s.get("phase") or s.get("round_state")),
        ("round", s.get("round") if s.get("mode") != "syncopt" else None),
        ("step", s.get("step") if s.get("mode") == "syncopt" else None),
        ("vocabulary", f"{s['vocabulary_size']} terms" if s.get("vocabulary_size") else None),
        ("last loss", s.get("last_loss")),
        ("rounds done", s.get("completed_rounds", s.get("rounds_trained"))),
        ("model version", s.get("model_version")),
        ("last metrics", s.get("metrics") or s.get("last_metrics")),
        ("global model eval", s.get("global_model_eval")),
        ("reconnects", s.get("reconnects")),
        ("last error", s.get("last_error")),
        ("rejected", s.get("rejected")),
        ("bytes in / out", f"{s.get('bytes_in', 0):,} / {s.get('bytes_out', 0):,}"),
    ]
    for k, v in rows:
        if (v is not None and k not in ("coordinator",)) or (k == "coordinator" and s.get("role") == "agent"):
            t.add_row(k, _fmt(v))
    console.print(t)
    if s.get("peers"):
        render_peers(s, console)


def _render_gossip(s: dict[str, Any], t: Table, console: Console) -> None:
    gs = s["gossip"]
    dis = s.get("disagreement")
    rel = s.get("disagreement_rel")
    rows = [
        ("federation", s.get("federation")),
        ("mode", "gossip (no coordinator)"),
        ("connection", s.get("connection")),
        ("broker", s.get("broker")),
        ("links", s.get("links")),
        ("state", s.get("round_state")),
        ("period", s.get("period")),
        ("model age", f"{s.get('model_age', 0):.0f} local steps"),
        ("merge / create", f"{gs.get('merge')} / {gs.get('create')}"),
        (
            "exchanges",
            f"sent {gs['sent']}, received {gs['received']}, dropped {gs['dropped']}, "
            f"refused {gs['refused']}, timeouts {gs['timeouts']}, in flight {gs['in_flight']}",
        ),
        ("disagreement", "-" if dis is None else f"{dis:.4g}" + ("" if rel is None else f" ({rel:.2%} of |model|)")),
        ("last metrics", s.get("last_metrics")),
        ("local model eval", s.get("local_model_eval")),
        ("reconnects", s.get("reconnects")),
        ("last error", s.get("last_error")),
        ("rejected", s.get("rejected")),
        ("bytes in / out", f"{s.get('bytes_in', 0):,} / {s.get('bytes_out', 0):,}"),
    ]
    for k, v in rows:
        if v is not None:
            t.add_row(k, _fmt(v))
    console.print(t)
    if s.get("peers"):
        render_peers(s, console)


def _online(value: Any) -> str:
    return "-" if value is None else ("yes" if value else "no")


def render_peers(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    peers = s.get("peers") or {}
    if not peers:
        console.print(f"no peers known in federation {s.get('federation') or '(none)'}")
        return
    p = Table(title=f"peers in {s.get('federation') or '?'}", title_justify="left")
    for col in ("id", "role", "online", "broker", "mDNS", "last seen"):
        p.add_column(col)
    for pid, info in peers.items():
        p.add_row(
            pid,
            str(info.get("role", "-")),
            _online(info.get("online")),
            str(info.get("broker") or "-"),
            "yes" if info.get("mdns") else "no",
            _ago(info.get("last_seen")),
        )
    console.print(p)


def render_search(text: str, s: dict[str, Any], console: Console | None = None) -> None:
    """``fedagent search``: the merged top-k, then who answered and who did not."""
    console = console or Console(width=120)
    t = Table(
        title=f"top {s.get('k')} for {text!r} (model version {_fmt(s.get('model_version'))}, {s.get('space')})",
        title_justify="left",
    )
    for col in ("#", "site", "document", "score"):
        t.add_column(col, justify="right" if col in ("#", "score") else "left")
    for i, r in enumerate(s.get("results") or [], 1):
        t.add_row(str(i), str(r["site"]), str(r["doc_id"]), f"{r['score']:.4f}")
    console.print(t)
    refused = [f"{f.get('peer')} ({f.get('error')})" for f in s.get("failed") or []]
    console.print(
        f"asked {len(s.get('asked') or [])} peers: answered {_fmt(s.get('answered'))}; "
        f"silent after {s.get('timeout')}s: {_fmt(s.get('silent'))}; refused: {_fmt(refused)}; "
        f"took {s.get('seconds')}s"
    )
    if s.get("mapped"):
        console.print(
            "mapped: "
            + "; ".join(f"{m['peer']} -> {m['space']} (d={m['dim']}, mapper {m['mapper']})" for m in s["mapped"])
        )
