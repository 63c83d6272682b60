"""The FedAvg round machine's configuration from a node's settings.

The settings go where their declaration says (``to="round"``, ``"train"``,
``"strategy"``, ``"secure"``); what is decided here is what no single setting says: the
defaults that depend on several tables (streamed updates and their compression, the
model broadcast, server momentum under differential privacy) and the combinations that
cannot work, named by their keys. The loader runs it on every config file, so a
coordinator's start and an agent's load refuse the same things.
"""

from __future__ import annotations

from fedagent.config.declare import build
from fedagent.config.settings import NodeConfig
from fedagent.errors import CodecError, ConfigError
from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.compression import default_mode
from fedagent.protocols.downlink import default_mode as default_downlink
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.secagg import SecAggParams
from fedagent.protocols.tiers import check_site, check_upper

#: Stands in for the noise multiplier that ``target_epsilon`` calibrates, when a config is
#: checked without running the calibration (it needs the privacy extra and takes a while):
#: the round machine's rules do not depend on its value.
UNCALIBRATED_NOISE = 1.0


def round_config(cfg: NodeConfig, *, calibrate: bool = True) -> R.RoundConfig:
    """The round machine's configuration; ``calibrate=False`` checks the settings without
    turning ``target_epsilon`` into a noise multiplier."""
    r = cfg.rounds
    try:
        strategy = build(r, "strategy", Strategy)
        if cfg.stream_updates and not strategy.streams:
            raise ValueError(
                f"[transfer] stream_updates = true, but aggregation {strategy.name!r}"
                f"{' with clip_norm' if strategy.clip_norm is not None else ''} needs whole "
                "updates (the median, trimmed mean and Krum read every update at once; clipping "
                "needs an update's norm before any of it is added): remove stream_updates"
            )
        secure = None
        if r.secure_aggregation:
            if cfg.stream_updates:
                raise ValueError(
                    "[transfer] stream_updates = true, but secure aggregation sends each update as one "
                    "masked vector (a part of it means nothing until every mask is off): remove stream_updates"
                )
            secure = build(r, "secure", SecAggParams, min_survivors=max(2, r.min_updates))
        stream = strategy.streams if cfg.stream_updates is None else cfg.stream_updates
        dp = None
        privacy = cfg.privacy if cfg.mode == "fedavg" else None
        if privacy is not None:
            if cfg.stream_updates:
                raise ValueError(
                    "[transfer] stream_updates = true, but differential privacy needs whole updates "
                    "(an update is clipped by its norm before any of it is added): remove stream_updates"
                )
            if calibrate:
                # Sampling amplification only counts when the population is known, and not
                # across tiers (a site is sampled with all of its agents: tiers/upper.py).
                q = r.agents_per_round / r.expected_agents if r.agents_per_round and r.expected_agents else 1.0
                if cfg.tier.sites:
                    q = 1.0
                dp = privacy.resolve(r.rounds, min(q, 1.0))
            else:
                dp = privacy.dp_config(privacy.noise_multiplier or UNCALIBRATED_NOISE)
            stream = False
        compression = cfg.compression
        if compression is None:
            compression = default_mode(streamed=stream and secure is None)
        train = build(r, "train", TrainConfig, compression=compression, topk_ratio=cfg.topk_ratio, stream=stream)
        # 0 switches the norm bound off (a multiplier below 1 would clip honest updates).
        norm = build(r, "norm", R.NormBound) if r.norm_multiplier else None
        if cfg.tier.sites:
            # Members that are site aggregators send means, whose distance grows with no
            # single member: the bound applies at the sites, which see the updates.
            norm = None
        return build(
            r,
            "round",
            R.RoundConfig,
            downlink=cfg.downlink or default_downlink(compression),
            strategy=strategy,
            dp=dp,
            secure=secure,
            train=train,
            norm_bound=norm,
            whole_model_every=cfg.whole_model_every,
        )
    except (ValueError, TypeError, CodecError) as exc:
        raise ConfigError(f"{cfg.path}: [rounds]/[transfer]: {exc}") from None
    except ConfigError as exc:  # a machine's configuration refused it, named by its table
        raise ConfigError(f"{cfg.path}: {exc}") from None


def tier_checks(cfg: NodeConfig, rc: R.RoundConfig) -> None:
    """Refuse what a tier of aggregation cannot take ([tier]): a site aggregator averages
    plainly (the top tier moves the model), a tier of site aggregators averages their
    means by samples (the member protections apply where the individual updates are)."""
    try:
        if cfg.tier.upstream:
            check_site(rc)
        if cfg.tier.sites:
            check_upper(rc)
    except ValueError as exc:
        raise ConfigError(f"{cfg.path}: [tier]/[rounds]: {exc}") from None
