"""Every setting of a config file, declared once: a dataclass per TOML table.

``[rounds]``, ``[gossip]``, ``[syncopt]``, ``[search]`` and ``[privacy]`` are
:class:`~fedagent.config.declare.Table` dataclasses (checked on construction); the top
level and the small tables ``[broker]``, ``[discovery]``, ``[task]``, ``[transfer]`` and
``[security]`` are fields of :class:`NodeConfig` that say their table, because the
daemons read them as ``cfg.keepalive``, ``cfg.compression``...; ``[tls]`` is
:class:`TlsConfig`. A field's ``to`` says where its value goes in a pure machine's
configuration (:func:`~fedagent.config.declare.build`).
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from fedagent.config.declare import REQUIRED, Table, build, setting
from fedagent.errors import ConfigError
from fedagent.protocols import dp
from fedagent.protocols import fedbuff as FB
from fedagent.protocols import gossip as G
from fedagent.protocols import secagg as SA
from fedagent.protocols import syncopt as S
from fedagent.protocols.aggregation import STRATEGIES
from fedagent.protocols.compression import MODES as COMPRESSIONS
from fedagent.protocols.downlink import MODES as DOWNLINKS
from fedagent.protocols.gossip_vocab import ConsensusConfig
from fedagent.protocols.messages import MAX_LOCAL_STEPS
from fedagent.protocols.messages import MODES as MESSAGE_MODES
from fedagent.protocols.search import MAX_PUBLIC_DOCS, PUBLIC_CORPORA, SPACES
from fedagent.protocols.topics import check_name
from fedagent.protocols.vocab import MAX_TERMS, VocabConfig
from fedagent.storage import history

MODES: tuple[str, ...] = MESSAGE_MODES


@dataclass(frozen=True, slots=True)
class TlsConfig:
    TABLE: ClassVar[str] = "tls"

    ca: Path = setting(REQUIRED, "the federation's CA certificate (PEM)")
    cert: Path = setting(REQUIRED, "this node's certificate (PEM); its CN is the node's `id`")
    key: Path = setting(REQUIRED, "this node's private key (PEM)")


@dataclass(frozen=True, slots=True)
class RoundsConfig(Table):
    TABLE: ClassVar[str] = "rounds"

    rounds: int = setting(10, "FedAvg rounds to run (coordinator)", ge=1, to="round")
    min_agents: int = setting(
        2, "quorum before a round starts (and for the vocabulary merge)", ge=1, to=("round", "vocab")
    )
    expected_agents: int = setting(
        0,
        "start at once when this many are online, and merge the vocabulary once this many offered (0: unknown)",
        ge=0,
        to=("round", "vocab"),
    )
    start_grace: float = setting(5.0, "seconds to wait for more agents after the quorum", ge=0, to="round")
    agents_per_round: int = setting(0, "sample this many agents per round (0: every online agent)", ge=0, to="round")
    min_updates: int = setting(1, "updates needed to aggregate at the deadline", ge=1, to="round")
    round_timeout: float = setting(120.0, "seconds before a round is closed", gt=0, to="round")
    max_norm: float | None = setting(None, "reject updates with a larger L2 norm", gt=0, to="round")
    local_epochs: int = setting(1, "epochs each agent trains a round", ge=1, le=10_000, to={"train": "epochs"})
    local_steps: int = setting(
        0,
        "mini-batches each agent trains a round instead of `local_epochs` (0: epochs); the task needs `fit_steps()` "
        "([modes/fedavg.md](modes/fedavg.md#shorter-rounds-and-a-server-step))",
        ge=0,
        le=MAX_LOCAL_STEPS,
        to={"train": "steps"},
    )
    lr: float = setting(0.05, "the agents' learning rate", gt=0, lt=100, to="train")
    batch_size: int = setting(32, "the agents' mini-batch size", ge=1, le=1_000_000, to="train")
    seed: int = setting(0, "seed of the agents' sampling and of the model built after a vocabulary", to="round")
    lr_schedule: str = setting(
        "constant",
        "`constant`, or `cosine`: lr·½(1+cos(π(r−1)/rounds)) in round r",
        choices=("constant", "cosine"),
        to="round",
    )
    server_lr: float = setting(
        1.0, "the global model moves this many times the aggregate's step (1: FedAvg)", gt=0, le=100, to="round"
    )
    server_momentum: float | None = setting(
        None,
        "server momentum β (FedAvgM): the velocity `v ← β·v + (aggregate − global)` moves the model by "
        "`server_lr · v`; kept on disk beside the checkpoint; 0: plain FedAvg "
        "([modes/fedavg.md](modes/fedavg.md#server-momentum))",
        ge=0,
        lt=1,
        to="round",
        shown="0.7; 0 with `[privacy]`; 0 in mode `async`",
    )
    local_norm: bool = setting(
        False,
        "coordinator, FedAvg: FedBN: the parameters and buffers of the model's normalisation layers (BatchNorm, "
        "LayerNorm, GroupNorm ...) stay on each agent, never averaged; the global model keeps its initial ones "
        "([tasks.md](tasks.md#buffers-normalisation-layers-and-fedbn))",
        to="train",
    )
    aggregation: str = setting(
        "fedavg",
        "`fedavg` (by samples), `metric` (by the reported metric `weight_key`), `blur` (FLSimCo eq. 11 on "
        "`weight_key`, default `blur_level`), `drop_above` (FedAvg without updates whose `weight_key` exceeds "
        "`drop_above`); robust: `median`, `trimmed_mean`, `krum` (see [security.md](security.md))",
        choices=STRATEGIES,
        to={"strategy": "name"},
    )
    weight_key: str = setting(
        "", "the metric agents report with their update that the strategy reads", to={"strategy": "key"}
    )
    drop_above: float | None = setting(
        None, "`drop_above`: the threshold on `weight_key`", to={"strategy": "threshold"}
    )
    leave_after: int = setting(
        0,
        "agent: take part in this many rounds, then leave (the last update says so; the daemon exits 0); 0: stay",
        ge=0,
    )
    byzantine: int = setting(
        0,
        "f: Byzantine updates per round a robust aggregation must tolerate; checked against `min_updates`",
        ge=0,
        to="strategy",
    )
    trim: float = setting(
        0.1, "`trimmed_mean`: fraction β in [0, 0.5) dropped at each end of every coordinate", to="strategy"
    )
    krum_m: int = setting(0, "`krum`: updates averaged by multi-Krum (0: n − f)", ge=0, to="strategy")
    clip_norm: float | None = setting(
        None,
        "any aggregation: an update's L2 distance from the global model is capped at this before it is aggregated",
        gt=0,
        to="strategy",
    )
    weight_cap: float = setting(
        2.0,
        "`fedavg`, `drop_above`: an update weighs at most the samples its agent announced in its presence, and at "
        "most this many times the median the round's agents announced (`async`: every agent seen); under secure "
        "aggregation, the samples that weigh 1 are at most this many times that median (0: off) "
        "([security.md](security.md#one-member-against-the-federation))",
        ge=0,
        to="round",
    )
    norm_multiplier: float = setting(
        3.0,
        "streamed aggregations: each update's L2 distance from the global model is scaled down to at most this many "
        "times the median distance accepted over the last `norm_window` rounds (`async`: buffers); under secure "
        "aggregation, the "
        "unmasked mean update, against the means of recent rounds (0: off; the robust aggregators, `clip_norm` "
        "and differential privacy bound updates their own way) "
        "([security.md](security.md#one-member-against-the-federation))",
        ge=0,
        to={"norm": "multiplier"},
    )
    norm_window: int = setting(
        10, "rounds whose accepted distances the norm bound's median is taken over", ge=1, to={"norm": "window"}
    )
    norm_floor: float = setting(
        0.0,
        "the norm bound is never below this distance (for models whose honest steps can vanish)",
        ge=0,
        to={"norm": "floor"},
    )
    norm_warmup: int = setting(
        3,
        "distances needed before the norm bound comes from earlier rounds; until then each round's bound comes from "
        "its own updates, folded once all are in",
        ge=1,
        to={"norm": "warmup"},
    )
    vocab_timeout: float = setting(
        60.0,
        "tasks with a vocabulary (`doc2vec`, `word2vec`): seconds the coordinator waits for the agents' vocabulary "
        "offers before merging with a quorum (`min_agents`); with `expected_agents` it merges as soon as that many "
        "offered",
        gt=0,
        to={"vocab": "deadline"},
    )
    vocab_min_count: int = setting(
        1, "keep the terms counted at least this often over all agents", ge=1, to={"vocab": "min_count"}
    )
    vocab_max_size: int = setting(
        0, "keep at most this many terms (0: all)", ge=0, le=MAX_TERMS, to={"vocab": "max_size"}
    )
    secure_aggregation: bool = setting(
        False,
        "coordinator, FedAvg: agents mask their updates (SecAgg+) so the coordinator learns only their sum; "
        "refused with the settings that read single updates ([privacy.md](privacy.md))",
    )
    secure_clip: float = setting(
        1.0,
        "secure aggregation: each coordinate of a weighted update is clipped to ±this",
        gt=0,
        le=SA.MAX_CLIP,
        to={"secure": "clip"},
    )
    secure_bits: int = setting(
        20,
        "secure aggregation: quantisation to 2^this levels (sums mod 2^32: at most 4096 agents a round at 20)",
        ge=2,
        le=30,
        to={"secure": "bits"},
    )
    secure_neighbours: int = setting(
        0,
        "secure aggregation: masking neighbours per agent (0: 2⌈log₂ n⌉)",
        ge=0,
        le=SA.MAX_NEIGHBOURS,
        to={"secure": "neighbours"},
    )
    secure_threshold: float = setting(
        0.5,
        "secure aggregation: a secret needs more than this fraction of its holders' shares",
        ge=0.5,
        lt=1,
        to={"secure": "threshold"},
    )
    secure_stage_timeout: float = setting(
        0.0,
        "secure aggregation: seconds for each key, share and unmasking stage (0: min(30, `round_timeout`/6))",
        ge=0,
        to="round",
    )

    def vocab_config(self) -> VocabConfig:
        return vocab_config(self)


_SCREEN_RULE = {"median": "n > 2f", "trimmed_mean": "n >= 2f + 1", "krum": "n > 2f + 2"}


@dataclass(frozen=True, slots=True)
class GossipSettings(Table):
    """``[gossip]``: how an agent of a ``mode = "gossip"`` federation exchanges models
    (see :mod:`fedagent.protocols.gossip` for the meaning of each)."""

    TABLE: ClassVar[str] = "gossip"

    period_steps: int = setting(
        10, "local training steps per exchange period (thesis: 10 frequent, 500 infrequent)", ge=1, to="gossip"
    )
    max_incoming: int = setting(2, "models kept per period; extra ones are dropped at random", ge=1, to="gossip")
    create: str = setting(
        "mu", "`mu` merge-then-update, `um` update-then-merge, `rw` random walk", choices=G.CREATE_MODES, to="gossip"
    )
    merge: str = setting(
        "pushsum",
        "`pushsum` (converges to the mean), `thesis` (Alg. 3.1) or `average` (equal weights)",
        choices=G.MERGE_MODES,
        to="gossip",
    )
    exchange: tuple[str, ...] | None = setting(
        None,
        "parameter names or globs exchanged; unset: all of them (a list that matches no parameter stops the agent "
        "at start)",
        shown="unset (all)",
    )
    send_timeout: float = setting(30.0, "seconds to wait for an ack", gt=0, to="gossip")
    max_retries: int = setting(2, "sends of one model to new peers before its mass is folded back", ge=0, to="gossip")
    periods: int = setting(0, "stop after this many exchange periods (0: run until stopped)", ge=0, to="gossip")
    lr: float = setting(0.05, "local SGD's learning rate", gt=0)
    batch_size: int = setting(32, "local SGD's mini-batch size", ge=1)
    seed: int = setting(0, "seed of the local training and of the peer choice", to="gossip")
    eval_every: int = setting(10, "evaluate the local model every this many periods (0: never)", ge=0)
    min_peers: int = setting(1, "peers to see before the first period", ge=0)
    period_seconds: float = setting(0.0, "least wall time per period (paces fast training)", ge=0)
    lr_schedule: str = setting(
        "cosine",
        "`cosine` (to 0 at `periods`), `linear` (word2vec's alpha decay to 1e-4·lr; inside each period for tasks "
        "whose `fit_steps` takes `lr_end`, e.g. `word2vec`) or `constant`",
        choices=("cosine", "linear", "constant"),
    )
    catch_up: bool = setting(
        True,
        "a newcomer's first merge adopts models more than twice its age instead of averaging its initial model in "
        "(its mass still counts)",
        to="gossip",
    )
    max_norm: float | None = setting(
        None, "refuse (and hand back the mass of) a received model whose L2 norm exceeds this", gt=0, to="gossip"
    )
    clip_norm: float | None = setting(
        None,
        "move a received model towards ours until its L2 distance is at most this, before it is kept "
        "(see [security.md](security.md#robust-aggregation))",
        gt=0,
        to="gossip",
    )
    aggregation: str = setting(
        "mean",
        "`mean` (push-sum), or a screening merge: `median`, `trimmed_mean`, `krum` "
        "(see [security.md](security.md#robust-aggregation))",
        choices=G.AGGREGATIONS,
        to="gossip",
    )
    byzantine: int = setting(
        0,
        "screening: Byzantine neighbours one merge must tolerate (f); `min_peers` below what the rule needs is refused",
        ge=0,
        to="gossip",
    )
    fanout: int = setting(1, "screening: peers the model is sent to per period", ge=1, to="gossip")
    neighbour_ttl: int = setting(10, "screening: periods a neighbour's newest model stays usable", ge=1, to="gossip")
    outer_step: float = setting(
        1.0,
        "after each period's training, adopt (send, merge) the period's start + this × the training's progress "
        "instead of the trained model (1: as trained)",
        gt=0,
        to="gossip",
    )
    vocab_agents: int = setting(
        0,
        "coordinator-free vocabulary consensus for tasks with a vocabulary (`word2vec`, `doc2vec`): the number of "
        "agents (this one included) whose term counts make the vocabulary; 0: off (the task's own vocabulary)",
        ge=0,
        to={"vocab": "expected_agents"},
    )
    vocab_members: tuple[str, ...] | None = setting(
        None, "optional: exactly these agent ids take part in the consensus", to={"vocab": "members"}
    )
    vocab_timeout: float = setting(
        120.0,
        "seconds for all offers and confirmations; then the consensus fails and nothing is trained",
        gt=0,
        to={"vocab": "deadline"},
    )
    vocab_min_count: int = setting(1, "merged count a term needs", ge=1, to={"vocab": "min_count"})
    vocab_max_size: int = setting(
        0, "keep at most this many terms (0: all)", ge=0, le=MAX_TERMS, to={"vocab": "max_size"}
    )

    def check(self) -> None:
        if self.vocab_agents:
            self.consensus_config()

    def lr_at(self, period: int) -> float:
        """The step size for ``period``: with a known end (``periods``) the default cosine
        decay lets the last periods be almost pure averaging, so the agents end in
        consensus instead of each one biased by its last local steps."""
        if self.lr_schedule == "constant" or not self.periods:
            return self.lr
        if self.lr_schedule == "linear":
            return self.lr * max(1e-4, 1.0 - min(period, self.periods) / self.periods)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(period, self.periods) / self.periods))

    def consensus_config(self) -> ConsensusConfig:
        """The coordinator-free vocabulary consensus's configuration (``vocab_agents`` > 0)."""
        return consensus_config(self)

    def sends(self) -> int:
        """Models this agent sends over ``periods``: one per period with push-sum,
        ``fanout`` per period with a screening merge (the only merge that fans out)."""
        return self.periods * (self.fanout if self.aggregation != "mean" else 1)

    def machine_config(self, names: tuple[str, ...] | None, fixed: frozenset[str] = frozenset()) -> G.GossipConfig:
        """The pure machine's configuration, with ``exchange`` resolved to ``names`` and
        ``fixed``: the model's tensors the outer step leaves as trained (its buffers)."""
        cfg = build(self, "gossip", G.GossipConfig, exchange=names, fixed=fixed)
        if self.aggregation != "mean":
            need = G.neighbours_needed(self.aggregation, self.byzantine)
            if self.min_peers < need:
                raise ConfigError(
                    f"[gossip]: aggregation = {self.aggregation} with byzantine = {self.byzantine} merges a node's "
                    f"own model with at least {need} neighbours' models ({_SCREEN_RULE[self.aggregation]}), "
                    f"but min_peers is {self.min_peers}: raise min_peers to {need} (and run that many "
                    "peers) or lower byzantine"
                )
        return cfg


