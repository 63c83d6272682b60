"""`fedagent export`: a checkpoint written as a plain PyTorch or safetensors file."""

from __future__ import annotations

from pathlib import Path

import click

from fedagent.cli.app import DEFAULT_AGENT_CONFIG, fail, main
from fedagent.errors import FedagentError


@main.command("export")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="config file of the daemon whose model to export (default: /etc/fedagent/agent.toml)",
)
@click.option("--coordinator", "is_coord", is_flag=True, help="export the coordinator's global model")
@click.option(
    "--checkpoint",
    "ckpt",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="read this checkpoint file instead of the daemon's",
)
@click.option(
    "--format", "fmt", type=click.Choice(["pt", "safetensors"]), default=None, help="default: from OUT's suffix"
)
def export_model(out: Path, config_path: Path | None, is_coord: bool, ckpt: Path | None, fmt: str | None) -> None:
    """Write the latest model to OUT as a PyTorch state_dict (*.pt, opened by
    torch.load(OUT, weights_only=True)) or as safetensors (*.safetensors)."""
    from fedagent import config
    from fedagent.storage import export as exporting

    role = "coordinator" if is_coord else "agent"
    try:
        if ckpt is None:
            path = config_path or (Path("/etc/fedagent/coordinator.toml") if is_coord else DEFAULT_AGENT_CONFIG)
            cfg = config.load(path, role)
            ckpt = exporting.checkpoint_of(cfg.state_dir, cfg.federation, role)
        summary = exporting.export(ckpt, out, fmt)
    except FedagentError as exc:
        fail(exc)
    click.echo(
        f"wrote {summary['path']}: {summary['tensors']} tensors, {summary['parameters']:,} parameters, "
        f"model version {summary['model_version']} ({summary['format']}, from {ckpt})"
    )
