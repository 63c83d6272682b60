"""The Task interface: what a workload gives fedagent, around a plain torch module.

A task is built by a factory ``make(options: dict) -> Task``. Built-in tasks are named
(``digits``); user code is named ``module:attribute`` in the config, where the
attribute is such a factory (see ``examples/custom_task.py``). The options a factory
declares as files (:func:`file_options`) arrive resolved against the config file's
directory. The agent calls ``fit`` in a worker thread, so it may block for as long as
training takes.
"""

from __future__ import annotations

import abc
import importlib
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fedagent.config.paths import TaskOptions
from fedagent.errors import ConfigError

Weights = dict[str, np.ndarray]


class Task(abc.ABC):
    """One workload on one node: a model and the node's own data."""

    #: Whether ``fit`` builds a torch optimiser: the agent then loads what torch loads
    #: lazily for the first one at start-up (:func:`warm_up_torch`), not in round 1.
    #: Tasks that train without one (word2vec, doc2vec) would only pay for it.
    uses_torch_optimiser: ClassVar[bool] = False

    @abc.abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A freshly initialised model; the same architecture on every node."""

    @abc.abstractmethod
    def num_samples(self) -> int:
        """How many local training samples (the FedAvg weight of this node)."""

    @abc.abstractmethod
    def fit(self, model: torch.nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        """Train ``model`` in place on local data; return metrics (e.g. ``loss``)."""

    @abc.abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Metrics of ``model`` on this node's held-out data (e.g. ``accuracy``)."""

    def fit_steps(
        self, model: torch.nn.Module, *, steps: int, lr: float, batch_size: int, seed: int
    ) -> dict[str, float]:
        """Train ``model`` in place for ``steps`` mini-batches (gossip mode exchanges every
        few steps, not every epoch; FedAvg with ``[rounds] local_steps`` trains that many a
        round). Tasks that support either override this."""
        raise ConfigError(
            f"task {type(self).__name__} has no fit_steps(): it supports neither gossip mode nor [rounds] local_steps"
        )


class SyncTask(Task):
    """A task trained by Sync-Opt (gFedNTM Algorithm 1): the coordinator owns the
    optimizer and applies it to the sample-weighted mean of the agents' per-step gradients.

    Before training, agents agree on a vocabulary: each sends ``term_counts()`` (never a
    document), the coordinator merges them and every agent calls ``set_vocabulary()``;
    ``build_model()`` needs that done first (the input size is the vocabulary's)."""

    batch_size: int

    @abc.abstractmethod
    def term_counts(self) -> dict[str, int]:
        """This node's vocabulary with its term counts."""

    @abc.abstractmethod
    def set_vocabulary(self, terms: list[str]) -> None:
        """Re-index the local data to the common vocabulary (other terms are dropped)."""

    @abc.abstractmethod
    def num_batches(self) -> int:
        """Mini-batches in one local epoch."""

    @abc.abstractmethod
    def step_loss(self, model: torch.nn.Module, step: int) -> tuple[torch.Tensor, int]:
        """Mean loss over this node's mini-batch of global step ``step`` and its size; the
        batch and every random draw are fixed by (seed, shard, step)."""

    @abc.abstractmethod
    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """The optimizer the coordinator applies to aggregated gradients."""

    def validation_loss(self, model: torch.nn.Module) -> tuple[float, int]:
        """Mean loss of ``model`` over this node's held-out documents and their number,
        for early stopping (``[syncopt] patience``); tasks without held-out data keep
        this default and cannot run with early stopping."""
        raise NotImplementedError(f"{type(self).__name__} has no validation_loss(): set [syncopt] patience = 0")

    @abc.abstractmethod
    def topics(self, model: torch.nn.Module, n_words: int = 10) -> list[list[str]]:
        """Top words of every topic."""

    @abc.abstractmethod
    def topic_word(self, model: torch.nn.Module) -> np.ndarray:
        """Topic-word distributions, K x V, rows summing to 1."""


def get_weights(model: torch.nn.Module) -> Weights:
    """The model's state as numpy arrays (copies, so training can't change them). A
    bfloat16 tensor, which numpy has no type for, comes as float32: every bfloat16 value
    is one, exactly (:mod:`fedagent.protocols.fingerprint`)."""
    return {k: _as_array(v) for k, v in model.state_dict().items()}


def _as_array(value: torch.Tensor) -> np.ndarray:
    t = value.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy().copy()


def set_weights(model: torch.nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Copy ``weights`` into the model's parameters and buffers (the arrays are not
    kept: ``load_state_dict`` copies each into the model's own tensor, in its dtype: a
    float32 array into a bfloat16 tensor is rounded to nearest even)."""
    state = model.state_dict()
    if state.keys() != weights.keys():
        raise ValueError("weights do not match the model's parameters")
    model.load_state_dict({k: _as_tensor(v) for k, v in weights.items()})


def _as_tensor(value: np.ndarray) -> torch.Tensor:
    """A tensor over ``value``'s memory, for load_state_dict to copy from: no copy of
    its own (a model's worth of fresh memory every time a model is loaded), except for
    a read-only array, which torch.from_numpy does not take without a warning."""
    a = np.asarray(value)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


BUILTIN: dict[str, str] = {
    "digits": "fedagent.tasks.digits:make",
    "flsimco": "fedagent.tasks.flsimco:make",
    "prodlda": "fedagent.tasks.ntm:make_prodlda",
    "combinedtm": "fedagent.tasks.ntm:make_combinedtm",
    "word2vec": "fedagent.tasks.word2vec:make",
    "doc2vec": "fedagent.tasks.doc2vec:make",
    "synthetic": "fedagent.tasks.synthetic:make",
}


Factory = TypeVar("Factory", bound=Callable[..., Any])


def file_options(*names: str) -> Callable[[Factory], Factory]:
    """Declare which options of a task factory name files: a relative path given there in
    a config file is taken from the file's directory (not the daemon's working
    directory), after ``$VARIABLES`` and ``~`` are expanded, as for every other path of
    the file. The factory gets it as a string, like the other options."""

    def declare(factory: Factory) -> Factory:
        factory.file_options = tuple(names)  # type: ignore[attr-defined]
        return factory

    return declare


def load_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """Build the task named in a config: a built-in name or ``module:attribute``.
    ``options`` read from a config file (:class:`~fedagent.config.TaskOptions`) know the
    file's directory, which the factory's file options are resolved against."""
    spec = BUILTIN.get(name, name)
    if ":" not in spec:
        raise ConfigError(f"unknown task {name!r}: use one of {sorted(BUILTIN)} or 'module:attribute'")
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[dict[str, Any]], Task] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load task {name!r}: {exc}") from exc
    base = options.base_dir if isinstance(options, TaskOptions) else None
    files = tuple(getattr(factory, "file_options", ()))
    try:
        task = factory(TaskOptions(options, base).with_files(files))
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"task {name!r} could not be built: {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise ConfigError(f"task factory {name!r} returned {type(task).__name__}, not a fedagent Task")
    return task


def warm_up_torch() -> float:
    """Load what torch loads lazily on a node's first training step, and return the
    seconds it took.

    torch 2.x imports its compiler stack (``torch._dynamo``, sympy: about 1.1 CPU-seconds)
    the first time an optimiser is built. Paid inside the first round, ten agents on two
    cores made round 1 several seconds longer than the others; paid at start-up it
    happens before the agent says it is there. The throwaway optimiser touches no model.
    """
    started = time.perf_counter()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return time.perf_counter() - started
