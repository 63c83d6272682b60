"""Secure aggregation with distributed differential privacy over Mosquitto, real processes.

Three agents clip their updates to C and add their share of the noise, N(0, (z·C)²/3)
per coordinate, before quantisation and masking. The coordinator only ever receives
masked vectors; each round's new model differs from the plain average of the clipped
updates by noise of exactly the scale the accountant charges; ε grows round by round in
`fedagent status` and on the Prometheus endpoint; the budget ends the federation.

A tap (a second coordinator-level certificate reading every topic) records the round
starts, so each round's model is known and every agent's training can be replayed here.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from netfed import assert_only_masked_vectors, history, scrape, secure_running, value, wait_for
from scipy import stats

from fedagent.local.federation import BATCH
from fedagent.protocols import dp
from fedagent.protocols.messages import GlobalModel, RoundStart, Update
from fedagent.protocols.secagg import SecAggSurvivors, SecAggUnmask, flatten
from fedagent.tasks.base import get_weights, load_task, set_weights

Z = 3.0  # noise multiplier of the round's sum
C = 0.2  # clip norm of each update
BUDGET = 2.6  # ε at δ = 1e-5: three rounds fit (2.54), a fourth would make it 2.99
ROUNDS = 20  # configured; the budget ends it sooner
AGENTS = 3
EPOCHS = 1
# Probability that the statistical check below fails although the noise has the right
# scale: the two-sided variance test and the mean test each take half.
FALSE_FAILURE = 1e-6


def replay_clipped_deltas(fed, start: RoundStart) -> dict[str, np.ndarray]:
    """Each agent's training of this round, as its process ran it, clipped to C."""
    torch.set_num_threads(1)
    out = {}
    for i, aid in enumerate(fed.agent_ids):
        task = load_task("digits", fed.shard_options(i))
        model = task.build_model()
        set_weights(model, start.weights)
        task.fit(model, epochs=start.train.epochs, lr=start.train.lr, batch_size=BATCH, seed=start.round)
        clipped, _ = dp.clipped_delta(start.weights, get_weights(model), C)
        out[aid] = flatten(clipped)[1]
    return out