@dataclass(frozen=True, slots=True)
class SyncOptSettings(Table):
    """``[syncopt]``: gFedNTM's vocabulary consensus and Sync-Opt steps (coordinator side;
    see :mod:`fedagent.protocols.vocab` and :mod:`fedagent.protocols.syncopt`)."""

    TABLE: ClassVar[str] = "syncopt"

    steps: int = setting(500, "maximum number of steps (I in Algorithm 1)", ge=1, to="syncopt")
    tol: float = setting(0.0, "stop when the relative weight change falls below this (0: never)", ge=0, to="syncopt")
    step_timeout: float = setting(60.0, "seconds a step waits for its gradients", gt=0, to="syncopt")
    on_fault: str = setting(
        "continue", "`continue` without missing agents, or `abort`", choices=S.FAULT_POLICIES, to="syncopt"
    )
    min_gradients: int = setting(
        1, "`continue`: aggregate a faulty step with at least this many gradients", ge=1, to="syncopt"
    )
    max_norm: float | None = setting(None, "refuse gradients with a larger L2 norm", gt=0, to="syncopt")
    aggregation: str = setting(
        "weighted",
        "`weighted` (by batch size: the gradient of the concatenated batch, a streaming sum), `ordered` (the same, "
        "summed in participant order: repeatable bit for bit) or `mean`",
        choices=tuple(S.AGGREGATORS),
        to="syncopt",
    )
    expected_agents: int = setting(
        0, "start (vocabulary merge, steps) once this many agents took part (0: unknown)", ge=0, to="vocab"
    )
    min_agents: int = setting(1, "quorum at the vocabulary deadline / after `start_grace`", ge=1, to="vocab")
    vocab_timeout: float = setting(
        60.0, "seconds until the vocabulary is merged with a quorum", gt=0, to={"vocab": "deadline"}
    )
    min_count: int = setting(1, "keep the terms counted at least this often overall", ge=1, to="vocab")
    max_size: int = setting(0, "keep at most this many terms (0: all)", ge=0, le=MAX_TERMS, to="vocab")
    start_grace: float = setting(
        5.0, "tasks without a vocabulary: wait this long after the quorum for more agents", ge=0
    )
    checkpoint_every: int = setting(10, "steps between checkpoints (the last step is always checkpointed)", ge=1)
    seed: int = setting(0, "torch seed on the coordinator before the task builds the model")
    patience: int = setting(
        0,
        "early stopping: epochs without improvement of the pooled validation loss before stopping (0: off)",
        ge=0,
        to="syncopt",
    )
    delta: float = setting(0.0, "an epoch improves when its validation loss ≤ best − `delta`", ge=0, to="syncopt")
    max_epochs: int = setting(100, "early stopping: at most this many epochs", ge=1, to="syncopt")
    epoch_steps: int = setting(0, "steps per epoch (needed with `patience`)", ge=0, to="syncopt")
    float64: bool = setting(
        False,
        'float64 mode: the model must be float64 (`[task] dtype = "float64"` everywhere) and `aggregation` is '
        "`ordered`, so runs repeat bit for bit",
    )

    def check(self) -> None:
        if self.expected_agents and self.min_agents > self.expected_agents:
            raise ConfigError(
                f"[syncopt] min_agents ({self.min_agents}) cannot exceed expected_agents ({self.expected_agents})"
            )

    def machine_config(self) -> S.SyncOptConfig:
        extra = {"aggregation": "ordered"} if self.float64 else {}
        return build(self, "syncopt", S.SyncOptConfig, **extra)

    def vocab_config(self) -> VocabConfig:
        return vocab_config(self)


