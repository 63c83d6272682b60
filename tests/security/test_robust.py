"""Robust aggregation and input limits before aggregation:
properties of the median, trimmed mean, multi-Krum and clipping (Hypothesis), refused
configurations, and updates/gossip models refused before they touch a model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedagent import config as config_mod
from fedagent.coordinator.fedavg import round_config
from fedagent.errors import ConfigError
from fedagent.protocols import gossip as G
from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import (
    Strategy,
    clip_to,
    coordinate_median,
    robust_aggregate,
    trimmed_mean,
)

FINITE = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
HUGE = st.floats(-3.0e38, 3.0e38, allow_nan=False, allow_infinity=False).map(lambda x: float(np.float32(x)))


@settings(max_examples=80, deadline=None)
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 9), st.integers(1, 5)), elements=FINITE))
def test_median_lies_within_min_and_max_of_each_coordinate(stack) -> None:
    med = coordinate_median(stack)
    assert np.all(med >= stack.min(axis=0)) and np.all(med <= stack.max(axis=0))


@st.composite
def honest_and_byzantine(draw, *, max_f: int = 3):
    f = draw(st.integers(0, max_f))
    n_honest = draw(st.integers(f + 3, f + 8))
    d = draw(st.integers(1, 6))
    honest = draw(hnp.arrays(np.float64, (n_honest, d), elements=st.floats(-1, 1)))
    byz = draw(hnp.arrays(np.float64, (f, d), elements=HUGE))
    return honest, byz


@settings(max_examples=80, deadline=None)
@given(honest_and_byzantine())
def test_median_and_trimmed_mean_stay_inside_the_honest_range(data) -> None:
    """f < n/2 arbitrary values cannot move the median outside the honest values'
    range; nor the trimmed mean when it trims at least f at each end."""
    honest, byz = data
    f = len(byz)
    stack = np.concatenate([honest, byz])
    lo, hi = honest.min(axis=0), honest.max(axis=0)
    for agg in (coordinate_median(stack), trimmed_mean(stack, f)):
        assert np.all(agg >= lo - 1e-9) and np.all(agg <= hi + 1e-9)


@st.composite
def far_byzantine(draw):
    f = draw(st.integers(1, 3))
    n = draw(st.integers(2 * f + 3, 2 * f + 7))
    d = draw(st.integers(1, 5))
    honest = draw(hnp.arrays(np.float64, (n - f, d), elements=st.floats(-1, 1)))
    # Arbitrary magnitude and direction, possibly all equal (colluding): just not
    # within the honest cloud.
    direction = draw(
        hnp.arrays(np.float64, (f, d), elements=st.floats(-1, 1)).filter(
            lambda a: np.all(np.linalg.norm(a, axis=1) > 0.1)
        )
    )
    scale = draw(st.floats(1e2, 1e15))
    return honest, direction / np.linalg.norm(direction, axis=1, keepdims=True) * scale, f


@settings(max_examples=80, deadline=None)
@given(far_byzantine(), st.data())
def test_multi_krum_selects_only_honest_updates_when_byzantine_ones_are_far(case, data) -> None:
    honest, byz, f = case
    n = len(honest) + f
    updates = [{"w": v.astype(np.float32)} for v in np.concatenate([honest, byz])]
    order = data.draw(st.permutations(range(n)))
    shuffled = [updates[i] for i in order]
    m = data.draw(st.integers(1, n - f))
    _, chosen = robust_aggregate("krum", {"w": np.zeros(honest.shape[1], np.float32)}, shuffled, f=f, krum_m=m)
    assert len(chosen) == m
    assert all(order[i] < len(honest) for i in chosen), "Krum picked a Byzantine update"


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 20), elements=HUGE), st.floats(1e-3, 1e3))
def test_clipping_bounds_the_distance_from_the_reference(update, bound) -> None:
    ref = {"w": np.zeros_like(update), "n": np.array(3, np.int64)}
    out = clip_to(ref, {"w": update, "n": np.array(9, np.int64)}, bound)
    dist = float(np.linalg.norm(out["w"].astype(np.float64)))
    assert dist <= bound * (1 + 1e-5) + 1e-30
    assert out["w"].dtype == np.float32 and int(out["n"]) == 9
    if float(np.linalg.norm(update.astype(np.float64))) <= bound:
        np.testing.assert_array_equal(out["w"], update)


def test_robust_strategies_aggregate_through_the_round_machine() -> None:
    """Five agents, one sending a huge update: median/trimmed/Krum ignore it, FedAvg not."""
    ref = {"w": np.zeros(4, np.float32)}
    results = {}
    for name, kw in (
        ("fedavg", {}),
        ("median", {"byzantine": 1}),
        ("trimmed_mean", {"byzantine": 1, "trim": 0.2}),
        ("krum", {"byzantine": 1}),
    ):
        cfg = R.RoundConfig(rounds=1, min_agents=5, expected_agents=5, min_updates=5, strategy=Strategy(name, **kw))
        m = R.RoundMachine(cfg, dict(ref))
        for a in "abcde":
            m.handle(R.AgentOnline(a, 10), 0.0)
        out = []
        for i, a in enumerate("abcde"):
            w = np.full(4, 1e9 if a == "e" else 1.0 + 0.01 * i, np.float32)
            out += m.handle(R.UpdateReceived(a, 1, 0, 10, {"w": w}, {}), 0.0)
        agg = next(c for c in out if isinstance(c, R.RoundAggregated))
        results[name] = (agg.weights["w"], agg.participants, agg.dropped)
    assert results["fedavg"][0][0] > 1e8
    for name in ("median", "trimmed_mean", "krum"):
        assert 1.0 <= results[name][0][0] <= 1.04, name
    assert "e" not in results["krum"][1] and "e" in results["krum"][2]


def _cfg(tmp_path, **rounds) -> config_mod.NodeConfig:
    p = tmp_path / "coordinator.toml"
    p.write_text(
        config_mod.render(
            node_id="coord",
            federation="fed",
            broker="mqtts://127.0.0.1:8883",
            tls=config_mod.TlsConfig(tmp_path / "ca.crt", tmp_path / "c.crt", tmp_path / "c.key"),
            state_dir=tmp_path,
            rounds=rounds,
        )
    )
    return config_mod.load(p, "coordinator")


@pytest.mark.parametrize(
    "rounds, message",
    [
        (
            {"aggregation": "krum", "byzantine": 2, "min_agents": 6, "min_updates": 6},
            r"Krum needs n > 2f \+ 2.*at least 7",
        ),
        ({"aggregation": "median", "byzantine": 3, "min_agents": 6, "min_updates": 6}, r"f < n/2.*at least 7"),
        ({"aggregation": "trimmed_mean", "trim": 0.5, "min_agents": 4, "min_updates": 4}, r"0 <= trim < 0.5"),
        (
            {"aggregation": "trimmed_mean", "trim": 0.1, "byzantine": 1, "min_agents": 5, "min_updates": 5},
            r"drops 0 values.*fewer than byzantine = 1",
        ),
        ({"aggregation": "krum", "byzantine": 1, "krum_m": 9, "min_agents": 6, "min_updates": 6}, r"1 <= m <= n - f"),
        ({"aggregation": "fedavg", "byzantine": 1}, r"needs a robust aggregation"),
        ({"aggregation": "fedavg", "clip_norm": -1.0}, r"clip_norm must be a positive"),
    ],
)
def test_configurations_violating_a_precondition_are_refused_at_start(tmp_path, rounds, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tmp_path, **rounds)  # refused when the file is loaded
    assert "[rounds]" in str(info.value)


def test_valid_robust_configuration_is_accepted(tmp_path) -> None:
    rc = round_config(_cfg(tmp_path, aggregation="krum", byzantine=2, min_agents=7, min_updates=7, clip_norm=5.0))
    assert rc.strategy.name == "krum" and rc.strategy.byzantine == 2 and rc.strategy.clip_norm == 5.0


# ---- input limits before work (item 2) ----------------------------------------------


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"w": np.full(4, np.nan, np.float32)}, "non-finite"),
        ({"w": np.array([1, np.inf, 0, 0], np.float32)}, "non-finite"),
        ({"w": np.zeros(5, np.float32)}, "shape"),
        ({"w": np.zeros(4, np.float64)}, "dtype"),
        ({"w": np.full(4, 100.0, np.float32)}, "norm"),
        ({"v": np.zeros(4, np.float32)}, "names"),
    ],
)
def test_bad_updates_are_refused_before_aggregation_with_the_sender_named(bad, reason) -> None:
    for strategy in (Strategy("fedavg"), Strategy("median", byzantine=0)):
        cfg = R.RoundConfig(rounds=1, min_agents=2, expected_agents=2, min_updates=1, max_norm=10.0, strategy=strategy)
        m = R.RoundMachine(cfg, {"w": np.zeros(4, np.float32)})
        m.handle(R.AgentOnline("good", 1), 0.0)
        m.handle(R.AgentOnline("evil", 1), 0.0)
        out = m.handle(R.UpdateReceived("evil", 1, 0, 10, bad, {}), 0.0)
        assert [(c.sender, c.reason) for c in out if isinstance(c, R.Rejected)] == [("evil", reason)]
        # The round does not wait for another update from the refused sender: the good
        # one is all it needs, and the only one aggregated.
        out = m.handle(R.UpdateReceived("good", 1, 0, 10, {"w": np.ones(4, np.float32)}, {}), 0.0)
        (agg,) = [c for c in out if isinstance(c, R.RoundAggregated)]
        assert agg.participants == ("good",) and np.array_equal(agg.weights["w"], np.ones(4, np.float32))


def _gossip(**kw) -> G.GossipMachine:
    return G.GossipMachine("me", G.GossipConfig(period_steps=1, **kw), {"w": np.zeros(4, np.float32)}, num_samples=1)


def test_gossip_refuses_a_model_above_max_norm_and_clips_with_clip_norm() -> None:
    g = _gossip(max_norm=10.0)
    out = g.handle(G.ModelReceived("evil", "x1", {"w": np.full(4, 100.0, np.float32)}, mass=1.0), 0.0)
    assert [(c.sender, c.reason) for c in out if isinstance(c, G.Dropped)] == [("evil", "norm")]
    assert [c.accepted for c in out if isinstance(c, G.SendAck)] == [False]
    g = _gossip(clip_norm=1.0)
    g.handle(G.ModelReceived("peer", "x1", {"w": np.full(4, 100.0, np.float32)}, mass=1.0), 0.0)
    kept = g._inbox[0].payload.values["w"]
    assert abs(float(np.linalg.norm(kept)) - 1.0) < 1e-5


def test_gossip_merge_survives_extreme_masses() -> None:
    """A peer may claim any finite mass: the merge must stay finite (fuzzer finding)."""
    g = _gossip()
    g.handle(G.PeerUp("p"), 0.0)
    g.handle(G.Start(), 0.0)
    g.handle(G.ModelReceived("p", "x1", {"w": np.full(4, 3e38, np.float32)}, mass=1e300), 0.0)
    g.handle(G.ModelReceived("q", "x2", {"w": np.ones(4, np.float32)}, mass=1e-300), 0.0)
    g.handle(G.TrainingDone(1, {"w": np.zeros(4, np.float32)}), 1.0)
    assert np.isfinite(g.model["w"]).all()
