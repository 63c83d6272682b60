"""The server momentum's velocity kept outside memory: the block-wise step against the
in-memory one (to the bit), the round machine with a store, and the coordinator's file
store (coordinator/velocity.py): round trip, resume, refusal of damaged or foreign files,
and which files a crash leaves usable."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.coordinator.velocity import FileVelocity, check_file, load
from fedagent.errors import FedagentError
from fedagent.protocols.rounds import AgentOnline, RoundAggregated, RoundConfig, RoundMachine, UpdateReceived
from fedagent.protocols.serveropt import BLOCK, MemoryVelocity, momentum_step, momentum_step_into, velocity_layout


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv": rng.normal(size=(4, 3, 5, 5)).astype(np.float32),
        "fc": rng.normal(size=(70_001,)).astype(np.float32),  # more than one block
        "bias64": rng.normal(size=(7,)),
        "empty": np.zeros((0, 3), np.float32),
        "steps": np.array(12, np.int64),
    }


def _aggregate(rng: np.random.Generator, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        k: (v + rng.normal(scale=0.05, size=v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v + 3
        for k, v in x.items()
    }


@pytest.mark.parametrize("block", [BLOCK, 1000])
def test_the_blockwise_step_is_the_in_memory_step_to_the_bit(block):
    rng = np.random.default_rng(3)
    x = _model(rng)
    x_mem, v_mem = dict(x), {}
    x_str, store = dict(x), MemoryVelocity()
    for version in range(1, 5):
        agg = _aggregate(rng, x_mem)
        x_mem, v_mem = momentum_step(x_mem, {k: a.copy() for k, a in agg.items()}, v_mem, lr=1.5, beta=0.7)
        writer = store.begin(velocity_layout(x_str), version)
        ref, before = x_str, {k: a.copy() for k, a in x_str.items()}
        x_str = momentum_step_into(
            ref, {k: a.copy() for k, a in agg.items()}, store, writer, lr=1.5, beta=0.7, block=block
        )
        store.adopt(writer)
        for k in x:
            assert x_str[k].dtype == x_mem[k].dtype and x_str[k].shape == x_mem[k].shape
            np.testing.assert_array_equal(x_str[k], x_mem[k], err_msg=k)
            np.testing.assert_array_equal(ref[k], before[k], err_msg=k)  # the reference is not changed
        assert sorted(store.current) == sorted(v_mem) == ["bias64", "conv", "empty", "fc"]
        for k, v in v_mem.items():
            np.testing.assert_array_equal(store.current[k], v, err_msg=k)
    assert store.model_version == 4


def test_the_step_writes_into_the_aggregate_it_owns_and_copies_what_it_does_not():
    rng = np.random.default_rng(4)
    x = _model(rng)
    agg = _aggregate(rng, x)
    mine = agg["fc"]
    readonly = agg["conv"].copy()
    readonly.flags.writeable = False
    agg["conv"] = readonly
    agg["bias64"] = x["bias64"]  # the reference itself: must not be written to
    keep_ref = x["bias64"].copy()
    store = MemoryVelocity()
    out = momentum_step_into(x, agg, store, store.begin(velocity_layout(x), 1), lr=1.0, beta=0.9)
    assert out["fc"] is mine  # in place: no second model-sized buffer
    assert out["conv"] is not readonly
    np.testing.assert_array_equal(x["bias64"], keep_ref)
    np.testing.assert_array_equal(out["bias64"], keep_ref)  # aggregate = reference: no step


def _round(m: RoundMachine, values: tuple[float, float], now: float) -> list:
    if not m.selected:
        for a in ("a", "b"):
            m.handle(AgentOnline(a, 10), now)
    r, v = m.round, m.model_version
    shape = m.weights["w"].shape
    m.handle(UpdateReceived("a", r, v, 10, {"w": np.full(shape, values[0], np.float32)}, {}), now)
    return m.handle(UpdateReceived("b", r, v, 30, {"w": np.full(shape, values[1], np.float32)}, {}), now)


def test_a_round_machine_with_a_store_makes_the_models_of_one_without():
    cfg = RoundConfig(rounds=5, min_agents=2, expected_agents=2, server_momentum=0.6)
    w0 = {"w": np.zeros((3, 4), np.float32)}
    plain = RoundMachine(cfg, dict(w0))
    store = MemoryVelocity()
    stored = RoundMachine(cfg, dict(w0), velocity_store=store)
    for t, vals in enumerate([(1.0, 3.0), (3.0, 2.0), (5.0, 4.0), (0.5, 1.0)], 1):
        (a,) = [c for c in _round(plain, vals, t) if isinstance(c, RoundAggregated)]
        (b,) = [c for c in _round(stored, vals, t) if isinstance(c, RoundAggregated)]
        np.testing.assert_array_equal(a.weights["w"], b.weights["w"])
        np.testing.assert_array_equal(a.velocity["w"], store.current["w"])
        assert b.velocity == {} and stored.velocity == {} and store.model_version == b.model_version == t
    # a velocity in memory and a store at once is refused
    with pytest.raises(ValueError, match="both"):
        RoundMachine(cfg, dict(w0), velocity={"w": np.ones((3, 4), np.float32)}, velocity_store=store)


def test_a_refused_aggregate_leaves_the_stored_velocity(tmp_path):
    cfg = RoundConfig(rounds=5, min_agents=2, expected_agents=2, server_momentum=0.6)
    w0 = {"w": np.zeros((3, 4), np.float32)}
    store = FileVelocity(tmp_path)
    m = RoundMachine(cfg, dict(w0), velocity_store=store)
    _round(m, (1.0, 3.0), 1.0)
    first = load(tmp_path / "velocity-1.bin", m.weights, 1)
    cmds = _round(m, (3e38, 3e38), 2.0)  # overflows: the round is abandoned
    assert not [c for c in cmds if isinstance(c, RoundAggregated)] and m.model_version == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["velocity-1.bin"]  # no velocity.tmp left
    np.testing.assert_array_equal(load(tmp_path / "velocity-1.bin", m.weights, 1)["w"], first["w"])
    (agg,) = [c for c in _round(m, (2.0, 2.0), 3.0) if isinstance(c, RoundAggregated)]
    np.testing.assert_allclose(load(tmp_path / "velocity-2.bin", m.weights, 2)["w"], 0.6 * 2.5 + (2.0 - 2.5))
    np.testing.assert_allclose(agg.weights["w"], 2.5 + 0.6 * 2.5 + (2.0 - 2.5))


def test_the_file_store_resumes_where_the_run_was(tmp_path):
    """Rounds with a file store, the store dropped (a crash) after round 2's checkpoint,
    a new store opened on version 2: round 3 is the one the first store made."""
    rng = np.random.default_rng(5)
    x = _model(rng)
    aggs = [_aggregate(rng, x) for _ in range(3)]
    store = FileVelocity(tmp_path)
    xs = [x]
    for version, agg in enumerate(aggs, 1):
        w = store.begin(velocity_layout(xs[-1]), version)
        xs.append(momentum_step_into(xs[-1], {k: a.copy() for k, a in agg.items()}, store, w, lr=1.0, beta=0.7))
        store.adopt(w)
        if version == 2:
            v2 = load(tmp_path / "velocity-2.bin", x, 2)
        store.prune(version)  # its checkpoint is written
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"velocity-{version}.bin"]
    store.close()
    again = FileVelocity(tmp_path)
    again.write_all(v2, x, 2)  # as after a crash between round 3's adoption and its checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["velocity-2.bin", "velocity-3.bin"]
    assert again.open(2, x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["velocity-2.bin"]  # version 3's is not this checkpoint's
    w = again.begin(velocity_layout(xs[2]), 3)
    redo = momentum_step_into(xs[2], {k: a.copy() for k, a in aggs[2].items()}, again, w, lr=1.0, beta=0.7)
    again.adopt(w)
    for k in x:
        np.testing.assert_array_equal(redo[k], xs[3][k], err_msg=k)
    # a checkpoint without a velocity file: the momentum starts from zero
    assert not FileVelocity(tmp_path).open(7, x)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_or_foreign_velocity_file_is_refused_with_its_name(tmp_path):
    rng = np.random.default_rng(6)
    x = _model(rng)
    store = FileVelocity(tmp_path)
    store.write_all({k: np.ones_like(v) for k, v in x.items() if v.dtype.kind == "f"}, x, 4)
    path = tmp_path / "velocity-4.bin"
    good = path.read_bytes()
    check_file(path, x, 4)
    with pytest.raises(FedagentError, match="other tensors"):
        check_file(path, {**x, "fc": np.zeros(5, np.float32)}, 4)
    with pytest.raises(FedagentError, match="other tensors"):
        check_file(path, x, 5)
    path.write_bytes(good[:-1])
    with pytest.raises(FedagentError, match="bytes, its header says"):
        check_file(path, x, 4)
    flipped = bytearray(good)
    flipped[-100] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(FedagentError, match="CRC-32"):
        check_file(path, x, 4)
    path.write_bytes(b"something else entirely")
    with pytest.raises(FedagentError, match="not a fedagent velocity file"):
        FileVelocity(tmp_path).open(4, x)
    nan = {k: np.ones_like(v) for k, v in x.items() if v.dtype.kind == "f"}
    nan["conv"][0, 0, 0, 0] = np.nan
    FileVelocity(tmp_path).write_all(nan, x, 4)
    with pytest.raises(FedagentError, match="not finite"):
        check_file(path, x, 4)


def test_a_velocity_that_cannot_be_written_leaves_the_previous_one(tmp_path, monkeypatch):
    """A full disk while the next velocity is written: StateWriteError (the coordinator
    exits 74, as for its checkpoint), no temp file, and the current velocity unchanged."""
    from fedagent.errors import StateWriteError

    cfg = RoundConfig(rounds=5, min_agents=2, expected_agents=2, server_momentum=0.6)
    store = FileVelocity(tmp_path)
    m = RoundMachine(cfg, {"w": np.zeros((3, 4), np.float32)}, velocity_store=store)
    _round(m, (1.0, 3.0), 1.0)
    before = (tmp_path / "velocity-1.bin").read_bytes()

    def full(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr("fedagent.coordinator.velocity.os.replace", full)
        with pytest.raises(StateWriteError, match="No space left"):
            _round(m, (2.0, 2.0), 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["velocity-1.bin"]
    assert (tmp_path / "velocity-1.bin").read_bytes() == before and m.model_version == 1
    # making a velocity durable (before its checkpoint) fails the same way
    with monkeypatch.context() as mp:
        mp.setattr("fedagent.coordinator.velocity.os.fsync", full)
        with pytest.raises(StateWriteError, match="No space left"):
            store.sync(1)
    store.sync(7)  # no velocity of that version: nothing to do
