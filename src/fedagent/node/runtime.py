"""What the agent and the coordinator daemons share: logging, the transport and
discovery set-up, timers driven by the monotonic clock, and a metrics history."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent.config import NodeConfig
from fedagent.node.transport import Subscription, TlsFiles, Transport
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, encode
from fedagent.protocols.messages import Presence
from fedagent.security.signing import Identity, sign
from fedagent.storage import history
from fedagent.storage.history import History

_identities: dict[tuple[Path, Path, Path], Identity] = {}


def node_identity(cfg: NodeConfig) -> Identity:
    """The node's signing identity (its TLS certificate and Ed25519 key), loaded once."""
    key = (cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
    ident = _identities.get(key)
    if ident is None:
        ident = _identities[key] = Identity.load(*key)
    if ident.name != cfg.id:
        from fedagent.errors import ConfigError

        raise ConfigError(f"{cfg.path}: id is {cfg.id!r} but certificate {cfg.tls.cert} is for {ident.name!r}")
    return ident


def setup_logging(level: str = "INFO") -> None:
    """One line per record on stderr; under systemd the journal adds the timestamp."""
    under_journal = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journal else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)
    for noisy in ("zeroconf", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def tls_files(cfg: NodeConfig) -> TlsFiles:
    return TlsFiles(ca=cfg.tls.ca, cert=cfg.tls.cert, key=cfg.tls.key)


def presence_payload(cfg: NodeConfig, federation: str, online: bool, **fields: Any) -> bytes:
    msg = Presence(online=online, role=cfg.role, mode=cfg.mode, **fields)
    return encode(
        sign(
            Envelope(
                kind=msg.kind,
                federation=federation,
                sender=cfg.id,
                round=0,
                seq=time.time_ns() // 1000,
                ts=time.time(),
                body=msg.to_body(),
            ),
            node_identity(cfg),
        )
    )


#: glibc serves allocations from this size on by mmap (see :func:`release_large_frees`):
#: the intake's per-part buffers (a part's floats, its finiteness mask, the norm sums'
#: blocks) are 64-256 KiB.
MMAP_THRESHOLD = 64 * 1024


def release_large_frees() -> bool:
    """Have glibc serve every allocation of 64 KiB or more by mmap, so freeing it
    returns the memory to the system at once; returns False where that cannot be set.

    glibc's default threshold starts at 128 KiB and rises to the size of any mmapped
    block freed (up to 32 MiB): after the first model-sized tensors are freed, the next
    ones come from the heap and their pages stay resident when freed. Measured on the
    coordinator at 10 agents × 44.8 MB (16 tensors of 2.8 MB): peak RSS 3.84 models
    above idle with the default, 2.70 with the threshold fixed at 1 MiB. With chunks
    sized to the model (a 4.4 MB model arrived in 550 KB chunks then) 1 MiB was not enough:
    the chunk-sized buffers of the receive and broadcast paths (many of them made in
    worker threads, each with its own heap) stayed resident, 3.4-3.9 models at 10 and
    50 agents × 4.4 MB against 2.7-2.8 with 256 KiB. With int8 parts folded 64 Ki
    values at a time, the 64-128 KiB buffers of each part, made and freed between the
    longer-lived small objects of the intake, left the main heap 1-1.5 MB larger at
    the peak (measured: 2.89-3.02 models at 10 and 50 agents × 4.4 MB with 256 KiB,
    2.63-2.72 with 64 KiB)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


#: An agent keeps freed memory below these (see :func:`keep_freed_memory`): blocks up to
#: 32 MiB (glibc's largest mmap threshold) come from its heaps, and a heap gives memory
#: back to the system only when more than 128 MiB of its top is free.
KEEP_MMAP_THRESHOLD = 32 * 2**20
KEEP_TRIM_THRESHOLD = 128 * 2**20


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a process frees for its next allocations instead of
    returning it to the system; returns False where that cannot be set.

    The opposite of :func:`release_large_frees`, for an agent: every round it takes in a
    model, loads it, trains (gradients, momentum and activations: torch allocates them
    anew each step), encodes and sends its update and evaluates, each in buffers of up
    to a model's size. With glibc's defaults many of those came as fresh pages from
    the system every round (about 5,500 page faults per agent and round of the
    time-to-accuracy benchmark, 21 MB), each zeroed by the kernel first; kept, they are
    reused. The price: the agent's memory stays at its peak between rounds."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, KEEP_MMAP_THRESHOLD)) and bool(  # M_MMAP_THRESHOLD
            libc.mallopt(-1, KEEP_TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
        )
    except (OSError, AttributeError):
        return False


def make_transport(
    cfg: NodeConfig,
    federation: str,
    broker: str,
    subscriptions: Sequence[Subscription],
    on_connect=None,
    receive_maximum: int | None = None,
    retired_subscriptions: Sequence[str] = (),
) -> Transport:
    will = (topics.presence(federation, cfg.id), presence_payload(cfg, federation, online=False))
    return Transport(
        uri=broker,
        client_id=cfg.id,
        tls=tls_files(cfg),
        will=will,
        on_connect=on_connect,
        subscriptions=subscriptions,
        receive_maximum=receive_maximum,
        retired_subscriptions=retired_subscriptions,
        keepalive=cfg.keepalive,
    )


class Timer:
    """One pending wake-up at a monotonic deadline; a later request replaces an earlier
    one only if it is sooner (the machines re-request what they still need)."""

    def __init__(self, queue: asyncio.Queue, event: object) -> None:
        self._queue = queue
        self._event = event
        self._handle: asyncio.TimerHandle | None = None
        self._at = float("inf")

    def request(self, at: float) -> None:
        now = time.monotonic()
        if self._handle is not None and self._at <= at and self._at > now:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        loop = asyncio.get_running_loop()
        self._handle = loop.call_later(max(0.0, at - now), self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._at = float("inf")
        try:
            self._queue.put_nowait(self._event)
        except asyncio.QueueFull:
            # The queue is full of work being done: the wake-up waits for room (a
            # wake-up that came late is handled as such), it is neither lost nor an error.
            self._handle = asyncio.get_running_loop().call_later(0.05, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


def open_history(cfg: NodeConfig, directory: Path) -> History:
    """The daemon's ``history.jsonl`` in ``directory``, rotated as its config says."""
    return History(directory / history.NAME, max_bytes=cfg.history_max_bytes, keep=cfg.history_keep)
