"""Built-in task ``flsimco``: a vehicle's self-supervised SimCo encoder on motion-blurred
images (FLSimCo, Gu et al.; shared/seeds/001).

Data: the 1,797 real 8×8 UCI digits (shipped in fedagent), upsampled to 16×16 so that a
motion-blur kernel of a few pixels means something. A fixed 25 % is held out; the rest
is split over ``shards`` by Dirichlet(``alpha``) label skew (``alpha = 0`` = IID).

Mobility: the vehicle's ``speed`` (km/h) is given, or drawn from the truncated Gaussian
of eq. 1; its blur level is eq. 2, ``L = (H s / Q) v`` pixels, and every local image is
smeared by a horizontal line kernel of length L (:mod:`fedagent.protocols.mobility`).
The defaults (H s / Q = 0.04 px per km/h) give 4 px of blur at 100 km/h on 16 px.

Training: SimCo's dual-temperature loss (eqs. 6-8), no momentum encoder, no queue. For
image i the anchor ``q_i = f(π1(x_i))`` and positive ``k_i = f(π2(x_i))`` are two
augmentations (eqs. 3-4); the negatives are ``k_j = f(x_j)``, j ≠ i, the other images of
the mini-batch without augmentation (eq. 5; ``negatives = "keys"`` uses the other
images' positives instead, as SimCo's code does). With ``p_τ(i)`` the softmax
probability of the positive among {positive, K negatives} at temperature τ::

    L_i = - sg[ (1 - p_τβ(i)) / (1 - p_τα(i)) ] · log p_τα(i)

averaged over the batch (eq. 9). Features are L2-normalised before the dot products
(as in SimCo); the encoder is a small ResNet (3 basic blocks, 16-32 channels,
GroupNorm) with a 64-D projection head (Linear-BatchNorm-ReLU-Linear), sized for CPU.

Reported with every update: ``loss``, ``speed`` and ``blur_level`` (what the
coordinator's ``blur`` and ``drop_above`` aggregation strategies read).
``evaluate``: kNN accuracy (k = 10, cosine) of the backbone features, memory = the
clean labelled training images, queries = the clean held-out images.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedagent.errors import ConfigError
from fedagent.protocols.mobility import blur_images, blur_level, sample_speeds
from fedagent.tasks.base import Task
from fedagent.tasks.digits import dirichlet_split, load_digits_arrays, train_test_split

SIZE = 16
DEFAULT_CAMERA = {"exposure": 0.01, "focal": 0.02, "pixel": 0.005}  # H s / Q = 0.04 px per km/h
DEFAULT_MOBILITY = {"mu": 90.0, "sigma": 20.0, "v_min": 50.0, "v_max": 130.0}


# ---- the loss (eqs. 6-8) -----------------------------------------------------------
def dual_temperature_loss(
    q: torch.Tensor, k_pos: torch.Tensor, k_neg: torch.Tensor, tau_alpha: float = 0.1, tau_beta: float = 1.0
) -> torch.Tensor:
    """Mean SimCo loss of a batch: ``q``, ``k_pos`` (M, D) anchors and their positives;
    ``k_neg`` (M, D) the negative keys, anchor i using every row j ≠ i (K = M − 1)."""
    if q.shape != k_pos.shape or q.shape != k_neg.shape or q.dim() != 2 or q.shape[0] < 2:
        raise ValueError("q, k_pos and k_neg must be (M, D) with M >= 2")
    q, k_pos, k_neg = F.normalize(q, dim=1), F.normalize(k_pos, dim=1), F.normalize(k_neg, dim=1)
    pos = (q * k_pos).sum(1, keepdim=True)  # (M, 1)
    neg = q @ k_neg.T  # (M, M)
    eye = torch.eye(q.shape[0], dtype=torch.bool, device=q.device)
    neg = neg.masked_fill(eye, float("-inf"))  # j ≠ i
    logits = torch.cat([pos, neg], dim=1)  # positive first
    log_p_alpha = F.log_softmax(logits / tau_alpha, dim=1)[:, 0]
    # W = 1 - p is the negatives' share of the softmax mass, taken in log space: once an
    # easy positive rounds p_alpha to 1.0 in float32, "1 - p" is 0 and the ratio explodes.
    log_w_alpha = torch.logsumexp(neg / tau_alpha, 1) - torch.logsumexp(logits / tau_alpha, 1)  # eq. 8
    log_w_beta = torch.logsumexp(neg / tau_beta, 1) - torch.logsumexp(logits / tau_beta, 1)  # eq. 7
    ratio = (log_w_beta - log_w_alpha).exp().detach()  # sg[·]
    return -(ratio * log_p_alpha).mean()  # eqs. 6, 9


# ---- the encoder -------------------------------------------------------------------
def _norm(channels: int) -> nn.Module:
    # GroupNorm, not BatchNorm, in the backbone: it keeps no running statistics, so the
    # features a global model gives at evaluation are the ones its vehicles trained, and
    # averaging has no batch statistics of label-skewed, differently blurred vehicles to
    # mix (Hsieh et al., "The Non-IID Data Quagmire", the paper's ref. [48]).
    return nn.GroupNorm(8, channels)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = _norm(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = _norm(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """Backbone (stem + 3 basic blocks with GroupNorm, global pooling → 32-D) and a 64-D
    projection head Linear-BatchNorm-ReLU-Linear (SimCLR's head)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), _norm(16), nn.ReLU())
        self.blocks = nn.Sequential(_Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 32, 1))
        # The BatchNorm centres the projections over the batch. Without it every image's
        # projection shares one large common direction (the pooled features are all
        # positive), all cosines are ~1, the softmax over {positive, negatives} is uniform
        # and the loss sits at log(batch) with nearly no gradient: the encoder never starts
        # to learn. Its running statistics are never used (evaluation reads the backbone,
        # and the loss is defined in training mode), so averaging them is harmless.
        self.head = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, dim))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# ---- augmentation (π1, π2) ---------------------------------------------------------
