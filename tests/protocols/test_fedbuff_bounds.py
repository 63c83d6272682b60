"""The member protections of FedAvg rounds in the buffer machine, as traces: a claimed
sample count is capped against what the agents announced, an update's distance is scaled
down to the adaptive bound from recent buffers (held and replayed from the journal when a
stream crosses it, or while the bound warms up), and a restart keeps both."""

from __future__ import annotations

import numpy as np
import pytest
from test_fedbuff import cfg, model, of, stream

from fedagent.protocols.fedbuff import (
    AgentOnline,
    AssignTask,
    BufferMachine,
    BufferSpoilt,
    Published,
    Refold,
    Refolded,
    Rejected,
    WholeUpdate,
)
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds import NormBound
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart

NORM = NormBound(multiplier=3.0, window=10, warmup=3)


def bcfg(**kw):
    kw.setdefault("weight_cap", 2.0)
    kw.setdefault("norm_bound", NORM)
    kw.setdefault("train", TrainConfig(compression="int8"))
    return cfg(**kw)


class Journal:
    """What the coordinator's journal would hold: every update as it came, read back in
    the same order for a :class:`Refold` (``lose``: updates it cannot give back whole)."""

    def __init__(self, m: BufferMachine) -> None:
        self.m = m
        self.streams: dict[tuple[str, str], list[UpdatePart]] = {}
        self.wholes: dict[tuple[str, int, int], WholeUpdate] = {}
        self.refolds: list[Refold] = []
        self.lose: set[tuple[str, int, int, str | None]] = set()

    def handle(self, ev, now: float = 1.0) -> list:
        if isinstance(ev, UpdatePart):
            self.streams.setdefault((ev.sender, ev.tid), []).append(ev)
        elif isinstance(ev, WholeUpdate):
            self.wholes.setdefault((ev.sender, ev.task, ev.base_version), ev)
        return self._carry_out(self.m.handle(ev, now), now)

    def feed(self, events, now: float = 1.0) -> list:
        out = []
        for ev in events:
            out += self.handle(ev, now)
        return out

    def _carry_out(self, cmds: list, now: float) -> list:
        out = list(cmds)
        for c in cmds:
            if not isinstance(c, Refold):
                continue
            self.refolds.append(c)
            incomplete = set()
            for key in c.updates:
                agent, task, base, tid = key
                if key in self.lose:
                    if key in c.counted:
                        incomplete.add(key)
                        continue
                if tid is not None:
                    for part in self.streams.get((agent, tid), []):
                        self.m.refold(key, part)
                elif (agent, task, base) in self.wholes:
                    w = self.wholes[(agent, task, base)]
                    for name, arr in w.delta.items():
                        self.m.refold(key, UpdatePart(agent, "", name, 0, np.asarray(arr).reshape(-1)))
            out += self._carry_out(self.m.handle(Refolded(c.model_version, frozenset(incomplete)), now), now)
        return out


def noise(seed: int, scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(0.0, scale, (4, 5)).astype(np.float32),
        "b": rng.normal(0.0, scale, 3).astype(np.float32),
        "n": np.array(0, np.int64),
    }


def dist(d: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.square(d[k].astype(np.float64)).sum() for k in ("w", "b"))))


def online(m: BufferMachine, counts: dict[str, int]) -> dict:
    cmds = []
    for a, n in counts.items():
        cmds += m.handle(AgentOnline(a, n), 0.0)
    return cmds


HONEST = {"a": 100, "b": 120, "c": 140}
#: Distances of three earlier buffers, every update at distance 1 (the bound is then 3).
WARM = [[1.0, 1.0, 1.0]] * 3


# ---- the weight cap ----------------------------------------------------------------------
def test_a_claim_of_a_billion_samples_weighs_at_most_the_cap():
    m = BufferMachine(bcfg(buffer_size=2, norm_bound=None), model())
    online(m, {**HONEST, "mallory": 10**9})
    j = Journal(m)
    j.feed(stream("a", model(1.0), model(), task=1, base_version=0, n=100))
    (p,) = of(j.feed(stream("mallory", model(-1.0), model(), task=4, base_version=0, n=10**9, tid="m")), Published)
    # announced 10^9 too: the lower median of (100, 120, 140, 10^9) is 120, cap 2 x 120
    assert p.bounded == {"mallory": {"samples": 1e9, "weight": 240.0}}
    shares = {u[0]: u[4] for u in p.updates}
    assert shares["mallory"] == pytest.approx(240 / 340, abs=1e-6)
    np.testing.assert_allclose(p.weights["w"], (100 * 1.0 - 240 * 1.0) / 340, atol=0.02)
    assert m.status()["bounds"]["last_round"] == p.bounded


