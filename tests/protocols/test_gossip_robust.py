"""Robust (screening) gossip: the rule, its preconditions, and Byzantine peers.

Pure unit tests of :func:`fedagent.protocols.gossip.screen` and of the machine's
screening mode, the configuration refusals, and the Byzantine table in gossip mode
(``tests/byzantine_gossip.py``: ten digits agents, real training, the real machine).

The budget (the Byzantine table's, in gossip mode): with 10/20/30 % of the agents attacking,
a screening rule keeps the honest agents' mean final accuracy within ``BUDGET`` (0.10)
of plain push-sum gossip without attackers, while plain gossip under the same attack
ends at least ``FAIL_MARGIN`` (0.15) below it. The ``slow`` test checks every fraction
and attack, with the cells docs/security.md reports as not holding; CI checks two cells
(median at 20 % scaled, Krum at 30 % sign flip).
"""

from __future__ import annotations

import functools

import byzantine_gossip as BG
import numpy as np
import pytest

from fedagent.config import GossipSettings
from fedagent.errors import ConfigError
from fedagent.protocols.gossip import (
    AckReceived,
    Finished,
    GossipConfig,
    GossipMachine,
    ModelReceived,
    PeerDown,
    PeerUp,
    SendAck,
    SendModel,
    Start,
    Train,
    TrainingDone,
    neighbours_needed,
    screen,
)

BUDGET = 0.10
FAIL_MARGIN = 0.15


def vec(*v: float) -> dict[str, np.ndarray]:
    return {"w": np.asarray(v, np.float32), "step": np.asarray([7], np.int64)}


# ---- the rule ------------------------------------------------------------------------
def test_median_and_trimmed_mean_ignore_f_outliers_per_coordinate():
    own = vec(1.0, 10.0)
    honest = [vec(2.0, 11.0), vec(3.0, 12.0), vec(4.0, 13.0), vec(5.0, 14.0)]
    evil = [vec(1e6, -1e6), vec(-1e6, 1e6)]
    med = screen("median", own, honest + evil, 2)
    assert med["w"].tolist() == [3.0, 12.0] and med["w"].dtype == np.float32
    tm = screen("trimmed_mean", own, honest + evil, 2)
    assert tm["w"].tolist() == [3.0, 12.0]  # the 2 largest and 2 smallest dropped
    assert "step" not in med  # integers stay the node's own


def test_krum_selects_the_clustered_models():
    own = vec(0.0, 0.0)
    honest = [vec(0.1, 0.0), vec(0.0, 0.1), vec(-0.1, 0.0), vec(0.0, -0.1)]
    evil = [vec(50.0, 50.0)]
    out = screen("krum", own, honest + evil, 1)
    # multi-Krum averages the n − f = 5 best: every honest model, not the outlier.
    np.testing.assert_allclose(out["w"], [0.0, 0.0], atol=1e-6)


def test_screen_refuses_to_run_outside_its_precondition():
    with pytest.raises(ValueError, match="cannot tolerate"):
        screen("median", vec(0, 0), [vec(1, 1)], 1)
    with pytest.raises(ValueError, match="cannot tolerate"):
        screen("krum", vec(0, 0), [vec(1, 1)] * 3, 1)  # n = 4 is not > 2f + 2
    assert [neighbours_needed(a, 2) for a in ("median", "trimmed_mean", "krum")] == [4, 4, 6]
    assert neighbours_needed("median", 0) == 1


# ---- configuration -------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(byzantine=1), "needs a screening aggregation"),
        (dict(aggregation="krum", create="um"), "replaces the merge"),
        (dict(aggregation="median", merge="thesis"), "replaces the merge"),
        (dict(aggregation="mode"), "aggregation must be one of"),
        (dict(aggregation="median", fanout=0), "fanout"),
    ],
)
def test_machine_config_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        GossipConfig(**kw)


@pytest.mark.parametrize(
    "aggregation, f, min_peers, need",
    [("krum", 1, 3, 4), ("krum", 2, 5, 6), ("median", 2, 3, 4), ("trimmed_mean", 1, 1, 2)],
)
def test_settings_refuse_too_few_peers_for_the_rule_at_start(aggregation, f, min_peers, need):
    with pytest.raises(ConfigError, match=f"raise min_peers to {need}"):
        GossipSettings(aggregation=aggregation, byzantine=f, min_peers=min_peers).machine_config(None)
    # Enough peers: accepted.
    assert GossipSettings(aggregation=aggregation, byzantine=f, min_peers=need).machine_config(None).robust


# ---- the machine in screening mode ----------------------------------------------------
def machine(peers: int, **kw) -> GossipMachine:
    m = GossipMachine("me", GossipConfig(period_steps=1, aggregation="median", byzantine=1, **kw), vec(0.0, 0.0))
    for i in range(peers):
        m.handle(PeerUp(f"p{i}"), 0.0)
    return m


def run_period(m: GossipMachine, now: float):
    """Finish the pending training unchanged and return the boundary's commands."""
    cmds = m.handle(TrainingDone(m._train_id, {k: v.copy() for k, v in m.model.items()}), now)
    return cmds


