"""WeightedMean.fold works block by block: the sums must be exactly what whole-array
arithmetic in the same precision gives, at any offset and across block boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from fedagent.protocols import aggregation
from fedagent.protocols.aggregation import WeightedMean


def whole_array_sum(ref, updates, compact):
    """The sums as fold computed them before it was blocked (three full temporaries)."""
    out = {}
    for name, r in ref.items():
        dt = np.float32 if compact and r.dtype in (np.float32, np.float16) else np.float64
        acc = np.zeros(r.size, dt)
        for u, w in updates:
            v = u[name].reshape(-1).astype(dt) - r.reshape(-1).astype(dt)
            acc += v * dt(w)
        out[name] = acc.reshape(r.shape)
    return out


@pytest.mark.parametrize("compact", [False, True])
def test_blocked_fold_equals_whole_array_arithmetic_bit_for_bit(compact, monkeypatch):
    monkeypatch.setattr(aggregation, "_FOLD_BLOCK", 1000)  # many blocks and a ragged last one
    rng = np.random.default_rng(7)
    ref = {
        "a": rng.standard_normal((37, 101)).astype(np.float32),
        "b": rng.standard_normal(2500).astype(np.float16),
        "c": rng.integers(-5, 5, 999).astype(np.int64),
        "d": rng.standard_normal(1001),
        "e": np.zeros((0, 3), np.float32),
    }
    updates = [
        ({k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in ref.items()}, w) for w in (1.0, 2.5, 7.0)
    ]
    m = WeightedMean(ref, compact=compact)
    for u, w in updates:
        m.add(u, w)
    expect = whole_array_sum(ref, updates, compact)
    for name in ref:
        assert m._sum[name].dtype == expect[name].dtype
        assert np.array_equal(m._sum[name], expect[name]), name


def test_fold_of_a_slice_touches_only_that_slice(monkeypatch):
    monkeypatch.setattr(aggregation, "_FOLD_BLOCK", 64)
    ref = {"w": np.arange(1000, dtype=np.float32)}
    m = WeightedMean(ref)
    m.fold("w", 300, np.full(150, 1000.0, np.float32), None, 2.0, delta=False)
    m.fold("w", 900, np.full(100, 0.5, np.float32), None, 4.0, delta=True)
    s = m._sum["w"]
    assert np.array_equal(s[300:450], 2.0 * (1000.0 - np.arange(300, 450)))
    assert np.array_equal(s[900:], np.full(100, 2.0))
    assert not s[:300].any() and not s[450:900].any()


def test_folds_reuse_one_scratch_per_dtype(monkeypatch):
    monkeypatch.setattr(aggregation, "_FOLD_BLOCK", 256)
    made = []
    real_empty = np.empty

    def counting_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        made.append(out.dtype)
        return out

    ref = {"a": np.zeros(1000, np.float32), "b": np.zeros(700, np.float64)}
    m = WeightedMean(ref, compact=True)
    monkeypatch.setattr(aggregation.np, "empty", counting_empty)
    for w in (1.0, 2.0, 3.0):
        m.add({"a": np.ones(1000, np.float32), "b": np.ones(700)}, w)
    monkeypatch.undo()
    assert sorted(map(str, made)) == ["float32", "float64"]  # one each, not one per fold
    assert np.array_equal(m._sum["a"], np.full(1000, 6.0, np.float32))
    assert np.array_equal(m._sum["b"], np.full(700, 6.0))


def test_a_scratch_in_use_is_not_handed_to_another_fold():
    m = WeightedMean({"a": np.zeros(10, np.float32)})
    first = m._take_scratch(np.dtype(np.float64))
    second = m._take_scratch(np.dtype(np.float64))
    assert first is not second
    m._give_scratch(first)
    assert m._take_scratch(np.dtype(np.float64)) is first