def test_a_claim_above_the_agents_own_announcement_weighs_the_announcement():
    m = BufferMachine(bcfg(buffer_size=1, norm_bound=None), model())
    online(m, {**HONEST, "mallory": 100})
    (p,) = of(Journal(m).feed(stream("mallory", model(1.0), model(), task=4, base_version=0, n=10**9)), Published)
    assert p.bounded == {"mallory": {"samples": 1e9, "weight": 100.0}}


# ---- the norm bound ----------------------------------------------------------------------
def test_honest_streams_fold_as_they_come_and_a_noise_stream_is_replayed_at_the_bound():
    m = BufferMachine(bcfg(buffer_size=2), model(), replays=True, norm_history=WARM)
    online(m, {**HONEST, "mallory": 100})
    assert m.influence.bound == pytest.approx(3.0)
    j = Journal(m)
    honest = {"w": np.full((4, 5), 0.2, np.float32), "b": np.full(3, 0.2, np.float32), "n": np.array(0, np.int64)}
    j.feed(stream("a", honest, model(), task=1, base_version=0, n=100))
    assert m.fill == 1 and not j.refolds  # within the bound (0.96): added as it came
    bad = noise(7, 5.0)
    cmds = j.feed(stream("mallory", bad, model(), task=4, base_version=0, n=100, tid="m"))
    (refold,) = j.refolds
    assert refold.updates == (("mallory", 4, 0, "m"),) and refold.counted == frozenset(refold.updates)
    (p,) = of(cmds, Published)
    b = p.bounded["mallory"]
    assert b["bound"] == pytest.approx(3.0) and b["norm"] == pytest.approx(dist(bad), rel=0.02)
    # the step: the mean of the honest delta and the noise scaled to distance 3
    scale = 3.0 / b["norm"]
    np.testing.assert_allclose(p.weights["w"], (0.2 + bad["w"] * scale) / 2, atol=0.05)
    step = dist({k: p.weights[k] - model()[k] for k in ("w", "b")})
    assert step <= (dist(honest) + 3.0) / 2 + 0.05
    assert m.status()["bounds"]["norm_bound"]["warming_up"] is False


def test_a_whole_noise_update_is_scaled_at_once():
    m = BufferMachine(bcfg(buffer_size=1, train=TrainConfig(stream=False)), model(), replays=True, norm_history=WARM)
    online(m, HONEST)
    j = Journal(m)
    bad = noise(3, 10.0)
    (p,) = of(j.handle(WholeUpdate("a", 1, 0, 100, {"loss": 1.0}, bad)), Published)
    assert not j.refolds
    np.testing.assert_allclose(p.weights["w"], bad["w"] * 3.0 / dist(bad), atol=0.03)  # (int8 downlink)
    assert p.bounded == {"a": {"norm": pytest.approx(dist(bad)), "bound": 3.0}}


def test_whole_updates_warming_up_are_read_back_whole_and_one_never_read_back_does_not_count():
    m = BufferMachine(bcfg(buffer_size=2, train=TrainConfig(stream=False)), model(), replays=True)
    online(m, HONEST)
    j = Journal(m)
    j.handle(WholeUpdate("a", 1, 0, 100, {"loss": 1.0}, delta_of(0.5)))
    (p,) = of(j.handle(WholeUpdate("b", 2, 0, 100, {"loss": 1.0}, delta_of(0.3))), Published)
    (refold,) = j.refolds
    assert refold.updates == (("a", 1, 0, None), ("b", 2, 0, None))
    np.testing.assert_allclose(p.weights["w"], 0.4, atol=0.01)
    # still warming up (2 distances of 3): held again. The journal gives nothing of c's
    # update back (its frames name another base version) without saying it is missing:
    # it must not count in the mean without its values.
    j.handle(WholeUpdate("c", 3, 1, 100, {"loss": 1.0}, delta_of(0.5)))
    del j.wholes[("c", 3, 1)]
    cmds = j.handle(WholeUpdate("a", 4, 1, 100, {"loss": 1.0}, delta_of(0.5)))
    (r,) = of(cmds, Rejected)
    assert (r.sender, r.reason) == ("c", "journal") and not of(cmds, Published)
    assert [e.sender for e in m.entries] == ["a"]


def delta_of(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 5), v, np.float32), "b": np.full(3, v, np.float32), "n": np.array(0, np.int64)}


