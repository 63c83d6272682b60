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


class Mixed(torch.nn.Module):
    """A bfloat16 layer, a BatchNorm (buffers) and a frozen float64 layer."""

    def __init__(self) -> None:
        super().__init__()
        self.half = torch.nn.Linear(4, 3).to(torch.bfloat16)
        self.bn = torch.nn.BatchNorm1d(3)
        self.fixed = torch.nn.Linear(3, 2).double()
        self.fixed.requires_grad_(False)


def _mixed_checkpoint(path: Path) -> tuple[Mixed, dict[str, np.ndarray]]:
    from fedagent.tasks.fingerprint import fingerprint

    torch.manual_seed(1)
    model = Mixed()
    weights = get_weights(model)
    # An aggregate: float32 values between bfloat16's, as a mean of agents' models is.
    weights["half.weight"] = weights["half.weight"] + np.float32(2**-10)
    weights["bn.running_var"] = np.array([0.5, 1e-6, 2.0], np.float32)
    checkpoint.save(path, weights, {"model_version": 3, "model": fingerprint(model).meta()})
    return model, weights


def test_export_restores_each_tensors_dtype_and_loads_strictly(tmp_path: Path) -> None:
    from safetensors.torch import load_file as load_torch

    model, weights = _mixed_checkpoint(tmp_path / "global.ckpt")
    summary = export(tmp_path / "global.ckpt", tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    fresh = Mixed()
    fresh.load_state_dict(state, strict=True)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in model.state_dict().items()}
    # Rounded to nearest even exactly as load_state_dict rounds the float32 aggregate.
    expected = torch.from_numpy(weights["half.weight"]).to(torch.bfloat16)
    assert torch.equal(state["half.weight"], expected)
    assert summary["dtypes_restored"] == {"half.bias": "bfloat16", "half.weight": "bfloat16"}
    assert (summary["parameter_tensors"], summary["buffer_tensors"], summary["frozen_tensors"]) == (6, 3, 2)
    assert summary["buffers"] == 3 + 3 + 1
    export(tmp_path / "global.ckpt", tmp_path / "m.safetensors")
    st = load_torch(str(tmp_path / "m.safetensors"))
    assert st["half.weight"].dtype == torch.bfloat16 and torch.equal(st["half.weight"], expected)
    Mixed().load_state_dict(st, strict=True)


def test_cli_export_states_parameters_and_buffers_and_a_sites_own_model(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "agent")
    home = tmp_path / "state" / "agent" / "lab"
    _, weights = _mixed_checkpoint(home / "global.ckpt")
    out = tmp_path / "global.pt"
    result = CliRunner().invoke(main, ["export", str(out), "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "parameters: 6 tensors" in result.output and "2 of them frozen" in result.output
    assert "buffers:    3 tensors, 7 values" in result.output
    assert "2 tensors back in bfloat16" in result.output
    # --site: the global model with this agent's own normalisation layers (FedBN).
    site = tmp_path / "site.pt"
    result = CliRunner().invoke(main, ["export", str(site), "--config", str(cfg), "--site"])
    assert result.exit_code != 0 and "local_norm is off" in result.output
    own = {"bn.weight": np.full(3, 4.0, np.float32), "bn.running_var": np.full(3, 9.0, np.float32)}
    checkpoint.save(home / "local_layers.ckpt", own, {})
    result = CliRunner().invoke(main, ["export", str(site), "--config", str(cfg), "--site"])
    assert result.exit_code == 0, result.output
    assert "this site's model" in result.output
    state = torch.load(site, weights_only=True)
    assert torch.equal(state["bn.running_var"], torch.full((3,), 9.0))
    assert torch.equal(state["bn.bias"], torch.from_numpy(weights["bn.bias"]))  # the global model's