@dataclass(frozen=True, slots=True)
class AsyncSettings(Table):
    """``[async]``: asynchronous buffered FedAvg (``mode = "async"``; see
    :mod:`fedagent.protocols.fedbuff` and docs/modes/async.md). The agents' training
    settings and the server step are ``[rounds]``'s."""

    TABLE: ClassVar[str] = "async"

    buffer_size: int = setting(5, "coordinator: updates that make one global model (K)", ge=1, le=100_000, to="buffer")
    max_staleness: int = setting(
        20,
        "coordinator: an update trained from a model more than this many versions older than the current one is "
        "refused",
        ge=0,
        le=FB.MAX_STALENESS,
        to="buffer",
    )
    staleness_exponent: float = setting(
        0.5,
        "coordinator: an update of staleness s adds its samples times (1 + s)^−this to the model "
        "(0.5: n/√(1+s); 0: no damping)",
        ge=0,
        le=4,
        to="buffer",
    )
    concurrency: int = setting(
        0, "coordinator: agents training at once (0: every agent online)", ge=0, le=1_000_000, to="buffer"
    )
    task_timeout: float = setting(
        120.0,
        "coordinator: seconds after which a task's place goes to another agent (its update is still taken later, "
        "within `max_staleness`)",
        gt=0,
        to="buffer",
    )
    versions: int = setting(
        50,
        "coordinator: global models to publish, then training ends (0: until the coordinator is stopped)",
        ge=0,
        to="buffer",
    )
    offline_trainings: int = setting(
        2,
        "agent: trainings it starts on its own while its link is down, per outage (on the model it holds, or "
        "training its kept update further); 0: it only finishes the task it has",
        ge=0,
        le=10_000,
    )
    journal_max_bytes: int = setting(
        64 * 2**20,
        "coordinator: at a model, a round journal past this size (and past twice what its last rewrite left) is "
        "rewritten without the update frames that model's checkpoint holds or makes too stale, when it cannot be "
        "emptied (some update always in transfer); it then stays under about the larger of this and twice what "
        "must be kept ([faults.md](faults.md#the-round-journal-of-an-asynchronous-coordinator))",
        ge=2**20,
        shown="64 MiB",
    )


