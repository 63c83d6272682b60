"""Agent and coordinator configuration: TOML files, validated into frozen dataclasses.

Relative paths in a config file are relative to the file's directory, so a folder
holding ``agent.toml`` with its certificates can be moved as a whole. Every problem
raises :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomli_w

from fedagent.errors import ConfigError
from fedagent.protocols.topics import check_name
from fedagent.storage import history

MODES = ("fedavg", "syncopt", "gossip")


@dataclass(frozen=True, slots=True)
class TlsConfig:
    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class RoundsConfig:
    rounds: int = 10
    min_agents: int = 2
    expected_agents: int = 0
    start_grace: float = 5.0
    agents_per_round: int = 0
    min_updates: int = 1
    round_timeout: float = 120.0
    max_norm: float | None = None
    local_epochs: int = 1
    local_steps: int = 0  # mini-batches a round instead of local_epochs (0: epochs); tasks with fit_steps
    lr: float = 0.05
    batch_size: int = 32
    seed: int = 0
    lr_schedule: str = "constant"  # "constant" | "cosine" over `rounds` (coordinator)
    server_lr: float = 1.0  # the global model moves server_lr x the aggregate's step (1: FedAvg)
    # server momentum β (FedAvgM): v = β·v + step, the model moves server_lr·v; 0: plain
    # FedAvg; None (not set): serveropt.default_momentum, 0.7 or 0 under [privacy]
    server_momentum: float | None = None
    aggregation: str = "fedavg"  # "fedavg" | "metric" | "blur" (FLSimCo eq. 11) | "drop_above"
    weight_key: str = ""  # the reported metric "metric"/"blur"/"drop_above" read
    drop_above: float | None = None  # "drop_above": threshold on weight_key
    leave_after: int = 0  # agent: leave after this many rounds (0 = stay)
    byzantine: int = 0  # robust aggregations: Byzantine updates per round to tolerate (f)
    trim: float = 0.1  # "trimmed_mean": fraction β dropped at each end
    krum_m: int = 0  # "krum": updates averaged by multi-Krum (0 = n - f)
    clip_norm: float | None = None  # cap each update's L2 distance from the global model (any aggregation)
    vocab_timeout: float = 60.0  # tasks with a vocabulary: merge at this deadline with a quorum
    vocab_min_count: int = 1  # keep terms counted at least this often over all agents
    vocab_max_size: int = 0  # keep at most this many terms (0 = all)
    # Secure aggregation (FedAvg; coordinator): see docs/privacy.md
    secure_aggregation: bool = False
    secure_clip: float = 1.0  # each coordinate of a weighted update is clipped to ±this
    secure_bits: int = 20  # quantisation bits (sums mod 2^32: at most 4096 agents a round at 20)
    secure_neighbours: int = 0  # masking neighbours per agent (0 = 2⌈log₂ n⌉)
    secure_threshold: float = 0.5  # shares to rebuild a secret: more than this fraction of its holders
    secure_stage_timeout: float = (
        0.0  # seconds for each key, share, list and unmasking stage (0: min(30, round_timeout/6))
    )


_SCREEN_RULE = {"median": "n > 2f", "trimmed_mean": "n >= 2f + 1", "krum": "n > 2f + 2"}


@dataclass(frozen=True, slots=True)
class GossipSettings:
    """``[gossip]``: how an agent of a ``mode = "gossip"`` federation exchanges models
    (see :mod:`fedagent.protocols.gossip` for the meaning of each)."""

    period_steps: int = 10  # local training steps per exchange (thesis: 10 or 500)
    max_incoming: int = 2  # models kept per period; extra ones dropped at random
    create: str = "mu"  # "mu" merge-then-update | "um" | "rw"
    merge: str = "pushsum"  # "pushsum" (converges to the mean) | "thesis" (Alg. 3.1) | "average" (equal weights)
    exchange: tuple[str, ...] | None = None  # parameter names or globs that travel; None = all
    send_timeout: float = 30.0
    max_retries: int = 2
    periods: int = 0  # stop after this many exchange periods; 0 = run forever
    lr: float = 0.05
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 10  # evaluate the local model every this many periods (0 = never)
    min_peers: int = 1  # start training once this many peers are known
    period_seconds: float = 0.0  # a period lasts at least this long (paces fast training)
    lr_schedule: str = "cosine"  # "cosine" (to 0 at `periods`) | "linear" (word2vec's alpha decay) | "constant"
    catch_up: bool = True  # a newcomer's first merge adopts far older models
    max_norm: float | None = None  # refuse a received model whose L2 norm exceeds this
    clip_norm: float | None = None  # cap a received model's L2 distance from ours
    aggregation: str = "mean"  # "mean" (push-sum) | "median" | "trimmed_mean" | "krum" (screening)
    byzantine: int = 0  # screening: Byzantine neighbours to tolerate per merge (f)
    fanout: int = 1  # peers the model is sent to per period
    neighbour_ttl: int = 10  # screening: periods a neighbour's newest model stays usable
    outer_step: float = 1.0  # adopt start + this x (trained - start) after each period (1 = as trained)
    # Coordinator-free vocabulary consensus (protocols/gossip_vocab.py) for tasks with a
    # vocabulary (term_counts/set_vocabulary): 0 = off, else the number of agents whose
    # offers make the vocabulary, this one included.
    vocab_agents: int = 0
    vocab_members: tuple[str, ...] | None = None  # optional: exactly these agent ids
    vocab_timeout: float = 120.0  # seconds for all offers and confirmations; then abort
    vocab_min_count: int = 1  # merged count a term needs
    vocab_max_size: int = 0  # keep at most this many terms (0 = all)

    def lr_at(self, period: int) -> float:
        """The step size for ``period``: with a known end (``periods``) the default cosine
        decay lets the last periods be almost pure averaging, so the agents end in
        consensus instead of each one biased by its last local steps."""
        if self.lr_schedule == "constant" or not self.periods:
            return self.lr
        if self.lr_schedule == "linear":
            return self.lr * max(1e-4, 1.0 - min(period, self.periods) / self.periods)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(period, self.periods) / self.periods))

    def __post_init__(self) -> None:
        if self.exchange is not None:
            if isinstance(self.exchange, str) or not all(isinstance(x, str) and x for x in self.exchange):
                raise ConfigError("gossip.exchange must be a list of parameter names or globs")
            object.__setattr__(self, "exchange", tuple(self.exchange))
        if self.vocab_members is not None:
            if isinstance(self.vocab_members, str) or not all(isinstance(x, str) and x for x in self.vocab_members):
                raise ConfigError("gossip.vocab_members must be a list of agent ids")
            object.__setattr__(self, "vocab_members", tuple(self.vocab_members))
        if self.vocab_agents:
            self.consensus_config()
        if not (isinstance(self.outer_step, int | float) and math.isfinite(self.outer_step) and self.outer_step > 0):
            raise ConfigError(f"gossip.outer_step must be a positive number, not {self.outer_step!r}")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(f"gossip.lr_schedule must be 'cosine', 'linear' or 'constant', not {self.lr_schedule!r}")
        if self.lr <= 0 or self.batch_size < 1 or self.eval_every < 0 or self.min_peers < 0 or self.period_seconds < 0:
            raise ConfigError(
                "gossip: lr and batch_size must be positive; eval_every, min_peers and period_seconds non-negative"
            )

    def consensus_config(self):
        """The coordinator-free vocabulary consensus's configuration (``vocab_agents`` > 0)."""
        from fedagent.protocols.gossip_vocab import ConsensusConfig

        try:
            return ConsensusConfig(
                expected_agents=self.vocab_agents,
                deadline=self.vocab_timeout,
                min_count=self.vocab_min_count,
                max_size=self.vocab_max_size,
                members=self.vocab_members,
            )
        except ValueError as exc:
            raise ConfigError(f"[gossip] vocabulary: {exc}") from None

    def sends(self) -> int:
        """Models this agent sends over ``periods``: one per period with push-sum,
        ``fanout`` per period with a screening merge (the only merge that fans out)."""
        return self.periods * (self.fanout if self.aggregation != "mean" else 1)

    def machine_config(self, names: tuple[str, ...] | None):
        """The pure machine's configuration, with ``exchange`` resolved to ``names``."""
        from fedagent.protocols.gossip import GossipConfig

        try:
            cfg = GossipConfig(
                period_steps=self.period_steps,
                max_incoming=self.max_incoming,
                create=self.create,
                merge=self.merge,
                exchange=names,
                catch_up=self.catch_up,
                send_timeout=self.send_timeout,
                max_retries=self.max_retries,
                periods=self.periods,
                seed=self.seed,
                max_norm=self.max_norm,
                clip_norm=self.clip_norm,
                aggregation=self.aggregation,
                byzantine=self.byzantine,
                fanout=self.fanout,
                neighbour_ttl=self.neighbour_ttl,
                outer_step=self.outer_step,
            )
        except ValueError as exc:
            raise ConfigError(f"[gossip]: {exc}") from None
        if self.aggregation != "mean":
            from fedagent.protocols.gossip import neighbours_needed

            need = neighbours_needed(self.aggregation, self.byzantine)
            if self.min_peers < need:
                raise ConfigError(
                    f"[gossip]: aggregation = {self.aggregation} with byzantine = {self.byzantine} merges a node's "
                    f"own model with at least {need} neighbours' models ({_SCREEN_RULE[self.aggregation]}), "
                    f"but min_peers is {self.min_peers}: raise min_peers to {need} (and run that many "
                    "peers) or lower byzantine"
                )
        return cfg


