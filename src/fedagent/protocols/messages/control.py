"""Messages every node sends, whatever its mode: its presence and its heartbeat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedagent.errors import CodecError
from fedagent.protocols import fields as F

ROLES = ("agent", "coordinator")
MODES = ("fedavg", "syncopt", "gossip", "async")
MAX_DOWNLINKS = 8


@dataclass(frozen=True, slots=True)
class Presence(F.WireMessage):
    """Retained per node; its Last Will is the same with ``online=False``."""

    kind: ClassVar[str] = "presence"
    WIRE: ClassVar[F.Body] = F.Body(
        "presence",
        F.Field("online", F.Flag()),
        F.Field("role", F.Text(max_len=32)),
        F.Field("mode", F.Text(max_len=32)),
        F.Field("num_samples", F.Count(), default=0),
        F.Field("model_version", F.Count(), default=0),
        F.Field("broker", F.Text(max_len=256), default=""),
        F.Field("downlinks", F.Strings(MAX_DOWNLINKS, max_len=16), default=(), omit_default=True),
    )
    online: bool
    role: str
    mode: str = "fedavg"
    num_samples: int = 0
    model_version: int = 0
    broker: str = ""
    # The encodings of the global model this agent rebuilds besides the whole model
    # ("int8": round starts as int8 steps, protocols/downlink.py). Agents of releases
    # before the int8 broadcast send none, and get the whole model.
    downlinks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise CodecError(f"presence: unknown role {self.role!r}")
        if self.mode not in MODES:
            raise CodecError(f"presence: unknown mode {self.mode!r}")
        F.count(self.num_samples, "presence", "num_samples")
        F.count(self.model_version, "presence", "model_version")
        if not isinstance(self.downlinks, tuple):
            raise CodecError("presence: downlinks must be a tuple of names")
        F.strings(list(self.downlinks), "presence", "downlinks", MAX_DOWNLINKS, max_len=16)


@dataclass(frozen=True, slots=True)
class Heartbeat(F.WireMessage):
    """Agent → coordinator, every ``interval`` seconds: "still here". The coordinator
    declares an agent that has been silent for a few intervals gone from the round long
    before the broker's keep-alive does (see :mod:`fedagent.protocols.liveness`)."""

    kind: ClassVar[str] = "heartbeat"
    WIRE: ClassVar[F.Body] = F.Body("heartbeat", F.Field("interval", F.Number(send_float=True)))
    interval: float

    def __post_init__(self) -> None:
        v = self.interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.05 <= v <= 3600):
            raise CodecError("heartbeat: interval must be 0.05..3600 seconds")