@dataclass(frozen=True, slots=True)
class SearchSettings(Table):
    """``[search]``: how ``fedagent search`` reaches the peers' documents (agent side).

    ``space = "joint"``: the sites share one model (SEEC joint learning, FedAvg), so one
    query vector serves every peer. ``space = "mapped"`` (SEEC Algorithm 2): every site
    trains its own model on its own documents only (its own vocabulary, never averaged);
    sites exchange vectors of the public corpus (the first ``public_docs`` documents of
    ``public_corpus``) and the asker maps the query into each peer's space with a mapper
    MLP trained on them. The same on every member of a federation."""

    TABLE: ClassVar[str] = "search"

    space: str = setting(
        "joint",
        "agent: `joint` (the sites share the FedAvg model) or `mapped` (SEEC Algorithm 2: own model per site, "
        "public-vector exchange, query mapped per peer); the same on every member",
        choices=SPACES,
    )
    local_epochs: int = setting(10, "`mapped`: epochs of this site's own model", ge=1, le=10_000)
    lr: float = setting(0.025, "`mapped`: the own model's step, decaying to 0 along a half cosine", gt=0)
    batch_size: int = setting(256, "`mapped`: the own model's mini-batch size", ge=1)
    public_corpus: str = setting(
        "newsgroups",
        "`mapped`: the public corpus the mappers learn from: `newsgroups` (the 20-newsgroups sample, 200 posts) or "
        "`freebsd-manpages` (the FreeBSD manual pages, 1,302 documents; Debian package freebsd-manpages); pick "
        "public text like the sites' own",
        choices=PUBLIC_CORPORA,
    )
    public_docs: int = setting(
        200, "`mapped`: the first this many documents of `public_corpus` are used", ge=1, le=MAX_PUBLIC_DOCS
    )
    mapper_epochs: int = setting(150, "`mapped`: epochs of each per-peer mapper MLP", ge=1, le=100_000)
    mapper_lr: float = setting(1e-3, "`mapped`: the mappers' learning rate", gt=0)
    mapper_hidden: int = setting(1200, "`mapped`: the mappers' hidden units", ge=1, le=100_000)
    seed: int = setting(0, "`mapped`: seed of the own model and the mappers")
    requests_per_minute: float = setting(
        30.0,
        "agent: incoming search queries and public-vector requests allowed per asking peer (a token bucket refilled "
        "at this rate; 0: no limit); a request over the limit is answered with error `rate`, counted in `status` "
        '(`search_requests_rate_limited`) and `fedagent_rejected_total{reason="rate"}`',
        ge=0,
        le=1e6,
    )
    request_burst: int = setting(
        10, "agent: requests a peer may make at once (the token bucket's size)", ge=1, le=10_000
    )


