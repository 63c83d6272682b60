"""The demo's runner: start a federation, follow it, evaluate, tidy up, whatever ends it.

Every demo mode is a :class:`Plan` (how to configure, watch, collect and evaluate its
federation) that :func:`run` carries out. Ctrl-C, SIGTERM (``timeout``, systemd, CI) and
SIGHUP (the terminal went away) all end a demo the same way
(:func:`fedagent.stopsignals.stop_signals`): every process it started is stopped and its
work directory removed (unless ``--keep``), and the exit status is 128 + the signal's
number (130, 143, 129).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedagent.errors import FedagentError
from fedagent.stopsignals import StopSignal, stop_signals

T = TypeVar("T")


class LocalFederation(Protocol):
    """What the runner needs of a federation on this machine (one broker, or tiers)."""

    work: Path
    procs: list[Any]

    def prepare(self) -> None: ...
    def start_all(self) -> None: ...
    def check_alive(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class Watch:
    """One look at a running federation: progress so far, and whether it is over."""

    completed: int
    description: str
    finished: bool


@dataclass
class Plan(Generic[T]):
    """One demo mode, as the runner needs it.

    ``configure`` writes the mode's configs after the PKI and broker exist; ``watch``
    polls the daemons (None while they do not answer yet); ``collect`` reads what the
    evaluation needs while they still run; ``evaluate`` runs after they have stopped
    and returns the exit status."""

    title: str
    started: Callable[[Any], str]
    total: int
    limit: float
    watch: Callable[[Any], Watch | None]
    collect: Callable[[Any], T]
    evaluate: Callable[[T], int]
    configure: Callable[[Any], None] | None = None


def work_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def _torch_scratch_in(work: Path) -> None:
    """torch's compiler stack makes a cache directory in TMPDIR (``torchinductor_<user>``)
    in each process that builds an optimiser, the demo's daemons included, and never
    removes it: under the demo it goes in the work directory and is removed with it. A
    directory the user chose is kept."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = Path(tempfile.gettempdir())
    if current is None or (Path(current).parent == default and Path(current).name.startswith("torchinductor_")):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "torchinductor")


def run(fed: LocalFederation, plan: Plan[T], *, keep: bool = False, console: Console | None = None) -> int:
    """Start ``fed``, watch it until ``plan`` says it is over, evaluate, tidy up.

    Whatever ends the run (the end, an error, Ctrl-C, SIGTERM, SIGHUP) every process the
    federation started is stopped, and its work directory is removed unless ``keep``."""
    console = console or Console()
    work = fed.work
    _torch_scratch_in(work)
    started = time.monotonic()
    stopped_by = ""
    try:
        with stop_signals():
            try:
                console.print(f"{plan.title}; work dir {work}")
                with console.status("creating a CA and certificates, starting a private Mosquitto ..."):
                    fed.prepare()
                    if plan.configure is not None:
                        plan.configure(fed)
                console.print(plan.started(fed))
                fed.start_all()
                _follow(fed, plan, started, console)
                collected = plan.collect(fed)
                fed.close()
                return plan.evaluate(collected)
            except (KeyboardInterrupt, StopSignal) as exc:
                # KeyboardInterrupt: Ctrl-C where the handlers stay as they were (a thread).
                signum = exc.signum if isinstance(exc, StopSignal) else signal.SIGINT
                stopped_by = "interrupted" if signum == signal.SIGINT else f"received {signal.Signals(signum).name}"
                console.print(f"[yellow]{stopped_by}; stopping every process the demo started[/]")
                return 128 + signum
    finally:
        # A second signal must not cut the clean-up short (SIGKILL still can).
        with stop_signals(signal.SIG_IGN):
            fed.close()
            if keep:
                console.print(f"kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
            if stopped_by:
                console.print(
                    f"[yellow]demo stopped ({stopped_by}): every process it started has exited"
                    + ("" if keep else f", {work} removed")
                    + "[/]"
                )


def _follow(fed: LocalFederation, plan: Plan[Any], started: float, console: Console) -> None:
    """Progress bar until ``plan.watch`` reports the end; a daemon that dies or a run
    past ``plan.limit`` seconds is an error."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    running = False
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("waiting for agents", total=plan.total)
        while True:
            fed.check_alive()
            w = plan.watch(fed)
            if w is not None:
                if not running:
                    running = True
                    progress.console.print(
                        f"federation running: {len(fed.procs)} daemons started, answering on their sockets"
                    )
                progress.update(bar, completed=w.completed, description=w.description)
                if w.finished:
                    return
            if time.monotonic() - started > plan.limit:
                raise FedagentError(
                    f"the federation did not finish in {plan.limit / 60:.0f} minutes; logs in {fed.work / 'logs'}"
                )
            time.sleep(0.25)


def elapsed(started: float) -> str:
    return f"{time.monotonic() - started:.1f}s"


def need_agents(agents: int) -> None:
    if agents < 2:
        raise FedagentError("the demo needs at least 2 agents")


def report_label() -> str:
    from fedagent.local.report import plots_available

    return "report with plots" if plots_available() else "report (no plots: install the 'report' extra)"