def test_while_warming_up_every_update_is_held_and_scaled_to_the_buffers_own_bound():
    m = BufferMachine(bcfg(buffer_size=3), model(), replays=True)
    online(m, {**HONEST, "mallory": 100})
    assert m.influence.bound is None and m.status()["bounds"]["norm_bound"]["warming_up"]
    j = Journal(m)
    ones = {"w": np.full((4, 5), 0.5, np.float32), "b": np.full(3, 0.5, np.float32), "n": np.array(0, np.int64)}
    j.feed(stream("a", ones, model(), task=1, base_version=0, n=100))
    j.feed(stream("b", ones, model(), task=2, base_version=0, n=100, tid="t2"))
    assert not j.refolds and m.fill == 2  # held: nothing added yet
    bad = noise(5, 8.0)
    cmds = j.feed(stream("mallory", bad, model(), task=4, base_version=0, n=100, tid="m"))
    (refold,) = j.refolds
    assert {k[0] for k in refold.updates} == {"a", "b", "mallory"}
    (p,) = of(cmds, Published)
    # the bound: 3 x the lower median of the buffer's own distances (2.4, 2.4, |noise|)
    honest = dist(ones)
    assert p.bounded == {
        "mallory": {"norm": pytest.approx(dist(bad), rel=0.02), "bound": pytest.approx(3 * honest, rel=0.02)}
    }
    np.testing.assert_allclose(p.weights["w"], (0.5 + 0.5 + bad["w"] * 3 * honest / dist(bad)) / 3, atol=0.05)
    # warmed up: the next buffer's honest updates are added as they come, no replay
    assert m.influence.bound == pytest.approx(3 * honest, rel=0.02)
    j.feed(stream("c", ones, model(), task=3, base_version=0, n=100, tid="t3"))
    assert len(j.refolds) == 1 and m.fill == 1


def test_a_restart_keeps_the_window_and_the_announced_counts():
    m = BufferMachine(bcfg(buffer_size=1), model(), replays=True)
    online(m, HONEST)
    j = Journal(m)
    half = {"w": np.full((4, 5), 0.5, np.float32), "b": np.full(3, 0.5, np.float32), "n": np.array(0, np.int64)}
    for i, a in enumerate(HONEST):  # (a delta of 0.5 everywhere, from each model in turn)
        j.feed(stream(a, half, model(), task=i + 1, base_version=m.model_version, n=100, tid=f"t{i}"))
    state = m.bounds_state()
    assert len(state["norms"]) == 3 and state["announced"] == HONEST
    # a new machine from the checkpoint: no warm-up, and a claim journaled before any
    # presence is capped at the counts announced before the restart
    r = BufferMachine(bcfg(buffer_size=1), model(), model_version=3, replays=True, **_restored(state))
    assert r.influence.bound == pytest.approx(3 * dist(half), rel=0.02)
    rj = Journal(r)
    r.handle(AgentOnline("x", 1), 0.0)  # (a quorum to start: min_agents 1)
    (p,) = of(rj.feed(stream("a", model(0.1), model(), task=9, base_version=3, n=10**9)), Published)
    assert p.bounded["a"]["weight"] == 100.0 and not rj.refolds


def _restored(state: dict) -> dict:
    return {"norm_history": state["norms"], "announced": state["announced"]}


# ---- failures ----------------------------------------------------------------------------
def test_a_stream_broken_after_parts_were_added_is_taken_out_not_spoiling_the_buffer():
    m = BufferMachine(bcfg(buffer_size=2), model(), replays=True, norm_history=WARM)
    online(m, HONEST)
    j = Journal(m)
    small = {"w": np.full((4, 5), 0.1, np.float32), "b": np.full(3, 0.1, np.float32), "n": np.array(0, np.int64)}
    j.feed(stream("a", small, model(), task=1, base_version=0, n=100))
    evs = stream("b", model(0.3), model(), task=2, base_version=0, n=100, tid="t2")
    head, parts = evs[0], [e for e in evs[1:] if isinstance(e, UpdatePart)]
    assert isinstance(head, UpdateHead) and len(parts) > 1
    j.feed([head, parts[0]])
    assert m.inflight["b"].folded > 0
    cmds = j.handle(UpdateEnd("b", "t2", False, "sender went offline mid-transfer"))
    assert of(cmds, Rejected) and not of(cmds, BufferSpoilt) and m.fill == 1
    # its resend (a new stream) fills the buffer; the broken one's prefix comes out first
    cmds = j.feed(stream("b", model(0.3), model(), task=2, base_version=0, n=100, tid="t3"))
    (refold,) = j.refolds
    assert refold.updates == (("b", 2, 0, "t2"),) and refold.counted == frozenset()
    (p,) = of(cmds, Published)
    np.testing.assert_allclose(p.weights["w"], (0.1 + 0.3) / 2, atol=0.01)
    assert m.spoilt == 0


