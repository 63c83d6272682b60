"""Valid config files build the same machine configurations as before the settings were
declared once: the expected values in config_machines.json were recorded from the code as
it was (hand-written dataclasses and mappings, commit "tests: machine configs built from
twelve representative config files"), settings added since (the history bounds, `[async]`, `[tier]`) at their
defaults ([tier] too), and are compared field by field, through the functions the daemons call."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import pytest

from fedagent import config
from fedagent.coordinator.fedavg import round_config
from fedagent.coordinator.vocabstage import vocab_config

EXPECTED = json.loads((Path(__file__).parent / "config_machines.json").read_text())

#: name: (role, the file's settings besides identity, paths, [broker] uri and [tls])
CONFIGS = {
    "agent-defaults": ("agent", ""),
    "coordinator-defaults": ("coordinator", ""),
    "coordinator-robust": (
        "coordinator",
        """
metrics_port = 9100
metrics_host = "0.0.0.0"
torch_threads = 2
[broker]
keepalive = 30
[discovery]
interfaces = ["127.0.0.1", "10.1.2.3"]
advertise = false
[security]
max_clock_skew = 60
[task]
name = "digits"
shards = 8
alpha = 0.3
[rounds]
rounds = 30
min_agents = 5
expected_agents = 8
agents_per_round = 6
min_updates = 5
start_grace = 2.5
round_timeout = 300
max_norm = 100.0
local_steps = 20
lr = 0.1
batch_size = 64
seed = 3
lr_schedule = "cosine"
server_lr = 0.8
server_momentum = 0.5
aggregation = "trimmed_mean"
byzantine = 2
trim = 0.4
clip_norm = 5.0
vocab_timeout = 30
vocab_min_count = 2
vocab_max_size = 5000
[transfer]
max_chunk_bytes = 1048576
max_model_bytes = 268435456
downlink = "none"
""",
    ),
    "coordinator-streamed": (
        "coordinator",
        """
[rounds]
rounds = 5
min_agents = 3
aggregation = "metric"
weight_key = "accuracy"
local_epochs = 2
server_lr = 1
[transfer]
compression = "topk"
topk_ratio = 0.05
stream_updates = true
downlink = "int8"
""",
    ),
    "coordinator-drop-above": (
        "coordinator",
        """
[rounds]
aggregation = "drop_above"
weight_key = "speed"
drop_above = 27.5
expected_agents = 4
[transfer]
compression = "fp16"
""",
    ),
    "coordinator-krum-whole": (
        "coordinator",
        """
[rounds]
min_agents = 6
min_updates = 6
aggregation = "krum"
byzantine = 1
krum_m = 3
[transfer]
stream_updates = false
""",
    ),
    "coordinator-secure-dp": (
        "coordinator",
        """
[rounds]
rounds = 8
min_agents = 4
min_updates = 3
round_timeout = 60
secure_aggregation = true
secure_clip = 0.5
secure_bits = 16
secure_neighbours = 4
secure_threshold = 0.6
secure_stage_timeout = 10
[privacy]
mode = "distributed"
noise_multiplier = 0.8
clip_norm = 0.5
adaptive_clip = true
target_quantile = 0.6
clip_lr = 0.1
count_stddev = 2.0
delta = 1e-6
epsilon_budget = 10.0
""",
    ),
    "coordinator-central-epsilon": (
        "coordinator",
        """
[rounds]
rounds = 20
expected_agents = 10
agents_per_round = 5
[privacy]
mode = "central"
target_epsilon = 3.0
clip_norm = 2.0
""",
    ),
    "coordinator-syncopt": (
        "coordinator",
        """
mode = "syncopt"
[task]
name = "prodlda"
[syncopt]
steps = 300
tol = 1e-6
step_timeout = 30
on_fault = "abort"
min_gradients = 2
max_norm = 1000.0
aggregation = "mean"
expected_agents = 5
min_agents = 3
vocab_timeout = 20
min_count = 2
max_size = 4000
start_grace = 1
checkpoint_every = 25
seed = 7
patience = 3
delta = 0.01
max_epochs = 50
epoch_steps = 40
""",
    ),
    "coordinator-syncopt-float64": (
        "coordinator",
        """
mode = "syncopt"
[task]
name = "prodlda"
dtype = "float64"
[syncopt]
float64 = true
""",
    ),
    "agent-gossip": (
        "agent",
        """
