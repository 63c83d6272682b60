"""One member against the round machine: the weight cap, the adaptive norm bound with
its replays, updates that fail after parts were folded, stalled streams at the deadline,
repeat offenders, late updates to abandoned rounds and the whole-model cap. Pure code:
the caller's journal is a list of parts in memory."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedagent.protocols.codec import Envelope
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.rounds import (
    AgentOnline,
    LateUpdate,
    NormBound,
    Refold,
    Refolded,
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
from fedagent.protocols.rounds.bounds import Bench, Influence, lower_median
from fedagent.protocols.streaming import (
    HEAD_KIND,
    StreamIntake,
    UpdateEnd,
    UpdatePart,
    encode_stream,
    head_body,
    iter_stream_chunks,
)

FED = "lab"
W = {"w": np.zeros((20, 15), np.float32), "b": np.zeros(7, np.float32), "n": np.array(0, np.int64)}


def const(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full((20, 15), v, np.float32), "b": np.full(7, v, np.float32), "n": np.array(0, np.int64)}


def norm_of(weights, ref) -> float:
    return float(np.sqrt(sum(np.square(weights[k].astype(np.float64) - ref[k]).sum() for k in ("w", "b"))))


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def stream(sender, weights, *, tid="t1", round_=1, base_version=0, n=10, base=None, chunk=97):
    """The events of a raw (uncompressed) stream of ``weights``."""
    comp = Compressor(CompressionConfig("none", 1.0))
    tensors = comp.encode(weights, base if base is not None else W)
    head = Envelope(
        kind=HEAD_KIND,
        federation=FED,
        sender=sender,
        round=round_,
        seq=1,
        ts=time.time(),
        body=head_body(round_, base_version, n, {"loss": 1.0}, False, tensors),
    )
    it = StreamIntake(FED, max_transfer_bytes=2**24, max_pending_bytes=2**20, timeout=30.0)
    out = []
    for body in iter_stream_chunks(encode_stream(head, tensors), max_chunk=chunk, transfer_id=tid):
        out += it.feed(sender, body, 0.0)
    return out


class Journal:
    """The caller's side of a replay: every part kept (as the coordinator's round journal
    keeps every frame), fed back on a Refold."""

    def __init__(self, machine: RoundMachine) -> None:
        self.m = machine
        self.parts: dict[tuple[str, str], list[UpdatePart]] = {}
        self.whole: dict[str, dict[str, np.ndarray]] = {}
        self.refolds: list[Refold] = []
        self.lose: set[str] = set()  # senders whose frames "are not in the journal"

    def handle(self, ev, now: float) -> list:
        if isinstance(ev, UpdatePart):
            self.parts.setdefault((ev.sender, ev.tid), []).append(ev)
        if isinstance(ev, UpdateReceived):
            self.whole[ev.sender] = ev.weights
        return self.serve(self.m.handle(ev, now), now)

    def serve(self, cmds: list, now: float) -> list:
        out = []
        for c in cmds:
            out.append(c)
            if isinstance(c, Refold):
                self.refolds.append(c)
                incomplete = set()
                for sender, tid in c.updates:
                    if sender in self.lose:
                        if sender in c.counted:
                            incomplete.add(sender)
                        continue
                    if tid is None:
                        for name, arr in self.whole[sender].items():
                            self.m.refold(sender, UpdatePart(sender, "", name, 0, np.asarray(arr).reshape(-1)))
                    else:
                        for p in self.parts.get((sender, tid), []):
                            self.m.refold(sender, p)
                out += self.serve(self.m.handle(Refolded(c.round, frozenset(incomplete)), now), now)
        return out

    def feed(self, events, now: float) -> list:
        out = []
        for ev in events:
            out += self.handle(ev, now)
        return out


def bounded_machine(agents, samples=None, *, warmup=3, multiplier=2.0, **cfg):
    cfg.setdefault("min_agents", len(agents))
    cfg.setdefault("server_momentum", 0.0)
    m = RoundMachine(
        RoundConfig(
            rounds=cfg.pop("rounds", 20),
            expected_agents=len(agents),
            norm_bound=NormBound(multiplier=multiplier, window=5, warmup=warmup),
            **cfg,
        ),
        {k: v.copy() for k, v in W.items()},
        replays=True,
    )
    j = Journal(m)
    cmds = []
    for a in agents:
        cmds += j.handle(AgentOnline(a, (samples or {}).get(a, 10)), 0.0)
    assert of(cmds, StartRound)
    return m, j


def test_the_lower_median_cannot_be_raised_by_one_of_two():
    assert lower_median([1.0, 1e9]) == 1.0 and lower_median([3.0, 1.0, 2.0]) == 2.0


def test_weight_is_capped_at_the_announcement_and_at_a_multiple_of_the_median():
    m = RoundMachine(RoundConfig(rounds=2, min_agents=4, expected_agents=4, weight_cap=2.0, server_momentum=0.0), W)
    for a, n in {"a": 100, "b": 100, "c": 100, "m": 10**9}.items():
        m.handle(AgentOnline(a, n), 0.0)
    for a in ("a", "b", "c"):
        m.handle(UpdateReceived(a, 1, 0, 100, const(1.0), {"loss": 1.0}), 1.0)
    # m claims 10^9 samples (and announced as many): it weighs 2 × the median, 200
    cmds = m.handle(UpdateReceived("m", 1, 0, 10**9, const(-100.0), {"loss": 0.0}), 1.0)
    (agg,) = of(cmds, RoundAggregated)
    assert agg.weights_used["m"] == pytest.approx(200 / 500)
    assert agg.bounded == {"m": {"samples": 1e9, "weight": 200.0}}
    np.testing.assert_allclose(agg.weights["w"], (300 * 1.0 + 200 * -100.0) / 500, rtol=1e-5)
    # the training metrics shown are weighted the same way
    assert agg.metrics["loss"] == pytest.approx(300 / 500)
    # an agent that claims more in its update than in its presence gets what it announced
    # (counts frozen at the round's start: a presence sent during it changes nothing)
    m.handle(AgentOnline("a", 10**6), 1.5)
    for a in ("b", "c", "m"):
        m.handle(UpdateReceived(a, 2, 1, 10, const(1.0), {}), 2.0)
    (agg,) = of(m.handle(UpdateReceived("a", 2, 1, 150, const(1.0), {}), 2.0), RoundAggregated)
    assert agg.bounded == {"a": {"samples": 150.0, "weight": 100.0}}


def test_warm_up_holds_every_update_and_folds_them_scaled_to_the_rounds_bound():
    m, j = bounded_machine(["a", "b", "c"], multiplier=2.0)
    cmds = []
    for a, v in (("a", 1.0), ("b", 2.0)):
        cmds += j.feed(stream(a, const(v), tid=f"t{a}"), 1.0)
    assert not of(cmds, Refold) and m.influence.bound is None
    cmds = j.feed(stream("c", const(50.0), tid="tc"), 1.0)
    (refold,) = of(cmds, Refold)
    assert [s for s, _ in refold.updates] == ["a", "b", "c"]
    (agg,) = of(cmds, RoundAggregated)
    # bound = 2 × the median distance (b's); c is scaled down to it, a and b are not
    nb = norm_of(const(2.0), W)
    assert agg.bounded == {"c": {"norm": pytest.approx(norm_of(const(50.0), W)), "bound": pytest.approx(2 * nb)}}
    expect = (1.0 + 2.0 + 50.0 * (2 * nb / norm_of(const(50.0), W))) / 3
    np.testing.assert_allclose(agg.weights["w"], expect, rtol=1e-5)


def test_after_warm_up_honest_updates_fold_as_they_come_and_an_outlier_is_replayed_scaled():
    m, j = bounded_machine(["a", "b", "c"], warmup=3)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    assert m.model_version == 1 and m.influence.bound == pytest.approx(2 * norm_of(const(1.0), W))
    base = {k: v.copy() for k, v in m.weights.items()}
    cmds = []
    for a in ("a", "b"):
        cmds += j.feed(stream(a, const(2.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 2.0)
    assert not of(cmds, Refold)
    cmds = j.feed(stream("c", const(1e6), tid="r2c", round_=2, base_version=1, base=base), 2.0)
    (refold,) = of(cmds, Refold)
    assert refold.updates == (("c", "r2c"),)  # only the outlier is read back
    assert m.influence.bound is not None
    (agg,) = of(cmds, RoundAggregated)
    bound = 2 * norm_of(const(1.0), W)
    far = norm_of(const(1e6), base)
    assert agg.bounded["c"]["bound"] == pytest.approx(bound)
    expect = base["w"][0, 0] + (1.0 + 1.0 + (1e6 - 1.0) * bound / far) / 3
    np.testing.assert_allclose(agg.weights["w"], expect, rtol=1e-4)
    # the outlier's distance enters the window as the bound, not as what it claimed
    assert max(max(r) for r in m.norm_state()) == pytest.approx(bound)


def test_a_digest_mismatch_after_folding_is_taken_out_and_the_round_goes_on():
    m, j = bounded_machine(["a", "b", "c"], warmup=1, min_agents=2)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    base = {k: v.copy() for k, v in m.weights.items()}
    evs = stream("c", const(3.0), tid="bad", round_=2, base_version=1, base=base)
    cmds = j.feed(evs[:-1], 2.0)
    cmds += j.handle(UpdateEnd("c", "bad", False, "sha256 mismatch"), 2.0)
    assert [r.reason for r in of(cmds, Rejected)] == ["transfer"]
    for a in ("a", "b"):
        cmds += j.feed(stream(a, const(2.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 2.0)
    assert not of(cmds, RoundAbandoned)
    (refold,) = of(cmds, Refold)
    assert refold.updates == (("c", "bad"),)
    (agg,) = of(cmds, RoundAggregated)
    assert agg.participants == ("a", "b")
    np.testing.assert_allclose(agg.weights["w"], base["w"][0, 0] + 1.0, rtol=1e-5)
    # c sits out the next round
    (start,) = of(cmds, StartRound)
    assert "c" not in start.selected and start.selected == ("a", "b")


def test_a_stream_still_arriving_at_the_deadline_is_dropped_not_waited_for():
    m, j = bounded_machine(["a", "b", "c"], warmup=1, round_timeout=30.0, min_updates=1, min_agents=2)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    base = {k: v.copy() for k, v in m.weights.items()}
    evs = stream("c", const(2.0), tid="slow", round_=2, base_version=1, base=base, chunk=16)
    cmds = []
    for a in ("a", "b"):
        cmds += j.feed(stream(a, const(3.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 2.0)
    # c keeps sending, a part a second: the round waits for it, up to its deadline
    assert len(evs) > 40
    for k in range(29):
        cmds += j.handle(evs[k], 2.0 + k)
    assert not of(cmds, RoundAggregated)
    cmds = j.handle(Wakeup(), 1.0 + 30.0)
    assert [(r.sender, r.reason) for r in of(cmds, Rejected)] == [("c", "deadline")]
    (agg,) = of(cmds, RoundAggregated)
    assert agg.participants == ("a", "b")
    np.testing.assert_allclose(agg.weights["w"], base["w"][0, 0] + 2.0, rtol=1e-5)
    # the rest of the stream, arriving late, is ignored
    assert not of(j.feed(evs[29:], 40.0), RoundAggregated)


def test_a_stream_without_progress_once_the_others_are_in_is_dropped_before_the_deadline():
    m, j = bounded_machine(["a", "b", "c"], warmup=1, round_timeout=30.0, min_updates=1, min_agents=2)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    base = {k: v.copy() for k, v in m.weights.items()}
    evs = stream("c", const(2.0), tid="stall", round_=2, base_version=1, base=base)
    j.feed(evs[:3], 2.0)
    cmds = []
    for a in ("a", "b"):
        cmds += j.feed(stream(a, const(3.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 4.0)
    # the others took 3 s (the round opened at 1.0): c gets 3 s more without progress
    (wake,) = of(cmds, RequestWakeup)
    assert wake.at == pytest.approx(7.0) and not of(cmds, RoundAggregated)
    assert not of(j.handle(Wakeup(), 6.0), RoundAggregated)
    cmds = j.handle(Wakeup(), 7.0)
    assert [(r.sender, r.reason) for r in of(cmds, Rejected)] == [("c", "stalled")]
    (agg,) = of(cmds, RoundAggregated)
    assert agg.participants == ("a", "b")
    np.testing.assert_allclose(agg.weights["w"], base["w"][0, 0] + 2.0, rtol=1e-5)
    # what it folded was taken out, and it sits out the next round
    assert "c" not in of(cmds, StartRound)[0].selected


def test_a_stream_that_starts_after_the_others_are_in_and_stalls_is_dropped_before_the_deadline():
    m, j = bounded_machine(["a", "b", "c"], warmup=1, round_timeout=30.0, min_updates=1, min_agents=2)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    base = {k: v.copy() for k, v in m.weights.items()}
    for a in ("a", "b"):
        assert not of(
            j.feed(stream(a, const(3.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 2.0), RoundAggregated
        )
    # c's header and first parts come once the others are in, then nothing more
    cmds = j.feed(stream("c", const(2.0), tid="stall", round_=2, base_version=1, base=base)[:3], 4.0)
    (wake,) = of(cmds, RequestWakeup)
    assert wake.at < 30.0 and not of(cmds, RoundAggregated)
    cmds = j.handle(Wakeup(), wake.at)
    assert [(r.sender, r.reason) for r in of(cmds, Rejected)] == [("c", "stalled")]
    (agg,) = of(cmds, RoundAggregated)
    assert agg.participants == ("a", "b")


def test_a_held_update_the_journal_lacks_is_refused_and_a_prefix_it_lacks_spoils_the_round():
    m, j = bounded_machine(["a", "b", "c"])
    j.lose = {"c"}
    cmds = []
    for a in ("a", "b", "c"):
        cmds += j.feed(stream(a, const(1.0), tid=f"t{a}"), 1.0)
    assert [(r.sender, r.reason) for r in of(cmds, Rejected)] == [("c", "journal")]
    (agg,) = of(cmds, RoundAggregated)
    assert agg.participants == ("a", "b")

    m, j = bounded_machine(["a", "b", "c"], warmup=1)
    for a in ("a", "b", "c"):
        j.feed(stream(a, const(1.0), tid=f"r1{a}"), 1.0)
    base = {k: v.copy() for k, v in m.weights.items()}
    evs = stream("c", const(1.5), tid="x", round_=2, base_version=1, base=base)
    j.lose = {"c"}
    cmds = j.feed(evs[:-1], 2.0) + j.handle(UpdateEnd("c", "x", False, "sha256 mismatch"), 2.0)
    for a in ("a", "b"):
        cmds += j.feed(stream(a, const(2.0), tid=f"r2{a}", round_=2, base_version=1, base=base), 2.0)
    (ab,) = of(cmds, RoundAbandoned)
    assert "could not be read back" in ab.reason and m.model_version == 1


def test_whole_updates_are_bounded_too():
    m, j = bounded_machine(["a", "b", "c"], warmup=1)
    cmds = []
    for a, v in (("a", 1.0), ("b", 1.0), ("c", 1e4)):
        cmds += j.handle(UpdateReceived(a, 1, 0, 10, const(v), {}), 1.0)
    (agg,) = of(cmds, RoundAggregated)
    bound = 2 * norm_of(const(1.0), W)
    np.testing.assert_allclose(agg.weights["w"], (2.0 + 1e4 * bound / norm_of(const(1e4), W)) / 3, rtol=1e-5)
    # after the warm-up a whole update is scaled as it comes: no replay
    j.refolds.clear()
    for a, v in (("a", 1.0), ("b", 1.0), ("c", 1e4)):
        cmds = j.handle(UpdateReceived(a, 2, 1, 10, const(v), {}), 2.0)
    assert not j.refolds and of(cmds, RoundAggregated)[0].bounded["c"]["norm"] > bound


def test_the_norm_bound_needs_a_caller_that_replays():
    with pytest.raises(ValueError, match="replays"):
        RoundMachine(RoundConfig(norm_bound=NormBound()), W)
    # inert where updates are bounded otherwise (a robust aggregator buffers whole updates)
    from fedagent.protocols.aggregation import Strategy

    RoundMachine(RoundConfig(norm_bound=NormBound(), strategy=Strategy("median"), min_updates=1), W)


def test_repeat_offenders_sit_out_more_rounds_each_time():
    b = Bench()
    assert b.offend("m", 1) == 1 and b.benched(2) == {"m"} and b.benched(3) == set()
    assert b.offend("m", 3) == 2 and b.benched(5) == {"m"} and b.benched(6) == set()
    assert b.offend("m", 6) == 4
    b.forgive("m")
    b.forgive("m")
    assert b.offend("m", 20) == 2


def test_an_update_for_an_abandoned_round_is_discarded_not_refused():
    m = RoundMachine(RoundConfig(rounds=3, min_agents=2, expected_agents=2, min_updates=2, round_timeout=10), W)
    for a in ("a", "b"):
        m.handle(AgentOnline(a, 10), 0.0)
    m.handle(UpdateReceived("a", 1, 0, 10, const(1.0), {}), 1.0)
    assert of(m.handle(Wakeup(), 10.0), RoundAbandoned)
    (late,) = m.handle(UpdateReceived("b", 1, 0, 10, const(9.0), {}), 11.0)
    assert isinstance(late, LateUpdate) and late.sender == "b" and late.round == 1
    (stale,) = m.handle(UpdateReceived("b", 7, 0, 10, const(9.0), {}), 11.0)
    assert isinstance(stale, Rejected) and stale.reason == "stale"


def test_an_agent_reading_only_whole_models_forces_at_most_one_whole_start_in_k():
    m = RoundMachine(RoundConfig(rounds=12, min_agents=2, expected_agents=3, downlink="int8", whole_model_every=4), W)
    cmds = m.handle(AgentOnline("a", 10), 0.0) + m.handle(AgentOnline("b", 10), 0.0)
    cmds += m.handle(AgentOnline("old", 10, reads_steps=False), 0.0)
    seen = []
    for r in range(1, 11):
        (start,) = of(cmds, StartRound)
        assert start.round == r
        seen.append((start.delta is None, "old" in start.selected))
        cmds = []
        for a in start.selected:
            cmds += m.handle(UpdateReceived(a, r, start.model_version, 10, const(float(r)), {}), float(r))
    # whole in the first round (no step yet), then one in four; the old agent only in those
    assert [whole for whole, _ in seen] == [True, False, False, False, True, False, False, False, True, False]
    assert all(whole == old for whole, old in seen)
    # with every agent reading steps, no round start is whole after the first
    m.handle(AgentOnline("old", 10), 11.0)
    assert m.whole_model_only() == []


def test_an_agent_reading_only_whole_models_the_quorum_needs_gets_every_round_start_whole():
    m = RoundMachine(RoundConfig(rounds=6, min_agents=3, expected_agents=3, downlink="int8", whole_model_every=4), W)
    cmds = m.handle(AgentOnline("a", 10), 0.0) + m.handle(AgentOnline("b", 10), 0.0)
    cmds += m.handle(AgentOnline("old", 10, reads_steps=False), 0.0)
    for r in range(1, 7):
        (start,) = of(cmds, StartRound)
        # without it there is no round: it takes part, and never meets a step it cannot read
        assert start.round == r and "old" in start.selected and start.delta is None
        cmds = []
        for a in start.selected:
            cmds += m.handle(UpdateReceived(a, r, start.model_version, 10, const(float(r)), {}), float(r))


def test_the_weight_cap_follows_announcements_made_during_the_round():
    """The median the cap is taken from is kept between updates, and taken again when an
    announcement changes the counts (a selected agent whose presence comes late)."""
    inf = Influence(RoundConfig(rounds=2, min_agents=3, expected_agents=3, weight_cap=2.0, server_momentum=0.0))
    inf.open(["a", "b", "c"], {"a": 100, "b": 0, "c": 0})
    assert inf.samples("a", 100) == 100  # the only count known: the median is 100
    inf.announce("b", 10)
    inf.announce("c", 10)
    assert inf.samples("b", 10) == 10
    assert inf.samples("a", 100) == 20  # capped at 2 × the median of 100, 10, 10
    inf.open(["a", "b"], {"a": 100, "b": 100})
    assert inf.samples("a", 100) == 100
