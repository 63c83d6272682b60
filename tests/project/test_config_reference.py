"""Each setting is declared once: docs/configuration.md is written from the declaration,
every field of a settings table is a declared setting, and every setting declared to go
to a machine's configuration names a field there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedagent.config import declare, reference, settings
from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.fedbuff import BufferConfig
from fedagent.protocols.gossip import GossipConfig
from fedagent.protocols.gossip_vocab import ConsensusConfig
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.secagg import SecAggParams
from fedagent.protocols.syncopt import SyncOptConfig
from fedagent.protocols.vocab import VocabConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"

#: (settings table, machine) -> the machine's configuration class, and the fields the
#: builder passes itself (what no single setting says).
MACHINES = {
    (settings.RoundsConfig, "round"): (
        R.RoundConfig,
        {"train", "strategy", "downlink", "dp", "secure", "norm_bound", "whole_model_every"},
    ),
    (settings.RoundsConfig, "norm"): (R.NormBound, set()),
    (settings.RoundsConfig, "train"): (
        TrainConfig,
        {"compression", "topk_ratio", "stream", "dp_clip", "dp_noise_std", "dp_count_std", "dp_cohort"},
    ),
    (settings.RoundsConfig, "strategy"): (Strategy, set()),
    (settings.RoundsConfig, "secure"): (SecAggParams, {"min_survivors"}),
    (settings.RoundsConfig, "vocab"): (VocabConfig, {"max_terms"}),
    (settings.SyncOptSettings, "syncopt"): (SyncOptConfig, set()),
    (settings.SyncOptSettings, "vocab"): (VocabConfig, {"max_terms"}),
    (settings.GossipSettings, "gossip"): (GossipConfig, {"exchange", "fixed"}),
    (settings.GossipSettings, "vocab"): (ConsensusConfig, {"resend"}),
    (settings.PrivacySettings, "dp"): (DPConfig, {"noise_multiplier", "epsilon_budget"}),
    # [rounds] gives the asynchronous mode its training, quorum, server step and the
    # member protections
    (settings.AsyncSettings, "buffer"): (
        BufferConfig,
        {
            "min_agents",
            "expected_agents",
            "start_grace",
            "train",
            "seed",
            "strategy",
            "lr_schedule",
            "server_lr",
            "server_momentum",
            "downlink",
            "dp",
            "weight_cap",
            "norm_bound",
        },
    ),
}


def test_the_reference_page_is_written_from_the_declaration() -> None:
    assert PAGE.read_text() == reference.page(), "run scripts/config_reference.py and commit docs/configuration.md"


def test_the_operators_guide_links_the_reference_instead_of_listing_keys() -> None:
    text = (ROOT / "docs" / "operators.md").read_text()
    assert "(configuration.md)" in text
    assert "| `[rounds] rounds` |" not in text and "| key | meaning | default |" not in text


@pytest.mark.parametrize("cls", list(settings.TABLE_CLASSES.values()), ids=lambda c: c.__name__)
def test_every_field_of_a_table_is_a_declared_setting(cls: type) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    assert fields == {d.name for d in declare.declared(cls)}
    for d in declare.declared(cls):
        assert d.setting.help and "\n" not in d.setting.help, d.name


def test_the_node_config_holds_the_flat_settings_and_the_tables() -> None:
    flat = {d.name for d in declare.declared(settings.NodeConfig)}
    rest = {f.name for f in dataclasses.fields(settings.NodeConfig)} - flat
    assert rest == {
        "path",
        "role",
        "tls",
        "task_options",
        "rounds",
        "gossip",
        "syncopt",
        "search",
        "privacy",
        "fedbuff",
        "tier",
    }
    assert {d.table for d in declare.declared(settings.NodeConfig)} == {
        "",
        "broker",
        "discovery",
        "task",
        "transfer",
        "security",
    }
    assert set(settings.TABLES) == {
        "tls",
        *settings.TABLE_CLASSES,
        "broker",
        "discovery",
        "task",
        "transfer",
        "security",
    }


@pytest.mark.parametrize("table, machine", list(MACHINES), ids=lambda x: getattr(x, "__name__", x))
def test_every_machine_field_comes_from_one_setting_or_the_builder(table: type, machine: str) -> None:
    cls, extra = MACHINES[(table, machine)]
    targets = [target for _, target in declare.targets(table, machine)]
    machine_fields = {f.name for f in dataclasses.fields(cls)}
    assert len(targets) == len(set(targets)), "two settings feed one field"
    assert set(targets) <= machine_fields
    assert set(targets) | extra == machine_fields


def test_declared_defaults_pass_their_own_checks() -> None:
    for cls in (*settings.TABLE_CLASSES.values(), settings.NodeConfig):
        for d in declare.declared(cls):
            if not d.required and d.default is not None and not d.setting.env:
                assert declare.checked(d, d.default) == d.default, d.where
