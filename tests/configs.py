"""A coordinator's configuration as `fedagent` renders and loads it, for tests of what a
config section reaches (no files besides the TOML; the TLS paths are never opened)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedagent import config


def coordinator_config(
    tmp_path: Path,
    rounds: dict[str, Any] | None = None,
    *,
    mode: str = "fedavg",
    privacy: dict[str, Any] | None = None,
    **transfer: Any,
) -> config.NodeConfig:
    """``[rounds]`` (default: 12 rounds), ``mode``, ``[privacy]`` and ``[transfer]`` keys."""
    tls = config.TlsConfig(ca=Path("ca.crt"), cert=Path("c.crt"), key=Path("c.key"))
    text = config.render(
        node_id="coordinator",
        federation="fed-1",
        tls=tls,
        state_dir=Path("state"),
        broker="mqtts://127.0.0.1:8883",
        mode=mode,
        rounds=rounds or {"rounds": 12},
        privacy=privacy,
    )
    if transfer:
        text += "[transfer]\n" + "".join(f"{k} = {str(v).lower()}\n" for k, v in transfer.items())
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    return config.load(path, "coordinator")