mode = "gossip"
[task]
name = "word2vec"
shard = 1
shards = 3
[gossip]
period_steps = 50
max_incoming = 3
create = "mu"
merge = "pushsum"
exchange = ["in_embed.*"]
send_timeout = 10
max_retries = 4
periods = 40
lr = 0.2
batch_size = 256
seed = 5
eval_every = 5
min_peers = 3
period_seconds = 1.5
lr_schedule = "linear"
catch_up = false
max_norm = 50.0
clip_norm = 10.0
aggregation = "median"
byzantine = 1
fanout = 2
neighbour_ttl = 6
outer_step = 2
vocab_agents = 3
vocab_members = ["agent-1", "agent-2", "agent-3"]
vocab_timeout = 90
vocab_min_count = 3
vocab_max_size = 10000
[privacy]
mode = "local"
noise_multiplier = 1.1
clip_norm = 2.0
""",
    ),
    "agent-search": (
        "agent",
        """
[task]
name = "doc2vec"
[rounds]
leave_after = 4
[search]
space = "mapped"
local_epochs = 5
lr = 0.05
batch_size = 128
public_corpus = "freebsd-manpages"
public_docs = 300
mapper_epochs = 100
mapper_lr = 0.002
mapper_hidden = 600
seed = 2
requests_per_minute = 0
request_burst = 3
""",
    ),
}


def config_text(role: str, body: str) -> str:
    """A whole config file: identity and paths, then ``body``, then [broker] and [tls]."""
    head = 'id = "node-1"\nfederation = "fed"\nstate_dir = "state"\nruntime_dir = "run"\n'
    uri = 'uri = "mqtts://127.0.0.1:8883"\n'
    if "[broker]" in body:
        body = body.replace("[broker]\n", "[broker]\n" + uri)
    elif role == "coordinator":
        body += "\n[broker]\n" + uri
    return head + body + '\n[tls]\nca = "tls/ca.crt"\ncert = "tls/node.crt"\nkey = "tls/node.key"\n'


def plain(value: Any, base: Path) -> Any:
    """``value`` as JSON-like data: dataclasses field by field (with their type's name),
    paths relative to the config's directory."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"__type__": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = plain(getattr(value, f.name), base)
        return out
    if isinstance(value, Path):
        try:
            return "<dir>/" + str(value.relative_to(base))
        except ValueError:
            return str(value)
    if isinstance(value, tuple | list):
        return [plain(x, base) for x in value]
    if isinstance(value, frozenset):
        return sorted(plain(x, base) for x in value)
    if isinstance(value, dict):
        return {str(k): plain(x, base) for k, x in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def machines(cfg: config.NodeConfig, base: Path) -> dict[str, Any]:
    """What each daemon builds from ``cfg``: the node config and its machines' configs."""
    out = {"node": plain(cfg, base)}
    if cfg.role == "coordinator" and cfg.mode == "fedavg":
        out["round"] = plain(round_config(cfg), base)
        out["vocab"] = plain(vocab_config(cfg.rounds, str(cfg.path)), base)
    if cfg.role == "coordinator" and cfg.mode == "syncopt":
        out["syncopt"] = plain(cfg.syncopt.machine_config(), base)
        out["vocab"] = plain(vocab_config(cfg.syncopt, str(cfg.path)), base)
    if cfg.mode == "gossip":
        out["gossip"] = plain(cfg.gossip.machine_config(("in_embed.weight",)), base)
        if cfg.gossip.vocab_agents:
            out["consensus"] = plain(config.consensus_config(cfg.gossip), base)
        if cfg.privacy is not None:
            out["dp"] = plain(cfg.privacy.resolve(cfg.gossip.sends()), base)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_machine_configs_are_the_recorded_ones(tmp_path, name):
    role, body = CONFIGS[name]
    path = tmp_path / f"{name}.toml"
    path.write_text(config_text(role, body))
    got = machines(config.load(path, role), tmp_path.resolve())
    expected = EXPECTED[name]
    assert got.keys() == expected.keys()
    for part, fields in expected.items():
        for key, value in fields.items():
            assert got[part][key] == value, f"{name}: {part}.{key}"
        assert got[part].keys() == fields.keys(), f"{name}: {part}"