def test_a_held_update_the_journal_cannot_give_back_is_refused_and_the_buffer_waits():
    m = BufferMachine(bcfg(buffer_size=2), model(), replays=True, norm_history=WARM)
    online(m, HONEST)
    j = Journal(m)
    j.lose.add(("a", 1, 0, "t1"))
    j.feed(stream("b", model(0.1), model(), task=2, base_version=0, n=100, tid="t2"))
    cmds = j.feed(stream("a", noise(1, 9.0), model(), task=1, base_version=0, n=100))
    (r,) = of(cmds, Rejected)
    assert (r.sender, r.reason) == ("a", "journal") and not of(cmds, Published)
    assert m.fill == 1 and [e.sender for e in m.entries] == ["b"]


def test_the_bounds_are_off_where_updates_are_bounded_otherwise():
    from fedagent.protocols.aggregation import Strategy
    from fedagent.protocols.dp import DPConfig

    assert not bcfg(strategy=Strategy(clip_norm=1.0), train=TrainConfig(stream=False)).bounds_norms
    dp = bcfg(
        dp=DPConfig(mode="central", clip_norm=1.0, noise_multiplier=1.0), buffer_size=1, train=TrainConfig(stream=False)
    )
    assert not dp.bounds_norms and not dp.caps_weights
    assert bcfg(strategy=Strategy(name="drop_above", key="loss", threshold=1.0)).caps_weights
    with pytest.raises(ValueError, match="replays"):
        BufferMachine(bcfg(), model())


# ---- one agent's share of a buffer ---------------------------------------------------------
def test_one_agent_adds_at_most_half_a_buffer_and_waits_for_the_next_model():
    m = BufferMachine(bcfg(buffer_size=4, norm_bound=None), model())
    assert [m.config.share(n) for n in (1, 2, 3, 4, 10)] == [4, 2, 2, 2, 2]
    online(m, {**HONEST, "mallory": 100})
    j = Journal(m)
    # answering at once, and unasked: tasks it was never given, or its "own" (task 0)
    (t,) = of(j.feed(stream("mallory", model(1.0), model(), task=4, base_version=0, tid="m1")), AssignTask)
    assert t.agent == "mallory"
    assert of(j.feed(stream("mallory", model(1.0), model(), task=0, base_version=0, tid="m2")), AssignTask) == []
    (r,) = of(j.feed(stream("mallory", model(1.0), model(), task=77, base_version=0, tid="m3")), Rejected)
    assert (r.sender, r.reason) == ("mallory", "share") and m.fill == 2
    j.feed(stream("a", model(0.1), model(), task=1, base_version=0))
    cmds = j.feed(stream("b", model(0.1), model(), task=2, base_version=0, tid="t2"))
    (p,) = of(cmds, Published)
    assert sorted(u[0] for u in p.updates) == ["a", "b", "mallory", "mallory"]
    # a new buffer: its share is free again (the task it was given after its first
    # update is answered)
    assert not of(j.feed(stream("mallory", model(1.0), model(), task=5, base_version=0, tid="m4")), Rejected)
    assert m.fill == 1


def test_fewer_agents_than_half_a_buffer_each_add_what_it_takes_to_fill_it():
    """Two agents and a buffer of 5 (the defaults' quorum and buffer): three each, or no
    model could ever be made."""
    m = BufferMachine(bcfg(buffer_size=5, norm_bound=None), model())
    online(m, {"a": 100, "b": 100})
    j = Journal(m)
    for i in range(3):
        j.feed(stream("a", model(0.1), model(), task=10 + i, base_version=0, tid=f"a{i}"))
    (r,) = of(j.feed(stream("a", model(0.1), model(), task=20, base_version=0, tid="a9")), Rejected)
    assert r.reason == "share" and "at most 3 per agent with 2 online" in r.detail
    j.feed(stream("b", model(0.1), model(), task=30, base_version=0, tid="b0"))
    (p,) = of(j.feed(stream("b", model(0.1), model(), task=31, base_version=0, tid="b1")), Published)
    assert len(p.updates) == 5
