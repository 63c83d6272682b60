"""The chaos soak's fault schedule (bench/chaos_base.py), without starting anything: every
fault's hold ends before the fault-free tail of the run, whatever the mode, and a seed
still draws the same kinds, targets and lengths."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest

from bench.chaos_base import HOLDS, KINDS, Fault, draw, fit, scheduled

# The slow soaks' settings (bench/tests/test_chaos.py FULL_SIZE).
WARMUP, QUIET, GAP, HOLD_SCALE, RESTART = 5.0, 20.0, (2.0, 4.0), 0.4, 2.0
MODES = {
    # mode: (daemons, partition targets, brokers)
    "fedavg": (["coordinator", "agent-1", "agent-2", "agent-3", "agent-4"], None, ["broker"]),
    "gossip": (["agent-1", "agent-2", "agent-3", "agent-4"], None, ["broker"]),
    "tiered": (["coordinator", "site-1", "site-2", "agent-1", "agent-2"], ["site-1", "site-2"], ["broker-hub"]),
}


def fake_site(mode: str) -> SimpleNamespace:
    names, cut, brokers = MODES[mode]
    args = argparse.Namespace(hold_scale=HOLD_SCALE, restart_sec=RESTART)
    setup = SimpleNamespace(partition_targets=lambda n: cut or n)
    return SimpleNamespace(
        names=names,
        args=args,
        setup=setup,
        brokers=lambda: dict.fromkeys(brokers),
        disk_node=names[-1],
        clock_node=names[0],
    )


def run_schedule(mode: str, seed: int, minutes: float) -> tuple[list[Fault], float]:
    """The faults of a run whose every fault recovers in 1-8 s, as the soak's loop injects them."""
    rng = random.Random(seed)
    site = fake_site(mode)
    cycle: list[str] = []
    faults_until = minutes * 60 - QUIET
    now, out = WARMUP, []
    while now < faults_until:
        f = scheduled(rng, list(KINDS), site, cycle, now, faults_until)
        if f is None:
            break
        out.append(f)
        now = f.at + f.hold + rng.uniform(1, 8) + rng.uniform(*GAP)
    return out, faults_until


@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_fault_is_held_into_the_quiet_tail(mode):
    """Under the old rule (any fault drawn before the tail, held as drawn) a partition drawn
    a second before the tail went on 9 s into it; a kill restarted its daemon there."""
    cut = 0
    for seed in range(60):
        faults, faults_until = run_schedule(mode, seed, minutes=3)
        assert faults
        for f in faults:
            assert f.at + f.hold <= faults_until + 1e-9, (seed, f)
            if f.kind != "kill":
                assert f.hold >= HOLDS[f.kind][0] * HOLD_SCALE - 1e-9, (seed, f)
            cut += "drawn_hold" in f.detail
    assert cut  # some holds were cut to fit rather than dropped


def test_a_hold_is_cut_to_the_room_left_or_the_fault_left_out():
    partition = Fault("partition", "agent-1", 150.0, 9.6)
    assert fit(partition, 4.0, HOLD_SCALE)
    assert partition.hold == 4.0 and partition.detail["drawn_hold"] == 9.6
    # Less room than its kind's shortest (5 s x 0.4): not injected.
    assert not fit(Fault("partition", "agent-1", 150.0, 9.6), 1.9, HOLD_SCALE)
    # A kill's hold is the restart delay: it fits whole or not at all.
    assert fit(Fault("kill", "agent-2", 150.0, RESTART), RESTART, HOLD_SCALE)
    assert not fit(Fault("kill", "agent-2", 150.0, RESTART), RESTART - 0.01, HOLD_SCALE)
    short = Fault("stop", "agent-3", 150.0, 1.0)
    assert fit(short, 30.0, HOLD_SCALE) and short.hold == 1.0 and not short.detail


def test_a_seed_draws_the_same_faults_as_before_the_fit():
    """The fit takes nothing from the random stream: the faults drawn at a seed are those
    the schedule drew without it (the runs' reports name their seeds)."""
    site = fake_site("gossip")
    rng, cycle = random.Random(7), []
    first = [(f.kind, f.target, f.hold) for f in (draw(rng, list(KINDS), site, cycle) for _ in range(8))]
    assert first == [  # what seed 7 drew before the schedule had a fit
        ("disk", "agent-4", 7.46),
        ("kill", "agent-1", 2.0),
        ("clock", "agent-1", 7.86),
        ("stop", "agent-1", 6.98),
        ("broker", "broker", 1.54),
        ("partition", "agent-4", 6.38),
        ("kill", "agent-3", 2.0),
        ("clock", "agent-1", 6.18),
    ]
    for seed in (1, 7, 11):
        plain_rng, fitted_rng = random.Random(seed), random.Random(seed)
        plain_cycle: list[str] = []
        fitted_cycle: list[str] = []
        for i in range(20):
            plain = draw(plain_rng, list(KINDS), site, plain_cycle)
            fitted = scheduled(fitted_rng, list(KINDS), site, fitted_cycle, 100.0 + i, 100.0 + i + 3.0)
            if fitted is not None:
                assert (fitted.kind, fitted.target) == (plain.kind, plain.target)
                assert fitted.detail.get("drawn_hold", fitted.hold) == plain.hold