def test_one_slot_per_neighbour_and_screening_only_with_enough_of_them():
    m = machine(4, fanout=2)
    m.handle(Start(), 0.0)
    # p0 floods: five models, one slot.
    for i in range(5):
        cmds = m.handle(ModelReceived("p0", f"x{i}", vec(100.0 + i, 100.0), mass=1e9), 0.1)
        assert cmds == [SendAck("p0", f"x{i}", True)]
    cmds = run_period(m, 1.0)
    # One neighbour < 2f = 2: no screening, the node trains on its own model.
    assert m.counts["screen_short"] == 1 and m.counts["screened"] == 0
    assert m.model["w"].tolist() == [0.0, 0.0]
    sends = [c for c in cmds if isinstance(c, SendModel)]
    assert len(sends) == 2 and len({c.peer for c in sends}) == 2  # fanout
    m.handle(ModelReceived("p1", "y", vec(1.0, 2.0)), 1.1)
    run_period(m, 2.0)
    # {own (0,0), p0 (104,100), p1 (1,2)}: the median of each coordinate.
    assert m.counts["screened"] == 1 and m.model["w"].tolist() == [1.0, 2.0]
    assert m.mass == 1.0  # masses play no part


def test_stale_and_departed_neighbours_are_forgotten():
    m = machine(3, neighbour_ttl=2)
    m.handle(Start(), 0.0)
    m.handle(ModelReceived("p0", "a", vec(5.0, 5.0)), 0.1)
    m.handle(ModelReceived("p1", "b", vec(6.0, 6.0)), 0.1)
    m.handle(PeerDown("p1"), 0.2)
    run_period(m, 1.0)
    assert m.counts["screened"] == 0  # p1 left: one neighbour only
    m.handle(ModelReceived("p2", "c", vec(7.0, 7.0)), 1.1)
    for t in (2.0, 3.0, 4.0, 5.0):
        run_period(m, t)
    screened = m.counts["screened"]
    assert screened >= 1
    run_period(m, 6.0)  # p0 and p2 older than the ttl now
    assert m.counts["screened"] == screened and m.counts["screen_short"] >= 2


def test_returned_models_are_refused_and_acks_carry_no_mass():
    m = machine(2)
    m.handle(Start(), 0.0)
    cmds = m.handle(ModelReceived("p0", "r", vec(1.0, 1.0), returned=True), 0.1)
    assert cmds[-1] == SendAck("p0", "r", False, "returned")
    cmds = run_period(m, 1.0)
    (send,) = [c for c in cmds if isinstance(c, SendModel)]
    assert m.handle(AckReceived(send.peer, send.exchange_id, False, "x"), 1.2) == []
    assert m.mass == 1.0


def test_last_period_screens_without_training_and_finishes():
    m = machine(2, periods=2)
    m.handle(Start(), 0.0)
    run_period(m, 1.0)
    m.handle(ModelReceived("p0", "a", vec(2.0, 2.0)), 1.1)
    m.handle(ModelReceived("p1", "b", vec(4.0, 4.0)), 1.1)
    cmds = run_period(m, 2.0)
    (fin,) = [c for c in cmds if isinstance(c, Finished)]
    assert fin.weights["w"].tolist() == [2.0, 2.0] and not [c for c in cmds if isinstance(c, (Train, SendModel))]


# ---- Byzantine peers, real training ---------------------------------------------------
@functools.cache
def clean() -> float:
    return BG.run("mean", None, 0).mean_accuracy


@pytest.mark.parametrize("fraction, attack, rule", [(0.2, "scaled", "median"), (0.3, "sign_flip", "krum")])
def test_plain_gossip_fails_and_screening_holds(fraction, attack, rule):
    """CI part, two cells (five runs of ~2 s CPU); the slow test runs the whole table,
    10 % included, and trimmed mean."""
    k = round(fraction * BG.N_AGENTS)
    base = clean()
    assert base > 0.75, f"clean gossip itself only reached {base:.3f}"
    plain = BG.run("mean", attack, k)
    robust = BG.run(rule, attack, k)
    assert plain.mean_accuracy < base - FAIL_MARGIN, (plain, base)
    assert robust.mean_accuracy >= base - BUDGET, (robust, base)
    assert robust.screened > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)  # every cell in process: past the default 300 s on a loaded 2-core machine
def test_whole_gossip_byzantine_table():
    base = clean()
    weak = set(WEAK)
    for k in (1, 2, 3):
        for attack in BG.ATTACKS:
            for rule in BG.RULES:
                acc = BG.run(rule, attack, k).mean_accuracy
                if rule == "mean":
                    assert acc < base - FAIL_MARGIN, (rule, attack, k, acc)
                elif (rule, attack, k) not in weak:
                    assert acc >= base - BUDGET, (rule, attack, k, acc)


# Cells the docs/security.md table reports as not holding: the x10 sign flip of 2-3 colluding
# peers moves every coordinate the same way, which shifts the median and the trimmed
# mean on non-IID models (as in coordinated mode, where it takes 3); clipping bounds
# each attacker's pull per merge, it does not remove it. trimmed_mean at 10 % sits on
# the budget's edge (0.735 against 0.736).
WEAK: tuple[tuple[str, str, int], ...] = (
    ("median", "sign_flip", 2),
    ("median", "sign_flip", 3),
    ("trimmed_mean", "sign_flip", 1),
    ("trimmed_mean", "sign_flip", 2),
    ("trimmed_mean", "sign_flip", 3),
    ("clip", "sign_flip", 2),
    ("clip", "sign_flip", 3),
)