@dataclass(frozen=True, slots=True)
class SyncOptSettings:
    """``[syncopt]``: gFedNTM's vocabulary consensus and Sync-Opt steps (coordinator side;
    see :mod:`fedagent.protocols.vocab` and :mod:`fedagent.protocols.syncopt`)."""

    steps: int = 500  # I in Algorithm 1
    tol: float = 0.0  # stop when ||W(t+1)-W(t)|| / ||W(t)|| < tol (0 = never)
    step_timeout: float = 60.0  # seconds a step waits for its gradients
    on_fault: str = "continue"  # "continue" without a vanished agent, or "abort"
    min_gradients: int = 1  # "continue": aggregate a faulty step with at least this many
    max_norm: float | None = None  # refuse gradients with a larger L2 norm
    aggregation: str = "weighted"  # "weighted" (by samples) | "mean"
    expected_agents: int = 0  # start (vocabulary, steps) once this many agents took part
    min_agents: int = 1  # quorum at the vocabulary deadline / start_grace
    vocab_timeout: float = 60.0  # vocabulary deadline: merge then with a quorum
    min_count: int = 1  # keep terms counted at least this often over all agents
    max_size: int = 0  # keep at most this many terms (0 = all)
    start_grace: float = 5.0  # tasks without a vocabulary: wait this long after quorum
    checkpoint_every: int = 10  # steps between checkpoints (and always the last one)
    seed: int = 0  # torch seed for the model's initial weights on the coordinator
    # early stopping on the agents' pooled validation loss, checked every epoch_steps steps
    patience: int = 0  # epochs without improvement before stopping (0 = off)
    delta: float = 0.0  # an epoch improves when its loss <= best - delta
    max_epochs: int = 100
    epoch_steps: int = 0  # steps in one epoch (required with patience)
    # float64 mode: the model must be float64 ([task] dtype = "float64" on every node) and
    # gradients are summed in participant order, so runs repeat bit for bit
    float64: bool = False

    def __post_init__(self) -> None:
        if self.expected_agents < 0 or self.min_agents < 1 or self.checkpoint_every < 1:
            raise ConfigError("syncopt: expected_agents >= 0, min_agents >= 1, checkpoint_every >= 1")
        if self.expected_agents and self.min_agents > self.expected_agents:
            raise ConfigError("syncopt: min_agents cannot exceed expected_agents")
        if not (self.vocab_timeout > 0 and self.start_grace >= 0):
            raise ConfigError("syncopt: vocab_timeout must be positive and start_grace non-negative")

    def machine_config(self):
        from fedagent.protocols.syncopt import SyncOptConfig

        try:
            return SyncOptConfig(
                steps=self.steps,
                tol=self.tol,
                step_timeout=self.step_timeout,
                on_fault=self.on_fault,
                min_gradients=self.min_gradients,
                max_norm=self.max_norm,
                aggregation="ordered" if self.float64 else self.aggregation,
                patience=self.patience,
                delta=self.delta,
                max_epochs=self.max_epochs,
                epoch_steps=self.epoch_steps,
            )
        except ValueError as exc:
            raise ConfigError(f"[syncopt]: {exc}") from None

    def vocab_config(self):
        from fedagent.protocols.vocab import VocabConfig

        try:
            return VocabConfig(
                expected_agents=self.expected_agents,
                min_agents=self.min_agents,
                deadline=self.vocab_timeout,
                min_count=self.min_count,
                max_size=self.max_size,
            )
        except ValueError as exc:
            raise ConfigError(f"[syncopt]: {exc}") from None


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """``[search]``: how ``fedagent search`` reaches the peers' documents (agent side).

    ``space = "joint"``: the sites share one model (SEEC joint learning, FedAvg), so one
    query vector serves every peer. ``space = "mapped"`` (SEEC Algorithm 2): every site
    trains its own model on its own documents only (its own vocabulary, never averaged);
    sites exchange vectors of the public corpus (the first ``public_docs`` documents of
    ``public_corpus``: ``newsgroups``, the 20-newsgroups sample, or ``freebsd-manpages``,
    the FreeBSD manual pages; pick public text like the sites' own) and the asker maps
    the query into each peer's space with a mapper MLP trained on them. The same on every member of a federation."""

    space: str = "joint"
    local_epochs: int = 10  # mapped: epochs of this site's own model
    lr: float = 0.025
    batch_size: int = 256
    public_corpus: str = "newsgroups"
    public_docs: int = 200
    mapper_epochs: int = 150  # see fedagent.tasks.seec: the 200-post sample needs more than 20
    mapper_lr: float = 1e-3
    mapper_hidden: int = 1200
    seed: int = 0
    # Incoming search queries and public-vector requests, per asking peer: a token bucket
    # (0 = no limit). Answering costs this site CPU (a model the first time); any member
    # may ask.
    requests_per_minute: float = 30.0
    request_burst: int = 10

    def __post_init__(self) -> None:
        from fedagent.protocols.search import MAX_PUBLIC_DOCS, PUBLIC_CORPORA, SPACES

        if self.space not in SPACES:
            raise ConfigError(f"search: space must be one of {SPACES}, not {self.space!r}")
        if not (
            1 <= self.local_epochs <= 10_000
            and 1 <= self.mapper_epochs <= 100_000
            and 1 <= self.batch_size
            and 1 <= self.mapper_hidden <= 100_000
        ):
            raise ConfigError("search: local_epochs, mapper_epochs, batch_size, mapper_hidden must be positive")
        if self.public_corpus not in PUBLIC_CORPORA:
            raise ConfigError(f"search: public_corpus must be one of {PUBLIC_CORPORA}, not {self.public_corpus!r}")
        if not 1 <= self.public_docs <= MAX_PUBLIC_DOCS:
            raise ConfigError(f"search: public_docs must be in 1..{MAX_PUBLIC_DOCS}")
        if not (self.lr > 0 and self.mapper_lr > 0):
            raise ConfigError("search: lr and mapper_lr must be positive")
        if not (
            isinstance(self.requests_per_minute, (int, float))
            and 0 <= self.requests_per_minute <= 1e6
            and isinstance(self.request_burst, int)
            and 1 <= self.request_burst <= 10_000
        ):
            raise ConfigError("search: requests_per_minute must be in 0..1e6 (0: no limit), request_burst in 1..10000")


