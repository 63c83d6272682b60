"""What the gossip-w2v experiment runs and records: its scales, the gossip
configurations it compares (the thesis's six and the extra ones), and one
configuration's result (:mod:`fedagent_experiments.gossip_w2v` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Scale:
    agents: int = 10
    topics: int = 5
    dim: int = 32
    window: int = 5
    negative: int = 5
    min_count: int = 5
    # 1024 pairs per batch: every repeated row in a batch adds its gradient at the
    # pre-step weights, and with the gossip step (x10 below) larger batches overshoot on
    # frequent words (in-process, 20 epochs, averaging every 164k pairs: 4096-pair batches
    # scored wordsim353 0.41 / w2v_sim 10, 1024-pair batches 0.50 / 47).
    batch_size: int = 1024
    lr: float = 0.025  # per training pair: word2vec's alpha
    # Gossip agents' step = lr x this (= agents). Averaging N models moves their mean by
    # the mean of their updates, 1/N of what one model taking all those steps moves: with
    # the same step the federation makes 1/N of the centralized progress per batch
    # (in-process, 20 epochs: x1 scored wordsim353 0.12, as centralized after 2 epochs;
    # x10 0.50). Local-only agents are not averaged and use lr.
    gossip_lr_factor: float = 10.0
    # The agents' merge (``[gossip] merge``) in every configuration but thesis-literal.
    merge: str = "pushsum"
    # ``[gossip] outer_step`` b in every exchanging configuration but thesis-literal: the
    # agents step at lr x gossip_lr_factor / b and adopt the period's start + b x their
    # progress (1: the x N step alone; in process b = 2 lost less, docs/experiments).
    outer_step: float = 1.0
    # ``[gossip] period_seconds`` of the agents of a frequent configuration (0: unpaced);
    # a configuration exchanging every n batches gets this x n / ``frequent``, so that
    # every configuration is paced to the same time per batch. On a shared machine the
    # agents train at different speeds and a period can end before the models sent in it
    # arrive; periods of at least this long keep them in step. 1.2 s is well above what the slowest of ten
    # agents on 2 shared cores needs for 10 batches and an exchange (unpaced, a period
    # took 0.38 s on average); results/gossip_w2v/paced/ against the unpaced report.
    period_seconds: float = 1.2
    # Batches per agent: 10 x 2760 = 27,600 batches = 20 epochs, where the centralized
    # learning curve (in the report) has flattened (thesis: 500,000 per agent).
    local_steps: int = 2760
    # Exchange every this many local batches. Frequent: the thesis's 10 (its batches were
    # 2048 pairs; 276 exchanges here, 50,000 there). Infrequent: 5x fewer (55 exchanges).
    # The thesis's 50x (every 500) would leave 5 exchanges here, too few for push-sum
    # to mix 10 nodes (the thesis's infrequent run still made 1,000); a first run with
    # 40 / 200 (69 / 13 exchanges) is in results/gossip_w2v/exchange40/.
    frequent: int = 10
    infrequent: int = 50
    eval_frequent: int = 5  # evaluate every this many periods
    seed: int = 0  # the seed of one run (split, initial model, streams); set per run from `seeds`
    # Every gossip configuration runs once per seed (split, initial model and data order
    # all change with it); half-frequent, thesis-literal and local run with the first only.
    seeds: tuple[int, ...] = (1, 2, 3)
    # Centralized runs (same budget) with these seeds: their mean is the reference and
    # their spread the noise floor of every comparison.
    central_seeds: tuple[int, ...] = (1, 2, 3)
    gensim_epochs: int = 20
    # Budgets of the centralized learning curve, as fractions of agents x local_steps.
    curve: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 1.5)

    def task_options(self, split: str) -> dict[str, Any]:
        opts = {
            "split": split,
            "shards": self.agents,
            "dim": self.dim,
            "window": self.window,
            "negative": self.negative,
            "min_count": self.min_count,
            "seed": self.seed,
        }
        if split == "topic":
            opts["topics"] = self.topics
        return opts


SCALES = {
    "default": Scale(),
    "tiny": Scale(
        agents=3,
        topics=3,
        dim=16,
        local_steps=60,
        frequent=5,
        infrequent=20,
        eval_frequent=2,
        gensim_epochs=2,
        curve=(0.5, 1.0),
        gossip_lr_factor=3.0,
        period_seconds=0.0,
        seeds=(1,),
        central_seeds=(1, 2),
    ),
}


@dataclass(frozen=True)
class Config:
    name: str
    split: str
    period_steps: int
    exchange: tuple[str, ...] | None = None
    local: bool = False
    merge: str | None = None  # None: the scale's merge
    lr_factor: float | None = None  # None: the scale's gossip_lr_factor
    every_seed: bool = True  # False: the first seed only


SIX = (
    "topic-frequent",
    "random-frequent",
    "imbalanced-frequent",
    "topic-infrequent",
    "random-infrequent",
    "imbalanced-infrequent",
)


def configurations(s: Scale) -> list[Config]:
    out = [
        Config(f"{split}-{how}", split, steps)
        for how, steps in (("frequent", s.frequent), ("infrequent", s.infrequent))
        for split in ("topic", "random", "imbalanced")
    ]
    out.insert(3, Config("half-frequent", "topic", s.frequent, exchange=("in_embed.*",), every_seed=False))
    # The thesis's Alg. 3.1 as written: a node's new model is the mean of the received
    # ones (no masses), each node steps with word2vec's alpha itself (no x N).
    out.append(Config("thesis-literal", "topic", s.frequent, merge="thesis", lr_factor=1.0, every_seed=False))
    out.append(Config("local", "topic", s.local_steps, local=True, every_seed=False))
    return out


@dataclass
class Result:
    name: str
    split: str
    period_steps: int
    exchanges: int
    seconds: float
    seed: int = 0
    per_agent: dict[str, dict[str, float]] = field(default_factory=dict)
    bytes_out: int = 0
    curves: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    # Each agent's ``lag_mean`` at the end: how many local steps behind it the models it
    # merged were, on average (empty in runs saved before it was recorded).
    lag: dict[str, float] = field(default_factory=dict)

    def mean(self, key: str) -> float:
        return float(np.mean([m[key] for m in self.per_agent.values()]))

    def spread(self, key: str) -> tuple[float, float]:
        v = [m[key] for m in self.per_agent.values()]
        return float(min(v)), float(max(v))
