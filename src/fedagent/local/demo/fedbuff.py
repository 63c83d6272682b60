"""``fedagent demo --mode async``: the digits federation with a slow agent and one that
keeps losing its link, first in synchronous FedAvg rounds, then asynchronously (buffered
FedAvg) for as long as the rounds took.

One agent trains five times slower than the others (``fedagent.tasks.slowed``) and one
reaches the broker through a link that is cut for a few seconds every so often
(:class:`fedagent.local.linkcut.Link`). In rounds, every round waits for the slow agent;
asynchronously, models come from whichever updates arrive (the slow agent's are stale
and weigh less; the cut-off agent keeps its update and sends it when it is back). The
table at the end says how many updates each made in the same time, when each first had a
model at 90 % held-out accuracy and what its last model scores.
"""

from __future__ import annotations

import threading
import time
import tomllib
from typing import Any

import tomli_w
from rich.console import Console
from rich.table import Table

from fedagent.local.demo.runner import Plan, Watch, elapsed, need_agents, run, work_dir
from fedagent.local.federation import SEED, Federation
from fedagent.local.linkcut import Link

SLOWDOWN = 5.0
#: Every agent's training takes at least this long, as on a small device: digits trains
#: in a tenth of a second here, too short for anybody's waiting to show.
TRAIN_SECONDS = 1.0
#: The cut-off agent's link: up this long, then down this long, over and over.
LINK_UP, LINK_DOWN = 12.0, 6.0
TARGET = 0.9


class Flaky:
    """Cuts and heals ``link`` in a thread of its own until stopped."""

    def __init__(self, link: Link, up: float = LINK_UP, down: float = LINK_DOWN) -> None:
        self.link, self.up, self.down = link, up, down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flaky-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.up):
            self.link.cut()
            if self._stop.wait(self.down):
                break
            self.link.heal()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.link.heal()


