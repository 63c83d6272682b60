"""Adaptive clipping under secure aggregation over Mosquitto, real processes.

The distributed variant of Andrew et al. (2021): each of three agents clips its update
to the round's C, adds its share of the update's noise, and appends its clipped-or-not
bit (``bᵢ − ½`` plus its share of the count's noise) as one value more of the vector it
masks. The coordinator unmasks only the noised sums, moves C by the geometric rule from
the noised fraction, and charges both releases to the accountant.

A tap (a second coordinator-level certificate reading every topic) records the round
starts (each round's model and C) and every masked vector an agent sent.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from netfed import assert_only_masked_vectors, history, secure_running, wait_for
from scipy import stats

from fedagent.local.federation import BATCH
from fedagent.protocols import dp
from fedagent.protocols.messages import RoundStart, Update
from fedagent.protocols.secagg import SecAggMasked
from fedagent.tasks.base import get_weights, load_task, set_weights

AGENTS = 3
ROUNDS = 3
C0 = 1.2  # the clip norm of round 1 (round 1 updates have norms about 1 to 1.5)
Z = 0.19  # noise multiplier of the two releases together (weak: this test checks mechanics)
COUNT_STD = 0.1  # σ_b: small, so the noised count still tells the true one (|noise| < ½)
CLIP_LR = 0.5
QUANTILE = 0.5
BITS = 12  # few levels: a masked value lands among them with probability 2^-20 (9 slots: 9·10⁻⁶)
FALSE_FAILURE = 1e-5  # the chance that the count-noise check fails although all is right


def replay_norms(fed, start: RoundStart) -> dict[str, float]:
    """Each agent's update norm this round, as its process trained it."""
    torch.set_num_threads(1)
    out = {}
    for i, aid in enumerate(fed.agent_ids):
        task = load_task("digits", fed.shard_options(i))
        model = task.build_model()
        set_weights(model, start.weights)
        task.fit(model, epochs=start.train.epochs, lr=start.train.lr, batch_size=BATCH, seed=start.round)
        out[aid] = dp.delta_norm(start.weights, get_weights(model))
    return out


def test_adaptive_clipping_under_secure_aggregation_over_mosquitto(tmp_path):
    privacy = {
        "mode": "distributed",
        "noise_multiplier": Z,
        "clip_norm": C0,
        "adaptive_clip": True,
        "count_stddev": COUNT_STD,
        "clip_lr": CLIP_LR,
        "target_quantile": QUANTILE,
    }
    with secure_running(
        tmp_path,
        tap=True,
        agents=AGENTS,
        rounds=ROUNDS,
        alpha=1.0,
        privacy=privacy,
        rounds_options={"secure_bits": BITS},
    ) as (fed, tap):
        done = wait_for(
            lambda: (s := fed.status("coordinator")) and s["phase"] == "done" and s, 240, "three rounds", fed
        )
        lines = history(fed)
    cfg = dp.DPConfig(
        mode="distributed",
        noise_multiplier=Z,
        clip_norm=C0,
        adaptive=True,
        count_stddev=COUNT_STD,
        clip_lr=CLIP_LR,
        target_quantile=QUANTILE,
    )
    rounds = [ln for ln in lines if ln.get("event") == "round"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert all(r["participants"] == fed.agent_ids for r in rounds)
    # every survivor's signature of the survivor list passed the coordinator's own check
    assert all(r["secure"]["bad_signatures"] == {} for r in rounds)
    assert not [x for x in done.get("recent_rejections", []) if x["reason"] == "list_signature"]

    # Both releases of every round are charged: ε is the accountant's for the update's
    # noise z_Δ and the count's 2·σ_b (sensitivity ½), each round; the update's alone
    # would be far less.
    z_update, z_count = cfg.update_noise_multiplier(AGENTS), 2 * cfg.count_std(AGENTS)
    both, alone = dp.Accountant(1e-5), dp.Accountant(1e-5)
    for r in rounds:
        both.spend(dp.Release(1.0, (z_update, z_count)))
        alone.spend(dp.Release(1.0, (z_update,)))
        assert r["privacy"]["epsilon"] == both.epsilon, (r["round"], r["privacy"], both.epsilon)
    assert done["privacy"]["epsilon"] == both.epsilon and done["privacy"]["releases"] == ROUNDS
    assert both.epsilon > 1.2 * alone.epsilon

    msgs = tap.messages()
    starts = {m.message.round: m.message for m in msgs if isinstance(m.message, RoundStart)}
    assert sorted(starts) == list(range(1, ROUNDS + 1))
    clips = [starts[r].train.dp_clip for r in range(1, ROUNDS + 1)]
    assert clips[0] == C0
    tail = stats.norm.isf(FALSE_FAILURE / (2 * ROUNDS)) * COUNT_STD  # |count noise| below this
    assert tail < 0.5
    for k, r in enumerate(rounds):
        start = starts[r["round"]]
        # the agents were told their shares of both noises
        assert math.isclose(start.train.dp_noise_std, z_update * clips[k] / math.sqrt(AGENTS), rel_tol=1e-12)
        assert math.isclose(start.train.dp_count_std, COUNT_STD / math.sqrt(AGENTS), rel_tol=1e-12)
        frac = r["privacy"]["unclipped_fraction"]
        # C moved by the geometric rule from the fraction the coordinator unmasked ...
        moved = clips[k] * math.exp(-CLIP_LR * (frac - QUANTILE))
        assert math.isclose(r["privacy"]["clip_norm"], moved, rel_tol=1e-12), (k, r["privacy"], clips)
        if k + 1 < ROUNDS:
            assert math.isclose(clips[k + 1], moved, rel_tol=1e-12)  # ... and the next round uses it
        # ... and that fraction is the true one (the agents' norms against C, replayed
        # here) plus the count's noise, N(0, σ_b²) on the sum of the bits.
        norms = replay_norms(fed, start)
        unclipped = sum(n <= clips[k] for n in norms.values())
        noise = frac * AGENTS - unclipped
        assert abs(noise) <= tail, (k, frac, norms, clips[k])
        assert noise != 0.0  # noised: never the bare count

    # The coordinator received masked vectors only (its journal of every message it was
    # sent), no agent sent a plain update (the tap saw every message), and the count's
    # slot, the last value of each masked vector, is masked too: an agent's unmasked
    # noised bit is a quantised value, below 2^BITS.
    assert_only_masked_vectors(lines, BITS)
    assert not [m for m in msgs if isinstance(m.message, Update)]
    masked = [m.message for m in msgs if isinstance(m.message, SecAggMasked)]
    assert len(masked) == AGENTS * ROUNDS
    size = sum(int(np.asarray(w).size) for w in starts[1].weights.values() if np.asarray(w).dtype.kind == "f")
    assert all(m.masked.size == size + 1 for m in masked)
    slots = [int(m.masked[-1]) for m in masked]
    assert not [s for s in slots if s < 2**BITS], slots
