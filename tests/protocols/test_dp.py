"""Differential privacy: clipping, noise, adaptive clipping, accounting and the budget stop
of the round machine (pure code, in memory)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from configs import coordinator_config

from fedagent.protocols import dp
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import (
    AgentOnline,
    Finished,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
    Wakeup,
)

REF = {"w": np.zeros((40, 50), np.float32), "b": np.zeros(50, np.float32), "steps": np.zeros(1, np.int64)}


def random_update(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    return {
        k: (v + rng.normal(0, scale, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in REF.items()
    }


# ---- clipping --------------------------------------------------------------------------
def test_clipping_bounds_every_update_norm_and_leaves_small_ones_alone() -> None:
    rng = np.random.default_rng(7)
    bound = 1.5
    for scale in (1e-4, 1e-3, 0.01, 0.1, 1.0, 100.0):
        for _ in range(20):
            upd = random_update(rng, scale)
            delta, norm = dp.clipped_delta(REF, upd, bound)
            clipped = math.sqrt(sum(float(np.square(v).sum()) for v in delta.values()))
            assert clipped <= bound * (1 + 1e-12)
            assert norm == pytest.approx(dp.delta_norm(REF, upd))
            if norm <= bound:  # untouched
                for k, v in delta.items():
                    np.testing.assert_array_equal(v, upd[k].astype(np.float64) - REF[k])
            else:  # same direction, on the sphere
                assert clipped == pytest.approx(bound, rel=1e-9)


def test_distributed_stage_clips_before_noise_and_never_sends_integers_it_trained() -> None:
    rng = np.random.default_rng(1)
    upd = random_update(rng, 10.0)
    upd["steps"] = np.array([99], np.int64)
    out, norm = dp.noise_share(REF, upd, clip=2.0, std=0.0, rng=rng)
    assert norm > 2.0
    assert dp.delta_norm(REF, out) <= 2.0 * (1 + 1e-6)  # float32 rounding of the rebuilt weights
    assert out["steps"][0] == 0  # an integer tensor cannot carry noise: the global model's value goes out
    assert out["w"].dtype == np.float32


def test_the_round_machine_clips_every_update_in_central_mode() -> None:
    """Huge updates from every agent move the model by at most C (noise negligible here)."""
    cfg = RoundConfig(rounds=1, min_agents=3, expected_agents=3, dp=dp.DPConfig(noise_multiplier=1e-9, clip_norm=0.5))
    m = RoundMachine(cfg, dict(REF), rng=np.random.default_rng(0))
    for a in "abc":
        m.handle(AgentOnline(a, 10), 0.0)
    rng = np.random.default_rng(3)
    out = []
    for a in "abc":
        out += m.handle(UpdateReceived(a, 1, 0, 10, random_update(rng, 50.0), {"loss": 1.0}), 1.0)
    (agg,) = [c for c in out if isinstance(c, RoundAggregated)]
    assert m._acc is None
    assert dp.delta_norm(REF, agg.weights) <= 0.5 + 1e-6
    assert agg.weights_used == {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}  # equal weights, not by samples


def test_server_momentum_steps_from_the_private_release() -> None:
    """With server momentum the noised, clipped mean is what the server optimizer steps
    from (post-processing of the release). Every agent pushes the model far along the
    same direction each round: each release is that direction clipped to C (noise
    negligible), so round 1 moves by C and round 2 by (1 + β)·C."""
    beta = 0.5
    cfg = RoundConfig(
        rounds=2,
        min_agents=3,
        expected_agents=3,
        server_momentum=beta,
        dp=dp.DPConfig(noise_multiplier=1e-9, clip_norm=0.5),
    )
    m = RoundMachine(cfg, dict(REF), rng=np.random.default_rng(0))
    for a in "abc":
        m.handle(AgentOnline(a, 10), 0.0)
    push = random_update(np.random.default_rng(3), 50.0)
    steps = []
    for rnd in (1, 2):
        base = dict(m.weights)
        upd = {k: base[k] + push[k] if v.dtype.kind == "f" else v for k, v in base.items()}
        out = []
        for a in "abc":
            out += m.handle(UpdateReceived(a, rnd, rnd - 1, 10, upd, {"loss": 1.0}), float(rnd))
        (agg,) = [c for c in out if isinstance(c, RoundAggregated)]
        steps.append(dp.delta_norm(base, agg.weights))
        np.testing.assert_allclose(agg.weights["w"] - base["w"], agg.velocity["w"], rtol=1e-5, atol=1e-6)
    assert steps[0] == pytest.approx(0.5, rel=1e-4)
    assert steps[1] == pytest.approx((1 + beta) * 0.5, rel=1e-4)


# ---- noise -------------------------------------------------------------------------------
def test_central_noise_std_is_z_times_c_over_n() -> None:
    """Three updates equal to the model: the aggregate is pure noise, N(0, (zC/n)²) per
    coordinate. Three seeded rounds give 6 150 draws, whose sample std has a relative
    standard error of 1/√(2·6150) ≈ 0.9 %: the ±5 % band is over 5 of them, and a wrong
    factor (z or C alone, no /n, /√n) lies far outside it."""
    z, c, n = 1.3, 0.7, 3
    cfg = dp.DPConfig(noise_multiplier=z, clip_norm=c)
    draws = []
    for seed in (11, 12, 13):
        agg = dp.DPAggregator(cfg, REF, c, z, np.random.default_rng(seed))
        for i in range(n):
            agg.add(str(i), dict(REF), 1, {})
        out = agg.result()
        draws += [out["w"].astype(np.float64).ravel(), out["b"].astype(np.float64).ravel()]
    x = np.concatenate(draws)
    assert x.size == 3 * 2050
    assert abs(x.mean()) < 4 * (z * c / n) / math.sqrt(x.size)
    assert x.std() == pytest.approx(z * c / n, rel=0.05)


def test_distributed_shares_add_up_to_z_times_c() -> None:
    """n agents each add N(0, (zC)²/n): the sum carries N(0, (zC)²)."""
    z, c, n = 0.8, 2.0, 5
    rng = np.random.default_rng(5)
    total = np.zeros(REF["w"].size)
    for _ in range(n):
        out, _ = dp.noise_share(REF, dict(REF), clip=c, std=z * c / math.sqrt(n), rng=rng)
        total += out["w"].astype(np.float64).ravel()
    assert total.std() == pytest.approx(z * c, rel=0.05)


# ---- adaptive clipping -------------------------------------------------------------------
def test_adaptive_clip_follows_the_median_norm() -> None:
    """Andrew et al. 2021: with γ = ½ the bound settles near the median of the update norms
    (here 1..21, median 11), from far below and from far above."""
    rng = np.random.default_rng(2)
    norms = np.arange(1, 22, dtype=float)
    for start in (0.1, 500.0):
        bound = dp.ClipBound(
            dp.DPConfig(noise_multiplier=0.5, clip_norm=start, adaptive=True, clip_lr=0.2, count_stddev=0.5)
        )
        for _ in range(300):
            bound.update(int((norms <= bound.value).sum()), len(norms), len(norms), rng)
        assert 8.0 < bound.value < 14.0, (start, bound.value)


def test_adaptive_noise_split_keeps_the_total_multiplier() -> None:
    cfg = dp.DPConfig(noise_multiplier=1.0, adaptive=True)  # σ_b = 100/20 = 5 for 100 agents
    z_delta = cfg.update_noise_multiplier(100)
    assert z_delta > 1.0
    assert (z_delta**-2 + (2 * cfg.count_std(100)) ** -2) ** -0.5 == pytest.approx(1.0)
    # Few agents: σ_b is raised to z, so the count costs at most a quarter of the budget.
    assert dp.DPConfig(noise_multiplier=1.0, adaptive=True).update_noise_multiplier(5) == pytest.approx(
        (1 - 0.25) ** -0.5
    )
    with pytest.raises(ValueError, match="count_stddev"):
        dp.DPConfig(noise_multiplier=1.0, adaptive=True, count_stddev=0.4)


# ---- accounting ------------------------------------------------------------------------
# Published figures: TensorFlow Privacy, tensorflow_privacy/privacy/analysis/
# compute_dp_sgd_privacy_test.py (test_compute_dp_sgd_privacy Test0 and Test1, and
# test_compute_dp_sgd_example_privacy 'no_microbatching_with_subsampling_rdp'), all with
# the RDP accountant and Poisson sampling.
@pytest.mark.parametrize(
    ("q", "z", "steps", "delta", "published"),
    [
        (150 / 60000, 1.3, 15 * 60000 // 150, 1e-5, 0.7242234026109595),  # MNIST, 15 epochs
        (100 / 100000, 1.0, 30 * 100000 // 100, 1e-7, 1.4154988495444842),
        (1e-2, 0.7, math.ceil(1.2 / 1e-2), 1e-5, 3.2392676),  # 1.2 epochs at q = 1 %
    ],
)
def test_accountant_agrees_with_tensorflow_privacy(
    q: float, z: float, steps: int, delta: float, published: float
) -> None:
    assert dp.epsilon_for(z, steps, delta, q) == pytest.approx(published, abs=1e-6)
    acc = dp.Accountant(delta)
    for _ in range(3):
        acc.spend(dp.Release(q, (z,)))
    assert acc.epsilon < published  # three steps spend less than all of them
    restored = dp.Accountant.from_state(delta, acc.to_state())
    assert restored.epsilon == acc.epsilon


def test_calibration_reaches_the_target_epsilon() -> None:
    for target, rounds in ((1.0, 10), (3.0, 30), (8.0, 100)):
        z = dp.calibrate(target, rounds, 1e-5)
        eps = dp.epsilon_for(z, rounds, 1e-5)
        assert eps <= target + 1e-6
        assert eps == pytest.approx(target, rel=1e-2)
        assert dp.epsilon_for(z * 0.95, rounds, 1e-5) > target  # less noise would pass it


# ---- the budget stop in the machine --------------------------------------------------------
def run_rounds(cfg: RoundConfig, agents: str = "abc", max_rounds: int = 50) -> tuple[RoundMachine, list[object]]:
    m = RoundMachine(cfg, dict(REF), rng=np.random.default_rng(0))
    out: list[object] = []
    for a in agents:
        out += m.handle(AgentOnline(a, 10), 0.0)
    rng = np.random.default_rng(9)
    for _ in range(max_rounds):
        starts = [c for c in out if isinstance(c, StartRound)]
        if not starts or any(isinstance(c, Finished) for c in out):
            break
        start = starts[-1]
        out = []
        for a in start.selected:
            out += m.handle(UpdateReceived(a, start.round, start.model_version, 10, random_update(rng, 0.1), {}), 1.0)
        aggregated = [c for c in out if isinstance(c, RoundAggregated)]
        assert aggregated and aggregated[0].privacy is not None
    return m, out


def test_budget_stops_the_federation_before_epsilon_passes_it() -> None:
    z, budget = 2.0, 3.0
    fits = max(k for k in range(1, 200) if dp.epsilon_for(z, k, 1e-5) <= budget)
    cfg = RoundConfig(
        rounds=100, min_agents=3, expected_agents=3, dp=dp.DPConfig(noise_multiplier=z, epsilon_budget=budget)
    )
    m, last = run_rounds(cfg)
    (fin,) = [c for c in last if isinstance(c, Finished)]
    (agg,) = [c for c in last if isinstance(c, RoundAggregated)]
    assert agg.final and "privacy budget reached" in fin.reason
    assert m.completed == fits
    privacy = m.privacy()
    assert privacy is not None and privacy["epsilon"] <= budget
    assert privacy["epsilon"] == pytest.approx(dp.epsilon_for(z, fits, 1e-5))
    assert m.status()["phase"] == "done" and "privacy budget" in str(m.status()["stop_reason"])
    # A restart from the checkpoint's record does not run one round more.
    again = RoundMachine(cfg, dict(REF), completed_rounds=m.completed, privacy_state=m.privacy_state())
    out = []
    for a in "abc":
        out += again.handle(AgentOnline(a, 10), 5.0)
    assert not [c for c in out if isinstance(c, StartRound)]
    assert next(c for c in out if isinstance(c, Finished)).reason.startswith("privacy budget reached")


def test_distributed_round_tells_agents_their_share_and_accounts_dropouts() -> None:
    z, c = 1.0, 0.5
    cfg = RoundConfig(
        rounds=5,
        min_agents=4,
        min_updates=2,
        expected_agents=4,
        round_timeout=10,
        dp=dp.DPConfig(mode="distributed", noise_multiplier=z, clip_norm=c),
    )
    m = RoundMachine(cfg, dict(REF), rng=np.random.default_rng(0))
    out = []
    for a in "abcd":
        out += m.handle(AgentOnline(a, 10), 0.0)
    (start,) = [x for x in out if isinstance(x, StartRound)]
    assert start.train.dp_clip == c and start.train.dp_noise_std == pytest.approx(z * c / 2) and not start.train.stream
    rng = np.random.default_rng(4)
    sent = []
    for a in "ab":  # c and d never answer: two of four shares of the noise arrive
        upd, _ = dp.noise_share(REF, random_update(rng, 1.0), c, start.train.dp_noise_std, rng)
        sent.append(upd)
        m.handle(UpdateReceived(a, 1, 0, 10, upd, {}), 1.0)
    out = m.handle(AgentOnline("d", 10), 20.0) + m.handle(AgentOnline("c", 10), 20.0)
    out += m.handle(Wakeup(), 20.0)
    (agg,) = [x for x in out if isinstance(x, RoundAggregated)]
    np.testing.assert_allclose(agg.weights["w"], (sent[0]["w"] + sent[1]["w"]) / 2, atol=1e-6)
    # Two of four shares: the sum's noise multiplier is z·√(2/4).
    assert m.accountant is not None and m.accountant.releases == [dp.Release(1.0, (z * math.sqrt(0.5),))]


def test_train_config_carries_the_noise_share() -> None:
    t = TrainConfig(stream=False, dp_clip=0.5, dp_noise_std=0.25)
    assert TrainConfig.from_body(t.to_body()) == t
    assert "dp_clip" not in TrainConfig().to_body()
    with pytest.raises(Exception, match="dp_clip"):
        TrainConfig.from_body({**t.to_body(), "dp_clip": True})


def test_dp_refuses_what_it_cannot_combine_with() -> None:
    from fedagent.protocols.aggregation import Strategy

    with pytest.raises(ValueError, match="replaces aggregation 'median'"):
        RoundConfig(strategy=Strategy("median", byzantine=0), min_agents=3, dp=dp.DPConfig())
    with pytest.raises(ValueError, match="adaptive clipping"):
        dp.DPConfig(mode="local", adaptive=True)
    with pytest.raises(ValueError, match="needs secure aggregation"):
        RoundConfig(min_agents=3, dp=dp.DPConfig(mode="distributed", adaptive=True))
    with pytest.raises(ValueError, match="gossip"):
        RoundConfig(dp=dp.DPConfig(mode="local"))


# ---- local DP (gossip) ---------------------------------------------------------------------
def test_local_release_clips_the_change_since_the_last_release_and_accounts_each() -> None:
    z, c = 2.0, 0.3
    cfg = dp.DPConfig(mode="local", noise_multiplier=z, clip_norm=c, epsilon_budget=4.0)
    local = dp.LocalRelease(cfg, REF, np.random.default_rng(8))
    rng = np.random.default_rng(6)
    sent = []
    while not local.over_budget():
        before = {k: v.copy() for k, v in local.reference.items()}
        model = random_update(rng, 5.0)
        exchanged = {"w": model["w"], "b": model["b"]}  # [gossip] exchange: a subset of the names
        out = local.release(exchanged)
        assert set(out) == {"w", "b"}
        # What left is the last release plus a change of norm <= C plus N(0, (zC)²) noise.
        noise = np.concatenate([(out[k] - before[k]).ravel() for k in out]).astype(np.float64)
        assert noise.std() == pytest.approx(z * c, rel=0.05)
        sent.append(out)
        assert local.reference["w"] is not before["w"] and np.array_equal(local.reference["w"], out["w"])
    # Replacement sensitivity 2C: each release is a Gaussian of multiplier z/2.
    assert local.accountant.releases == [dp.Release(1.0, (z / 2,))] * len(sent)
    assert local.accountant.epsilon == pytest.approx(dp.epsilon_for(z / 2, len(sent), 1e-5))
    assert local.accountant.epsilon <= 4.0 < dp.epsilon_for(z / 2, len(sent) + 1, 1e-5)
    assert "privacy budget reached" in local.over_budget()
    again = dp.LocalRelease(cfg, REF, np.random.default_rng(0), local.accountant.to_state())
    assert again.accountant.epsilon == local.accountant.epsilon


def test_local_clip_bounds_the_released_change_without_noise_influence() -> None:
    cfg = dp.DPConfig(mode="local", noise_multiplier=1e-12, clip_norm=0.25)
    local = dp.LocalRelease(cfg, REF, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    for _ in range(20):
        before = dict(local.reference)
        out = local.release({k: v for k, v in random_update(rng, 3.0).items() if k != "steps"})
        assert dp.delta_norm({k: before[k] for k in out}, out) <= 0.25 * (1 + 1e-5)


# ---- configuration -------------------------------------------------------------------------
def test_privacy_config_reaches_the_round_machine(tmp_path) -> None:
    from fedagent.coordinator.fedavg import round_config

    cfg = coordinator_config(tmp_path, privacy={"mode": "distributed", "target_epsilon": 3.0, "delta": 1e-6})
    rc = round_config(cfg)
    assert rc.dp is not None and rc.dp.mode == "distributed" and rc.dp.epsilon_budget == 3.0
    assert rc.dp.noise_multiplier == pytest.approx(dp.calibrate(3.0, 12, 1e-6))
    assert dp.epsilon_for(rc.dp.noise_multiplier, 12, 1e-6) <= 3.0
    assert rc.train.stream is False


@pytest.mark.parametrize(
    ("privacy", "mode", "transfer", "words"),
    [
        ({"noise_multiplier": 1.0, "target_epsilon": 3.0}, "fedavg", {}, "exactly one of"),
        ({"mode": "local", "noise_multiplier": 1.0}, "fedavg", {}, "does not fit mode = 'fedavg'"),
        ({"mode": "central", "noise_multiplier": 1.0}, "syncopt", {}, "not 'syncopt'"),
        ({"noise_multiplier": -1.0}, "fedavg", {}, "noise_multiplier must be a positive"),
        ({"noise_multiplier": 1.0, "delta": 2.0}, "fedavg", {}, "delta must be a number in (0, 1), not 2.0"),
        ({"noise_multiplier": 1.0, "wrong": 1}, "fedavg", {}, "[privacy]"),
        ({"noise_multiplier": 1.0}, "fedavg", {"stream_updates": True}, "needs whole updates"),
    ],
)
def test_privacy_config_errors_name_the_problem(tmp_path, privacy, mode, transfer, words) -> None:
    from fedagent.coordinator.fedavg import round_config
    from fedagent.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        round_config(coordinator_config(tmp_path, mode=mode, privacy=privacy, **transfer))
    assert words in str(info.value)
