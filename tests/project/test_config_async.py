"""``mode = "async"``: the buffer machine's configuration from a config file, and what
cannot run asynchronously refused at load with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedagent import config
from fedagent.config import TlsConfig
from fedagent.errors import EXIT_CONFIG, ConfigError

TLS = TlsConfig(ca=Path("ca.crt"), cert=Path("c.crt"), key=Path("c.key"))


def load(tmp_path: Path, **tables) -> config.NodeConfig:
    text = config.render(
        node_id="coordinator",
        federation="fed",
        tls=TLS,
        state_dir=Path("state"),
        broker="mqtts://127.0.0.1:8883",
        mode="async",
        **tables,
    )
    path = tmp_path / "c.toml"
    path.write_text(text)
    return config.load(path, "coordinator")


def test_defaults_stream_int8_deltas_and_broadcast_int8_steps(tmp_path):
    cfg = load(tmp_path, fedbuff={"buffer_size": 3, "max_staleness": 6, "concurrency": 4})
    b = config.buffer_config(cfg)
    assert (b.buffer_size, b.max_staleness, b.concurrency, b.staleness_exponent) == (3, 6, 4, 0.5)
    assert b.train.stream and b.train.compression == "int8" and b.downlink == "int8"
    assert b.momentum == 0.0 and b.versions == 50  # no server momentum asynchronously
    assert cfg.fedbuff.offline_trainings == 2


def test_the_member_protections_of_rounds_apply_and_switch_off_as_in_rounds(tmp_path):
    b = config.buffer_config(load(tmp_path))
    assert b.weight_cap == 2.0 and b.caps_weights
    assert b.norm_bound is not None and (b.norm_bound.multiplier, b.norm_bound.window, b.norm_bound.warmup) == (
        3.0,
        10,
        3,
    )
    assert b.bounds_norms
    off = config.buffer_config(load(tmp_path, rounds={"weight_cap": 0, "norm_multiplier": 0}))
    assert not off.caps_weights and off.norm_bound is None and not off.bounds_norms
    # clip_norm bounds every update already (whole, before it is added)
    assert not config.buffer_config(load(tmp_path, rounds={"clip_norm": 2.0})).bounds_norms


def test_rounds_training_settings_and_server_step_apply(tmp_path):
    cfg = load(
        tmp_path,
        rounds={"local_epochs": 3, "lr": 0.1, "min_agents": 5, "server_lr": 1.5, "server_momentum": 0.0},
        transfer={"compression": "none"},
    )
    b = config.buffer_config(cfg)
    assert (b.train.epochs, b.train.lr, b.min_agents, b.server_lr, b.momentum) == (3, 0.1, 5, 1.5, 0.0)
    assert b.whole and b.train.compression == "none" and b.downlink == "none"


def test_central_dp_and_clip_norm_take_whole_updates(tmp_path):
    cfg = load(
        tmp_path,
        rounds={"min_agents": 4},
        fedbuff={"buffer_size": 4},
        privacy={"mode": "central", "noise_multiplier": 1.0},
    )
    b = config.buffer_config(cfg)
    assert b.whole and b.train.compression == "none" and b.momentum == 0.0
    cfg = load(
        tmp_path,
        rounds={"min_agents": 4},
        fedbuff={"buffer_size": 4},
        privacy={"mode": "distributed", "noise_multiplier": 1.0},
    )
    assert not config.buffer_config(cfg).whole
    assert config.buffer_config(load(tmp_path, rounds={"clip_norm": 2.0})).whole


@pytest.mark.parametrize(
    "tables, match",
    [
        ({"rounds": {"secure_aggregation": True}}, "secure_aggregation = true cannot run in mode = 'async'"),
        ({"rounds": {"max_norm": 5.0}}, "no longer holds: the norm of its weights cannot be known"),
        ({"rounds": {"aggregation": "krum", "byzantine": 1, "min_updates": 2, "min_agents": 5}}, "one at a time"),
        ({"rounds": {"clip_norm": 1.0}, "transfer": {"compression": "int8"}}, "leave compression unset"),
        ({"privacy": {"mode": "central", "noise_multiplier": 1.0}}, "raise min_agents"),
        ({"fedbuff": {"max_staleness": -1}}, "max_staleness"),
        (
            {"fedbuff": {"versions": 0}, "privacy": {"mode": "central", "target_epsilon": 8.0}},
            "versions = 0 has no end",
        ),
    ],
)
def test_what_cannot_run_asynchronously_is_refused_at_load(tmp_path, tables, match):
    with pytest.raises(ConfigError, match=match) as exc:
        load(tmp_path, **tables)
    assert exc.value.exit_code == EXIT_CONFIG and str(tmp_path) in str(exc.value)
