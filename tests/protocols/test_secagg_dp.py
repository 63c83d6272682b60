"""Distributed differential privacy under secure aggregation, in memory: the quantisation
range holds the noised updates, the sum a round unmasks carries the noise the accountant
charges, and a sum whose survivors carry too little noise for the budget is never unmasked."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from configs import coordinator_config

from fedagent.protocols import dp
from fedagent.protocols import rounds as R
from fedagent.protocols import secagg as S

W0 = {"w": np.zeros((30, 40), np.float32), "b": np.zeros(40, np.float32), "steps": np.zeros(1, np.int64)}
SIZE = 30 * 40 + 40


def det_bytes(seed: int):
    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


def config(n: int, z: float, clip: float, budget: float | None = None, **kw) -> R.RoundConfig:
    base = dict(
        rounds=5,
        min_agents=n,
        expected_agents=n,
        min_updates=2,
        secure=S.SecAggParams(clip=1.0, bits=20),
        dp=dp.DPConfig(mode="distributed", noise_multiplier=z, clip_norm=clip, epsilon_budget=budget),
    )
    base.update(kw)
    return R.RoundConfig(**base)


def test_quantisation_range_holds_the_noise_with_the_stated_probability() -> None:
    c, std, d, n = 1.0, 0.5, 10_000, 10
    r = dp.quantisation_range(c, std, d, n)
    k = (r - c) / std
    # Union bound: n·d values, each outside k·σ with probability 2(1 − Φ(k)).
    assert 2 * n * d * (1 - 0.5 * (1 + math.erf(k / math.sqrt(2)))) == pytest.approx(dp.RANGE_MISS, rel=1e-3)
    assert dp.quantisation_range(c, std, d, n, miss=1e-3) < r < dp.quantisation_range(c, std, d, n, miss=1e-12)
    assert dp.quantisation_range(c, 0.0, d, n) == c
    # The worst update: all of its norm on one coordinate, plus the noise.
    rng = np.random.default_rng(7)
    worst = np.zeros((n, d))
    worst[:, 0] = c
    worst += rng.normal(0, std, worst.shape)
    assert np.abs(worst).max() < r


def start_round(m: R.RoundMachine, agents: list[str], now: float = 0.0) -> R.StartRound:
    out = []
    for a in agents:
        out += m.handle(R.AgentOnline(a, 50), now)
    (start,) = [c for c in out if isinstance(c, R.StartRound)]
    return start


def test_secure_round_under_dp_widens_the_quantisation_range_to_the_noise() -> None:
    z, clip, n = 1.0, 0.5, 4
    m = R.RoundMachine(config(n, z, clip), dict(W0))
    start = start_round(m, [f"a{i}" for i in range(n)])
    assert start.secagg is not None and start.train.dp_clip == clip
    std = z * clip / math.sqrt(n)
    assert start.train.dp_noise_std == pytest.approx(std)
    want = dp.quantisation_range(clip, std, SIZE, n)
    assert want > 1.0  # wider than the configured secure_clip
    assert start.secagg.params.clip == pytest.approx(want)
    assert m.secure_params == start.secagg.params
    # With little noise the configured range (wider) stays.
    quiet = R.RoundMachine(config(n, 1e-3, 0.01), dict(W0))
    assert start_round(quiet, [f"a{i}" for i in range(n)]).secagg.params.clip == 1.0


def run_round(m: R.RoundMachine, n: int, dead: set[str], seed: int = 0):
    """One secure round with agents that clip and noise as the round says; ``dead``
    agents share their keys, then vanish before their masked input."""
    names = [f"a{i}" for i in range(n)]
    start = start_round(m, names)
    rng = np.random.default_rng(seed)
    agents = {a: S.SecAggAgent(a, random_bytes=det_bytes(i)) for i, a in enumerate(start.selected)}
    deltas: dict[str, np.ndarray] = {}
    out: list = []
    sent: list[str] = []

    def pump(cmds: list) -> None:
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            out.append(c)
            if isinstance(c, R.SendSecAgg):
                sent.append(c.message.kind)
                if c.to not in dead:
                    for msg in agents[c.to].on_message(c.message):
                        queue += m.handle(R.SecAggReceived(c.to, msg), 1.0)

    for a in agents:
        for msg in agents[a].on_round_start(start.round, start.selected, start.secagg):
            pump(m.handle(R.SecAggReceived(a, msg), 1.0))
    for a in agents:
        if a in dead:
            continue
        trained = {
            k: (v + rng.normal(0, 0.3, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in W0.items()
        }
        noised, norm = dp.noise_share(W0, trained, start.train.dp_clip, start.train.dp_noise_std, rng)
        if start.train.dp_count_std:
            noised[dp.COUNT_KEY] = dp.count_share(norm, start.train.dp_clip, start.train.dp_count_std, rng)
        deltas[a] = S.flatten(noised)[1] - S.flatten(dp.with_slots(W0, noised))[1]
        for msg in agents[a].on_trained(1, deltas[a], base_version=0, num_samples=50, metrics={}):
            pump(m.handle(R.SecAggReceived(a, msg), 2.0))
    for a in dead:  # their presence goes offline: the input stage closes without them
        pump(m.handle(R.AgentOffline(a), 3.0))
    return start, out, deltas, sent, agents


def test_unmasked_sum_is_the_sum_of_noised_updates_uncut() -> None:
    z, clip, n = 1.0, 0.5, 4
    m = R.RoundMachine(config(n, z, clip), dict(W0))
    start, out, deltas, sent, _ = run_round(m, n, set())
    (agg,) = [c for c in out if isinstance(c, R.RoundAggregated)]
    assert "secagg_survivors" in sent and "secagg_unmask" in sent
    got = S.flatten(agg.weights)[1] - S.flatten(W0)[1]
    want = sum(deltas.values()) / n
    params = start.secagg.params
    # Nothing cut by the range: only rounding (half a step per update) and float32.
    assert max(np.abs(d).max() for d in deltas.values()) < params.clip
    assert np.abs(got - want).max() <= params.error_bound(n, n) + 1e-6
    assert agg.privacy is not None
    assert m.accountant is not None and m.accountant.releases == [dp.Release(1.0, (z,))]


def test_a_sum_of_too_few_survivors_for_the_budget_is_never_unmasked() -> None:
    z, clip, n = 2.0, 0.5, 4
    full = dp.epsilon_for(z, 1, 1e-5)
    three = dp.epsilon_for(z * math.sqrt(3 / 4), 1, 1e-5)
    budget = (full + three) / 2  # one round of all four fits, a round of three would not
    m = R.RoundMachine(config(n, z, clip, budget), dict(W0))
    _, out, _, sent, _ = run_round(m, n, {"a2"})
    abandoned = [c for c in out if isinstance(c, R.RoundAbandoned)]
    assert abandoned and "privacy budget" in abandoned[0].reason and "3 of 4" in abandoned[0].reason
    # Refused before the consistency and unmasking stages: no share was ever asked for.
    assert "secagg_survivors" not in sent and "secagg_unmask" not in sent
    assert not [c for c in out if isinstance(c, R.RoundAggregated)]
    assert m.accountant is not None and m.accountant.releases == []
    # Not the end of the federation: a new round waits for its quorum (a2 is gone).
    assert m.phase is R.Phase.WAITING and not m.stop_reason


def test_plain_distributed_sum_of_too_few_updates_for_the_budget_is_not_published() -> None:
    z, clip, n = 2.0, 0.5, 4
    budget = (dp.epsilon_for(z, 1, 1e-5) + dp.epsilon_for(z * math.sqrt(2 / 4), 1, 1e-5)) / 2
    m = R.RoundMachine(config(n, z, clip, budget, secure=None, round_timeout=10.0), dict(W0))
    start = start_round(m, [f"a{i}" for i in range(n)])
    rng = np.random.default_rng(1)
    for a in start.selected[:2]:
        upd, _ = dp.noise_share(W0, W0, clip, start.train.dp_noise_std, rng)
        m.handle(R.UpdateReceived(a, 1, 0, 10, upd, {}), 1.0)
    out = m.handle(R.Wakeup(), 20.0)
    (ab,) = [c for c in out if isinstance(c, R.RoundAbandoned)]
    assert "privacy budget" in ab.reason and "2 of 4" in ab.reason
    assert not [c for c in out if isinstance(c, R.RoundAggregated)] and m.model_version == 0
    assert m.accountant is not None and m.accountant.releases == []


def test_privacy_table_with_secure_aggregation_in_the_config(tmp_path) -> None:
    from fedagent.coordinator.fedavg import round_config
    from fedagent.errors import ConfigError

    rounds = {"rounds": 12, "secure_aggregation": True}
    rc = round_config(coordinator_config(tmp_path, rounds, privacy={"mode": "distributed", "target_epsilon": 3.0}))
    assert rc.secure is not None and rc.dp is not None and rc.dp.mode == "distributed" and not rc.dp.adaptive
    adaptive = {"mode": "distributed", "noise_multiplier": 1.0, "adaptive_clip": True}
    rc = round_config(coordinator_config(tmp_path, rounds, privacy=adaptive))
    assert rc.secure is not None and rc.dp is not None and rc.dp.adaptive
    refused = [
        ({"mode": "central", "noise_multiplier": 1.0}, "in mode 'distributed' only"),
        ({"mode": "central", "noise_multiplier": 1.0, "adaptive_clip": True}, "in mode 'distributed' only"),
    ]
    for privacy, words in refused:
        with pytest.raises(ConfigError, match=words):
            round_config(coordinator_config(tmp_path, rounds, privacy=privacy))
    # Without secure aggregation nothing could carry the clipped-or-not bits unseen.
    with pytest.raises(ConfigError, match="needs secure aggregation"):
        round_config(coordinator_config(tmp_path, {"rounds": 12}, privacy=adaptive))


def test_values_outside_counts_what_a_range_would_cut() -> None:
    base = {"w": np.zeros(5, np.float32), "n": np.zeros(2, np.int64)}
    noised = {"w": np.array([0.5, -2.0, 1.9, 2.1, 0.0], np.float32), "n": np.array([9, 9], np.int64)}
    assert dp.values_outside(base, noised, 2.0) == 1 and dp.values_outside(base, noised, 0.4) == 4


def test_adaptive_clipping_under_secure_aggregation_moves_the_bound_from_the_masked_count() -> None:
    """Andrew et al.'s variant for secure aggregation: each agent's clipped-or-not bit
    (minus ½) and its share of the count's noise ride in the masked sum as one value
    more; the coordinator moves C from the unmasked, noised count it never saw per agent."""
    z, clip, n = 1.0, 0.5, 4
    cfg = config(
        n, z, clip, None, dp=dp.DPConfig(mode="distributed", noise_multiplier=z, clip_norm=clip, adaptive=True)
    )
    m = R.RoundMachine(cfg, dict(W0))
    start, out, deltas, sent, _ = run_round(m, n, set())
    d = cfg.dp
    assert d is not None
    root = math.sqrt(n)
    assert start.train.dp_noise_std == pytest.approx(d.update_noise_multiplier(n) * clip / root)
    assert start.train.dp_count_std == pytest.approx(d.count_std(n) / root)
    assert m.model_version == 1
    (agg,) = [c for c in out if isinstance(c, R.RoundAggregated)]
    # The model moved by the mean of the noised updates, the count slot left out.
    got = S.flatten(agg.weights)[1] - S.flatten(W0)[1]
    assert got.size == SIZE
    params = start.secagg.params
    assert np.abs(got - sum(v[:-1] for v in deltas.values()) / n).max() <= params.error_bound(n, n) + 1e-6
    # Every update (norm ≈ 0.3·√1240 ≈ 10.6) was clipped: the count is about −n/2, and the
    # bound moves up, by exactly what the unmasked noised count says.
    count = sum(float(v[-1]) for v in deltas.values())
    frac = count / n + 0.5
    assert m.clip is not None
    assert m.clip.value == pytest.approx(clip * math.exp(-d.clip_lr * (frac - d.target_quantile)), rel=1e-4)
    assert m.privacy_state()["clip_norm"] == m.clip.value
    # Both releases are charged, as in the central variant.
    assert m.accountant is not None
    assert m.accountant.releases == [dp.Release(1.0, (d.update_noise_multiplier(n), 2 * d.count_std(n)))]


def test_train_config_carries_the_count_share() -> None:
    from fedagent.protocols.messages import TrainConfig

    t = TrainConfig(stream=False, dp_clip=0.5, dp_noise_std=0.25, dp_count_std=0.6)
    assert TrainConfig.from_body(t.to_body()) == t
    assert "dp_count_std" not in TrainConfig(stream=False, dp_clip=0.5).to_body()
    with pytest.raises(Exception, match="dp_count_std"):
        TrainConfig(dp_count_std=0.5)
    with pytest.raises(Exception, match="dp_count_std must be a number"):
        TrainConfig.from_body({**t.to_body(), "dp_count_std": "x"})


def test_rounding_to_the_grid_is_negligible_next_to_the_noise():
    """The figure docs/privacy.md gives for the rounding the accountant does not see: the
    demo's private secure round (3 agents, 4,810 parameters, C = 1, z = 5.78, 20 bits).
    Each agent rounds its noised update to the grid; the sum then differs from the sum of
    the noised updates (the mechanism analysed) by at most n·step/2 per coordinate, with
    the variance of n uniform roundings, n·step²/12: about 2·10⁻¹¹ of the noise's."""
    n, d, clip, z = 3, 4810, 1.0, 5.78
    share = z * clip / math.sqrt(n)
    p = S.SecAggParams(clip=dp.quantisation_range(clip, share, d, n), bits=20)
    rng = np.random.default_rng(0)
    errors = []
    for _ in range(40):
        xs = [rng.uniform(-1, 1, d) * clip / math.sqrt(d) + rng.normal(0.0, share, d) for _ in range(n)]
        q = sum(S.quantise(x, p).astype(np.uint64) for x in xs).astype(np.uint32)
        errors.append(S.dequantise_sum(q, n, p) - sum(xs))
    e = np.concatenate(errors)
    assert np.abs(e).max() <= n * p.step / 2
    assert e.var() == pytest.approx(n * p.step**2 / 12, rel=0.05)
    assert e.var() / (z * clip) ** 2 < 2e-11