def _broker_uri(uri: str) -> str:
    if uri and not uri.startswith("mqtts://"):
        raise ValueError(f"must look like mqtts://HOST:PORT, not {uri!r}")
    return uri


@dataclass(frozen=True, slots=True)
class TierSettings(Table):
    """``[tier]``: tiers of aggregation ([multisite.md](multisite.md)). A coordinator with
    ``upstream`` set is a *site aggregator*: the coordinator of the agents on its own
    broker and, at the upstream tier's broker, one participant whose update is its site's
    weighted mean. ``sites = true`` on a coordinator whose members are site aggregators
    (the hub, a region)."""

    TABLE: ClassVar[str] = "tier"

    upstream: str = setting(
        "",
        "site aggregator: `mqtts://HOST:PORT` of the upstream tier's broker (the hub's or a region's); empty: this "
        "coordinator is the top tier",
        check=_broker_uri,
    )
    upstream_id: str = setting(
        "", "site aggregator: its name at the upstream tier (the CN of `upstream_cert`, issued with role `aggregator`)"
    )
    upstream_cert: str = setting(
        "", "site aggregator: its certificate at the upstream tier (`fedagent ca issue NAME --role aggregator`)"
    )
    upstream_key: str = setting("", "site aggregator: the key of `upstream_cert`")
    upload_share: float = setting(
        0.25,
        "site aggregator: the part of the upstream round's deadline kept for its partial result to travel up; its own "
        "round ends at most (1 − this) × the upstream deadline after it starts",
        gt=0,
        lt=1,
    )
    sites: bool = setting(
        False,
        "hub or region: its members are site aggregators; each is weighed by the samples it announced (the weight "
        "cap holds it to its own announcement, not to a median of its peers'); the norm bound is off here, and the "
        "robust aggregators and `clip_norm` are refused (they apply at the sites, which see the individual updates)",
    )

    def check(self) -> None:
        if self.upstream:
            if not self.upstream_id:
                raise ConfigError("[tier] upstream_id is required with upstream")
            check_name(self.upstream_id, "[tier] upstream_id")
            if not (self.upstream_cert and self.upstream_key):
                raise ConfigError("[tier] upstream_cert and upstream_key are required with upstream")


