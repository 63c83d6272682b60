"""Reading a config file into a :class:`~fedagent.config.settings.NodeConfig`, writing one.

Everything is checked when the file is loaded, by agents and coordinators alike: unknown
keys (with the table's known keys), types and bounds as declared, the rules between
settings of a table and the combinations the round machine would refuse. Every problem is
one :class:`ConfigError` line naming the file, the table and the key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import tomli_w

from fedagent.config.declare import base_type, checked, declared, read_table, toml_repr, unknown_keys
from fedagent.config.fedbuff import buffer_config
from fedagent.config.machines import round_config, tier_checks
from fedagent.config.paths import TaskOptions, resolve_path
from fedagent.config.settings import (
    TABLES,
    AsyncSettings,
    GossipSettings,
    NodeConfig,
    PrivacySettings,
    RoundsConfig,
    SearchSettings,
    SyncOptSettings,
    TierSettings,
    TlsConfig,
    check_interfaces,
)
from fedagent.errors import ConfigError
from fedagent.protocols.topics import check_name


def load(path: Path | str, role: str) -> NodeConfig:
    path = Path(path).expanduser().resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        return _node(raw, path, role)
    except ConfigError as exc:
        message = str(exc)
        if str(path) in message:
            raise
        raise ConfigError(f"{path}: {message}") from None


def _value(d: Any, table: dict[str, Any], base: Path) -> Any:
    """Setting ``d`` from its TOML table: checked, a path resolved; absent: ``...``."""
    if d.key in table:
        value = table[d.key]
    elif d.setting.env and os.environ.get(d.setting.env):
        value = os.environ[d.setting.env]
    elif d.required:
        raise ConfigError(f"{d.where} is required")
    else:
        return ...
    value = checked(d, value)
    if base_type(d.type)[0] is Path and value is not None:
        value = resolve_path(value, base)
    return value


def _node(raw: dict[str, Any], path: Path, role: str) -> NodeConfig:
    base = path.parent
    fields = declared(NodeConfig)
    top = [d.key for d in fields if not d.table]
    unknown_keys(raw, [*top, *TABLES], "", TABLES)
    tables: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        value = raw.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table, not {toml_repr(value)}")
        tables[name] = value
    for name in ("broker", "discovery", "transfer", "security"):
        unknown_keys(tables[name], [d.key for d in fields if d.table == name], name)
    values: dict[str, Any] = {}
    for d in fields:
        value = _value(d, tables[d.table] if d.table else raw, base)
        if value is not ...:
            values[d.name] = value
    unknown_keys(tables["tls"], [d.key for d in declared(TlsConfig)], "tls")
    tls = TlsConfig(**{d.name: _value(d, tables["tls"], base) for d in declared(TlsConfig)})
    mode = values.get("mode", "fedavg")
    federation = values.get("federation", "")
    if federation or role == "coordinator":
        check_name(federation, "federation")
    if role == "coordinator" and not values.get("broker"):
        raise ConfigError("[broker] uri is required for a coordinator (it advertises it to agents)")
    privacy = None
    if "privacy" in raw:
        privacy = read_table(PrivacySettings, tables["privacy"])
        expected = "local" if mode == "gossip" else ("central", "distributed")
        if mode == "syncopt":
            raise ConfigError("[privacy] is for mode = 'fedavg' or 'gossip', not 'syncopt'")
        if (mode == "gossip") != (privacy.mode == "local"):
            raise ConfigError(f"[privacy] mode = {privacy.mode!r} does not fit mode = {mode!r} (use {expected!r})")
    gossip = read_table(GossipSettings, tables["gossip"])
    gossip.machine_config(gossip.exchange)
    syncopt = read_table(SyncOptSettings, tables["syncopt"])
    syncopt.machine_config()
    syncopt.vocab_config()
    if mode == "gossip" and privacy is not None and privacy.target_epsilon is not None and not gossip.periods:
        raise ConfigError("[privacy] target_epsilon needs [gossip] periods (the releases it is spread over)")
    cfg = NodeConfig(
        path=path,
        role=role,
        tls=tls,
        task_options=TaskOptions({k: v for k, v in tables["task"].items() if k != "name"}, base),
        rounds=read_table(RoundsConfig, tables["rounds"]),
        gossip=gossip,
        syncopt=syncopt,
        search=read_table(SearchSettings, tables["search"]),
        privacy=privacy,
        fedbuff=read_table(AsyncSettings, tables["async"]),
        tier=_tier(tables["tier"], base, mode),
        **values,
    )
    # What the machines would refuse is refused now, by agents too.
    if mode == "async":
        buffer_config(cfg, calibrate=False)
    else:
        rc = round_config(cfg, calibrate=False)
        if role == "coordinator":
            tier_checks(cfg, rc)
    return cfg


def _tier(raw: dict[str, Any], base: Path, mode: str) -> TierSettings:
    tier = read_table(TierSettings, raw)
    if (tier.upstream or tier.sites) and mode != "fedavg":
        raise ConfigError(f"[tier]: tiers of aggregation run FedAvg rounds (mode = 'fedavg', not {mode!r})")
    if tier.upstream:
        cert, key = (str(resolve_path(p, base)) for p in (tier.upstream_cert, tier.upstream_key))
        tier = replace(tier, upstream_cert=cert, upstream_key=key)
    return tier


def render(
    *,
    node_id: str,
    federation: str,
    tls: TlsConfig,
    state_dir: Path,
    broker: str = "",
    runtime_dir: Path | None = None,
    mode: str = "fedavg",
    interfaces: tuple[str, ...] = ("127.0.0.1",),
    task: str = "digits",
    task_options: dict[str, Any] | None = None,
    rounds: dict[str, Any] | None = None,
    gossip: dict[str, Any] | None = None,
    syncopt: dict[str, Any] | None = None,
    search: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
    transfer: dict[str, Any] | None = None,
    fedbuff: dict[str, Any] | None = None,
    tier: dict[str, Any] | None = None,
) -> str:
    """A config file as TOML text (used by the in-machine federation, the demo and the tests)."""
    doc: dict[str, Any] = {"id": node_id, "federation": federation, "mode": mode, "state_dir": str(state_dir)}
    if runtime_dir is not None:
        doc["runtime_dir"] = str(runtime_dir)
    doc["broker"] = {"uri": broker}
    doc["tls"] = {"ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key)}
    doc["discovery"] = {"interfaces": list(interfaces)}
    doc["task"] = {"name": task, **(task_options or {})}
    if rounds:
        doc["rounds"] = rounds
    if gossip:
        doc["gossip"] = gossip
    if syncopt:
        doc["syncopt"] = syncopt
    if search:
        doc["search"] = search
    if privacy:
        doc["privacy"] = privacy
    if fedbuff:
        doc["async"] = fedbuff
    if transfer:
        doc["transfer"] = transfer
    if tier:
        doc["tier"] = tier
    return tomli_w.dumps(doc)


def update_membership(path: Path, federation: str, broker: str, interfaces: tuple[str, ...] | None = None) -> None:
    """Record ``fedagent join`` (or, with an empty federation, ``leave``) in the config
    file, keeping everything else; ``interfaces`` (``join --interface``) replaces
    ``[discovery] interfaces`` so the daemon browses there after a restart too.

    The file is edited in place (tomlkit): the operator's comments, key order and
    formatting survive; only the changed values are rewritten. The edit is checked by
    reading the result back before the file is replaced."""
    import tomlkit

    from fedagent.storage.statefile import atomic_write

    if federation:
        check_name(federation, "federation")
    chosen = list(check_interfaces(interfaces, "--interface")) if interfaces else None
    text = path.read_text()
    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    expected = tomllib.loads(text)
    expected["federation"] = federation
    expected.setdefault("broker", {})["uri"] = broker
    doc["federation"] = federation
    _edit_table(doc, "broker")["uri"] = broker
    if chosen is not None:
        expected.setdefault("discovery", {})["interfaces"] = chosen
        _edit_table(doc, "discovery")["interfaces"] = chosen
    out = tomlkit.dumps(doc)
    if tomllib.loads(out) != expected:
        # A layout tomlkit cannot edit in place (e.g. a dotted ``broker.uri`` key):
        # write the same values without the comments rather than a wrong file.
        out = tomli_w.dumps(expected)
    atomic_write(path, out.encode(), mode=path.stat().st_mode & 0o777)


def _edit_table(doc: Any, name: str) -> Any:
    """``doc[name]`` as a table to set keys in, created at the end if missing."""
    import tomlkit

    if name not in doc:
        doc[name] = tomlkit.table()
    return doc[name]
