"""The FedAvg round machine and the participant machine, driven in memory."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.protocols.messages import RoundStart, TrainConfig
from fedagent.protocols.participant import Discarded, Participant, SendUpdate, Train, TrainingDone
from fedagent.protocols.rounds import (
    AgentOffline,
    AgentOnline,
    Finished,
    LateUpdate,
    Rejected,
    RequestWakeup,
    RoundAbandoned,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
    Wakeup,
)

W0 = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


def const(v: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(a, v) for k, a in W0.items()}


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def started(machine: RoundMachine, agents, now=0.0) -> StartRound:
    cmds = []
    for a in agents:
        cmds += machine.handle(AgentOnline(a, 10), now)
    (start,) = of(cmds, StartRound)
    return start


def test_round_waits_for_quorum_then_grace():
    m = RoundMachine(RoundConfig(rounds=2, min_agents=2, start_grace=5.0), W0)
    assert m.handle(AgentOnline("a", 10), 0.0) == []
    cmds = m.handle(AgentOnline("b", 10), 1.0)
    assert cmds == [RequestWakeup(6.0)]
    assert of(m.handle(Wakeup(), 3.0), StartRound) == []
    (start,) = of(m.handle(Wakeup(), 6.0), StartRound)
    assert start.selected == ("a", "b") and start.round == 1 and start.model_version == 0


def test_expected_agents_start_without_waiting():
    m = RoundMachine(RoundConfig(min_agents=2, expected_agents=3, start_grace=60), W0)
    start = started(m, ["a", "b", "c"])
    assert start.selected == ("a", "b", "c")


def test_weighted_mean_and_final():
    m = RoundMachine(RoundConfig(rounds=1, min_agents=2, expected_agents=2), W0)
    started(m, ["a", "b"])
    assert m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {"loss": 1.0}), 1.0) == []
    cmds = m.handle(UpdateReceived("b", 1, 0, 30, const(3.0), {"loss": 3.0}), 2.0)
    (agg,) = of(cmds, RoundAggregated)
    np.testing.assert_allclose(agg.weights["w"], 2.5)
    assert agg.weights["w"].dtype == np.float32
    assert agg.metrics == {"loss": 2.5} and agg.participants == ("a", "b") and agg.final
    assert of(cmds, Finished) and m.phase.value == "done"


@pytest.mark.parametrize(
    "bad, reason",
    [
        (UpdateReceived("a", 2, 0, 10, const(1), {}), "stale"),
        (UpdateReceived("z", 1, 0, 10, const(1), {}), "unselected"),
        (UpdateReceived("a", 1, 7, 10, const(1), {}), "stale"),
        (UpdateReceived("a", 1, 0, 10, {**const(1), "w": np.full((2, 3), np.nan, np.float32)}, {}), "non-finite"),
        (UpdateReceived("a", 1, 0, 10, {**const(1), "w": np.zeros((3, 2), np.float32)}, {}), "shape"),
        (UpdateReceived("a", 1, 0, 10, {**const(1), "w": np.zeros((2, 3), np.float64)}, {}), "dtype"),
        (UpdateReceived("a", 1, 0, 10, {"w": np.zeros((2, 3), np.float32)}, {}), "names"),
    ],
)
def test_bad_updates_are_rejected_and_named(bad, reason):
    m = RoundMachine(RoundConfig(min_agents=2, expected_agents=2), W0)
    started(m, ["a", "b"])
    (rej,) = m.handle(bad, 1.0)
    assert isinstance(rej, Rejected) and rej.reason == reason and rej.sender == bad.sender
    assert m.received == {}


def test_an_aggregate_past_float32s_range_is_abandoned_and_the_model_kept():
    """Finite updates whose weighted sum overflows float32 (found by fuzz_machines.py):
    the round is abandoned rather than publishing an infinite global model."""
    m = RoundMachine(RoundConfig(rounds=2, min_agents=2, expected_agents=2), W0)
    started(m, ["a", "b"])
    huge = {**const(1.0), "w": np.full((2, 3), 3.4e38, np.float32)}
    assert m.handle(UpdateReceived("a", 1, 0, 949, huge, {}), 1.0) == []
    cmds = m.handle(UpdateReceived("b", 1, 0, 949, huge, {}), 2.0)
    (abandoned,) = of(cmds, RoundAbandoned)
    assert not of(cmds, RoundAggregated)
    assert "not finite in w" in abandoned.reason and "a, b" in abandoned.reason
    assert m.model_version == 0 and all(np.array_equal(m.weights[k], W0[k]) for k in W0)
    (start,) = of(cmds, StartRound)  # the agents are still online: the next round starts
    assert start.round == 2 and start.model_version == 0


def test_duplicate_update_applied_once():
    m = RoundMachine(RoundConfig(rounds=1, min_agents=2, expected_agents=2), W0)
    started(m, ["a", "b"])
    m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {}), 1.0)
    (rej,) = m.handle(UpdateReceived("a", 1, 0, 10, const(100.0), {}), 1.5)
    assert rej.reason == "duplicate"
    (agg,) = of(m.handle(UpdateReceived("b", 1, 0, 10, const(3.0), {}), 2.0), RoundAggregated)
    np.testing.assert_allclose(agg.weights["b"], 2.0)


def test_agent_leaving_mid_round_does_not_stall():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=3), W0)
    started(m, ["a", "b", "c"])
    m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {}), 1.0)
    m.handle(UpdateReceived("b", 1, 0, 10, const(3.0), {}), 1.0)
    cmds = m.handle(AgentOffline("c"), 2.0)
    (agg,) = of(cmds, RoundAggregated)
    np.testing.assert_allclose(agg.weights["w"], 2.0)
    # Two agents are still a quorum: the next round starts at once, without c.
    (nxt,) = of(cmds, StartRound)
    assert nxt.round == 2 and nxt.selected == ("a", "b") and nxt.model_version == 1


def test_deadline_without_enough_updates_abandons_and_renumbers():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=2, min_updates=2, round_timeout=10), W0)
    started(m, ["a", "b"])
    m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {}), 1.0)
    assert of(m.handle(Wakeup(), 5.0), RoundAbandoned) == []
    cmds = m.handle(Wakeup(), 10.0)
    (ab,) = of(cmds, RoundAbandoned)
    assert ab.round == 1 and "1 of 2" in ab.reason
    (nxt,) = of(cmds, StartRound)
    assert nxt.round == 2 and nxt.model_version == 0
    # The late update of the abandoned round is discarded (never aggregated), and not
    # counted as a refusal: its agent did nothing wrong.
    (late,) = m.handle(UpdateReceived("b", 1, 0, 10, const(9.0), {}), 11.0)
    assert isinstance(late, LateUpdate) and late.sender == "b"


def test_deadline_with_quorum_aggregates_what_came():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=2, round_timeout=10), W0)
    started(m, ["a", "b"])
    m.handle(UpdateReceived("a", 1, 0, 10, const(4.0), {}), 1.0)
    (agg,) = of(m.handle(Wakeup(), 10.0), RoundAggregated)
    assert agg.participants == ("a",)
    np.testing.assert_allclose(agg.weights["w"], 4.0)


def test_resume_from_checkpoint_continues_numbering():
    m = RoundMachine(
        RoundConfig(rounds=5, min_agents=1, expected_agents=1),
        const(2.0),
        model_version=3,
        completed_rounds=3,
        last_round=4,
    )
    start = started(m, ["a"])
    assert start.round == 5 and start.model_version == 3


def test_sampling_selects_agents_per_round():
    m = RoundMachine(RoundConfig(min_agents=4, expected_agents=4, agents_per_round=2, seed=1), W0)
    start = started(m, ["a", "b", "c", "d"])
    assert len(start.selected) == 2 and set(start.selected) <= {"a", "b", "c", "d"}


def test_invalid_round_configs_are_refused():
    with pytest.raises(ValueError):
        RoundConfig(min_agents=2, min_updates=3)
    with pytest.raises(ValueError):
        RoundConfig(min_agents=3, agents_per_round=1, min_updates=2)


def rs(round_: int, selected=("a",), version=0) -> RoundStart:
    return RoundStart(round_, version, tuple(selected), 60.0, TrainConfig(), const(0.0))


def test_participant_trains_once_per_round_and_discards_stale_work():
    p = Participant("a")
    (train,) = p.handle(rs(1))
    assert isinstance(train, Train) and train.round == 1
    assert p.handle(rs(1)) == []  # QoS 1 redelivery
    assert p.handle(rs(2, selected=("b",))) == []  # a newer round started, not for us
    (disc,) = p.handle(TrainingDone(1, 0, 10, {}, const(1.0)))
    assert isinstance(disc, Discarded)
    (train3,) = p.handle(rs(3))
    (send,) = p.handle(TrainingDone(3, 0, 10, {"loss": 0.5}, const(1.0)))
    assert isinstance(send, SendUpdate) and send.update.round == 3 and train3.round == 3
    assert p.handle(rs(2)) == []  # old round start arriving late


def test_in_memory_federation_converges_to_weighted_optimum():
    """Ten agents each pull the model toward their own target; FedAvg must land on the
    sample-weighted mean of the targets, the optimum of the summed local losses."""
    rng = np.random.default_rng(0)
    agents = [f"agent-{i}" for i in range(10)]
    targets = {a: rng.normal(size=(2, 3)).astype(np.float32) for a in agents}
    sizes = {a: int(rng.integers(10, 100)) for a in agents}
    coord = RoundMachine(RoundConfig(rounds=60, min_agents=10, expected_agents=10), W0)
    parts = {a: Participant(a) for a in agents}
    pending = []
    for a in agents:
        pending += coord.handle(AgentOnline(a, sizes[a]), 0.0)
    now, final = 0.0, None
    while pending:
        cmd = pending.pop(0)
        now += 0.01
        if isinstance(cmd, StartRound):
            msg = RoundStart(cmd.round, cmd.model_version, cmd.selected, cmd.deadline_s, cmd.train, cmd.weights)
            for a in agents:
                for c in parts[a].handle(msg):
                    w = {k: v.copy() for k, v in c.weights.items()}
                    w["w"] += 0.5 * (targets[a] - w["w"])  # one local "epoch"
                    (send,) = parts[a].handle(TrainingDone(c.round, c.base_version, sizes[a], {}, w))
                    u = send.update
                    pending += coord.handle(
                        UpdateReceived(a, u.round, u.base_version, u.num_samples, u.weights, u.metrics), now
                    )
        elif isinstance(cmd, Finished):
            final = cmd
    assert final is not None and final.model_version == 60
    optimum = sum(targets[a] * sizes[a] for a in agents) / sum(sizes.values())
    np.testing.assert_allclose(final.weights["w"], optimum, atol=1e-4)