@dataclass(frozen=True, slots=True)
class PrivacySettings(Table):
    """``[privacy]``: differential privacy of the updates (see docs/privacy.md and
    :mod:`fedagent.protocols.dp`). ``mode`` is "central" or "distributed" on a FedAvg
    coordinator (agents learn it from each round), "local" on a gossip agent."""

    TABLE: ClassVar[str] = "privacy"

    mode: str = setting(
        "central",
        "`central` or `distributed` on a FedAvg coordinator (agents follow the round), `local` on each gossip agent",
        choices=dp.MODES,
        to="dp",
    )
    noise_multiplier: float | None = setting(
        None,
        "`z`: the noise's standard deviation is `z·C` on a round's sum (on each model sent, for `local`)",
        gt=0,
        shown="one of it and `target_epsilon`",
    )
    target_epsilon: float | None = setting(
        None,
        "choose `z` so that the configured rounds (gossip: `periods` sends, `periods × fanout` with a screening "
        "merge) spend this ε",
        gt=0,
        shown="one of it and `noise_multiplier`",
    )
    clip_norm: float = setting(
        1.0,
        "`C`, the L2 bound on an update's (or, local, a sent model's) change; with `adaptive_clip` its start",
        gt=0,
        to="dp",
    )
    adaptive_clip: bool = setting(
        False,
        "move `C` towards a quantile of the update norms (central; distributed only under secure aggregation)",
        to={"dp": "adaptive"},
    )
    target_quantile: float = setting(0.5, "the quantile adaptive clipping aims at", gt=0, lt=1, to="dp")
    clip_lr: float = setting(0.2, "the step of the geometric update of `C`", gt=0, to="dp")
    count_stddev: float | None = setting(
        None,
        "noise on the count of unclipped updates (adaptive)",
        gt=0,
        to="dp",
        shown="expected updates / 20, at least `z`",
    )
    delta: float = setting(1e-5, "the δ ε is reported at; keep it below 1 / the number of agents", gt=0, lt=1, to="dp")
    epsilon_budget: float | None = setting(None, "stop before ε would pass this", gt=0, shown="`target_epsilon`")

    def check(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError("[privacy]: set exactly one of noise_multiplier and target_epsilon")
        self.dp_config(self.noise_multiplier or 1.0)

    def dp_config(self, noise_multiplier: float) -> dp.DPConfig:
        budget = self.epsilon_budget if self.epsilon_budget is not None else self.target_epsilon
        return build(self, "dp", dp.DPConfig, noise_multiplier=noise_multiplier, epsilon_budget=budget)

    def resolve(self, releases: int, q: float = 1.0) -> dp.DPConfig:
        """The DPConfig, with ``target_epsilon`` turned into a noise multiplier for
        ``releases`` rounds (or gossip periods) sampled at ``q`` (needs the privacy extra)."""
        if self.noise_multiplier is not None:
            return self.dp_config(self.noise_multiplier)
        assert self.target_epsilon is not None
        z = dp.calibrate(self.target_epsilon, max(releases, 1), self.delta, q)
        # A local release's sensitivity is 2C (see protocols/dp.LocalRelease): twice the noise.
        return self.dp_config(2 * z if self.mode == "local" else z)


def vocab_config(table: RoundsConfig | SyncOptSettings) -> VocabConfig:
    """The vocabulary merge of a coordinator (FedAvg: ``[rounds]``; Sync-Opt: ``[syncopt]``)."""
    return build(table, "vocab", VocabConfig)


def consensus_config(table: GossipSettings) -> ConsensusConfig:
    """The coordinator-free vocabulary consensus of a gossip agent: the same settings as
    a coordinator's merge (who offers, the deadline, the cut) under its own names."""
    return build(table, "vocab", ConsensusConfig)


# ---- the node ------------------------------------------------------------------------
DEFAULT_INTERFACES = ("127.0.0.1",)


def check_interfaces(value: Any, where: str = "[discovery] interfaces") -> tuple[str, ...]:
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


#: The tables of a config file, in the order of the reference.
TABLES: tuple[str, ...] = (
    "broker",
    "tls",
    "discovery",
    "task",
    "rounds",
    "gossip",
    "syncopt",
    "search",
    "privacy",
    "async",
    "tier",
    "transfer",
    "security",
)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A loaded config file, shared by ``fedagent agent`` and ``fedagent coordinator``."""

    TABLE: ClassVar[str] = ""

    path: Path
    role: str  # "agent" or "coordinator"
    tls: TlsConfig
    id: str = setting(
        REQUIRED,
        "node identity; must equal its certificate's CN (lower-case letters, digits, `-`)",
        check=lambda v: check_name(v, "id"),
    )
    federation: str = setting("", "the federation; empty for an agent until `fedagent join`")
    mode: str = setting(
        "fedavg",
        "how the federation trains: rounds ([modes/fedavg.md](modes/fedavg.md)), Sync-Opt steps "
        "([modes/syncopt.md](modes/syncopt.md)), gossip ([modes/gossip.md](modes/gossip.md)) or asynchronous "
        "buffered FedAvg ([modes/async.md](modes/async.md))",
        choices=MODES,
    )
    state_dir: Path = setting(
        Path("/var/lib/fedagent"),
        "checkpoints, history",
        env="STATE_DIRECTORY",
        shown="`/var/lib/fedagent`; `$STATE_DIRECTORY` under systemd",
    )
    runtime_dir: Path | None = setting(
        None,
        "where the control socket lives",
        env="RUNTIME_DIRECTORY",
        shown="`$RUNTIME_DIRECTORY` under systemd; `/run/fedagent-ROLE` as root, else `$XDG_RUNTIME_DIR/fedagent` "
        "or `/tmp/fedagent-UID`",
    )
    broker: str = setting(
        "",
        "`mqtts://HOST:PORT`; empty: find it by mDNS",
        table="broker",
        key="uri",
        check=_broker_uri,
        shown='`""` (required for a coordinator)',
    )
    keepalive: int = setting(
        10,
        "MQTT keep-alive in seconds. A FedAvg agent also sends the coordinator a heartbeat every keepalive / 4 s; "
        "the coordinator takes an agent it has not heard from for one keepalive out of the round "
        "([faults.md](faults.md#a-silent-agent)). Raise it on a slow link where a large chunk can take longer than "
        "that to arrive",
        table="broker",
        ge=2,
        le=65535,
    )
    interfaces: tuple[str, ...] = setting(
        DEFAULT_INTERFACES,
        "this machine's IPv4 addresses mDNS runs on (fedagent never picks one itself; `fedagent join --interface "
        "ADDRESS` records them here)",
        table="discovery",
        check=check_interfaces,
    )
    advertise: bool = setting(True, "announce this node by mDNS", table="discovery")
    task: str = setting(
        "digits",
        "the task: `digits`, `flsimco`, `prodlda`, `combinedtm`, `word2vec`, `doc2vec`, `synthetic` (built in, "
        "[tasks.md](tasks.md)) or `module:attribute` of your own factory "
        "([examples/custom_task.py](../examples/custom_task.py))",
        table="task",
        key="name",
    )
    task_options: dict[str, Any] = field(default_factory=dict)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    gossip: GossipSettings = field(default_factory=GossipSettings)
    syncopt: SyncOptSettings = field(default_factory=SyncOptSettings)
    search: SearchSettings = field(default_factory=SearchSettings)
    privacy: PrivacySettings | None = None
    fedbuff: AsyncSettings = field(default_factory=AsyncSettings)
    tier: TierSettings = field(default_factory=TierSettings)
    max_chunk_bytes: int = setting(
        4 * 2**20,
        "messages above this are chunked (below the broker's packet limit); a model is cut into 4 chunks of at "
        "least 256 KiB, none above this",
        table="transfer",
        ge=1024,
        shown="4 MiB",
    )
    max_model_bytes: int = setting(
        2**30, "largest reassembled message accepted", table="transfer", ge=1024, shown="1 GiB"
    )
    compression: str | None = setting(
        None,
        "coordinator: how agents send their updates: `none` (full weights), `fp16`, `int8` (per-tensor scale) or "
        "`topk` (with error feedback) of the delta to the round's global model; announced with each round. Unset: "
        "`int8` where updates are streamed, `none` where they travel whole (robust aggregators, `clip_norm`, "
        "`stream_updates = false`, differential privacy, secure aggregation) "
        "([streaming.md](streaming.md#compression)); set, any mode but `none` needs streamed updates",
        table="transfer",
        choices=COMPRESSIONS,
        shown="unset (`int8` streamed)",
    )
    topk_ratio: float = setting(
        0.01, "with `topk`: fraction of each tensor's entries sent per round", table="transfer", gt=0, le=1
    )
    downlink: str | None = setting(
        None,
        "coordinator: how round starts carry the global model: `int8` (after the first round, the int8 step from "
        "the previous model) or `none` (the whole model every round). Unset: `int8` when the updates are `int8`, "
        "else `none` ([streaming.md](streaming.md#the-model-broadcast-int8-steps))",
        table="transfer",
        choices=DOWNLINKS,
        shown="unset (`int8` with int8 updates)",
    )
    whole_model_every: int = setting(
        5,
        "coordinator: while an agent that reads only whole models (an earlier release, by its presence) is online, at "
        "most one round start in this many carries the whole model, and such agents take part in those rounds only, "
        "unless a round needs them for `min_agents` (its start is then whole too; 1: every round start goes whole "
        "while one is online)",
        table="transfer",
        ge=1,
    )
    stream_updates: bool | None = setting(
        None,
        "coordinator: agents send updates as signed streams folded chunk by chunk as they arrive (`true`), or "
        "whole (`false`); unset: streamed for `fedavg`/`metric`/`blur`/`drop_above`, whole for the robust "
        "aggregators, `clip_norm`, differential privacy and secure aggregation (`true` with them is refused)",
        table="transfer",
        shown="unset",
    )
    metrics_port: int = setting(
        0, "Prometheus endpoint's port (0: a free port, shown as `metrics_url` by `status`; -1: off)", ge=-1, le=65535
    )
    metrics_host: str = setting("127.0.0.1", "the address the Prometheus endpoint listens on")
    torch_threads: int = setting(1, "threads torch may use for training", ge=1, le=4096)
    max_clock_skew: float = setting(
        300.0, "seconds a message's timestamp may differ from this node's clock", table="security", ge=1, le=86400
    )
    history_max_bytes: int = setting(
        history.DEFAULT_MAX_BYTES,
        "`history.jsonl` becomes `history.jsonl.1` (older ones move up) when the next record would take it past "
        "this size, so a history holds at most (`history_keep` + 1) × this; `fedagent report` reads the rotated "
        "files too ([operators.md](operators.md#what-bounds-the-state-on-disk))",
        ge=history.MIN_MAX_BYTES,
    )
    history_keep: int = setting(history.DEFAULT_KEEP, "rotated history files kept (the oldest deleted)", ge=1)

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


#: The dataclass of each table whose keys are all settings of one class.
TABLE_CLASSES: dict[str, type] = {
    "tls": TlsConfig,
    "rounds": RoundsConfig,
    "gossip": GossipSettings,
    "syncopt": SyncOptSettings,
    "search": SearchSettings,
    "privacy": PrivacySettings,
    "async": AsyncSettings,
    "tier": TierSettings,
}
