"""Who a round selects, on the wire: a round that selects every agent online says so
with a count, a sampled or secure round names its agents, a result counts its
participants; the sizes do not grow with the federation. And the agent that comes
online just after such a round started."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols.codec import Envelope, Limits, encode
from fedagent.protocols.messages import RoundResult, RoundStart, TrainConfig, body_of
from fedagent.protocols.participant import Participant, Train
from fedagent.protocols.rounds import (
    AgentOnline,
    LateUpdate,
    Rejected,
    RoundAggregated,
    RoundConfig,
    RoundMachine,
    StartRound,
    UpdateReceived,
)

W0 = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


def const(v: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(a, v) for k, a in W0.items()}


def names(n: int) -> list[str]:
    return [f"agent-{i:05d}" for i in range(n)]


def start_of(n: int, **cfg) -> tuple[RoundMachine, StartRound]:
    """A machine with ``n`` agents online and the round it started."""
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=n, **cfg), W0)
    out = []
    for a in names(n):
        out += m.handle(AgentOnline(a, 10), 0.0)
    (start,) = [c for c in out if isinstance(c, StartRound)]
    return m, start


def wire_size(msg) -> int:
    env = Envelope(kind=msg.kind, federation="fed", sender="coordinator", round=1, seq=17, ts=1.5, body=msg.to_body())
    return len(encode(env))


def result_of(agg: RoundAggregated) -> RoundResult:
    return RoundResult(agg.round, agg.model_version, len(agg.participants), agg.metrics)


@pytest.mark.parametrize("n", [10, 10_000])
def test_a_round_of_every_agent_online_names_none_of_them(n):
    m, start = start_of(n)
    assert start.everyone and len(start.selected) == n  # the machine (and its journal) keep the names
    msg = start.message()
    assert msg.everyone and msg.selected == () and msg.agents == n and msg.count == n
    assert msg.selects("agent-00003") and msg.selects("someone-else")


def test_round_start_and_result_sizes_do_not_grow_with_the_federation():
    sizes = {}
    for n in (10, 10_000):
        m, start = start_of(n)
        out = []
        for a in names(n):
            out += m.handle(UpdateReceived(a, 1, 0, 10, const(1.0), {"loss": 1.0}), 1.0)
        (agg,) = [c for c in out if isinstance(c, RoundAggregated)]
        assert len(agg.participants) == n
        sizes[n] = (wire_size(start.message()), wire_size(result_of(agg)))
    (s10, r10), (s10k, r10k) = sizes[10], sizes[10_000]
    # the counts 10 and 10,000 take 1 and 3 bytes in msgpack
    assert abs(s10k - s10) <= 4 and abs(r10k - r10) <= 4, sizes


def test_a_sampled_round_names_its_k_agents_whatever_the_federation():
    sizes = {}
    for n, k in ((100, 10), (10_000, 10), (10_000, 100)):
        _m, start = start_of(n, agents_per_round=k)
        msg = start.message()
        assert not msg.everyone and len(msg.selected) == k and msg.count == k
        sizes[n, k] = wire_size(msg)
    assert sizes[100, 10] == sizes[10_000, 10]  # ids of the same length: the same bytes
    assert sizes[10_000, 100] - sizes[10_000, 10] >= 90 * len("agent-00000")


def test_a_resumed_round_names_its_selection():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2), W0, last_round=4)
    out = m.resume(4, ("a", "b"), 0.0)
    (start,) = [c for c in out if isinstance(c, StartRound)]
    assert not start.everyone and start.message().selected == ("a", "b")


def test_a_round_that_leaves_a_benched_agent_out_names_the_others():
    m, start = start_of(3)
    m.bench.offend("agent-00000", 1)  # sits out round 2
    out = []
    for a in names(3):
        out += m.handle(UpdateReceived(a, 1, 0, 10, const(1.0), {}), 1.0)
    (nxt,) = [c for c in out if isinstance(c, StartRound)]
    assert nxt.round == 2 and nxt.selected == ("agent-00001", "agent-00002")
    assert not nxt.everyone and nxt.message().selected == nxt.selected


def test_an_agent_online_after_an_everyone_round_started_is_discarded_not_refused():
    m, start = start_of(2)
    assert start.everyone
    # The late agent reads the round start as its own (it names no one) and trains.
    late = Participant("late-agent")
    (train,) = late.handle(start.message())
    assert isinstance(train, Train) and train.round == 1
    m.handle(AgentOnline("late-agent", 10), 0.5)
    assert m.expects("late-agent") and not m.expects("stranger")
    (cmd,) = m.handle(UpdateReceived("late-agent", 1, 0, 10, const(5.0), {}), 1.0)
    assert isinstance(cmd, LateUpdate) and "came online after round 1 started" in cmd.detail
    # Not counted, not waited for, not in the aggregate; it is selected from the next round.
    out = []
    for a in names(2):
        out += m.handle(UpdateReceived(a, 1, 0, 10, const(1.0), {}), 2.0)
    (agg,) = [c for c in out if isinstance(c, RoundAggregated)]
    assert agg.participants == tuple(names(2))
    np.testing.assert_allclose(agg.weights["w"], 1.0)
    (nxt,) = [c for c in out if isinstance(c, StartRound)]
    assert nxt.everyone and "late-agent" in nxt.selected


def test_an_unselected_agent_of_a_sampled_round_is_still_refused():
    m, start = start_of(5, agents_per_round=2)
    outside = next(a for a in names(5) if a not in start.selected)
    assert not m.expects(outside)
    (cmd,) = m.handle(UpdateReceived(outside, 1, 0, 10, const(1.0), {}), 1.0)
    assert isinstance(cmd, Rejected) and cmd.reason == "unselected"


def test_an_agent_that_is_not_online_is_refused_in_an_everyone_round():
    m, _start = start_of(2)
    (cmd,) = m.handle(UpdateReceived("stranger", 1, 0, 10, const(1.0), {}), 1.0)
    assert isinstance(cmd, Rejected) and cmd.reason == "unselected"


def decoded(body) -> RoundStart | RoundResult:
    return body_of(body.pop("_kind"), body, Limits())


def test_round_start_bodies_are_checked():
    msg = RoundStart(1, 0, (), 5.0, TrainConfig(), {}, everyone=True, agents=3)
    body = msg.to_body()
    assert "selected" not in body and body["everyone"] is True and body["agents"] == 3
    assert decoded({"_kind": "round_start", **body}) == msg
    for bad, match in [
        ({**body, "selected": ["a"]}, "no ids"),
        ({**body, "agents": 0}, "count of agents"),
        ({k: v for k, v in body.items() if k != "everyone"}, "missing field 'selected'"),
        (
            {**{k: v for k, v in body.items() if k not in ("everyone", "agents")}, "selected": ["a"], "agents": 2},
            "only",
        ),
    ]:
        with pytest.raises(CodecError, match=match):
            decoded({"_kind": "round_start", **bad})


def test_a_result_of_an_earlier_release_is_read_as_a_count():
    old = {"round": 3, "model_version": 4, "participants": ["a", "b"], "metrics": {}, "aggregated": True}
    assert decoded({"_kind": "round_result", **old}) == RoundResult(3, 4, 2, {})
    with pytest.raises(CodecError, match="participants"):
        decoded({"_kind": "round_result", **old, "participants": ["A/B"]})
