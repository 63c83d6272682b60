"""A torch module's fingerprint comes from the module (parameters, frozen parameters,
buffers, ties, normalisation layers), never from names; a dtype that cannot travel stops
the node at start; bfloat16 tensors travel as float32 and are rounded back to nearest
even when loaded."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fedagent.errors import EXIT_CONFIG, ConfigError
from fedagent.tasks.base import get_weights, load_task, set_weights
from fedagent.tasks.fingerprint import fingerprint, task_fingerprint


class Odd(nn.Module):
    """Names that lie: a parameter called running_var, a buffer called weight."""

    def __init__(self) -> None:
        super().__init__()
        self.running_var = nn.Parameter(torch.ones(3))
        self.register_buffer("weight", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(5), persistent=False)
        self.embed = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.GroupNorm(1, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_the_kinds_come_from_the_module_not_the_names():
    fp = fingerprint(Odd())
    got = {t.name: (t.kind, t.tied_to, t.norm) for t in fp.tensors}
    assert got == {
        "running_var": ("parameter", "", False),
        "weight": ("buffer", "", False),
        "embed.weight": ("parameter", "", False),
        "head.weight": ("parameter", "embed.weight", False),
        "norm.weight": ("parameter", "", True),
        "norm.bias": ("parameter", "", True),
        "frozen.weight": ("frozen", "", False),
        "frozen.bias": ("frozen", "", False),
    }
    assert "scratch" not in got  # non-persistent: not in the state_dict, never sent
    assert [t.name for t in fp.tensors] == list(Odd().state_dict())


def test_batchnorm_buffers_and_their_dtypes():
    fp = fingerprint(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))
    kinds = {t.name: (t.kind, t.dtype, t.shape, t.norm) for t in fp.tensors}
    assert kinds["1.running_var"] == ("buffer", "float32", (4,), True)
    assert kinds["1.num_batches_tracked"] == ("buffer", "int64", (), True)
    assert kinds["0.weight"] == ("parameter", "float32", (4, 2), False)
    assert fp.roles(local_norm=True).kept == {n for n in kinds if n.startswith("1.")}


class Ids(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(3, dtype=torch.uint32))


def _complex() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: complex modules are "a new feature"
        return nn.Linear(2, 2).to(torch.complex64)


@pytest.mark.parametrize(
    "layer, words",
    [
        (_complex, "dtype complex64"),
        (lambda: nn.Linear(2, 2).to(torch.float8_e4m3fn), "dtype float8_e4m3fn"),
        (Ids, "dtype uint32"),
    ],
)
def test_a_dtype_that_cannot_travel_is_a_configuration_error(layer, words):
    model = nn.Sequential(nn.Linear(2, 2), layer())
    with pytest.raises(ConfigError) as info:
        fingerprint(model)
    assert info.value.exit_code == EXIT_CONFIG
    assert "'1.weight'" in str(info.value) and words in str(info.value) and "\n" not in str(info.value)


def test_extra_state_that_is_not_a_tensor_is_refused():
    class WithExtra(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"note": 1}

        def set_extra_state(self, state: dict) -> None:
            pass

    with pytest.raises(ConfigError, match="not a tensor"):
        fingerprint(WithExtra(2, 2))


def test_bfloat16_travels_as_float32_and_is_rounded_back_to_nearest_even():
    model = nn.Linear(3, 2).to(torch.bfloat16)
    w = get_weights(model)
    assert w["weight"].dtype == np.float32
    np.testing.assert_array_equal(w["weight"], model.weight.detach().float().numpy())
    # 1 + 2^-8 is halfway between two bfloat16 values: to even (1.0); 1 + 3·2^-8 to 1 + 2^-6.
    mean = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -2.0]] * 2, np.float32)
    set_weights(model, {**w, "weight": mean})
    assert model.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(model.weight.detach().float().numpy()[0], [1.0, 1 + 2**-6, -2.0])
    assert fingerprint(model).model_dtypes() == {"weight": "bfloat16", "bias": "bfloat16"}


def test_float16_and_float64_travel_in_their_dtype():
    model = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2).double())
    w = get_weights(model)
    assert w["0.weight"].dtype == np.float16 and w["1.weight"].dtype == np.float64
    assert fingerprint(model).model_dtypes() == {}


def test_the_same_task_gives_the_same_digest_and_leaves_the_random_state_alone():
    task = load_task("digits", {"seed": 0})
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    a = task_fingerprint(task)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = task_fingerprint(load_task("digits", {"seed": 3, "shard": 1, "shards": 2}))
    assert a is not None and b is not None and a.digest == b.digest
