"""Local differential privacy in gossip mode, for real: three agent processes over
Mosquitto with mutual TLS. Every model an agent sends is clipped and noised and accounted
by that agent; at its budget it stops sending, keeps training, and its ε never passes the
budget."""

from __future__ import annotations

import pytest
from netfed import running, wait_for

from fedagent.local.federation import BATCH, SEED
from fedagent.protocols import dp

Z = 8.0  # each release: a Gaussian of multiplier Z/2 = 4 (replacement sensitivity 2C)
BUDGET = 3.62  # ten releases fit (3.619 at δ = 1e-5), an eleventh would make it 3.84
PERIODS = 30


@pytest.mark.slow
def test_gossip_agents_stop_sending_at_their_budget(tmp_path):
    fits = max(k for k in range(1, 40) if dp.epsilon_for(Z / 2, k, 1e-5) <= BUDGET)
    assert fits == 10
    gossip = {
        "periods": PERIODS,
        "period_steps": 5,
        "lr": 0.1,
        "batch_size": BATCH,
        "seed": SEED,
        "period_seconds": 0.1,
        "send_timeout": 3.0,
        "min_peers": 2,
        "eval_every": 5,
    }
    privacy = {"mode": "local", "noise_multiplier": Z, "clip_norm": 1.0, "epsilon_budget": BUDGET}
    with running(
        tmp_path,
        agents=3,
        rounds=1,
        alpha=1.0,
        mode="gossip",
        gossip=gossip,
        privacy=privacy,
        agent_broker_by_mdns=False,
    ) as fed:
        done = wait_for(
            lambda: (
                [s for s in (fed.status(a) for a in fed.agent_ids) if s and s.get("round_state") == "finished"]
                if all((fed.status(a) or {}).get("round_state") == "finished" for a in fed.agent_ids)
                else None
            ),
            240,
            "every gossip agent to finish its periods",
            fed,
        )
        for s in done:
            p = s["privacy"]
            assert p["mode"] == "local" and p["epsilon_budget"] == BUDGET
            assert p["releases"] == fits and p["epsilon"] <= BUDGET
            assert abs(p["epsilon"] - dp.epsilon_for(Z / 2, fits, 1e-5)) < 1e-9
            assert "privacy budget reached" in s["stop_reason"]
            assert s["period"] == PERIODS  # training went on after the last release
