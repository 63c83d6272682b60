"""The buffer machine's configuration (``mode = "async"``) from a node's settings.

``[async]`` says how the buffer works; ``[rounds]`` gives the agents' training settings,
the quorum before the first task and the server step, as for FedAvg rounds (its round
settings, ``rounds``, ``agents_per_round``, ``min_updates`` and ``round_timeout``, are
not read here: ``versions``, ``concurrency`` and ``task_timeout`` take their place).
What is decided here is what no single setting says (the defaults of the update's
transfer) and what cannot run asynchronously, named by its keys. The loader runs it on
every config file of an ``async`` federation.
"""

from __future__ import annotations

from fedagent.config.declare import build
from fedagent.config.machines import UNCALIBRATED_NOISE
from fedagent.config.settings import NodeConfig
from fedagent.errors import CodecError, ConfigError
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.compression import default_mode
from fedagent.protocols.downlink import default_mode as default_downlink
from fedagent.protocols.fedbuff import BufferConfig
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import NormBound

#: Why a coordinator of ``mode = "async"`` refuses ``[rounds] secure_aggregation``.
NO_SECURE_AGGREGATION = (
    "[rounds] secure_aggregation = true cannot run in mode = 'async': SecAgg+'s masks cancel "
    "only in the sum of the agents of one key stage, all of whom send before any mask comes "
    "off, and a buffer is filled by whichever agents finish first, which no one knows when the "
    "masks are drawn (masking across a buffer needs another scheme, e.g. LightSecAgg's). Use "
    "mode = 'fedavg' with secure aggregation, or keep 'async' with [privacy] mode = 'distributed' "
    "(the agents noise their own updates)"
)

#: Why ``[rounds] max_norm`` is refused in ``mode = "async"``.
MAX_NORM_REFUSED = (
    "max_norm refuses an update whose weights (the model it was trained from plus its change) have a "
    "larger L2 norm, and an asynchronous update is a change to a model up to max_staleness versions old, "
    "which the coordinator no longer holds: the norm of its weights cannot be known. Each update's change "
    "is bounded instead: by the adaptive norm bound (norm_multiplier, on by default), or at a fixed "
    "distance with clip_norm; remove max_norm"
)


def buffer_config(cfg: NodeConfig, *, calibrate: bool = True) -> BufferConfig:
    """The buffer machine's configuration; ``calibrate=False`` checks the settings
    without turning ``target_epsilon`` into a noise multiplier."""
    r, a = cfg.rounds, cfg.fedbuff
    try:
        if r.secure_aggregation:
            raise ConfigError(NO_SECURE_AGGREGATION)
        if r.max_norm is not None:
            raise ValueError(MAX_NORM_REFUSED)
        strategy = build(r, "strategy", Strategy)
        dp = None
        if cfg.privacy is not None:
            if cfg.privacy.noise_multiplier is None and not a.versions:
                raise ValueError(
                    "[privacy] target_epsilon is spread over the `versions` models, and versions = 0 has no end: "
                    "set versions, or give noise_multiplier (with epsilon_budget to stop at a budget)"
                )
            if calibrate:
                dp = cfg.privacy.resolve(a.versions, 1.0)
            else:
                dp = cfg.privacy.dp_config(cfg.privacy.noise_multiplier or UNCALIBRATED_NOISE)
        # Whole updates where their norm is needed before any of them is added.
        whole = strategy.clip_norm is not None or (dp is not None and dp.mode == "central")
        if cfg.stream_updates and whole:
            raise ValueError(
                "[transfer] stream_updates = true, but clip_norm and central differential privacy need an "
                "update's norm before any of it is added: remove stream_updates"
            )
        stream = not whole if cfg.stream_updates is None else cfg.stream_updates
        compression = cfg.compression
        if compression is None:
            compression = default_mode(streamed=stream)
        if compression != "none" and not stream:
            raise ValueError(
                f"compression = {compression!r} streams updates, and these updates travel whole "
                "(stream_updates = false, clip_norm or central differential privacy): leave compression unset"
            )
        train = build(r, "train", TrainConfig, compression=compression, topk_ratio=cfg.topk_ratio, stream=stream)
        return build(
            a,
            "buffer",
            BufferConfig,
            min_agents=r.min_agents,
            expected_agents=r.expected_agents,
            start_grace=r.start_grace,
            seed=r.seed,
            lr_schedule=r.lr_schedule,
            server_lr=r.server_lr,
            server_momentum=r.server_momentum,
            downlink=cfg.downlink or default_downlink(compression),
            strategy=strategy,
            dp=dp,
            train=train,
            weight_cap=r.weight_cap,
            # 0 switches the norm bound off, as in rounds
            norm_bound=build(r, "norm", NormBound) if r.norm_multiplier else None,
        )
    except (ValueError, TypeError, CodecError) as exc:
        raise ConfigError(f"{cfg.path}: [async]/[rounds]/[transfer]: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: {exc}") from None
