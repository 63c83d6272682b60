"""A torch module's fingerprint (:class:`~fedagent.protocols.fingerprint.Fingerprint`),
read from the module itself: which ``state_dict`` entries are parameters (trainable or
frozen) and which are buffers comes from ``named_parameters`` and ``named_buffers``,
never from the names; a non-persistent buffer is not in the ``state_dict`` and does not
travel. The dtypes are checked here, once, at a node's start: a tensor that cannot travel
stops the node with a configuration error (exit 78) naming it."""

from __future__ import annotations

import torch

from fedagent.errors import ConfigError
from fedagent.protocols.fingerprint import TRAVELS, Fingerprint, TensorInfo
from fedagent.tasks.base import Task

#: The module types ``[rounds] local_norm`` keeps on each agent (their parameters and
#: buffers): every normalisation layer torch ships.
NORM_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
    torch.nn.LocalResponseNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """The fingerprint of ``model``'s ``state_dict``; ConfigError (exit 78) for an entry
    that cannot travel: a dtype outside :data:`~fedagent.protocols.fingerprint.TRAVELS`
    (complex, quantised, float8 ...), a sparse tensor or extra state that is not a tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}  # (storage, offset, shape) -> first name
    out: list[TensorInfo] = []
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"model entry {name!r} is {type(value).__name__}, not a tensor: fedagent sends tensors only "
                "(move it out of the state_dict, e.g. into the task)"
            )
        if value.layout != torch.strided or value.is_quantized:
            raise ConfigError(
                f"model tensor {name!r} is {'quantised' if value.is_quantized else str(value.layout)}: fedagent sends "
                "dense tensors only"
            )
        dtype = dtype_name(value.dtype)
        if dtype not in TRAVELS:
            raise ConfigError(
                f"model tensor {name!r} has dtype {dtype}, which fedagent cannot send (it sends "
                f"{', '.join(TRAVELS)}): convert that layer before training"
            )
        if name in params:
            kind = "parameter" if params[name].requires_grad else "frozen"
        elif name in buffers:
            kind = "buffer"
        else:
            raise ConfigError(f"model entry {name!r} is neither a parameter nor a buffer of the model")
        tied_to = ""
        if value.numel():
            key = (value.untyped_storage().data_ptr(), int(value.storage_offset()), tuple(int(d) for d in value.shape))
            tied_to = first.setdefault(key, name)
            if tied_to == name:
                tied_to = ""
        owner = modules.get(name.rpartition(".")[0])
        out.append(
            TensorInfo(
                name,
                dtype,
                tuple(int(d) for d in value.shape),
                kind,
                tied_to,
                isinstance(owner, NORM_LAYERS),
            )
        )
    return Fingerprint(tuple(out))


def waits_for_vocabulary(task: object) -> bool:
    """A task whose model is built on a vocabulary agreed first (its size is the
    vocabulary's): its fingerprint is known only then, so it is not announced."""
    return callable(getattr(task, "term_counts", None)) and callable(getattr(task, "set_vocabulary", None))


def task_fingerprint(task: Task, model: torch.nn.Module | None = None) -> Fingerprint | None:
    """The fingerprint of ``task``'s model (``model``, or one built for the purpose
    without touching torch's global random state), or None when the model waits for a
    vocabulary. ConfigError for a model that cannot travel."""
    if waits_for_vocabulary(task):
        return None
    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = task.build_model()
    return fingerprint(model)
