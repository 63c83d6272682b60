"""The ``fedagent`` command line: the group in :mod:`.app`, one module per command group,
and the commands other installed distributions add (entry points of the group
``fedagent.cli``, e.g. ``fedagent experiment`` from fedagent-experiments)."""

from __future__ import annotations

from importlib.metadata import entry_points

import click

from fedagent.cli import ask, ca, daemons, demo, export, membership, report
from fedagent.cli.app import main

__all__ = ["main"]
_COMMAND_MODULES = (ask, ca, daemons, demo, export, membership, report)  # importing them registers their commands

EXPERIMENTS_HINT = (
    "fedagent experiment needs the fedagent-experiments package: pip install ./experiments (from a fedagent checkout)"
)


def _stub(name: str, message: str) -> click.Command:
    """A hidden command that says in one line why ``name`` is not here."""

    @click.command(
        name,
        hidden=True,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    def stub() -> None:
        click.secho(f"error: {message}", fg="red", err=True)
        raise SystemExit(2)

    return stub


def _add_plugins() -> None:
    """The commands installed distributions add. One that fails to load stays a one-line
    error of its own command: the core commands (``agent``, ``status``) still run."""
    for ep in entry_points(group="fedagent.cli"):
        if ep.name in main.commands:
            continue
        try:
            command = ep.load()
        except Exception as exc:  # noqa: BLE001 (a broken plugin must not take the daemons' CLI down with it)
            command = _stub(ep.name, f"fedagent {ep.name} could not be loaded from {ep.value}: {exc}")
        main.add_command(command, ep.name)
    if "experiment" not in main.commands:
        main.add_command(_stub("experiment", EXPERIMENTS_HINT), "experiment")


_add_plugins()
