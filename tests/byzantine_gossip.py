"""Byzantine peers against the real gossip machine with real training (test-only).

The gossip counterpart of ``byzantine.py``: ten digits agents (Dirichlet non-IID
shards), every one a :class:`~fedagent.protocols.gossip.GossipMachine` that knows the
nine others, local training for real (``fit_steps``), a discrete-event bus that
delivers every model and acknowledgement after a random delay. The last ``k`` agents are
Byzantine: they run the honest machine (so they keep receiving, merging and training
like everybody else) but every model they put on the wire is replaced by an attack on
their own last step, with ``g`` the model the step started from and ``Δ = w − g``:

* ``sign_flip``: ``g − 10·Δ``; * ``scaled``: ``g + 100·Δ``; * ``noise``: ``g + N(0, 1)``.

Masses stay honest (a claimed mass would only make the mean's failure worse).
Accuracy is that of the *honest* agents' final models on the shared test set: their
mean and their worst.

``python tests/byzantine_gossip.py`` prints the table (fractions × attacks × rules).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from byzantine import ALPHA, BATCH, attack

from fedagent.protocols import gossip as G
from fedagent.tasks import digits
from fedagent.tasks.base import get_weights, set_weights
from fedagent.tasks.digits import DigitsTask

digits.load_digits_arrays = functools.lru_cache(maxsize=1)(digits.load_digits_arrays)

N_AGENTS = 10
PERIODS = 30
STEPS = 5  # local mini-batches per period
LR = 0.05
ATTACKS = ("sign_flip", "scaled", "noise")
RULES = ("mean", "clip", "median", "trimmed_mean", "krum")
CLIP = 1.0
FANOUT = 3  # screening: models sent per period, so each node hears most peers every few periods
TTL = 8


@functools.cache
def task(shard: int) -> DigitsTask:
    return DigitsTask(shard=shard, shards=N_AGENTS, alpha=ALPHA, seed=0)


def config(rule: str, f: int, periods: int) -> G.GossipConfig:
    common = dict(period_steps=STEPS, periods=periods, seed=0, send_timeout=5.0)
    if rule == "mean":
        return G.GossipConfig(**common)
    if rule == "clip":
        return G.GossipConfig(clip_norm=CLIP, **common)
    return G.GossipConfig(aggregation=rule, byzantine=f, fanout=FANOUT, neighbour_ttl=TTL, **common)


@dataclass
class Outcome:
    mean_accuracy: float
    worst_accuracy: float
    screened: int
    screen_short: int
    seconds: float


def run(rule: str, attack_kind: str | None, n_byzantine: int, *, periods: int = PERIODS, seed: int = 0) -> Outcome:
    torch.set_num_threads(1)
    started = time.perf_counter()
    rng = random.Random(seed)
    noise = np.random.default_rng(seed)
    ids = [f"agent-{i}" for i in range(N_AGENTS)]
    byzantine = set(ids[N_AGENTS - n_byzantine :]) if attack_kind else set()
    f = n_byzantine
    cfg = config(rule, f, periods)
    model = task(0).build_model()
    w0 = get_weights(model)
    nodes = {
        a: G.GossipMachine(a, cfg, dict(w0), num_samples=task(i).num_samples(), session="0") for i, a in enumerate(ids)
    }
    last_step: dict[str, tuple[dict, dict]] = {}
    queue: list = []
    seq = itertools.count()

    def at(t: float, node: str, ev) -> None:
        heapq.heappush(queue, (t, next(seq), node, ev))

    for a in ids:
        for b in ids:
            if a != b:
                nodes[a].handle(G.PeerUp(b), 0.0)
        at(rng.uniform(0, 0.2), a, G.Start())
    finished: set[str] = set()
    while queue and len(finished) < N_AGENTS:
        now, _, node, ev = heapq.heappop(queue)
        for c in nodes[node].handle(ev, now):
            lag = rng.uniform(0.01, 0.3)
            if isinstance(c, G.SendModel):
                w = c.weights
                if node in byzantine and not c.returned and node in last_step:
                    g, trained = last_step[node]
                    w = attack(attack_kind, {k: g[k] for k in w}, {k: trained[k] for k in w}, noise)
                at(now + lag, c.peer, G.ModelReceived(node, c.exchange_id, w, c.mass, c.age, c.returned))
            elif isinstance(c, G.SendAck):
                at(now + lag, c.peer, G.AckReceived(node, c.exchange_id, c.accepted, c.reason))
            elif isinstance(c, G.Train):
                i = int(node.split("-")[1])
                set_weights(model, c.weights)
                task(i).fit_steps(
                    model, steps=c.steps, lr=LR, batch_size=BATCH, seed=seed * 100_003 + nodes[node].period * 101 + i
                )
                trained = get_weights(model)
                last_step[node] = (c.weights, trained)
                at(now + rng.uniform(0.9, 1.1), node, G.TrainingDone(c.train_id, trained))
            elif isinstance(c, G.RequestWakeup):
                at(c.at, node, G.Wakeup())
            elif isinstance(c, G.Finished):
                finished.add(node)
    accs = []
    for a in ids:
        if a in byzantine:
            continue
        set_weights(model, nodes[a].model)
        acc = task(0).evaluate(model)["accuracy"]
        accs.append(acc if math.isfinite(acc) else 0.0)
    honest = [nodes[a] for a in ids if a not in byzantine]
    return Outcome(
        float(np.mean(accs)),
        float(min(accs)),
        sum(m.counts["screened"] for m in honest),
        sum(m.counts["screen_short"] for m in honest),
        time.perf_counter() - started,
    )


def table(fractions=(0.1, 0.2, 0.3), attacks=ATTACKS, rules=RULES) -> str:
    clean = {r: run(r, None, 0) for r in rules}
    cell = lambda o: f"{o.mean_accuracy:.3f} / {o.worst_accuracy:.3f}"  # noqa: E731
    lines = [
        "| Byzantine | attack | " + " | ".join(rules) + " |",
        "|---|---|" + "---|" * len(rules),
        "| 0 % | none | " + " | ".join(cell(clean[r]) for r in rules) + " |",
    ]
    for frac in fractions:
        k = round(frac * N_AGENTS)
        for att in attacks:
            lines.append(f"| {int(frac * 100)} % | {att} | " + " | ".join(cell(run(r, att, k)) for r in rules) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    print(table())
    print(f"\n{time.perf_counter() - t0:.1f} s", file=sys.stderr)
