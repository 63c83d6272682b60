"""Asynchronous buffered FedAvg's machines, driven in memory: tasks and the concurrency
limit, staleness, the buffer, streamed and whole updates, restart, privacy; and the
agent's side, which keeps working while its link is down."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.codec import Envelope
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.dp import DPConfig
from fedagent.protocols.fedbuff import (
    AgentOffline,
    AgentOnline,
    AssignTask,
    BufferConfig,
    BufferMachine,
    BufferSpoilt,
    Finished,
    Phase,
    Published,
    Rejected,
    RequestWakeup,
    Wakeup,
    WholeUpdate,
)
from fedagent.protocols.fedbuff import worker as W
from fedagent.protocols.messages import AsyncTask, TrainConfig
from fedagent.protocols.streaming import (
    HEAD_KIND,
    StreamIntake,
    UpdateEnd,
    UpdateHead,
    encode_stream,
    head_body,
    iter_stream_chunks,
)

FED = "lab"
W0 = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(3, np.float32), "n": np.array(0, np.int64)}


def model(v: float = 0.0) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 5), v, np.float32), "b": np.full(3, v, np.float32), "n": np.array(int(v), np.int64)}


def delta(v: float) -> dict[str, np.ndarray]:
    """An update that moved every floating value by ``v`` (counters as trained)."""
    return {"w": np.full((4, 5), v, np.float32), "b": np.full(3, v, np.float32), "n": np.array(1, np.int64)}


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def cfg(**kw) -> BufferConfig:
    kw.setdefault("min_agents", 1)
    kw.setdefault("start_grace", 0.0)
    kw.setdefault("server_momentum", 0.0)
    kw.setdefault("train", TrainConfig(stream=False))
    return BufferConfig(**kw)


def started(m: BufferMachine, agents, now: float = 0.0) -> dict[str, AssignTask]:
    cmds = []
    for a in agents:
        cmds += m.handle(AgentOnline(a, 10), now)
    return {c.agent: c for c in of(cmds, AssignTask)}


def whole(m, agent, task, base, v, n=10, now=1.0):
    return m.handle(WholeUpdate(agent, task, base, n, {"loss": v}, delta(v)), now)


# ---- tasks and the concurrency limit ---------------------------------------------------
def test_tasks_wait_for_the_quorum_and_grace_then_every_agent_trains():
    m = BufferMachine(cfg(min_agents=2, start_grace=5.0), model())
    assert m.handle(AgentOnline("a", 10), 0.0) == []
    assert m.handle(AgentOnline("b", 10), 1.0) == [RequestWakeup(6.0)]
    assert of(m.handle(Wakeup(), 3.0), AssignTask) == []
    tasks = of(m.handle(Wakeup(), 6.0), AssignTask)
    assert [(t.agent, t.task, t.model_version) for t in tasks] == [("a", 1, 0), ("b", 2, 0)]
    assert m.phase is Phase.RUNNING
    # a latecomer gets a task at once
    (t,) = of(m.handle(AgentOnline("c", 10), 7.0), AssignTask)
    assert (t.agent, t.task) == ("c", 3)


def test_concurrency_limit_hands_the_freed_place_to_the_longest_idle_agent():
    m = BufferMachine(cfg(concurrency=2, buffer_size=10), model())
    cmds = []
    for i, a in enumerate(["a", "b", "c", "d"]):
        cmds += m.handle(AgentOnline(a, 10), float(i))
    assert [t.agent for t in of(cmds, AssignTask)] == ["a", "b"]
    assert m.status()["training"] == 2
    (t,) = of(whole(m, "a", 1, 0, 1.0, now=10.0), AssignTask)
    assert t.agent == "c"  # idle since 2.0, d since 3.0, a since 10.0
    (t,) = of(whole(m, "b", 2, 0, 1.0, now=11.0), AssignTask)
    assert t.agent == "d"
    assert m.status()["training"] == 2


def test_an_expired_task_frees_its_place_and_its_late_update_still_counts():
    m = BufferMachine(cfg(concurrency=1, buffer_size=2, task_timeout=30.0), model())
    tasks = started(m, ["a", "b"])
    assert list(tasks) == ["a"]
    cmds = m.handle(Wakeup(), 31.0)
    (t,) = of(cmds, AssignTask)
    assert t.agent == "b"  # a's place went to b
    cmds = whole(m, "a", 1, 0, 2.0, now=40.0)  # a was only slow
    assert not of(cmds, Rejected) and m.fill == 1


def test_an_agent_that_goes_offline_frees_its_place_and_sends_later():
    m = BufferMachine(cfg(concurrency=1, buffer_size=1), model())
    started(m, ["a", "b"])
    (t,) = of(m.handle(AgentOffline("a"), 2.0), AssignTask)
    assert t.agent == "b"
    # a trained on, cut off, and is back: its task's update is taken
    cmds = m.handle(AgentOnline("a", 10), 5.0) + whole(m, "a", 1, 0, 1.0, now=5.0)
    (pub,) = of(cmds, Published)
    assert pub.contributors == ("a",) and pub.model_version == 1


# ---- staleness and the buffer ----------------------------------------------------------
def test_buffer_of_k_makes_a_model_with_staleness_damping():
    m = BufferMachine(cfg(buffer_size=2, max_staleness=5), model())
    started(m, ["a", "b", "c"])
    # two fresh updates make version 1: the sample-weighted mean of the deltas
    assert of(whole(m, "a", 1, 0, 1.0, n=10), Published) == []
    (p1,) = of(whole(m, "b", 2, 0, 3.0, n=30), Published)
    np.testing.assert_allclose(p1.weights["w"], 2.5)
    assert p1.model_version == 1 and [u[3] for u in p1.updates] == [0, 0]
    # c trained from version 0 (staleness 1) and a fresh one from version 1
    whole(m, "c", 3, 0, 4.0, n=10)
    (p2,) = of(whole(m, "a", 4, 1, 1.0, n=10), Published)
    w1 = 1 / np.sqrt(2)
    np.testing.assert_allclose(p2.weights["w"], 2.5 + (10 * w1 * 4.0 + 10 * 1.0) / 20, rtol=1e-6)
    assert {u[0]: u[3] for u in p2.updates} == {"c": 1, "a": 0}
    assert m.staleness()["histogram"] == {"0": 3, "1": 1}


def test_stale_and_future_updates_are_refused_and_the_agent_gets_a_new_task():
    m = BufferMachine(cfg(buffer_size=1, max_staleness=1), model())
    started(m, ["a", "b"])
    whole(m, "a", 1, 0, 1.0)  # version 1
    whole(m, "a", 3, 1, 1.0)  # version 2
    cmds = whole(m, "b", 2, 0, 1.0)  # trained from 0: staleness 2 > 1
    (r,) = of(cmds, Rejected)
    assert r.reason == "stale" and "2 versions behind" in r.detail
    (t,) = of(cmds, AssignTask)
    assert (t.agent, t.model_version) == ("b", 2)
    (r,) = of(whole(m, "b", 0, 9, 1.0), Rejected)
    assert r.reason == "version"
    assert m.refused == {"stale": 1, "version": 1}


def test_an_update_is_taken_once_even_across_a_restart():
    m = BufferMachine(cfg(buffer_size=1), model())
    started(m, ["a"])
    (p,) = of(whole(m, "a", 1, 0, 1.0), Published)
    (r,) = of(whole(m, "a", 1, 0, 1.0), Rejected)  # its outbox sent it again
    assert r.reason == "duplicate"
    # the restarted coordinator resumes from the checkpoint's model and keys
    again = BufferMachine(cfg(buffer_size=1), p.weights, model_version=1, accepted=m.accepted_keys(), first_task=50)
    (r,) = of(whole(again, "a", 1, 0, 1.0), Rejected)
    assert r.reason == "duplicate"
    (t,) = started(again, ["a"]).values()
    assert t.task == 50


def test_journaled_updates_are_taken_before_any_agent_is_back():
    """After a restart the journal's updates come first, before any presence: the buffer
    takes them while the machine still waits for its quorum."""
    m = BufferMachine(cfg(buffer_size=2, min_agents=2), model())
    assert m.phase is Phase.WAITING
    assert of(whole(m, "a", 7, 0, 1.0), Rejected) == []
    (p,) = of(whole(m, "b", 8, 0, 3.0), Published)
    assert p.contributors == ("a", "b") and m.phase is Phase.WAITING


def test_versions_end_training_and_later_updates_are_refused():
    m = BufferMachine(cfg(buffer_size=1, versions=2), model())
    started(m, ["a"])
    whole(m, "a", 1, 0, 1.0)
    cmds = whole(m, "a", 2, 1, 1.0)
    (p,) = of(cmds, Published)
    assert p.final and of(cmds, Finished) and m.phase is Phase.DONE
    assert of(cmds, AssignTask) == []
    (r,) = of(whole(m, "a", 3, 2, 1.0), Rejected)
    assert r.reason == "done"


def test_versions_zero_publishes_until_stopped():
    m = BufferMachine(cfg(buffer_size=1, versions=0), model())
    started(m, ["a"])
    for task in range(1, 6):
        (p,) = of(whole(m, "a", task, task - 1, 1.0), Published)
        assert not p.final
    assert m.model_version == 5 and m.phase is Phase.RUNNING
    assert BufferMachine(cfg(versions=0), model(), model_version=10**6).phase is Phase.WAITING
    with pytest.raises(ValueError, match="cosine"):
        cfg(versions=0, lr_schedule="cosine")


def test_metric_weights_and_drop_above_work_in_the_buffer():
    m = BufferMachine(cfg(buffer_size=2, strategy=Strategy("drop_above", key="speed", threshold=100.0)), model())
    started(m, ["a", "b"])
    m.handle(WholeUpdate("a", 1, 0, 10, {"speed": 120.0}, delta(9.0)), 1.0)
    (p,) = of(m.handle(WholeUpdate("b", 2, 0, 10, {"speed": 50.0}, delta(1.0)), 1.0), Published)
    np.testing.assert_allclose(p.weights["w"], 1.0)
    assert p.contributors == ("b",) and list(p.dropped.values()) == [120.0]


# ---- streamed updates --------------------------------------------------------------------
def stream(sender, trained, base, *, task, base_version, mode="int8", n=10, tid="t1", chunk=64):
    tensors = Compressor(CompressionConfig(mode, 1.0)).encode(trained, base)
    head = Envelope(
        kind=HEAD_KIND,
        federation=FED,
        sender=sender,
        round=task,
        seq=1,
        ts=time.time(),
        body=head_body(task, base_version, n, {"loss": 1.0}, False, tensors),
    )
    it = StreamIntake(FED, max_transfer_bytes=2**24, max_pending_bytes=2**20, timeout=30.0)
    out = []
    for body in iter_stream_chunks(encode_stream(head, tensors), max_chunk=chunk, transfer_id=tid):
        out += it.feed(sender, body, 0.0)
    return out


def feed(m: BufferMachine, events, now: float = 1.0) -> list:
    out = []
    for ev in events:
        out += m.handle(ev, now)
    return out


def scfg(**kw) -> BufferConfig:
    return cfg(train=TrainConfig(compression="int8"), **kw)


def test_streamed_int8_deltas_of_stale_updates_are_added_to_the_newer_model():
    m = BufferMachine(scfg(buffer_size=1), model())
    started(m, ["a", "b"])
    for ev in stream("a", model(1.0), model(), task=1, base_version=0):
        m.handle(ev, 1.0)
    assert m.model_version == 1
    # b trained from version 0 too: its delta (+2) goes onto version 1, damped by 1/√2
    cmds = []
    for ev in stream("b", model(2.0), model(), task=2, base_version=0, tid="t2"):
        cmds += m.handle(ev, 2.0)
    (p,) = of(cmds, Published)
    np.testing.assert_allclose(p.weights["w"], 1.0 + 2.0 / np.sqrt(2), rtol=1e-2)


def test_streams_of_raw_floats_or_the_wrong_shape_are_refused_at_their_header():
    m = BufferMachine(scfg(buffer_size=1), model())
    started(m, ["a"])
    (r,) = of(
        feed(m, stream("a", model(1.0), None, task=1, base_version=0, mode="none"), 1.0),
        Rejected,
    )
    assert r.reason == "encoding" and m.fill == 0
    bad = {**model(1.0), "w": np.zeros((5, 4), np.float32)}
    events = stream("a", bad, {**model(), "w": bad["w"]}, task=1, base_version=0, tid="t2")
    (r,) = of(feed(m, events), Rejected)
    assert r.reason == "shape"


def test_a_broken_stream_after_folding_spoils_the_buffer_and_a_new_one_supersedes_it():
    m = BufferMachine(scfg(buffer_size=3), model())
    started(m, ["a", "b"])
    for ev in stream("a", model(1.0), model(), task=1, base_version=0):
        m.handle(ev, 1.0)
    assert m.fill == 1
    evs = stream("b", model(2.0), model(), task=2, base_version=0, tid="t2")
    head, parts = evs[0], [e for e in evs[1:] if not isinstance(e, UpdateEnd)]
    assert isinstance(head, UpdateHead) and parts
    m.handle(head, 2.0)
    m.handle(parts[0], 2.0)
    # b's link broke mid-transfer; its outbox sends the update again as a new stream
    cmds = []
    for ev in stream("b", model(2.0), model(), task=2, base_version=0, tid="t3"):
        cmds += m.handle(ev, 3.0)
    (spoilt,) = of(cmds, BufferSpoilt)
    assert spoilt.lost == ("a/1/0", "b/2/0") and m.spoilt == 1
    assert m.fill == 1 and m.entries[0].key == ("b", 2, 0)  # the new stream was taken afresh


def test_a_model_waits_for_a_stream_being_folded():
    m = BufferMachine(scfg(buffer_size=1), model())
    started(m, ["a", "b"])
    eb = stream("b", model(2.0), model(), task=2, base_version=0, tid="t2")
    m.handle(eb[0], 1.0)
    m.handle(eb[1], 1.0)
    cmds = []
    for ev in stream("a", model(1.0), model(), task=1, base_version=0):
        cmds += m.handle(ev, 1.0)
    assert of(cmds, Published) == [] and m.fill == 1
    cmds = []
    for ev in eb[2:]:
        cmds += m.handle(ev, 1.0)
    (p,) = of(cmds, Published)
    assert p.contributors == ("a", "b")


def test_buffering_many_streams_stays_within_three_models_of_memory():
    ref = {"a": np.zeros((500, 1000), np.float32), "b": np.zeros(500_000, np.float32)}
    model_bytes = sum(v.nbytes for v in ref.values())
    rng = np.random.default_rng(0)
    upd = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ref.items()}
    agents = [f"s{i}" for i in range(10)]
    tensors = Compressor(CompressionConfig("int8", 1.0)).encode(upd, ref)
    data = {}
    for i, a in enumerate(agents):
        head = Envelope(HEAD_KIND, FED, a, i + 1, 1, 1.0, head_body(i + 1, 0, 10, {}, False, tensors))
        data[a] = encode_stream(head, tensors)
    del upd, tensors
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    m = BufferMachine(scfg(buffer_size=10, min_agents=10), ref)
    it = StreamIntake(FED, max_transfer_bytes=2**26, max_pending_bytes=2**20, timeout=30.0)
    streams = {a: iter_stream_chunks(data[a], max_chunk=256 * 1024, transfer_id=f"t{a}") for a in agents}
    done = []
    while streams:
        for a in list(streams):
            body = next(streams[a], None)
            if body is None:
                del streams[a]
                continue
            for ev in it.feed(a, body, 0.0):
                done += of(m.handle(ev, 1.0), Published)
            del body
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(done) == 1 and len(done[0].contributors) == 10
    # one float32 sum, the new model and chunk-sized buffers; with the global model < 3
    assert peak - base < 2 * model_bytes, f"peak {(peak - base) / model_bytes:.2f} x the model"


# ---- downlink ------------------------------------------------------------------------------
def test_models_go_out_as_int8_steps_unless_an_agent_reads_only_whole_models():
    m = BufferMachine(scfg(buffer_size=1), model())
    started(m, ["a"])
    (p,) = of(feed(m, stream("a", model(1.0), model(), task=1, base_version=0), 1.0), Published)
    assert p.delta is not None and p.delta.base_version == 0
    m.handle(AgentOnline("old", 10, reads_steps=False), 2.0)
    (p,) = of(
        feed(m, stream("a", model(2.0), p.weights, task=2, base_version=1, tid="t2"), 2.0),
        Published,
    )
    assert p.delta is None


# ---- privacy --------------------------------------------------------------------------------
def test_central_dp_clips_noises_and_counts_each_agent_once_per_model():
    dp = DPConfig(mode="central", noise_multiplier=1e-9, clip_norm=1.0)
    m = BufferMachine(cfg(buffer_size=2, min_agents=2, dp=dp), model(), rng=np.random.default_rng(0))
    tasks = started(m, ["a", "b", "c"])
    assert m.config.whole and tasks["a"].train.dp_clip is None  # central: the coordinator clips
    whole(m, "a", 1, 0, 10.0)  # norm ≫ 1: clipped to 1
    (r,) = of(whole(m, "a", 0, 0, 1.0), Rejected)  # a's second update for the same model
    assert r.reason == "once"
    cmds = whole(m, "b", 2, 0, 10.0)
    (p,) = of(cmds, Published)
    norm = np.sqrt(sum(float(np.square(p.weights[k]).sum()) for k in ("w", "b")))
    assert norm == pytest.approx(1.0, rel=1e-4)  # the mean of two deltas clipped to 1
    assert p.privacy is not None and p.privacy["releases"] == 1.0


def test_distributed_dp_tells_the_agents_their_noise_share_and_weighs_equally():
    dp = DPConfig(mode="distributed", noise_multiplier=2.0, clip_norm=1.0)
    m = BufferMachine(scfg(buffer_size=4, min_agents=4, dp=dp), model())
    tasks = started(m, ["a", "b", "c", "d"])
    train = tasks["a"].train
    assert train.dp_clip == 1.0 and train.dp_noise_std == pytest.approx(2.0 * 1.0 / 2)
    assert not m.config.whole  # the agents noise, the deltas may stream


def test_the_privacy_budget_stops_publishing():
    dp = DPConfig(mode="central", noise_multiplier=3.0, clip_norm=1.0, epsilon_budget=3.0)
    m = BufferMachine(cfg(buffer_size=1, dp=dp), model(), rng=np.random.default_rng(0))
    assert started(m, ["a"])
    cmds, task, version = [], 1, 0
    while not of(cmds, Finished):
        cmds = whole(m, "a", task, version, 0.1)
        task, version = task + 1, version + 1
        assert version < 100
    (f,) = of(cmds, Finished)
    (p,) = of(cmds, Published)
    assert p.final and p.model_version > 1
    assert "privacy budget" in f.reason and m.privacy()["epsilon"] <= 3.0
    # too little noise for even one model: nothing starts
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip_norm=1.0, epsilon_budget=3.0)
    m = BufferMachine(cfg(buffer_size=1, dp=dp), model())
    (f,) = of(m.handle(AgentOnline("a", 10), 0.0), Finished)
    assert m.phase is Phase.DONE and "one more" in f.reason


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"strategy": Strategy("median")}, "compares the updates"),
        ({"dp": DPConfig(mode="central"), "buffer_size": 5, "min_agents": 2}, "at least that many agents"),
        ({"dp": DPConfig(mode="distributed", adaptive=True)}, "secure aggregation"),
        ({"dp": DPConfig(mode="central"), "min_agents": 5, "train": TrainConfig(compression="int8")}, "whole updates"),
    ],
)
def test_what_cannot_work_asynchronously_is_refused_with_the_reason(kw, match):
    with pytest.raises(ValueError, match=match):
        BufferConfig(**kw)


# ---- the agent's side ------------------------------------------------------------------------
TASK = AsyncTask(1, 0, TrainConfig(compression="int8"), 60.0)


def test_worker_trains_keeps_sends_and_discards_in_that_order():
    w = W.AsyncWorker(model=(0, model()))
    assert w.handle(W.LinkUp()) == []
    (train,) = w.handle(W.TaskIn(TASK))
    assert isinstance(train, W.Train) and train.work.task == 1 and train.work.base_version == 0
    keep, send = w.handle(W.Trained(train.work, model(1.0), 10, {"loss": 0.5}))
    assert isinstance(keep, W.Keep) and isinstance(send, W.Send) and send.pending is keep.pending
    (discard,) = w.handle(W.Delivered(send.pending))
    assert isinstance(discard, W.Discard) and w.outbox is None
    assert w.handle(W.TaskIn(TASK)) == []  # the same task delivered again


def test_worker_cut_off_keeps_its_update_trains_further_and_sends_the_latest_when_back():
    w = W.AsyncWorker(offline_trainings=2, model=(0, model()))
    w.handle(W.LinkUp())
    (train,) = w.handle(W.TaskIn(TASK))
    w.handle(W.LinkDown())
    keep, again = w.handle(W.Trained(train.work, model(1.0), 10, {}))
    assert isinstance(keep, W.Keep) and isinstance(again, W.Train)  # nothing sent; trained further
    assert again.work.trainings == 2 and again.work.offline and again.start["w"][0, 0] == 1.0
    keep, again = w.handle(W.Trained(again.work, model(2.0), 10, {}))
    assert isinstance(again, W.Train) and again.work.trainings == 3
    (keep,) = w.handle(W.Trained(again.work, model(3.0), 10, {}))  # the bound per outage
    assert w.status()["outbox"] == {"task": 1, "base_version": 0, "trainings": 3}
    (send,) = w.handle(W.LinkUp())
    assert isinstance(send, W.Send) and send.pending.weights["w"][0, 0] == 3.0
    assert send.pending.work.base_version == 0  # a delta from the model it started from


def test_worker_idle_and_cut_off_trains_on_its_own_from_the_model_it_holds():
    w = W.AsyncWorker(offline_trainings=1, model=(0, model()))
    w.handle(W.LinkUp())
    (train,) = w.handle(W.TaskIn(TASK))
    keep, send = w.handle(W.Trained(train.work, model(1.0), 10, {}))
    w.handle(W.Delivered(send.pending))
    w.handle(W.ModelIn(3, model(5.0)))
    (own,) = w.handle(W.LinkDown())
    assert isinstance(own, W.Train) and own.work.task == 0 and own.work.base_version == 3
    (keep,) = w.handle(W.Trained(own.work, model(6.0), 10, {}))
    (send,) = w.handle(W.LinkUp())
    assert send.pending.work.task == 0


def test_worker_fetches_a_model_it_lacks_and_trains_from_the_newest_it_holds():
    w = W.AsyncWorker(model=(1, model()))
    w.handle(W.LinkUp())
    (fetch,) = w.handle(W.TaskIn(AsyncTask(4, 3, TrainConfig(), 60.0)))
    assert fetch == W.Fetch(1)
    (train,) = w.handle(W.ModelIn(5, model(2.0)))
    assert train.work.base_version == 5 and train.work.task == 4


def test_worker_restored_outbox_goes_out_when_the_link_is_up():
    pending = W.Pending(W.Work(7, 2, TrainConfig(), model()), model(1.0), 10, {})
    w = W.AsyncWorker(offline_trainings=1)
    assert w.handle(W.Restored(pending)) == []
    (send,) = w.handle(W.LinkUp())
    assert send.pending is pending
    # not delivered: kept, trained further meanwhile, and sent on the next connection
    (train,) = w.handle(W.NotDelivered(pending, "no PUBACK"))
    assert train.work.trainings == 2
    (keep,) = w.handle(W.Trained(train.work, model(2.0), 10, {}))
    (send,) = w.handle(W.LinkUp())
    assert send.pending is keep.pending


def test_worker_never_trains_a_noised_update_further():
    dp_task = AsyncTask(1, 0, TrainConfig(stream=False, dp_clip=1.0, dp_noise_std=0.5), 60.0)
    w = W.AsyncWorker(offline_trainings=3, model=(0, model()))
    w.handle(W.LinkUp())
    (train,) = w.handle(W.TaskIn(dp_task))
    w.handle(W.LinkDown())
    assert [type(c) for c in w.handle(W.Trained(train.work, model(1.0), 10, {}))] == [W.Keep]


def test_worker_stops_at_the_final_model():
    w = W.AsyncWorker(model=(0, model()))
    w.handle(W.Restored(W.Pending(W.Work(1, 0, TrainConfig(), model()), model(1.0), 10, {})))
    (discard,) = w.handle(W.ModelIn(9, model(), final=True))
    assert isinstance(discard, W.Discard) and w.outbox is None
    assert w.handle(W.LinkUp()) == [] and w.handle(W.LinkDown()) == []
