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
@click.option(
    "--site",
    is_flag=True,
    help="an agent's own model: the global model with the normalisation layers it keeps ([rounds] local_norm)",
)
def export_model(
    out: Path, config_path: Path | None, is_coord: bool, ckpt: Path | None, fmt: str | None, site: bool
) -> None:
    """Write the latest model to OUT as a PyTorch state_dict (*.pt, opened by
    torch.load(OUT, weights_only=True)) or as safetensors (*.safetensors), every tensor in
    the model's own dtype."""
    from fedagent import config
    from fedagent.storage import export as exporting

    role = "coordinator" if is_coord else "agent"
    try:
        if site and is_coord:
            raise FedagentError("--site is an agent's own model; the coordinator holds the global one")
        if ckpt is None:
            path = config_path or (Path("/etc/fedagent/coordinator.toml") if is_coord else DEFAULT_AGENT_CONFIG)
            cfg = config.load(path, role)
            ckpt = exporting.checkpoint_of(cfg.state_dir, cfg.federation, role)
        model = exporting.site_weights(ckpt, ckpt.parent / exporting.LOCAL_LAYERS) if site else None
        summary = exporting.export(ckpt, out, fmt, weights=model)
    except FedagentError as exc:
        fail(exc)
    what = "this site's model" if summary["site"] else "model"
    click.echo(
        f"wrote {summary['path']}: {what} version {summary['model_version']}, {summary['tensors']} tensors "
        f"({summary['format']}, from {ckpt})"
    )
    if summary["described"]:
        frozen = f", {summary['frozen_tensors']} of them frozen" if summary["frozen_tensors"] else ""
        click.echo(f"  parameters: {summary['parameter_tensors']} tensors, {summary['parameters']:,} values{frozen}")
        click.echo(f"  buffers:    {summary['buffer_tensors']} tensors, {summary['buffers']:,} values")
    else:
        click.echo(
            f"  {summary['parameters']:,} values (a checkpoint of an earlier release: parameters and buffers "
            "are not told apart)"
        )
    if summary["dtypes_restored"]:
        restored = sorted(set(summary["dtypes_restored"].values()))
        click.echo(f"  {len(summary['dtypes_restored'])} tensors back in {', '.join(restored)}")
