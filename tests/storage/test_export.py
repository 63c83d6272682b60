"""`fedagent export`: a daemon's checkpoint out as a plain state_dict or safetensors file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file

from fedagent import config
from fedagent.cli import main
from fedagent.errors import FedagentError
from fedagent.storage import checkpoint
from fedagent.storage.export import export
from fedagent.tasks.base import get_weights, load_task


def _digits_weights() -> dict[str, np.ndarray]:
    torch.manual_seed(3)
    return get_weights(load_task("digits").build_model())


def _config(tmp_path: Path, role: str, federation: str = "lab") -> Path:
    tls = config.TlsConfig(ca=tmp_path / "ca.pem", cert=tmp_path / "c.pem", key=tmp_path / "c.key")
    path = tmp_path / f"{role}.toml"
    text = config.render(
        node_id="n1", federation=federation, tls=tls, state_dir=tmp_path / "state", broker="mqtts://127.0.0.1:8883"
    )
    path.write_text(text)
    return path


def test_pt_export_opens_with_weights_only_and_loads_into_the_model(tmp_path: Path) -> None:
    weights = _digits_weights()
    src = tmp_path / "global.ckpt"
    # A Sync-Opt coordinator keeps optimizer state next to the weights: not part of the model.
    checkpoint.save(src, {**weights, "optim/0/exp_avg": np.ones(3, np.float32)}, {"model_version": 7})
    summary = export(src, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(weights)
    for name, arr in weights.items():
        assert np.array_equal(state[name].numpy(), arr)
    model = load_task("digits").build_model()
    model.load_state_dict(state)  # strict: every key of the model, nothing else
    assert summary["model_version"] == 7
    assert summary["parameters"] == sum(a.size for a in weights.values())


def test_safetensors_export_matches_the_checkpoint(tmp_path: Path) -> None:
    weights = _digits_weights()
    weights["steps"] = np.array([3, 4], dtype=np.int64)
    src = tmp_path / "global.ckpt"
    checkpoint.save(src, weights, {"model_version": 2, "federation": "lab"})
    export(src, tmp_path / "model.safetensors")
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(weights)
    for name, arr in weights.items():
        assert loaded[name].dtype == arr.dtype and np.array_equal(loaded[name], arr)


def test_cli_export_finds_the_coordinators_checkpoint_from_its_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "coordinator")
    weights = _digits_weights()
    checkpoint.save(tmp_path / "state" / "coordinator" / "lab" / "global.ckpt", weights, {"model_version": 5})
    out = tmp_path / "out" / "global.pt"
    result = CliRunner().invoke(main, ["export", str(out), "--config", str(cfg), "--coordinator"])
    assert result.exit_code == 0, result.output
    assert "model version 5" in result.output
    assert set(torch.load(out, weights_only=True)) == set(weights)


def test_cli_export_explains_a_missing_checkpoint_and_a_bad_name(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "agent")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "m.pt"), "--config", str(cfg)])
    assert result.exit_code != 0
    assert "no model checkpoint" in result.output
    checkpoint.save(tmp_path / "x.ckpt", _digits_weights(), {})
    with pytest.raises(FedagentError, match="name it"):
        export(tmp_path / "x.ckpt", tmp_path / "model.bin")
    assert not list(tmp_path.glob(".model*"))  # no temp file left behind
