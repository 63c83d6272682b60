"""`fedagent report`: plots from the daemons' histories."""

from __future__ import annotations

from pathlib import Path

import click

from fedagent.cli.app import fail, main
from fedagent.errors import ConfigError, FedagentError


@main.command()
@click.argument("histories", nargs=-1, type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="collect every history.jsonl below this state directory",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("fedagent-report"), show_default=True)
@click.option("--title", default=None)
def report(histories: tuple[Path, ...], state_dir: Path | None, out: Path, title: str | None) -> None:
    """Write a markdown report with PNG plots from daemon histories."""
    from fedagent.local.report import find_histories, write_report

    paths = list(histories)
    if state_dir is not None:
        paths += find_histories(state_dir)
    if not paths:
        default = [Path("/var/lib/fedagent-coordinator"), Path("/var/lib/fedagent-agent")]
        paths = [p for d in default if d.exists() for p in find_histories(d)]
    try:
        if not paths:
            raise ConfigError("no history.jsonl found; pass HISTORY files or --state-dir DIR")
        md = write_report(paths, out, title=title)
    except FedagentError as exc:
        fail(exc)
    click.echo(f"wrote {md} ({len(paths)} histories)")
