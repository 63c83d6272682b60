"""Byzantine agents against the real round machine with real training (test-only).

Ten digits agents (``fedagent.tasks.digits``, Dirichlet non-IID shards) train for real
and the real :class:`~fedagent.protocols.rounds.RoundMachine` aggregates; the last
``k`` agents are Byzantine: they train like everybody else, then send

* ``sign_flip``: ``g − 10·Δ`` (their honest step Δ = w − g reversed and amplified);
* ``scaled``:    ``g + 100·Δ`` (model replacement, Bagdasaryan et al. 2018);
* ``noise``:     ``g + N(0, 1)`` on every coordinate;
* ``nan``:       every floating value NaN (must be refused before aggregation).

The attacks live here, in tests/, on purpose: no configuration of the installed
package can make an agent send them. ``tests/byzantine_task.py`` wraps the same
attacks in a task factory for the one run over a real broker.

``python tests/byzantine.py`` prints the whole table (fractions × attacks ×
aggregators) as markdown.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.messages import TrainConfig
from fedagent.tasks import digits
from fedagent.tasks.base import get_weights, set_weights
from fedagent.tasks.digits import DigitsTask

# Ten agents read the same bundled data set: load it once per process.
digits.load_digits_arrays = functools.lru_cache(maxsize=1)(digits.load_digits_arrays)

N_AGENTS = 10
ROUNDS = 8
ALPHA = 5.0
LR = 0.1
BATCH = 32
CLIP = 1.0  # L2 bound on an update's distance from the global model (honest: ~0.3-0.8)
ATTACKS = ("sign_flip", "scaled", "noise", "nan")
AGGREGATORS = ("fedavg", "clip", "median", "trimmed_mean", "krum")


def attack(kind: str, g: dict[str, np.ndarray], w: dict[str, np.ndarray], rng: np.random.Generator):
    out = {}
    for k, ref in g.items():
        delta = w[k].astype(np.float64) - ref
        if kind == "sign_flip":
            v = ref - 10.0 * delta
        elif kind == "scaled":
            v = ref + 100.0 * delta
        elif kind == "noise":
            v = ref + rng.normal(0.0, 1.0, size=ref.shape)
        elif kind == "nan":
            v = np.full(ref.shape, np.nan)
        else:
            raise ValueError(kind)
        out[k] = v.astype(ref.dtype)
    return out


def strategy_for(aggregator: str, f: int, min_updates: int) -> Strategy:
    if aggregator == "fedavg":
        return Strategy("fedavg")
    if aggregator == "clip":
        return Strategy("fedavg", clip_norm=CLIP)
    if aggregator == "trimmed_mean":
        # Enough trimmed at each end for f even in a round of only min_updates.
        return Strategy("trimmed_mean", byzantine=f, trim=min(0.49, (f + 0.5) / min_updates))
    return Strategy(aggregator, byzantine=f)


_TASKS: dict[int, DigitsTask] = {}


def task(shard: int) -> DigitsTask:
    if shard not in _TASKS:
        _TASKS[shard] = DigitsTask(shard=shard, shards=N_AGENTS, alpha=ALPHA, seed=0)
    return _TASKS[shard]


@dataclass
class Outcome:
    accuracy: float
    rejected: dict[str, int]
    aggregated_rounds: int
    seconds: float


def run(aggregator: str, attack_kind: str | None, n_byzantine: int, *, rounds: int = ROUNDS, seed: int = 0) -> Outcome:
    """One federation, in process: the round machine, real local training, attacks."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    names = [f"agent-{i}" for i in range(N_AGENTS)]
    byzantine = set(names[N_AGENTS - n_byzantine :])
    # The NaN senders are refused, so rounds are aggregated from the honest ones alone.
    min_updates = N_AGENTS - n_byzantine if attack_kind == "nan" else N_AGENTS - 1
    f = 0 if attack_kind == "nan" else n_byzantine
    cfg = R.RoundConfig(
        rounds=rounds,
        min_agents=N_AGENTS,
        expected_agents=N_AGENTS,
        min_updates=min_updates,
        round_timeout=60.0,
        strategy=strategy_for(aggregator, f, min_updates),
        train=TrainConfig(epochs=1, lr=LR, batch_size=BATCH),
        seed=seed,
    )
    model = task(0).build_model()
    machine = R.RoundMachine(cfg, get_weights(model))
    rng = np.random.default_rng(seed)
    now = 0.0
    pending: list = []
    for a in names:
        pending += machine.handle(R.AgentOnline(a, task(int(a.split("-")[1])).num_samples()), now)
    rejected: dict[str, int] = {}
    aggregated = 0
    while pending:
        cmd = pending.pop(0)
        if isinstance(cmd, R.StartRound):
            for a in cmd.selected:
                t = task(int(a.split("-")[1]))
                set_weights(model, cmd.weights)
                metrics = t.fit(
                    model, epochs=cmd.train.epochs, lr=cmd.train.lr, batch_size=cmd.train.batch_size, seed=cmd.round
                )
                w = get_weights(model)
                if a in byzantine and attack_kind is not None:
                    w = attack(attack_kind, cmd.weights, w, rng)
                pending += machine.handle(
                    R.UpdateReceived(a, cmd.round, cmd.model_version, t.num_samples(), w, metrics), now
                )
            if machine.phase is R.Phase.TRAINING and machine.round == cmd.round:
                now += cfg.round_timeout  # the refused ones never answer: deadline
                pending += machine.handle(R.Wakeup(), now)
        elif isinstance(cmd, R.Rejected):
            assert cmd.sender in byzantine, f"honest {cmd.sender} rejected: {cmd.reason} {cmd.detail}"
            rejected[cmd.reason] = rejected.get(cmd.reason, 0) + 1
        elif isinstance(cmd, R.RoundAggregated):
            aggregated += 1
        elif isinstance(cmd, R.RoundAbandoned):
            raise AssertionError(f"round {cmd.round} abandoned: {cmd.reason}")
    set_weights(model, machine.weights)
    acc = task(0).evaluate(model)["accuracy"]
    if not math.isfinite(acc):
        acc = 0.0
    return Outcome(acc, rejected, aggregated, time.perf_counter() - started)


def table(fractions=(0.1, 0.2, 0.3), attacks=ATTACKS, aggregators=AGGREGATORS) -> str:
    clean = {a: run(a, None, 0).accuracy for a in aggregators}
    lines = [
        "| Byzantine | attack | " + " | ".join(aggregators) + " |",
        "|---|---|" + "---|" * len(aggregators),
        "| 0 % | none | " + " | ".join(f"{clean[a]:.3f}" for a in aggregators) + " |",
    ]
    for frac in fractions:
        k = round(frac * N_AGENTS)
        for att in attacks:
            cells = [run(a, att, k).accuracy for a in aggregators]
            lines.append(f"| {int(frac * 100)} % | {att} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    print(table())
    print(f"\n{time.perf_counter() - t0:.1f} s", file=sys.stderr)
