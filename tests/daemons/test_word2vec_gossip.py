"""Word2Vec in gossip mode through the real daemons: three agent processes, no
coordinator, Mosquitto with mutual TLS, peers found by mDNS on loopback, each agent
training skip-gram on its own share of the Wikipedia dump (slow: run with -m slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from netfed import wait_for

from fedagent.local.federation import SEED, Federation
from fedagent.storage import checkpoint
from fedagent.tasks.base import load_task

AGENTS = 3
PERIODS, STEPS, BATCH, LR = 40, 10, 256, 0.2
OPTIONS = {"limit": 30, "split": "random", "dim": 32, "min_count": 5}


def in_vectors(fed: Federation, aid: str) -> np.ndarray:
    loaded = checkpoint.load(fed.model_path(aid))
    assert loaded is not None, f"{aid} wrote no model"
    return loaded[0]["in_embed.weight"]


def relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / ((np.linalg.norm(a) + np.linalg.norm(b)) / 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_word2vec_agents_gossip_and_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDAGENT_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path):
    # Parse the dump once here; the agent processes inherit the cache directory.
    local = [load_task("word2vec", {**OPTIONS, "seed": SEED, "shard": i, "shards": AGENTS}) for i in range(2)]
    fed = Federation(
        tmp_path / "fed",
        agents=AGENTS,
        rounds=1,
        alpha=0.0,
        mode="gossip",
        task="word2vec",
        task_options=OPTIONS,
        gossip={
            "periods": PERIODS,
            "period_steps": STEPS,
            "lr": LR,
            "batch_size": BATCH,
            "min_peers": AGENTS - 1,
            "send_timeout": 5.0,
            "eval_every": 10,
            # A period trains 10 batches in a few milliseconds: unpaced, the agents ran all
            # 40 periods in about two seconds, before most of their peers' models arrived.
            "period_seconds": 0.25,
        },
    )
    (tmp_path / "fed").mkdir()
    try:
        fed.prepare()
        fed.start_all()
        ids = list(fed.agent_ids)
        done = wait_for(
            lambda: (lambda ss: ss if all(s and s.get("round_state") == "finished" for s in ss.values()) else None)(
                {a: fed.status(a) for a in ids}
            ),
            240,
            "the agents to finish",
            fed,
        )
        for a, s in done.items():
            assert s["task"] == "word2vec" and s["period"] == PERIODS
            assert s["gossip"]["sent"] > 0 and s["gossip"]["received"] > 0, (a, s["gossip"])
            assert not s["rejected"], s["rejected"]
            assert s["last_metrics"]["loss"] < 4.0  # untrained: 6·log 2 = 4.16
            assert "wordsim353_rho" in s["local_model_eval"]
        final = {a: in_vectors(fed, a) for a in ids}
    finally:
        fed.close()
    # The same number of steps without exchange: two agents' models drift apart; gossip
    # keeps them together.
    models = [t.build_model() for t in local]
    for t, m in zip(local, models):
        t.fit_steps(m, steps=PERIODS * STEPS, lr=LR, batch_size=BATCH, seed=1)
    apart = relative_distance(*(m.in_embed.weight.detach().numpy() for m in models))
    together = max(relative_distance(final[a], final[b]) for a in ids for b in ids if a < b)
    print(f"word2vec gossip: max pairwise relative distance {together:.3f}, local-only {apart:.3f}")
    assert together < 0.5 * apart, (together, apart)
