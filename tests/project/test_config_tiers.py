"""``[tier]``: what a site aggregator and a tier of site aggregators take, refused at load
with the key to change."""

from __future__ import annotations

import pytest

from fedagent import config
from fedagent.errors import ConfigError

HEAD = 'id = "site-1"\nfederation = "fed"\nstate_dir = "state"\nruntime_dir = "run"\n'
TAIL = '\n[broker]\nuri = "mqtts://127.0.0.1:8883"\n[tls]\nca = "ca.crt"\ncert = "n.crt"\nkey = "n.key"\n'
SITE = (
    '[tier]\nupstream = "mqtts://hub:8883"\nupstream_id = "site-1-up"\n'
    'upstream_cert = "up.crt"\nupstream_key = "up.key"\n'
)


def load(tmp_path, body: str):
    path = tmp_path / "c.toml"
    path.write_text(HEAD + body + TAIL)
    return config.load(path, "coordinator")


def test_a_site_aggregator_config(tmp_path):
    cfg = load(tmp_path, SITE)
    assert cfg.tier.upstream == "mqtts://hub:8883" and cfg.tier.upload_share == 0.25
    assert cfg.tier.upstream_cert == str(tmp_path / "up.crt")  # relative to the file


@pytest.mark.parametrize(
    "body, words",
    [
        ('[tier]\nupstream = "mqtts://hub:8883"\n', "upstream_id is required"),
        ('[tier]\nupstream = "mqtts://hub:8883"\nupstream_id = "up"\n', "upstream_cert and upstream_key"),
        ('[tier]\nupstream = "hub:8883"\n', "mqtts://"),
        (SITE + "[rounds]\nserver_lr = 2.0\n", "server_lr 1"),
        (SITE + "[rounds]\nserver_momentum = 0.9\n", "momentum"),
        (SITE + '[privacy]\nmode = "central"\nnoise_multiplier = 1.0\n', "accounted once, at the top"),
        ('mode = "gossip"\n' + SITE, "mode = 'fedavg'"),
        ('[tier]\nsites = true\n[rounds]\naggregation = "median"\n', "robust aggregation"),
        (
            '[tier]\nsites = true\n[privacy]\nmode = "distributed"\nnoise_multiplier = 1.0\n',
            "needs \\[rounds\\] secure_aggregation = true on this tier",
        ),
        (
            '[tier]\nsites = true\n[privacy]\nmode = "central"\nnoise_multiplier = 1.0\n',
            "cannot run over site aggregators",
        ),
    ],
)
def test_what_tiers_refuse(tmp_path, body, words):
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, body)


def test_a_hub_of_sites_has_no_norm_bound(tmp_path):
    cfg = load(tmp_path, "[tier]\nsites = true\n")
    assert config.round_config(cfg).norm_bound is None
    assert config.round_config(load(tmp_path, "")).norm_bound is not None
