"""What the agent does around training and evaluation each round, without changing what
they compute: weights loaded without a copy of their own, one evaluation model kept
between evaluations, glibc told to keep freed memory."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
import warnings

import numpy as np
import pytest
import torch

from fedagent.agent.core import Agent
from fedagent.tasks import digits
from fedagent.tasks.base import get_weights, set_weights


def _task() -> digits.DigitsTask:
    return digits.make({"shard": 0, "shards": 4, "seed": 0})


def test_set_weights_loads_values_and_keeps_no_reference_to_the_arrays() -> None:
    task = _task()
    model = task.build_model()
    torch.manual_seed(1)
    weights = get_weights(type(model)())  # other values than the model's own
    set_weights(model, weights)
    got = get_weights(model)
    assert all(np.array_equal(got[k], weights[k]) for k in weights)
    before = {k: v.copy() for k, v in got.items()}
    for v in weights.values():
        v += 1.0  # the caller's arrays change afterwards: the model does not
    after = get_weights(model)
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_set_weights_takes_read_only_arrays_without_a_warning() -> None:
    """Arrays decoded from a bytes payload are read-only views: copied, not refused."""
    model = _task().build_model()
    weights = {}
    for k, v in get_weights(model).items():
        ro = np.frombuffer((v * 2).tobytes(), dtype=v.dtype).reshape(v.shape)
        assert not ro.flags.writeable
        weights[k] = ro
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_weights(model, weights)
    got = get_weights(model)
    assert all(np.array_equal(got[k], weights[k]) for k in weights)


def _agent_like(task) -> types.SimpleNamespace:
    """What Agent.evaluate reads of an agent (a real Agent needs a config, PKI and a
    control socket; the method itself is what is tested)."""
    built: list[torch.nn.Module] = []
    inner = task.build_model

    def build_model() -> torch.nn.Module:
        built.append(inner())
        return built[-1]

    task.build_model = build_model
    ns = types.SimpleNamespace(task=task, model=inner(), thread_lock=threading.Lock(), _eval_model=None, built=built)
    ns.evaluate = types.MethodType(Agent.evaluate, ns)
    return ns


def test_evaluation_keeps_its_model_and_scores_as_a_fresh_one() -> None:
    task = _task()
    agent = _agent_like(task)
    models = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        weights = get_weights(digits.DigitsMLP())
        fresh = digits.DigitsMLP()
        set_weights(fresh, weights)
        assert agent.evaluate(weights) == task.evaluate(fresh)
        models.append(agent._eval_model[2])
    assert len(agent.built) == 1 and all(m is models[0] for m in models)


def test_evaluation_model_is_rebuilt_for_a_new_training_model_or_other_shapes() -> None:
    task = _task()
    agent = _agent_like(task)
    weights = get_weights(agent.model)
    agent.evaluate(weights)
    agent.model = task.build_model()  # as after a new vocabulary
    agent.built.clear()
    agent.evaluate(weights)
    assert len(agent.built) == 1
    # Weights of other shapes (a model on another vocabulary) never meet the kept model.
    wider = {k: np.zeros((v.shape[0] + 1, *v.shape[1:]), v.dtype) if v.ndim else v for k, v in weights.items()}
    with pytest.raises(RuntimeError):  # the task's model cannot take them: built anew, then refused
        agent.evaluate(wider)
    assert len(agent.built) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.procs
def test_keep_freed_memory_is_accepted_by_glibc() -> None:
    # In a process of its own: the setting is process-wide.
    out = subprocess.run(
        [sys.executable, "-c", "from fedagent.node.runtime import keep_freed_memory; print(keep_freed_memory())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"