def test_secure_aggregation_with_distributed_dp_over_mosquitto(tmp_path):
    fits = max(k for k in range(1, ROUNDS) if dp.epsilon_for(Z, k, 1e-5) <= BUDGET)
    assert fits == 3
    privacy = {"mode": "distributed", "noise_multiplier": Z, "clip_norm": C, "epsilon_budget": BUDGET}
    with secure_running(
        tmp_path,
        tap=True,
        agents=AGENTS,
        rounds=ROUNDS,
        alpha=1.0,
        privacy=privacy,
        rounds_options={"local_epochs": EPOCHS},
    ) as (fed, tap):
        seen: list[tuple[int, float, float]] = []  # (rounds done, ε in status, ε on /metrics)

        url: list[str] = []

        def watch():
            # /metrics is set while a round's commands run, the status once they are
            # done: /metrics may be one round ahead of the status read after it
            prom = None
            if url:
                try:
                    prom = value(scrape(url[0]), "fedagent_dp_epsilon")
                except OSError:  # a scrape that times out on a loaded machine: next poll
                    pass
            s = fed.status("coordinator")
            if not s:
                return None
            if not url and s.get("metrics_url"):
                url.append(s["metrics_url"])
            if s.get("privacy") and prom is not None:
                seen.append((s["completed_rounds"], s["privacy"]["epsilon"], prom))
            return s if s["phase"] == "done" else None

        done = wait_for(watch, 300, "the budget to stop the secure federation", fed)
        lines = history(fed)
        final, _ = fed.final_weights()
    # The budget ended it, ε as the accountant says, in the status and on /metrics.
    assert done["completed_rounds"] == fits and "privacy budget reached" in done["stop_reason"]
    p = done["privacy"]
    assert p["mode"] == "distributed" and abs(p["epsilon"] - dp.epsilon_for(Z, fits, 1e-5)) < 1e-9
    assert p["epsilon"] <= BUDGET
    per_round = [dp.epsilon_for(Z, k, 1e-5) for k in range(fits + 1)]
    for k, eps_status, eps_prom in seen:
        assert abs(eps_status - per_round[k]) < 1e-9, (k, seen)
        # (scraped before the status was read, which waits for a round in progress to end:
        # /metrics may be a round behind the status as well as one ahead)
        near = [per_round[j] for j in (k - 1, k, k + 1) if 0 <= j < len(per_round)]
        assert any(abs(eps_prom - e) < 1e-9 for e in near), (k, eps_prom, seen[-5:])
    assert len({round(e, 9) for _, _, e in seen}) >= 2, f"ε seen on /metrics never grew: {seen}"
    assert [e for _, _, e in seen] == sorted(e for _, _, e in seen)
    rounds = [ln for ln in lines if ln.get("event") == "round"]
    assert [r["privacy"]["epsilon"] for r in rounds] == [per_round[k] for k in range(1, fits + 1)]
    assert all(r["participants"] == fed.agent_ids for r in rounds)

    # The coordinator received masked vectors only (its journal of every update-bearing
    # message), and no agent sent a plain update (the tap saw every message).
    assert_only_masked_vectors(lines, 20)
    msgs = tap.messages()
    assert not [m for m in msgs if isinstance(m.message, Update)]
    starts = {m.message.round: m.message for m in msgs if isinstance(m.message, RoundStart)}
    assert sorted(starts) == list(range(1, fits + 1))
    finals = [m.message for m in msgs if isinstance(m.message, GlobalModel) and m.message.final]
    assert finals and finals[-1].model_version == fits
    models = [starts[r].weights for r in range(1, fits + 1)] + [final]
    # The consistency round, on the wire: each round one survivor list, sent to all three,
    # and every request for shares carries their three signatures of it.
    for r in range(1, fits + 1):
        lists = [m.message.survivors for m in msgs if isinstance(m.message, SecAggSurvivors) and m.message.round == r]
        assert lists == [tuple(fed.agent_ids)] * AGENTS
        asks = [m.message for m in msgs if isinstance(m.message, SecAggUnmask) and m.message.round == r]
        assert len(asks) == AGENTS and all(set(a.signatures) == set(fed.agent_ids) for a in asks)

    # Each round: new model − (round's model + mean of the clipped updates) is the sum of
    # the three noise shares over 3, N(0, (z·C/3)²) per coordinate (plus quantisation
    # error ≤ the round's bound, and float32 rounding: both below 1e-5 of σ).
    sigma = Z * C / AGENTS
    residuals = []
    for r in range(1, fits + 1):
        deltas = replay_clipped_deltas(fed, starts[r])
        base = flatten(models[r - 1])[1]
        want = base + sum(deltas.values()) / AGENTS
        residuals.append(flatten(models[r])[1] - want)
        sec = rounds[r - 1]["secure"]
        # the quantisation range held every noised update: nothing was cut
        assert abs(sec["range"] - dp.quantisation_range(C, Z * C / math.sqrt(AGENTS), base.size, AGENTS)) < 1e-12
        assert sec["error_bound"] < 1e-4 * sigma
    res = np.concatenate(residuals)
    n = res.size
    lo, hi = stats.chi2.ppf([FALSE_FAILURE / 4, 1 - FALSE_FAILURE / 4], n) / n
    ratio = float(np.mean(res**2)) / sigma**2
    assert lo <= ratio <= hi, f"noise variance / expected = {ratio:.4f}, outside [{lo:.4f}, {hi:.4f}]"
    z_mean = float(np.mean(res)) * math.sqrt(n) / sigma
    assert abs(z_mean) <= stats.norm.isf(FALSE_FAILURE / 4), z_mean
    # Had each agent added the whole z·C (or none), the check could not pass.
    assert not lo <= ratio * AGENTS <= hi and not lo <= 0.0 <= hi
    agent_lines = [
        json.loads(x)
        for aid in fed.agent_ids
        for x in next((fed.work / "state" / aid).rglob("history.jsonl")).read_text().splitlines()
    ]
    assert not [ln for ln in agent_lines if ln.get("event") == "quantisation_cut"]
