"""Human rendering of a daemon's status reply (``fedagent status`` without --json)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.tree import Tree


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


def _privacy(p: Any) -> str | None:
    """ε spent at δ, against the budget, and how: one line for operators."""
    if not isinstance(p, dict) or "epsilon" not in p:
        return None
    line = f"ε = {p['epsilon']:.3f} at δ = {p.get('delta', 0):g}"
    if p.get("epsilon_budget") is not None:
        line += f" (budget {p['epsilon_budget']:g})"
    parts = [f"{p['mode']}" if p.get("mode") else None]
    if p.get("noise_multiplier") is not None:
        parts.append(f"noise ×{p['noise_multiplier']:.3g}")
    if p.get("clip_norm") is not None:
        parts.append(f"clip {p['clip_norm']:.3g}")
    if p.get("cohort") is not None:
        parts.append(f"last round {p.get('noise_shares', 0):.0f} of {p['cohort']:.0f} noise shares")
    extra = ", ".join(x for x in parts if x)
    return f"{line}; {extra}" if extra else line


def _site_privacy(p: Any) -> str:
    """What a site aggregator does for the upstream tier's distributed DP: nothing but
    pass its calibration down."""
    if not isinstance(p, dict):
        return "-"
    return (
        f"the agents add their shares (σ {p.get('share_std', 0):.3g} each, for {p.get('cohort', 0):.0f} agents, "
        f"clip {p.get('clip_norm', 0):.3g}); added here: {p.get('noise_added', 0):g}, accounted upstream"
    )


def _rounds_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """Round and model version, each with its meaning: a round number is used by every
    round started (also one abandoned, or cut short by a restart); the model version
    counts aggregations, so the two drift apart after faults."""
    if s.get("mode") == "syncopt":
        done = (
            f"{s['steps_done']} of {s.get('steps')}"
            if s.get("steps_done") is not None
            else (f"{s['steps_computed']} (by this agent)" if s.get("steps_computed") is not None else None)
        )
        return [("step", s.get("step")), ("steps done", done), ("model version", s.get("model_version"))]
    rnd, version = s.get("round"), s.get("model_version")
    rows: list[tuple[str, Any]] = [("round", None if rnd is None else f"{rnd} (the latest round started)")]
    if s.get("role") == "coordinator":
        done, target = s.get("completed_rounds"), s.get("rounds")
        if done is not None:
            in_progress = 1 if s.get("phase") == "training" else 0
            lost = max(0, int(rnd or 0) - int(done) - in_progress)
            text = f"{done} aggregated" + (f" of {target}" if target else "")
            if lost:
                text += f"; {lost} not aggregated (abandoned, or cut short by a restart)"
            rows.append(("rounds", text))
    elif s.get("rounds_trained") is not None:
        rows.append(("rounds trained", f"{s['rounds_trained']} (by this agent)"))
    if version is not None:
        meaning = "aggregations so far" if s.get("role") == "coordinator" else "of the global model held"
        rows.append(("model version", f"{version} ({meaning})"))
    return rows


def _eval_text(ev: dict[str, Any] | None, final: int | None = None) -> str | None:
    """``metrics (model version V[, final])`` for an agent's evaluation of a global model;
    while the final model (``final``) is still being scored the line says so."""
    if not ev:
        return None
    metrics = {k: v for k, v in ev.items() if k != "model_version"}
    version = ev.get("model_version")
    tag = ""
    if final is not None and version == final:
        tag = ", the final model"
    elif isinstance(final, int) and isinstance(version, int) and version < final:
        tag = f"; the final model, version {final}, is being evaluated"
    return f"{_fmt(metrics)} (model version {version}{tag})"


def _held_out_text(h: dict[str, Any] | None) -> str | None:
    if not h:
        return None
    agents = h.get("agents") or []
    if "single_source" not in h:  # a coordinator of an earlier release
        return (
            f"{_fmt(h.get('metrics'))} (model version {h.get('model_version')}, "
            f"{len(agents)} agents, {h.get('samples')} samples, weighted by samples)"
        )
    if h.get("single_source"):
        return (
            f"{_fmt(h.get('metrics'))} (model version {h.get('model_version')}: {', '.join(agents)}'s report "
            "alone, no other agent's confirms it)"
        )
    return (
        f"{_fmt(h.get('metrics'))} (model version {h.get('model_version')}, median of {len(agents)} agents, "
        f"{h.get('samples')} samples)"
    )


def _connection_text(s: dict[str, Any]) -> str | None:
    conn = s.get("connection")
    if conn == "unresponsive":
        return (
            f"unresponsive: nothing from the broker for {_fmt(s.get('broker_silent_s'))} s "
            "(link down?); peers' online state unknown"
        )
    return conn


def _refused_text(refused: Any) -> str | None:
    """Nodes refused for what they announced (a model that differs, no samples): who and why."""
    if not refused:
        return None
    return "; ".join(f"{n}: {r['detail'] if isinstance(r, dict) else r}" for n, r in refused.items())


def _waiting_text(w: Any) -> str | None:
    """A FedAvg coordinator waiting for a quorum: how many agents it needs, and which are
    there (the updates a round waits for are the "received" row's)."""
    if not isinstance(w, dict) or w.get("for") != "quorum":
        return None
    online = w.get("online") or []
    return f"a quorum: {len(online)} of {w.get('need')} agents online ({', '.join(online) or 'none'})"


def _rejected_text(s: dict[str, Any]) -> str | None:
    counts = s.get("rejected") or {}
    if not counts:
        return None
    text = _fmt(counts)
    recent = s.get("recent_rejections") or []
    if recent:
        r = recent[-1]
        where = ", ".join(f"{k} {r[k]}" for k in ("round", "step") if k in r)
        text += f"; latest: {r.get('sender')}{' (' + where + ')' if where else ''} {r.get('reason')}"
    return text


def _bounds_text(b: dict[str, Any] | None) -> str | None:
    """The weight cap and the norm bound a FedAvg coordinator holds one member's update to."""
    if not b:
        return None
    parts = []
    if b.get("weight_cap"):
        parts.append(f"weight <= {b['weight_cap']:g}x the median announced samples")
    n = b.get("norm_bound")
    if n:
        if n.get("warming_up"):
            parts.append("distance bound warming up")
        else:
            of = f" ({n['multiplier']:g}x the median {n['median']:.4g})" if n.get("median") is not None else ""
            parts.append(f"distance <= {n['bound']:.4g}{of}")
    return "; ".join(parts) or "off"


def _bounded_text(b: dict[str, Any] | None) -> str | None:
    """Whose update the last round bounded, and who sits out rounds for spoiling one."""
    if not b:
        return None
    items = []
    for agent, what in (b.get("last_round") or {}).items():
        how = []
        if "weight" in what:
            how.append(f"weight {what['weight']:.0f} of {what['samples']:.0f} claimed")
        if "norm" in what:
            how.append(f"distance {what['norm']:.4g} scaled to {what['bound']:.4g}")
        items.append(f"{agent}: {', '.join(how)}")
    for agent, bench in (b.get("benched") or {}).items():
        items.append(f"{agent} sits out rounds until {bench['until_round']} ({bench['offences']} offences)")
    return "; ".join(items) if items else "-"


def _dropped_text(d: dict[str, dict[str, int]] | None) -> str | None:
    """Frames dropped unread, of the senders with the most (over budget, or not expected)."""
    if not d:
        return None
    shown = list(d.items())[:3]
    text = "; ".join(f"{sender}: {_fmt(reasons)}" for sender, reasons in shown)
    return text + (f"; and {len(d) - 3} more senders" if len(d) > 3 else "")


_UPDATE_FORMS = {"none": "uncompressed", "fp16": "fp16 deltas", "int8": "int8 deltas", "topk": "top-k deltas"}


def _updates_text(u: dict[str, Any] | None) -> str | None:
    """How a FedAvg coordinator's agents send their updates, and whether that is the
    default (docs/streaming.md, "Compression")."""
    if not u:
        return None
    mode = str(u.get("compression"))
    how = _UPDATE_FORMS.get(mode, mode)
    where = "default" if u.get("default") else "[transfer] compression"
    return f"{how}, {'streamed' if u.get('streamed') else 'whole'} ({where})"


def _broadcast_text(s: dict[str, Any]) -> str | None:
    """How round starts carry the model (coordinator), or how this agent got it."""
    u = s.get("updates")
    if u and "downlink" in u:
        where = "default" if u.get("downlink_default") else "[transfer] downlink"
        how = "int8 steps from the previous model" if u["downlink"] == "int8" else "the whole model"
        old = u.get("whole_model_only") or []
        if u["downlink"] == "int8" and old:
            names = ", ".join(old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
            return f"{how} ({where}); the whole model while {names} (an earlier release) is online"
        return f"{how} ({where})"
    steps = s.get("model_steps")
    if steps and (steps.get("rebuilt") or steps.get("fetched")):
        return f"{steps['rebuilt']} rebuilt from int8 steps, {steps['fetched']} fetched whole for a round"
    return None


def _server_step_text(step: dict[str, Any] | None) -> str | None:
    """The coordinator's server step: FedAvgM's momentum or plain FedAvg, and server_lr."""
    if not step:
        return None
    beta, lr = step.get("momentum", 0), step.get("lr", 1)
    how = f"momentum {beta:g}" if beta else "plain FedAvg, no momentum"
    if not step.get("default"):
        where = "[rounds] server_momentum"
    else:
        where = step.get("default_reason") or ("default" if beta else "default with differential privacy")
    return f"{how} ({where})" + (f", server_lr {lr:g}" if lr != 1 else "")


def status_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of `fedagent status` for a FedAvg or Sync-Opt node (label, text)."""
    coordinator = s.get("role") == "coordinator"
    final = s.get("model_version") if s.get("round_state") == "finished" or s.get("phase") == "done" else None
    if s.get("final_model_version") is not None:  # a FedAvg agent: training ended
        final = s["final_model_version"]
    rows: list[tuple[str, Any]] = [
        ("federation", s.get("federation")),
        ("mode", s.get("mode")),
        ("role", s.get("role")),
        ("connection", _connection_text(s)),
        ("broker", s.get("broker")),
        ("coordinator", s.get("coordinator") or "-" if not coordinator else None),
        ("mDNS on", s.get("mdns_interfaces")),
        ("phase", s.get("phase") or s.get("round_state")),
        ("waiting for", _waiting_text(s.get("waiting")) if coordinator else None),
        ("refused agents", _refused_text(s.get("refused_agents")) if coordinator else None),
        *(_async_rows(s) if s.get("mode") == "async" else _rounds_rows(s)),
        ("vocabulary", f"{s['vocabulary_size']} terms" if s.get("vocabulary_size") else None),
        ("last loss", s.get("last_loss")),
        ("training metrics" if coordinator else "last training metrics", s.get("metrics") or s.get("last_metrics")),
        ("held-out (agents)", _held_out_text(s.get("held_out")) if coordinator else None),
        ("global model eval", _eval_text(s.get("global_model_eval"), final)),
        ("privacy", _privacy(s.get("privacy"))),
        ("updates", _updates_text(s.get("updates"))),
        ("model broadcast", _broadcast_text(s)),
        ("server step", _server_step_text(s.get("server_step"))),
        ("stopped", s.get("stop_reason")),
        ("reconnects", s.get("reconnects")),
        ("last error", s.get("last_error")),
        ("rejected", _rejected_text(s) or ("-" if "rejected" in s else None)),
        ("dropped unread", _dropped_text(s.get("dropped"))),
        ("update bounds", _bounds_text(s.get("bounds")) if coordinator else None),
        (
            "bounded (last model)" if s.get("mode") == "async" else "bounded (last round)",
            _bounded_text(s.get("bounds")) if coordinator else None,
        ),
        ("bytes in / out", f"{s.get('bytes_in', 0):,} / {s.get('bytes_out', 0):,}"),
        *_round_rows(s),
    ]
    return [(k, _fmt(v)) for k, v in rows if v is not None]


def render_status(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"fedagent {s.get('role', '?')} {s.get('id', '')}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    if s.get("mode") == "gossip" and "gossip" in s:
        return _render_gossip(s, t, console)
    for k, v in status_rows(s):
        t.add_row(k, v)
    console.print(t)
    if s.get("mode") == "async" and s.get("agents"):
        render_async_agents(s, console)
    if isinstance(s.get("tier"), dict):
        render_tier(s["tier"], console)
    if s.get("peers"):
        render_peer_table(s, console)


def render_tier(tier: dict[str, Any], console: Console) -> None:
    """A hub's sites (their agents and state), or a site aggregator's agents and upstream."""
    if tier.get("role") == "hub":
        t = Table(title="sites (site aggregators)", title_justify="left")
        for col in ("site", "agents", "samples", "state"):
            t.add_column(col)
        for name, site in (tier.get("sites") or {}).items():
            t.add_row(name, str(site.get("agents", 0)), str(site.get("samples", 0)), str(site.get("state", "-")))
        console.print(t)
        return
    up = tier.get("upstream") or {}
    last = tier.get("last_partial_result") or {}
    sent = "-"
    if last:
        sent = (
            f"round {last['round']}: {last.get('agents', 0)} agents, {last.get('num_samples', 0)} samples"
            if last.get("sent")
            else f"round {last['round']}: not sent ({last.get('reason', 'held')})"
        )
    held = tier.get("held") or {}
    waiting = (
        f"upstream round {held.get('round')}: {held.get('agents', 0)} agents, {held.get('num_samples', 0)} samples, "
        f"{held.get('seconds_left', 0)}s left"
        if held
        else "-"
    )
    down = tier.get("upstream_down_since")
    down_since = "-" if down is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(down)))
    u = Table(title="upstream tier", show_header=False, title_justify="left")
    u.add_column(style="bold")
    u.add_column()
    for k, v in (
        ("as", up.get("id")),
        ("broker", up.get("broker")),
        ("connection", up.get("connection")),
        ("coordinator", up.get("coordinator") or "-"),
        ("upstream round", tier.get("upstream_round") or "-"),
        ("site round", tier.get("site_round")),
        ("announced", f"{up.get('announced_agents', 0)} agents, {up.get('announced_samples', 0)} samples"),
        ("last partial result", sent),
        ("down since", down_since),
        ("held", waiting),
        ("privacy", _site_privacy(tier.get("privacy"))),
    ):
        u.add_row(k, _fmt(v))
    console.print(u)
    a = Table(title="agents of this site", title_justify="left")
    a.add_column("agent")
    a.add_column("samples announced")
    for name, samples in (tier.get("agents") or {}).items():
        a.add_row(name, str(samples))
    console.print(a)


def _clock(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%H:%M:%S", time.localtime(ts))


def _async_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """Asynchronous buffered FedAvg (docs/modes/async.md): the model version, the buffer
    and the staleness of the updates (coordinator); the task, the link and the outbox
    (agent)."""
    version = s.get("model_version")
    if s.get("role") == "coordinator":
        b = s.get("buffer") or {}
        st = s.get("staleness") or {}
        rows: list[tuple[str, Any]] = [
            (
                "model version",
                f"{version} of {s['versions']} (models published)"
                if s.get("versions")
                else f"{version} (models published; no end set: until the coordinator is stopped)",
            ),
            (
                "buffer",
                f"{b.get('fill', 0)} of {b.get('size')} updates"
                + (f", {b['streaming']} arriving" if b.get("streaming") else ""),
            ),
            (
                "training",
                f"{s.get('training', 0)} agents"
                + (f" (at most {s['concurrency']})" if s.get("concurrency") else " (every agent online)"),
            ),
        ]
        if st.get("updates"):
            rows.append(
                (
                    "staleness",
                    f"median {st.get('p50')}, 90% {st.get('p90')}, max {st.get('max')} of the last updates; "
                    f"{st['updates']} taken (bound {s.get('max_staleness')})",
                )
            )
            hist = st.get("histogram") or {}
            rows.append(("staleness counts", "  ".join(f"{k}: {v}" for k, v in hist.items())))
        if s.get("refused"):
            rows.append(("refused updates", s["refused"]))
        if s.get("spoilt_buffers"):
            rows.append(("spoilt buffers", s["spoilt_buffers"]))
        return rows
    link = s.get("link") or {}
    rows = [("model version", None if version is None else f"{version} (the newest global model held)")]
    if link:
        rows.append(
            (
                "link",
                "up" if link.get("up") else f"down for {link.get('down_s')} s (since {_clock(link.get('down_since'))})",
            )
        )
    tr = s.get("training")
    if tr:
        who = f"task {tr['task']}" if tr.get("task") else "on its own"
        rows.append(("training", f"{who} from model version {tr['from_version']} (training {tr['training']})"))
    box = s.get("outbox")
    rows.append(
        (
            "outbox",
            "-"
            if not box
            else f"the update of {'task ' + str(box['task']) if box.get('task') else 'its own training'} from model "
            f"version {box['base_version']} ({box['trainings']} training{'' if box['trainings'] == 1 else 's'}), held {box.get('held_s')} s "
            f"(since {_clock(box.get('since'))})",
        )
    )
    rows.append(("updates sent", f"{s.get('updates_sent', 0)} of {s.get('trained', 0)} trained"))
    return rows


def render_async_agents(s: dict[str, Any], console: Console | None = None) -> None:
    """The asynchronous coordinator's view of each agent: its task and the model it
    trains from, its last update's base version and staleness, what was taken."""
    console = console or Console()
    t = Table(title="agents (asynchronous: the model version each one trains from)", title_justify="left")
    for col in ("id", "online", "task", "training from", "last update from", "staleness", "taken", "refused"):
        t.add_column(col, justify="left" if col in ("id", "online") else "right")
    for aid, a in (s.get("agents") or {}).items():
        t.add_row(
            aid,
            "yes" if a.get("online") else "no",
            _fmt(a.get("task")),
            _fmt(a.get("training_from")),
            _fmt(a.get("last_base")),
            _fmt(a.get("last_staleness")),
            str(a.get("accepted", 0)),
            str(a.get("refused", 0)),
        )
    console.print(t)


def _round_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """A FedAvg coordinator mid-round: who it still waits for, who is silent (no
    heartbeat for a keep-alive: out of the round), and what its round journal holds."""
    if s.get("role") != "coordinator" or "journal" not in s:
        return []
    if s.get("mode") == "async":  # no rounds: the journal holds the buffer
        j = s.get("journal") or {}
        rewrites = j.get("rewrites") or 0
        return [
            (
                "journal",
                f"{j.get('frames', 0)} update frames, {j.get('bytes', 0):,} bytes"
                + (f" (rewritten at {rewrites} models)" if rewrites else ""),
            )
        ]
    rows: list[tuple[str, Any]] = []
    if s.get("phase") == "training":
        selected, received = s.get("selected") or [], set(s.get("received") or [])
        waiting = [a for a in selected if a not in received]
        rows.append(
            (
                "received",
                f"{len(received)} of {len(selected)}" + (f"; waiting for {', '.join(waiting)}" if waiting else ""),
            )
        )
    silent = [f"{a} ({h['age']:.0f}s)" for a, h in (s.get("heartbeats") or {}).items() if h.get("silent")]
    rows.append(("silent", silent or None))
    j = s.get("journal") or {}
    if j.get("round"):
        rows.append(("journal", f"round {j['round']}: {j.get('frames', 0)} frames, {j.get('bytes', 0):,} bytes"))
    return rows


def _lag_text(lag: object, mean: object) -> str:
    """How many local steps behind this agent the models it merged were: at the last
    merge and on average (docs/modes/gossip.md, "Agents of unequal speed, and pacing")."""
    if not isinstance(lag, (int, float)) or not isinstance(mean, (int, float)):
        return "-"
    return f"{lag:.0f} local steps behind this model at the last merge, {mean:.0f} on average"


def _render_gossip(s: dict[str, Any], t: Table, console: Console) -> None:
    gs = s["gossip"]
    dis = s.get("disagreement")
    rel = s.get("disagreement_rel")
    rows = [
        ("federation", s.get("federation")),
        ("mode", "gossip (no coordinator)"),
        ("connection", _connection_text(s)),
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
        ("merged models' lag", _lag_text(s.get("lag"), s.get("lag_mean"))),
        ("last metrics", s.get("last_metrics")),
        ("local model eval", s.get("local_model_eval")),
        ("privacy", _privacy(s.get("privacy"))),
        ("stopped sending", s.get("stop_reason")),
        ("refused peers", _refused_text(s.get("refused_peers"))),
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
        render_peer_table(s, console)


def _online(value: Any) -> str:
    """None: not known (never seen over MQTT, or this node's own broker link is down)."""
    return "?" if value is None else ("yes" if value else "no")


def render_peers(s: dict[str, Any], console: Console | None = None) -> None:
    """``fedagent peers``: on a hub or a site aggregator the tree of its tier (a hub's
    sites with their agents and state; a site's upstream and agents), else the table."""
    console = console or Console()
    tier = s.get("tier")
    if isinstance(tier, dict) and tier.get("role") in ("hub", "site"):
        console.print(peer_tree(s, tier))
        return
    render_peer_table(s, console)


def _peer_line(name: str, info: dict[str, Any], *parts: str) -> str:
    online = {None: "online ?", True: "online", False: "offline"}[info.get("online")]
    return "  ".join([f"[bold]{name}[/bold]", online, *parts, f"last seen {_ago(info.get('last_seen'))}"])


def peer_tree(s: dict[str, Any], tier: dict[str, Any]) -> Tree:
    """The tier around this node: a hub's sites (each a site aggregator: its agents,
    samples and state in the round) and any other peer; a site aggregator's upstream
    (the tier above, over its own connection) and the agents on its site broker."""
    peers = s.get("peers") or {}
    fed = s.get("federation") or "?"
    if tier.get("role") == "hub":
        sites = tier.get("sites") or {}
        root = Tree(f"[bold]{s.get('id', '?')}[/bold] hub of {fed}: {len(sites)} site{'' if len(sites) == 1 else 's'}")
        for name, site in sites.items():
            root.add(
                _peer_line(
                    name,
                    peers.get(name, {"online": site.get("state") != "offline"}),
                    "site aggregator",
                    f"{site.get('agents', 0)} agents, {site.get('samples', 0)} samples",
                    str(site.get("state", "-")),
                )
            )
        for name, info in peers.items():
            if name not in sites:
                root.add(_peer_line(name, info, str(info.get("role") or "-")))
        return root
    up = tier.get("upstream") or {}
    agents = tier.get("agents") or {}
    root = Tree(f"[bold]{s.get('id', '?')}[/bold] site aggregator in {fed}")
    root.add(
        f"upstream: [bold]{up.get('coordinator') or '-'}[/bold]  {up.get('connection', '?')}  "
        f"via {up.get('broker') or '-'} as {up.get('id') or '-'}  upstream round {tier.get('upstream_round') or '-'}"
    )
    site = root.add(f"agents on the site broker: {len(agents)} online, {tier.get('samples', 0)} samples")
    names = sorted(set(agents) | {n for n, i in peers.items() if i.get("role") == "agent"})
    for name in names:
        info = peers.get(name, {"online": name in agents})
        samples = agents.get(name, info.get("samples"))
        site.add(_peer_line(name, info, "-" if samples is None else f"{samples} samples"))
    for name, info in peers.items():
        if name not in names:
            root.add(_peer_line(name, info, str(info.get("role") or "-")))
    return root


def render_peer_table(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    peers = s.get("peers") or {}
    if not peers:
        console.print(f"no peers known in federation {s.get('federation') or '(none)'}")
        return
    p = Table(
        title=f"peers in {s.get('federation') or '?'} (last seen: their last message of any kind or mDNS answer)",
        title_justify="left",
    )
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