def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shift (±2 px), contrast/brightness jitter and pixel noise, per image."""
    n = x.shape[0]
    padded = F.pad(x, (2, 2, 2, 2))
    dx = torch.randint(0, 5, (n,), generator=gen).tolist()
    dy = torch.randint(0, 5, (n,), generator=gen).tolist()
    out = torch.stack([padded[i, :, dy[i] : dy[i] + SIZE, dx[i] : dx[i] + SIZE] for i in range(n)])
    contrast = 0.6 + 0.8 * torch.rand((n, 1, 1, 1), generator=gen)
    bright = 0.2 * (torch.rand((n, 1, 1, 1), generator=gen) - 0.5)
    noise = 0.08 * torch.randn(out.shape, generator=gen)
    return (out * contrast + bright + noise).clamp(0.0, 1.0)


def _to_images(x: np.ndarray) -> np.ndarray:
    """(N, 64) digits in [0, 1] → (N, 16, 16) by bilinear upsampling."""
    t = torch.from_numpy(x.reshape(-1, 1, 8, 8))
    return F.interpolate(t, size=(SIZE, SIZE), mode="bilinear", align_corners=False)[:, 0].numpy()


class FLSimCoTask(Task):
    uses_torch_optimiser = True

    def __init__(
        self,
        *,
        shard: int | None,
        shards: int,
        alpha: float,
        seed: int,
        speed: float,
        camera: dict[str, float],
        tau_alpha: float,
        tau_beta: float,
        negatives: str,
    ) -> None:
        x, y = load_digits_arrays()
        (xtr, ytr), (xte, yte) = train_test_split(x, y, seed=seed)
        self.memory = torch.from_numpy(_to_images(xtr))[:, None]
        self.memory_labels = torch.from_numpy(ytr)
        self.queries = torch.from_numpy(_to_images(xte))[:, None]
        self.query_labels = torch.from_numpy(yte)
        if shard is not None:
            if not 0 <= shard < shards:
                raise ConfigError(f"flsimco: shard {shard} not in 0..{shards - 1}")
            if alpha > 0:
                idx = dirichlet_split(ytr, shards, alpha, seed=seed, min_size=32)[shard]
            else:  # IID: an even random split
                idx = np.sort(np.array_split(np.random.default_rng(seed).permutation(len(ytr)), shards)[shard])
            xtr = xtr[idx]
        self.speed = float(speed)
        self.blur = blur_level(self.speed, **camera)
        self.images = torch.from_numpy(blur_images(_to_images(xtr), self.blur))[:, None]
        self.seed, self.tau_alpha, self.tau_beta, self.negatives = seed, tau_alpha, tau_beta, negatives

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return SmallResNet()

    def num_samples(self) -> int:
        return len(self.images)

    def fit(self, model: nn.Module, *, epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, float]:
        gen = torch.Generator().manual_seed(seed * 7919 + int(self.speed * 1000))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        model.train()
        total, count = 0.0, 0
        n = len(self.images)
        for _ in range(epochs):
            # ``loss`` is the last epoch's: the loss of the model the vehicle uploads, not
            # an average dragged up by the first epochs from the global model.
            total, count = 0.0, 0
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, batch_size):
                b = order[start : start + batch_size]
                if len(b) < 2:  # a lone image has no negative
                    continue
                x = self.images[b]
                q = model(augment(x, gen))
                k = model(augment(x, gen))
                neg = k if self.negatives == "keys" else model(x)
                loss = dual_temperature_loss(q, k, neg, self.tau_alpha, self.tau_beta)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(b)
                count += len(b)
        return {"loss": total / max(count, 1), "speed": self.speed, "blur_level": self.blur}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {
            "knn_accuracy": knn_accuracy(model, self.memory, self.memory_labels, self.queries, self.query_labels),
            "simco_loss": heldout_loss(model, self.queries, self.tau_alpha, self.tau_beta, self.negatives),
        }


EVAL_BATCH = 64


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    images: torch.Tensor,
    tau_alpha: float = 0.1,
    tau_beta: float = 1.0,
    negatives: str = "raw",
    seed: int = 12345,
) -> float:
    """The SimCo loss of ``model`` on clean held-out images, with augmentations drawn from
    a fixed ``seed``: the same batches and views for every model, so two global models
    (two rounds, two strategies) are compared on exactly the same problem. Full batches
    of ``EVAL_BATCH`` only, so log(EVAL_BATCH) is the loss of an encoder that cannot tell
    images apart. Run on a copy in training mode: the loss is defined with batch
    statistics (as in training), and the caller's normalisation buffers stay untouched."""
    net = copy.deepcopy(model).train()
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for start in range(0, len(images) - EVAL_BATCH + 1, EVAL_BATCH):
        x = images[start : start + EVAL_BATCH]
        q, k = net(augment(x, gen)), net(augment(x, gen))
        neg = k if negatives == "keys" else net(x)
        losses.append(float(dual_temperature_loss(q, k, neg, tau_alpha, tau_beta)))
    if not losses:
        raise ValueError(f"heldout_loss needs at least {EVAL_BATCH} images")
    return sum(losses) / len(losses)