def run_async_demo(
    *,
    agents: int = 5,
    rounds: int = 10,
    alpha: float = 0.3,
    keep: bool = False,
    compare: bool = True,
    console: Console | None = None,
) -> int:
    """The federation in ``rounds`` rounds, then asynchronously for as long; without
    ``compare``, asynchronously alone for as long as the rounds would take at the least
    (each waits for the slow agent's training)."""
    import torch

    console = console or Console()
    need_agents(agents)
    if agents < 3:
        raise ValueError("the asynchronous demo needs at least 3 agents (one slow, one cut off, one steady)")
    torch.set_num_threads(1)
    started = time.monotonic()

    slow, flaky = f"agent-{agents}", f"agent-{agents - 1}"
    results: dict[str, dict[str, Any]] = {}

    def federation(mode: str) -> Federation:
        return Federation(
            work_dir("fedagent-demo-"),
            agents=agents,
            rounds=rounds,
            alpha=alpha,
            mode=mode,
            # Stopped by time, not by a number of models.
            fedbuff={"versions": 0} if mode == "async" else None,
            slow_agents={slow: SLOWDOWN},
            train_seconds=TRAIN_SECONDS,
            round_timeout=120.0,
        )

    for mode in ("fedavg", "async") if compare else ("async",):
        fed = federation(mode)
        links: dict[str, Any] = {}
        duration = results["fedavg"]["seconds"] if "fedavg" in results else rounds * SLOWDOWN * TRAIN_SECONDS
        try:
            code = run(fed, plan(fed, mode, slow, flaky, results, console, links, duration), keep=keep, console=console)
        finally:
            if "flaky" in links:
                links["flaky"].stop()
                links["link"].close()
        if code:
            return code
    title = "the same federation in rounds and asynchronously" if len(results) > 1 else "the federation, asynchronously"
    table = Table(title=title, title_justify="left")
    for col in ("mode", "seconds", "models", "updates", f"{TARGET:.0%} after", "last model's accuracy"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in results.items():
        hit = r["to_target"]
        table.add_row(
            "asynchronous (buffered)" if mode == "async" else "FedAvg rounds",
            f"{r['seconds']:.1f}",
            str(r["models"]),
            str(r["updates"]),
            "-" if hit is None else f"{hit:.1f} s",
            f"{r['accuracy']:.3f}",
        )
    console.print(table)
    a = results["async"]
    console.print(
        f"asynchronous: staleness of the updates taken {a['staleness']}; the slow agent ({slow}) sent "
        f"{a['by_agent'].get(slow, 0)} updates, the cut-off one ({flaky}) {a['by_agent'].get(flaky, 0)} "
        f"(its link was cut {a['cuts']} times)"
    )
    if "fedavg" in results:
        f = results["fedavg"]
        console.print(
            f"in rounds every round waited for {slow}: {f['seconds'] / max(f['models'], 1):.1f} s a round against "
            f"{a['seconds'] / max(a['models'], 1):.1f} s a model asynchronously; total {elapsed(started)}"
        )
    return 0 if a["accuracy"] >= TARGET else 1


def plan(
    fed: Federation,
    mode: str,
    slow: str,
    flaky: str,
    results: dict[str, dict[str, Any]],
    console: Console,
    link: dict[str, Any],
    duration: float | None,
) -> Plan[Any]:
    """``link`` receives the cut-off agent's link and the thread that cuts it;
    ``duration``: the asynchronous run stops this long after its first task."""
    total = (fed.fedbuff.get("versions") or fed.rounds) if mode == "async" else fed.rounds
    if duration is not None:
        total = max(1, round(duration))
    label = "asynchronous" if mode == "async" else "FedAvg rounds"
    history = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"

    def records() -> list[dict[str, Any]]:
        from fedagent.storage.history import read_records

        return read_records(history)

    def since_start() -> float | None:
        first = next((r for r in records() if r.get("event") in ("training_started", "round")), None)
        if first is None:
            return None
        start = first["time"] - (first.get("seconds") or 0.0) if first["event"] == "round" else first["time"]
        return time.time() - start

    def configure(fed: Federation) -> None:
        assert fed.broker is not None
        ln = Link(fed.broker.port)
        link["link"], link["flaky"] = ln, Flaky(ln)
        path = fed.config_path(flaky)
        doc = tomllib.loads(path.read_text())
        doc.setdefault("broker", {})["uri"] = f"mqtts://127.0.0.1:{ln.port}"
        path.write_text(tomli_w.dumps(doc))

    def started(fed: Federation) -> str:
        link["flaky"].start()
        link["t0"] = time.monotonic()
        return (
            f"broker [green]{fed.broker_uri}[/]; a training takes {TRAIN_SECONDS:g} s, {slow}'s {SLOWDOWN:g}x as "
            f"long; {flaky}'s link is cut for {LINK_DOWN:g} s every {LINK_UP + LINK_DOWN:g} s"
        )

    def watch(fed: Federation) -> Watch | None:
        s = fed.status("coordinator")
        if s is None:
            return None
        f = fed.status(flaky) or {}
        cut = " (link down)" if f.get("link") and not f["link"].get("up") else ""
        if mode == "async":
            b, st = s.get("buffer") or {}, s.get("staleness") or {}
            box = " holding an update" if f.get("outbox") else ""
            desc = (
                f"{label}: model {s['model_version']}, buffer {b.get('fill', 0)}/{b.get('size')}, "
                f"staleness max {st.get('max', 0)}; {flaky}{cut}{box}"
            )
        else:
            desc = f"{label}: round {s['round']} ({s['phase']}); {flaky}{cut}"
        if duration is not None:
            elapsed_s = since_start() or 0.0
            return Watch(
                min(total, int(elapsed_s)), desc + f" ({elapsed_s:.0f} of {duration:.0f} s)", elapsed_s >= duration
            )
        return Watch(int(s.get("model_version") or 0), desc, s.get("phase") == "done")

    def collect(fed: Federation) -> dict[str, Any]:
        seconds = time.monotonic() - link["t0"]
        weights, _meta = fed.final_weights()
        recs = records()
        models = [r for r in recs if r.get("event") == "round"]
        first = next((r for r in recs if r.get("event") in ("training_started", "round")), None)
        start = (
            time.time()
            if first is None
            else first["time"] - (first.get("seconds") or 0.0 if first["event"] == "round" else 0.0)
        )
        if duration is not None:
            models = [r for r in models if r["time"] <= start + duration]
        accuracy = _scores(fed)
        by_agent: dict[str, int] = {}
        staleness: list[int] = []
        for r in models:
            if mode == "async":
                for u in r.get("updates", []):
                    by_agent[u["agent"]] = by_agent.get(u["agent"], 0) + 1
                    staleness.append(int(u["staleness"]))
            else:
                for a in r.get("participants", []):
                    by_agent[a] = by_agent.get(a, 0) + 1
        hit = next((r for r in models if accuracy.get(int(r["model_version"]), 0.0) >= TARGET), None)
        return {
            "weights": weights,
            "models": len(models),
            "updates": sum(by_agent.values()),
            "seconds": (models[-1]["time"] - start) if models else seconds,
            "to_target": None if hit is None else hit["time"] - start,
            "by_agent": by_agent,
            "cuts": link["link"].cuts,
            "staleness": _describe(staleness),
        }

    def evaluate(c: dict[str, Any]) -> int:
        from fedagent.tasks.base import load_task, set_weights

        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, c.pop("weights"))
        c["accuracy"] = task.evaluate(model)["accuracy"]
        results[mode] = c
        console.print(f"{label}: {c['models']} models from {c['updates']} updates in {c['seconds']:.1f} s")
        return 0

    return Plan(
        title=f"[bold]fedagent demo[/] ({label}): federation [cyan]{fed.fed}[/], {fed.n} agents on UCI digits "
        f"(Dirichlet alpha={fed.alpha})",
        started=started,
        total=total,
        limit=900,
        watch=watch,
        collect=collect,
        evaluate=evaluate,
        configure=configure,
    )


def _scores(fed: Federation) -> dict[int, float]:
    """Each model version's held-out accuracy, as the agents scored it."""
    from fedagent.storage.history import read_records

    out: dict[int, float] = {}
    for aid in fed.agent_ids:
        for r in read_records(fed.work / "state" / aid / "agent" / fed.fed / "history.jsonl"):
            if r.get("event") == "global_eval" and "accuracy" in r.get("metrics", {}):
                out.setdefault(int(r["model_version"]), float(r["metrics"]["accuracy"]))
    return out


def _describe(values: list[int]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    return f"median {v[len(v) // 2]}, 90% {v[(9 * len(v)) // 10 if len(v) > 1 else 0]}, max {v[-1]}"