@dataclass(frozen=True, slots=True)
class PrivacySettings:
    """``[privacy]``: differential privacy of the updates (see docs/privacy.md and
    :mod:`fedagent.protocols.dp`). ``mode`` is "central" or "distributed" on a FedAvg
    coordinator (agents learn it from each round), "local" on a gossip agent."""

    mode: str = "central"
    noise_multiplier: float | None = None  # z; or let target_epsilon choose it
    target_epsilon: float | None = None  # choose z so that the configured rounds/periods spend this
    clip_norm: float = 1.0
    adaptive_clip: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_stddev: float | None = None
    delta: float = 1e-5
    epsilon_budget: float | None = None  # stop before ε passes this (default: target_epsilon)

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError("privacy: set exactly one of noise_multiplier and target_epsilon")
        if self.target_epsilon is not None and not (
            isinstance(self.target_epsilon, int | float)
            and math.isfinite(self.target_epsilon)
            and self.target_epsilon > 0
        ):
            raise ConfigError(f"privacy: target_epsilon must be a positive number, not {self.target_epsilon!r}")
        self.dp_config(self.noise_multiplier or 1.0)  # validates the rest now

    def dp_config(self, noise_multiplier: float):
        from fedagent.protocols.dp import DPConfig

        budget = self.epsilon_budget if self.epsilon_budget is not None else self.target_epsilon
        try:
            return DPConfig(
                mode=self.mode,
                noise_multiplier=noise_multiplier,
                clip_norm=self.clip_norm,
                delta=self.delta,
                epsilon_budget=budget,
                adaptive=self.adaptive_clip,
                target_quantile=self.target_quantile,
                clip_lr=self.clip_lr,
                count_stddev=self.count_stddev,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"[privacy]: {exc}") from None

    def resolve(self, releases: int, q: float = 1.0):
        """The DPConfig, with ``target_epsilon`` turned into a noise multiplier for
        ``releases`` rounds (or gossip periods) sampled at ``q`` (needs the privacy extra)."""
        if self.noise_multiplier is not None:
            return self.dp_config(self.noise_multiplier)
        from fedagent.protocols.dp import calibrate

        assert self.target_epsilon is not None
        z = calibrate(self.target_epsilon, max(releases, 1), self.delta, q)
        # A local release's sensitivity is 2C (see protocols/dp.LocalRelease): twice the noise.
        return self.dp_config(2 * z if self.mode == "local" else z)


