"""A zoo of models a user might bring, each a task on the digits data (it ships inside
fedagent: nothing is downloaded), for the tests that train them through fedagent.

Reachable by the daemons as ``task = { name = "zoo:make", model = "resnet", ... }`` with
this directory on ``PYTHONPATH``; the other options are the digits task's (``shard``,
``shards``, ``alpha``, ``seed``), so a federation splits the data non-IID as the digits
task does.

=============  ================================================================================
``resnet``     a small ResNet: a convolution stem and one residual block, BatchNorm after every
               convolution (running mean, variance and a batch counter), inputs scaled by 0.01
               so the running variances shrink towards zero as they learn the data's
``transformer`` a Transformer encoder over the pooled image's pixels as tokens (each place and
               intensity a token of its own): an embedding, one encoder layer (LayerNorms,
               attention), and the class scores read through the embedding itself (tied
               weights: the head is the class tokens' rows)
``lstm``       an LSTM over the image's 8 rows
``bf16``       an MLP whose hidden layer is bfloat16, with a bfloat16 buffer (a running mean of
               the hidden activations, updated while training)
``fp16``       the same with a float16 layer and buffer
``frozen``     an MLP with a frozen random projection in front, a non-persistent buffer (the
               pixel mean it subtracts, never sent), a float64 layer, a float64 buffer and an
               int64 counter
``every``      all of the above, smaller, side by side (their class scores summed): one model
               with every kind of tensor, for the tests a CI runs on every change
=============  ================================================================================

:func:`reference_fedavg` is FedAvg as fedagent states it, written out here on its own
(in numpy, from the task's model): what the tests compare a federation of daemons with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fedagent.protocols.secagg import SecAggParams, flatten, quantise, unflatten
from fedagent.tasks.digits import DigitsTask

PIXEL_TOKENS = 17  # a digits pixel is 0..16
TOKENS = 16  # the transformer's sequence: the 4x4-pooled image
CLASSES = 10


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class ResNet(nn.Module):
    """``side``: the image is pooled to ``side`` x ``side`` pixels first (8: as it is)."""

    def __init__(self, width: int = 6, side: int = 8) -> None:
        super().__init__()
        self.side = side
        self.stem = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block = Block(width)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(width * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(0.01 * x.view(-1, 1, 8, 8), self.side)
        h = torch.relu(self.bn(self.stem(x)))
        return self.fc(self.pool(self.block(h)).flatten(1))


class Transformer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        # A token is a pixel of the 4x4-pooled image at its place: (position, intensity).
        self.vocab = TOKENS * PIXEL_TOKENS
        self.embed = nn.Embedding(self.vocab + CLASSES, d)
        nn.init.normal_(self.embed.weight, std=0.1)
        self.encoder = nn.TransformerEncoderLayer(
            d, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab + CLASSES, bias=False)
        self.head.weight = self.embed.weight  # tied: a class's score is its token's embedding
        self.register_buffer("places", torch.arange(TOKENS) * PIXEL_TOKENS, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.avg_pool2d(x.view(-1, 1, 8, 8), 2).flatten(1)
        tokens = torch.round(pooled * 16).long().clamp(0, PIXEL_TOKENS - 1) + self.places
        h = self.encoder(self.embed(tokens))
        return self.head(self.norm(h.mean(1)))[:, self.vocab :]


class Lstm(nn.Module):
    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.view(-1, 8, 8) * 2 - 1)  # pixels centred: its gates learn faster
        return self.fc(out[:, -1])


class HalfMlp(nn.Module):
    """A hidden layer in ``dtype``, with a running mean of its activations (a buffer of
    ``dtype``, non-negative: the activations are ReLU's)."""

    def __init__(self, dtype: torch.dtype, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, hidden).to(dtype)
        self.register_buffer("act_mean", torch.zeros(hidden, dtype=dtype))
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x.to(self.hidden.weight.dtype)))
        if self.training:
            with torch.no_grad():
                self.act_mean.mul_(0.9).add_(0.1 * h.mean(0))
        return self.out(h.float())


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(64, 48)
        self.project.requires_grad_(False)  # a fixed random feature map
        self.register_buffer("pixel_mean", torch.full((64,), 0.3), persistent=False)
        self.mid = nn.Linear(48, 32).double()
        self.register_buffer("feature_scale", torch.ones(32, dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.project(x - self.pixel_mean)).double()
        h = torch.relu(self.mid(h))
        if self.training:
            with torch.no_grad():
                self.steps += 1
                self.feature_scale.mul_(0.9).add_(0.1 * h.std(0))
        return self.out(h.float())


class Every(nn.Module):
    """Every model of the zoo in one, each smaller: what one federation can check at once."""

    def __init__(self) -> None:
        super().__init__()
        self.resnet = ResNet(width=4, side=4)
        self.transformer = Transformer(d=8)
        self.lstm = Lstm(hidden=12)
        self.bf16 = HalfMlp(torch.bfloat16, hidden=16)
        self.fp16 = HalfMlp(torch.float16, hidden=16)
        self.frozen = Frozen()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((m(x) for m in self.children()), torch.zeros(()))


MODELS = {
    "resnet": ResNet,
    "transformer": Transformer,
    "lstm": Lstm,
    "bf16": lambda: HalfMlp(torch.bfloat16),
    "fp16": lambda: HalfMlp(torch.float16),
    "frozen": Frozen,
    "every": Every,
}


class Complex(nn.Module):
    """A model fedagent cannot send (complex weights): refused at start."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
        self.out = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class ZooTask(DigitsTask):
    """The digits data with one of :data:`MODELS` (``hidden``: the width of the float16
    and bfloat16 models' hidden layer, for a model that differs from the others')."""

    def __init__(self, model: str, hidden: int = 32, **kw: Any) -> None:
        super().__init__(**kw)
        self.model_name = model
        self.hidden = hidden

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.model_name in ("bf16", "fp16"):
            return HalfMlp(torch.bfloat16 if self.model_name == "bf16" else torch.float16, self.hidden)
        if self.model_name == "complex":
            return Complex()
        return MODELS[self.model_name]()


def make(options: dict[str, Any]) -> ZooTask:
    opts = dict(options)
    model = str(opts.pop("model"))
    if model not in MODELS and model != "complex":
        raise ValueError(f"zoo: no model {model!r}; choose one of {sorted(MODELS)}")
    shard = opts.get("shard")
    return ZooTask(
        model,
        hidden=int(opts.get("hidden", 32)),
        shard=None if shard is None else int(shard),
        shards=int(opts.get("shards", 1)),
        alpha=float(opts.get("alpha", 0.5)),
        seed=int(opts.get("seed", 0)),
    )


class CsvTask(ZooTask):
    """The README's kind of task: a site's own CSV file (64 pixels, then the digit) when
    the ``csv`` option names one, no data otherwise (the coordinator only builds the
    model; an agent whose option is misspelt has none either)."""

    def __init__(self, csv: str | None, **kw: Any) -> None:
        super().__init__("fp16", **kw)
        if csv is None:
            self.x_train, self.y_train = torch.empty(0, 64), torch.empty(0, dtype=torch.long)
        else:
            data = torch.from_numpy(np.loadtxt(csv, delimiter=",", dtype=np.float32, ndmin=2))
            self.x_train, self.y_train = data[:, :-1], data[:, -1].long()


def make_csv(options: dict[str, Any]) -> CsvTask:
    return CsvTask(options.get("csv"), seed=int(options.get("seed", 0)), shard=None, shards=1, alpha=1.0)


# ---- FedAvg as fedagent states it, on its own ----------------------------------------
def _int8(d: np.ndarray) -> np.ndarray:
    """``d`` through int8 with one scale a tensor (``max|d| / 127``), as it travels."""
    peak = float(np.abs(d).max()) if d.size else 0.0
    if peak == 0:
        return np.zeros_like(d)
    scale = np.float32(peak / 127.0)
    return (np.clip(np.rint(d / scale), -127, 127).astype(np.float32) * scale).astype(np.float32)


def state(model: nn.Module) -> dict[str, np.ndarray]:
    """The state_dict as numpy, bfloat16 as float32 (as fedagent holds it)."""
    return {
        k: (v.detach().float() if v.dtype == torch.bfloat16 else v.detach()).numpy().copy()
        for k, v in model.state_dict().items()
    }


def load(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})


def norm_tensors(model: nn.Module) -> set[str]:
    """The state_dict entries of the model's normalisation layers (what ``local_norm``
    keeps on the agents)."""
    norm_types = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    modules = dict(model.named_modules())
    return {k for k in model.state_dict() if isinstance(modules.get(k.rpartition(".")[0]), norm_types)}


def reference_fedavg(
    tasks: list[ZooTask],
    rounds: int,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    momentum: float = 0.7,
    local_norm: bool = False,
    secure: float = 0.0,
    sites: list[dict[str, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """The global model after ``rounds`` of FedAvg over ``tasks`` (one per agent), as the
    docs state it (docs/tasks.md, "How each tensor is aggregated"):

    * each agent trains from the global model (with its own normalisation layers under
      ``local_norm``, sending the global model's values for them) and sends its floating
      parameters as an int8 step from the global model (float32 arithmetic), its buffers
      and integers exactly;
    * a parameter's aggregate is the global model plus the sample-weighted mean of the
      steps, summed in float32 for float32, float16 and bfloat16 tensors (float64 for
      float64 ones); a buffer's is the weighted mean of the values, in float64 (an integer
      one rounded);
    * the trainable parameters then take the server momentum in their dtype (``v ← Δ + β·v``,
      ``x ← x + v``); the rest is the aggregate itself (the normalisation layers under
      ``local_norm``: the global model's);
    * the next global model is the previous one plus its float32 trainable parameters'
      step as the agents rebuild it from int8 (the rest whole).

    ``secure``: secure aggregation with this clip range instead: each agent's floating
    tensors' difference from the global model, weighted by its samples over the most any
    agent has, quantised to 2^20 levels by fedagent's quantiser (the masks cancel, so the
    masked sum is the sum of these); their mean added to the global model in float64; the
    model broadcast whole; the integer tensors kept at the global model's values.
    ``sites`` receives each agent's own normalisation layers at the end (``local_norm``).
    """
    compressed = not secure
    levels = SecAggParams(clip=secure or 1.0)
    models = [t.build_model() for t in tasks]
    ref = tasks[0].build_model()
    global_ = state(ref)
    params = dict(ref.named_parameters(remove_duplicate=False))
    trainable = {k for k, p in params.items() if p.requires_grad}
    norm = norm_tensors(ref)
    kept = norm if local_norm else set()
    buffers = set(global_) - set(params)
    own: list[dict[str, np.ndarray]] = [{k: global_[k] for k in kept} for _ in tasks]
    velocity = {k: np.zeros_like(v) for k, v in global_.items() if k in trainable}
    n = [float(t.num_samples()) for t in tasks]
    for r in range(1, rounds + 1):
        sent = []
        for i, (task, model) in enumerate(zip(tasks, models, strict=True)):
            load(model, {**global_, **own[i]})
            task.fit(model, epochs=epochs, lr=lr, batch_size=batch_size, seed=r)
            w = state(model)
            own[i] = {k: w[k] for k in kept}
            w.update({k: global_[k] for k in kept})
            sent.append(w)
        masked = _masked_mean(global_, sent, n, levels) if secure else {}
        new = {}
        for k, g in global_.items():
            if k in kept or (secure and g.dtype.kind in "iub"):
                new[k] = g
                continue
            if secure:
                agg = masked[k]
                if k in trainable:
                    velocity[k] = (agg - g) + g.dtype.type(momentum) * velocity[k]
                    agg = g + velocity[k]
                new[k] = agg
                continue
            if k in buffers:
                mean = sum(n[i] * sent[i][k].astype(np.float64) for i in range(len(tasks))) / sum(n)
                new[k] = np.rint(mean).astype(g.dtype) if g.dtype.kind in "iub" else mean.astype(g.dtype)
                continue
            acc_t = np.float32 if g.dtype in (np.float32, np.float16) else np.float64
            acc = np.zeros(g.shape, acc_t)
            for i in range(len(tasks)):
                v = sent[i][k]
                step = (
                    _int8(v.astype(np.float32) - g.astype(np.float32))
                    if compressed
                    else v.astype(acc_t) - g.astype(acc_t)
                )
                acc += step.astype(acc_t) * acc_t(n[i])
            agg = (acc / acc_t(sum(n)) + g.astype(acc_t)).astype(g.dtype)
            if k in trainable:  # in the tensor's dtype, as the coordinator steps
                velocity[k] = (agg - g) + g.dtype.type(momentum) * velocity[k]
                new[k] = g + velocity[k]
            else:
                new[k] = agg
        for k, g in global_.items():  # the int8 downlink: a float32 trainable parameter's step
            if compressed and k in trainable and k not in kept and g.dtype == np.float32:
                new[k] = g + _int8(new[k] - g)
        global_ = new
    if sites is not None:
        sites.extend(own)
    return global_


def _masked_mean(
    global_: dict[str, np.ndarray], sent: list[dict[str, np.ndarray]], n: list[float], params: SecAggParams
) -> dict[str, np.ndarray]:
    """Secure aggregation's result for the floating tensors: the global model plus the
    dequantised mean of the agents' quantised, weighted differences."""
    layout, base = flatten(global_)
    top = max(n)
    total = np.zeros(base.size, np.uint64)
    for w, samples in zip(sent, n, strict=True):
        _, mine = flatten(w)
        total += quantise(mine - base, params, scale=min(samples, top) / top)
    mean = (total.astype(np.float64) * params.step - len(sent) * params.clip) / sum(min(s, top) / top for s in n)
    return unflatten(layout, base + mean, global_)
