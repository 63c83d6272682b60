"""The ``fedagent`` command group and what every command shares: how an error ends the
process (its exit code) and how a daemon runs until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from fedagent import __version__
from fedagent.errors import EXIT_OK, FedagentError

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

    code = EXIT_OK
    try:
        asyncio.run(main())
    except (FedagentError, BaseExceptionGroup) as exc:
        found = _first_fedagent_error(exc)
        if found is None:
            raise
        click.secho(f"error: {found}", fg="red", err=True)
        code = found.exit_code
    _end_process(code)


def _end_process(code: int) -> NoReturn:
    """End a daemon that has stopped, without Python's interpreter finalisation.

    With torch (and the compiler stack its first optimiser loads) in the process, the
    teardown of the modules garbage-collects for seconds: measured after SIGTERM, an
    agent took 8.5 s and a coordinator 6.2 s to exit, all of it in ``Py_FinalizeEx``,
    which a service manager waits out and every test that stops a daemon paid. By now
    the daemon has written and closed what it leaves behind (checkpoints are atomic,
    the MQTT session ended with its offline presence); the logs and the standard
    streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