def default_socket_path(role: str) -> Path:
    """Where a daemon of ``role`` listens for ``fedagent status`` when no ``runtime_dir`` is set."""
    rt = os.environ.get("RUNTIME_DIRECTORY")
    if rt:
        return Path(rt.split(":")[0]) / f"{role}.sock"
    if os.geteuid() == 0:
        return Path(f"/run/fedagent-{role}") / f"{role}.sock"  # the unit's RuntimeDirectory
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "fedagent" / f"{role}.sock"
    return Path(f"/tmp/fedagent-{os.getuid()}") / f"{role}.sock"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Shared by ``fedagent agent`` and ``fedagent coordinator``."""

    path: Path
    role: str  # "agent" or "coordinator"
    id: str
    federation: str  # "" for an agent that has not joined yet
    mode: str
    broker: str  # "" = find by mDNS
    tls: TlsConfig
    state_dir: Path
    runtime_dir: Path | None
    interfaces: tuple[str, ...] = ("127.0.0.1",)
    advertise: bool = True
    task: str = "digits"
    task_options: dict[str, Any] = field(default_factory=dict)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    gossip: GossipSettings = field(default_factory=GossipSettings)
    syncopt: SyncOptSettings = field(default_factory=SyncOptSettings)
    search: SearchSettings = field(default_factory=SearchSettings)
    privacy: PrivacySettings | None = None
    max_chunk_bytes: int = 4 * 2**20
    max_model_bytes: int = 1 * 2**30
    # coordinator: how agents send updates (none|fp16|int8|topk); None: the default,
    # int8 where updates are streamed, none where they travel whole (compression.default_mode)
    compression: str | None = None
    topk_ratio: float = 0.01
    # coordinator: how round starts carry the model (none|int8); None: int8 when the
    # updates are int8 (downlink.default_mode)
    downlink: str | None = None
    stream_updates: bool | None = None  # coordinator: True/False forces it; None: streamed when the aggregation allows
    metrics_port: int = 0  # 0: a free loopback port (shown by status); -1: off
    metrics_host: str = "127.0.0.1"
    torch_threads: int = 1
    max_clock_skew: float = 300.0  # [security]: a message's timestamp may differ this much from ours
    keepalive: int = 10  # [broker]: MQTT keep-alive in seconds; agents send heartbeats every keepalive / 4
    history_max_bytes: int = history.DEFAULT_MAX_BYTES  # history.jsonl is rotated at this size
    history_keep: int = history.DEFAULT_KEEP  # rotated history files kept (the oldest deleted)

    @property
    def control_socket(self) -> Path:
        if self.runtime_dir is not None:
            return self.runtime_dir / f"{self.role}.sock"
        return default_socket_path(self.role)

    def with_membership(self, federation: str, broker: str, interfaces: tuple[str, ...] | None = None) -> NodeConfig:
        if federation:
            check_name(federation, "federation")
        if interfaces is None:
            return replace(self, federation=federation, broker=broker)
        return replace(self, federation=federation, broker=broker, interfaces=check_interfaces(interfaces))


DEFAULT_INTERFACES = ("127.0.0.1",)


def check_interfaces(value: Any, where: str = "discovery.interfaces") -> tuple[str, ...]:
    """mDNS interfaces: a non-empty list of this machine's IPv4 addresses (zeroconf binds
    to addresses, never to interface names; fedagent never picks one by itself)."""
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ConfigError(f'{where} must be a non-empty list of IPv4 addresses, such as ["192.168.1.11"]')
    out = []
    for item in value:
        try:
            out.append(str(ipaddress.IPv4Address(item)))
        except (ipaddress.AddressValueError, ValueError, TypeError):
            raise ConfigError(
                f"{where}: {item!r} is not an IPv4 address (give this machine's address on the LAN, "
                "such as 192.168.1.11, not an interface name)"
            ) from None
    return tuple(dict.fromkeys(out))


_TOP = {
    "id",
    "federation",
    "mode",
    "state_dir",
    "runtime_dir",
    "broker",
    "tls",
    "discovery",
    "task",
    "rounds",
    "gossip",
    "syncopt",
    "transfer",
    "metrics_port",
    "metrics_host",
    "torch_threads",
    "history_max_bytes",
    "history_keep",
    "security",
    "search",
    "privacy",
}


def _table(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return v


_TRANSFER_KEYS = frozenset(
    {"max_chunk_bytes", "max_model_bytes", "compression", "topk_ratio", "downlink", "stream_updates"}
)


def _known(table: dict[str, Any], keys: set[str] | frozenset[str], name: str, where: str) -> None:
    """A misspelt key must not fall back to the default without a word."""
    unknown = set(table) - keys
    if unknown:
        raise ConfigError(f"{where}: [{name}]: unknown keys {sorted(unknown)} (known: {', '.join(sorted(keys))})")


def load(path: Path | str, role: str) -> NodeConfig:
    path = Path(path).expanduser().resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    where = str(path)
    unknown = set(raw) - _TOP
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    base = path.parent

    def p(value: Any, key: str) -> Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} must be a non-empty path")
        # $CREDENTIALS_DIRECTORY etc.: systemd hands keys to a DynamicUser service there.
        # Unset ones stay as written: `fedagent status` reads the file outside the unit,
        # and a daemon that needs the file reports it missing by that name.
        q = Path(os.path.expandvars(value)).expanduser()
        return q if q.is_absolute() else base / q

    try:
        node_id = check_name(raw.get("id", ""), "id")
        federation = raw.get("federation", "")
        if federation or role == "coordinator":
            check_name(federation, "federation")
        mode = raw.get("mode", "fedavg")
        if mode not in MODES:
            raise ConfigError(f"{where}: mode must be one of {MODES}, not {mode!r}")
        tls_raw = _table(raw, "tls", where)
        _known(tls_raw, {"ca", "cert", "key"}, "tls", where)
        tls = TlsConfig(
            ca=p(tls_raw.get("ca"), "tls.ca"),
            cert=p(tls_raw.get("cert"), "tls.cert"),
            key=p(tls_raw.get("key"), "tls.key"),
        )
        broker_raw = _table(raw, "broker", where)
        _known(broker_raw, {"uri", "keepalive"}, "broker", where)
        broker = broker_raw.get("uri", "")
        keepalive = broker_raw.get("keepalive", 10)
        if isinstance(keepalive, bool) or not isinstance(keepalive, int) or not 2 <= keepalive <= 65535:
            raise ConfigError(f"{where}: broker.keepalive must be 2..65535 seconds, not {keepalive!r}")
        if broker and not str(broker).startswith("mqtts://"):
            raise ConfigError(f"{where}: broker.uri must look like mqtts://HOST:PORT, not {broker!r}")
        if role == "coordinator" and not broker:
            raise ConfigError(f"{where}: a coordinator needs broker.uri (it advertises it to agents)")
        disc = _table(raw, "discovery", where)
        _known(disc, {"interfaces", "advertise"}, "discovery", where)
        interfaces = check_interfaces(disc.get("interfaces", list(DEFAULT_INTERFACES)))
        task = _table(raw, "task", where)
        options = {k: v for k, v in task.items() if k != "name"}
        rounds_raw = _table(raw, "rounds", where)
        try:
            rounds = RoundsConfig(**rounds_raw)
        except TypeError as exc:
            raise ConfigError(f"{where}: [rounds]: {exc}") from None
        gossip_raw = _table(raw, "gossip", where)
        try:
            gossip = GossipSettings(**gossip_raw)
            gossip.machine_config(gossip.exchange)  # validates the rest now
        except TypeError as exc:
            raise ConfigError(f"{where}: [gossip]: {exc}") from None
        syncopt_raw = _table(raw, "syncopt", where)
        try:
            syncopt = SyncOptSettings(**syncopt_raw)
            syncopt.machine_config()  # validates the rest now
            syncopt.vocab_config()
        except TypeError as exc:
            raise ConfigError(f"{where}: [syncopt]: {exc}") from None
        try:
            search = SearchSettings(**_table(raw, "search", where))
        except TypeError as exc:
            raise ConfigError(f"{where}: [search]: {exc}") from None
        privacy = None
        if "privacy" in raw:
            try:
                privacy = PrivacySettings(**_table(raw, "privacy", where))
            except TypeError as exc:
                raise ConfigError(f"{where}: [privacy]: {exc}") from None
            expected = "local" if mode == "gossip" else ("central", "distributed")
            if (mode == "gossip") != (privacy.mode == "local"):
                raise ConfigError(
                    f"{where}: [privacy] mode = {privacy.mode!r} does not fit mode = {mode!r} (use {expected!r})"
                )
            if mode == "syncopt":
                raise ConfigError(f"{where}: [privacy] is for mode = 'fedavg' or 'gossip', not 'syncopt'")
        transfer = _table(raw, "transfer", where)
        _known(transfer, _TRANSFER_KEYS, "transfer", where)
        security = _table(raw, "security", where)
        _known(security, {"max_clock_skew"}, "security", where)
        skew = security.get("max_clock_skew", 300.0)
        if isinstance(skew, bool) or not isinstance(skew, int | float) or not 1 <= skew <= 86400:
            raise ConfigError(f"{where}: security.max_clock_skew must be 1..86400 seconds, not {skew!r}")
        state_dir = p(raw.get("state_dir", os.environ.get("STATE_DIRECTORY", "/var/lib/fedagent")), "state_dir")
        rt = raw.get("runtime_dir") or os.environ.get("RUNTIME_DIRECTORY")
        return NodeConfig(
            path=path,
            role=role,
            id=node_id,
            federation=federation,
            mode=mode,
            broker=broker,
            tls=tls,
            state_dir=state_dir,
            runtime_dir=p(rt, "runtime_dir") if rt else None,
            interfaces=interfaces,
            advertise=bool(disc.get("advertise", True)),
            task=str(task.get("name", "digits")),
            task_options=options,
            rounds=rounds,
            gossip=gossip,
            syncopt=syncopt,
            search=search,
            privacy=privacy,
            max_chunk_bytes=int(transfer.get("max_chunk_bytes", 4 * 2**20)),
            max_model_bytes=int(transfer.get("max_model_bytes", 2**30)),
            compression=_compression(transfer, where),
            topk_ratio=float(transfer.get("topk_ratio", 0.01)),
            downlink=_downlink(transfer, where),
            stream_updates=_stream_updates(transfer, where),
            metrics_port=int(raw.get("metrics_port", 0)),
            metrics_host=str(raw.get("metrics_host", "127.0.0.1")),
            torch_threads=int(raw.get("torch_threads", 1)),
            max_clock_skew=float(skew),
            keepalive=keepalive,
            history_max_bytes=_int_at_least(raw, "history_max_bytes", history.DEFAULT_MAX_BYTES, history.MIN_MAX_BYTES),
            history_keep=_int_at_least(raw, "history_keep", history.DEFAULT_KEEP, 1),
        )
    except ConfigError as exc:
        if where in str(exc):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def _int_at_least(raw: dict[str, Any], key: str, default: int, least: int) -> int:
    v = raw.get(key, default)
    if type(v) is not int or v < least:
        raise ConfigError(f"{key} must be an integer of at least {least}, not {v!r}")
    return v


def _stream_updates(transfer: dict[str, Any], where: str) -> bool | None:
    v = transfer.get("stream_updates")
    if v is not None and type(v) is not bool:
        raise ConfigError(f"{where}: [transfer] stream_updates must be true or false, not {v!r}")
    return v


def _downlink(transfer: dict[str, Any], where: str) -> str | None:
    mode = transfer.get("downlink")
    if mode is not None and mode not in ("none", "int8"):
        raise ConfigError(f"{where}: [transfer] downlink must be none or int8, not {mode!r}")
    return mode


def _compression(transfer: dict[str, Any], where: str) -> str | None:
    mode = transfer.get("compression")
    ratio = transfer.get("topk_ratio", 0.01)
    if mode is not None and mode not in ("none", "fp16", "int8", "topk"):
        raise ConfigError(f"{where}: [transfer] compression must be none, fp16, int8 or topk, not {mode!r}")
    if type(ratio) not in (int, float) or not 0 < ratio <= 1:
        raise ConfigError(f"{where}: [transfer] topk_ratio must be in (0, 1], not {ratio!r}")
    return mode


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
) -> str:
    """A config file as TOML text (written by the demo, the local federation and the tests)."""
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
    if transfer:
        doc["transfer"] = transfer
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