@torch.no_grad()
def knn_accuracy(
    model: nn.Module,
    memory: torch.Tensor,
    memory_labels: torch.Tensor,
    queries: torch.Tensor,
    query_labels: torch.Tensor,
    k: int = 10,
    t: float = 0.1,
) -> float:
    """Weighted kNN (cosine similarity, weights exp(s/t)) on the backbone's features."""
    model.eval()
    feats = getattr(model, "features", model)
    mem = F.normalize(feats(memory), dim=1)
    qry = F.normalize(feats(queries), dim=1)
    sims, idx = (qry @ mem.T).topk(k, dim=1)
    votes = torch.zeros(len(qry), int(memory_labels.max()) + 1)
    votes.scatter_add_(1, memory_labels[idx], (sims / t).exp())
    return float((votes.argmax(1) == query_labels).float().mean())


def make(options: dict[str, Any]) -> FLSimCoTask:
    """Options: ``shard``, ``shards``, ``alpha`` (Dirichlet; 0 = IID), ``seed``; ``speed``
    (km/h; absent = drawn from eq. 1 with ``mu``, ``sigma``, ``v_min``, ``v_max`` and
    ``speed_seed``); camera ``exposure``, ``focal``, ``pixel`` (eq. 2); ``tau_alpha``,
    ``tau_beta`` (eqs. 6-8; default 0.1 and 1.0); ``negatives`` (``"raw"`` per eq. 5, or ``"keys"``)."""
    known = {
        "shard",
        "shards",
        "alpha",
        "seed",
        "speed",
        "speed_seed",
        "tau_alpha",
        "tau_beta",
        "negatives",
        *DEFAULT_CAMERA,
        *DEFAULT_MOBILITY,
    }
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"flsimco: unknown options {sorted(unknown)}; known: {sorted(known)}")
    try:
        camera = {k: float(options.get(k, v)) for k, v in DEFAULT_CAMERA.items()}
        mob = {k: float(options.get(k, v)) for k, v in DEFAULT_MOBILITY.items()}
        if "speed" in options:
            speed = float(options["speed"])
        else:
            rng = np.random.default_rng(int(options.get("speed_seed", options.get("shard", 0) or 0)))
            speed = float(sample_speeds(1, mob["mu"], mob["sigma"], mob["v_min"], mob["v_max"], rng)[0])
        negatives = str(options.get("negatives", "raw"))
        if negatives not in ("raw", "keys"):
            raise ConfigError(f"flsimco: negatives must be 'raw' or 'keys', not {negatives!r}")
        tau_alpha, tau_beta = float(options.get("tau_alpha", 0.1)), float(options.get("tau_beta", 1.0))
        if not (tau_alpha > 0 and tau_beta > 0 and speed >= 0):
            raise ConfigError("flsimco: temperatures must be positive and speed non-negative")
        shard = options.get("shard")
        return FLSimCoTask(
            shard=None if shard is None else int(shard),
            shards=int(options.get("shards", 1)),
            alpha=float(options.get("alpha", 0.1)),
            seed=int(options.get("seed", 0)),
            speed=speed,
            camera=camera,
            tau_alpha=tau_alpha,
            tau_beta=tau_beta,
            negatives=negatives,
        )
    except ValueError as exc:
        raise ConfigError(f"flsimco: {exc}") from None
