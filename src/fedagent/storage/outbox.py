"""An agent's finished update on disk until the coordinator has it (asynchronous FedAvg).

An agent writes its update here as soon as training ends, before it sends anything, and
removes it once the broker has acknowledged every frame of it; a crash, a power cut or
a link that is down for minutes therefore never loses it, and a restarted agent sends it
again (the coordinator takes an update once: by agent, task and base version). The
outbox holds one update (the agent's newest: one trained further while cut off replaces
it), so it is bounded by two models on disk: the trained weights and the model they
were trained from (the update travels as their difference, and the base may be gone from
the agent's own checkpoint by the time the link is back).

The file is a checkpoint (:mod:`fedagent.storage.checkpoint`: the wire codec's tensors,
written atomically through :mod:`fedagent.storage.statefile`) whose tensors are
``trained/<name>`` and ``base/<name>`` and whose meta says the task, the base version, the
samples, the metrics, the trainings it holds, the task's training settings and when the
update was first kept. Reading it back checks all of them; a damaged file is set aside
(renamed ``*.damaged``) with an error in the log, never trained from.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedagent.errors import CodecError, FedagentError, StateWriteError
from fedagent.protocols.fedbuff.worker import Pending, Work
from fedagent.protocols.messages import TrainConfig
from fedagent.storage import checkpoint

log = logging.getLogger(__name__)

NAME = "outbox.ckpt"
TRAINED = "trained/"
BASE = "base/"


class Outbox:
    """The outbox file in ``directory``; files above ``max_bytes`` are refused on read."""

    def __init__(self, directory: Path, *, max_bytes: int = 2**31) -> None:
        self.path = Path(directory) / NAME
        self.max_bytes = max_bytes
        self.since: float | None = None  # wall-clock time the entry was first kept
        self.nbytes = 0

    def put(self, pending: Pending, *, since: float | None = None) -> None:
        """Keep ``pending`` (replacing the entry), durable on return. ``since``: when the
        update it replaces was first kept (a further training keeps the date)."""
        now = time.time()
        self.since = since if since is not None else now
        tensors = {TRAINED + k: v for k, v in pending.weights.items()}
        tensors.update({BASE + k: v for k, v in pending.work.base.items()})
        meta = {
            "task": pending.work.task,
            "base_version": pending.work.base_version,
            "trainings": pending.work.trainings,
            "num_samples": pending.num_samples,
            "metrics": {k: float(v) for k, v in pending.metrics.items()},
            "train": pending.work.train.to_body(),
            "since": self.since,
            "kept": now,
        }
        checkpoint.save(self.path, tensors, meta)
        self.nbytes = self.path.stat().st_size

    def clear(self) -> None:
        """The update reached the broker (or is no longer wanted)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StateWriteError(f"cannot remove {self.path}: {exc.strerror or exc}") from exc
        self.since = None
        self.nbytes = 0

    def get(self) -> Pending | None:
        """The entry kept before a restart, or None (none, or a damaged one set aside)."""
        try:
            loaded = checkpoint.load(self.path, max_bytes=self.max_bytes)
        except FedagentError as exc:
            self._set_aside(str(exc))
            return None
        if loaded is None:
            return None
        tensors, meta = loaded
        try:
            pending, since = _entry(tensors, meta)
        except (ValueError, TypeError, KeyError, CodecError) as exc:
            self._set_aside(f"{self.path}: not an outbox entry ({exc})")
            return None
        self.since = since
        self.nbytes = self.path.stat().st_size
        return pending

    def held_s(self) -> float | None:
        """Seconds the entry has been kept, for status and history: the age of a wall-clock
        time that may come from before a restart, so the wall clock (never below 0 when it
        was stepped back); nothing waits on it."""
        if self.since is None:
            return None
        return max(0.0, time.time() - self.since)

    def status(self) -> dict[str, Any] | None:
        if self.since is None:
            return None
        return {"since": self.since, "bytes": self.nbytes}

    def _set_aside(self, why: str) -> None:
        log.error("%s; set aside as %s.damaged", why, self.path.name)
        try:
            self.path.replace(self.path.with_name(self.path.name + ".damaged"))
        except OSError:
            pass


def _entry(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[Pending, float]:
    trained = {k[len(TRAINED) :]: v for k, v in tensors.items() if k.startswith(TRAINED)}
    base = {k[len(BASE) :]: v for k, v in tensors.items() if k.startswith(BASE)}
    if not trained or trained.keys() != base.keys() or len(trained) + len(base) != len(tensors):
        raise ValueError("the trained and base tensors do not match")
    for name, t in trained.items():
        if t.shape != base[name].shape or t.dtype != base[name].dtype:
            raise ValueError(f"tensor {name!r}: trained and base differ in shape or dtype")
    ints = {k: meta[k] for k in ("task", "base_version", "trainings", "num_samples")}
    if any(type(v) is not int or v < 0 for v in ints.values()) or ints["num_samples"] < 1 or ints["trainings"] < 1:
        raise ValueError(f"bad counts {ints}")
    metrics = meta["metrics"]
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, float) and math.isfinite(v) for k, v in metrics.items()
    ):
        raise ValueError("bad metrics")
    since = meta["since"]
    if not isinstance(since, float):
        raise ValueError("bad date")
    work = Work(ints["task"], ints["base_version"], TrainConfig.from_body(meta["train"]), base, ints["trainings"])
    return Pending(work, trained, ints["num_samples"], dict(metrics)), since
