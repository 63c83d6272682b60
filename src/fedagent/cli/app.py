"""The ``fedagent`` command group and what every command shares: how an error ends the
process (its exit code) and how a daemon runs until SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import click

from fedagent import __version__
from fedagent.errors import FedagentError

DEFAULT_AGENT_CONFIG = Path(os.environ.get("FEDAGENT_CONFIG", "/etc/fedagent/agent.toml"))


def fail(exc: FedagentError) -> None:
    click.secho(f"error: {exc}", fg="red", err=True)
    sys.exit(exc.exit_code)


def run_daemon(make) -> None:
    """Run a daemon's ``run()`` until SIGTERM/SIGINT, then let it shut down cleanly."""
    from fedagent.node.runtime import setup_logging

    setup_logging(os.environ.get("FEDAGENT_LOG_LEVEL", "INFO"))

    async def main() -> None:
        daemon = make()
        task = asyncio.current_task()
        assert task is not None  # main() runs as asyncio.run's task
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await daemon.run()
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(main())
    except (FedagentError, BaseExceptionGroup) as exc:
        found = _first_fedagent_error(exc)
        if found is None:
            raise
        fail(found)


def _first_fedagent_error(exc: BaseException) -> FedagentError | None:
    """The error to report from a TaskGroup's (possibly nested) exception group."""
    if isinstance(exc, FedagentError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first_fedagent_error(sub)
            if found is not None:
                return found
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedagent")
def main() -> None:
    """fedagent: federated learning between edge machines over MQTT with mutual TLS."""
