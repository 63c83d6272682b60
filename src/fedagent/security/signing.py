"""End-to-end message authenticity: every frame signed by its sender, checked by every receiver.

The broker is trusted to keep strangers out (mutual TLS, ACLs) but not to deliver
what was published unchanged: a compromised broker or bridge could alter a model,
replay an old update or forge one in a member's name. So every frame a node puts on
the wire carries

* ``cert``: the sender's certificate (DER), issued by the federation CA, whose key is
  the node's Ed25519 TLS key (:mod:`fedagent.security.pki`); receivers check it against their
  own ``ca.crt``, that its CN is the envelope's sender, that it is valid now and that
  its role may send messages. Every frame carries it, so no frame depends on a
  presence message having arrived first (retained presence, several brokers and
  bridges do not order deliveries across topics). Checked certificates are cached by
  their digest: the ECDSA check of the CA's signature runs once per certificate.
* ``sig``: Ed25519 over :func:`signing_digest`, a SHA-256 of every envelope field
  (version, kind, federation, sender, round, seq, ts, cert) and the body.

For a ``chunk`` frame (and a ``ustream`` frame, a chunk of a streamed update) the
chunk's ``data`` is left out of the digest: each chunk
carries the SHA-256 of the whole transfer, which *is* signed, and the reassembler
refuses a transfer whose bytes do not match it. A 44.8 MB model is thus hashed once on
each side (by the chunking layer) instead of twice; a tampered chunk costs the
transfer, which a broker could drop anyway. The envelope inside a chunked transfer is
not signed itself: it is accepted only if its sender is the chunks' signer.

Freshness (:class:`ReplayGuard`) rests on per-sender sequence numbers: a frame's ``seq``
must be new for its sender, within a sliding window below the highest seen (MQTT does
not order messages across topics or brokers, so strict monotonicity would drop
legitimate traffic). The envelope's round is signed and the messenger refuses a message
whose body names another round (round binding). Both survive restarts:

* the sender's counter starts above every number it used before: at the larger of its
  wall clock in microseconds and a persisted reservation (:class:`SequenceCounter`), so
  a node restarted after its clock went back does not reuse numbers;
* the receiver persists, per sender, the largest numbers it accepted
  (:meth:`ReplayGuard.snapshot`) before it hands a message on, so a frame captured
  before a crash is refused after the restart too (heartbeats and Sync-Opt's per-step
  messages, whose replay the protocol refuses by itself, are persisted a little later:
  ``Messenger.lazy_durable_kinds``).

The timestamp is only a coarse bound, ``max_skew`` seconds around the receiver's clock,
for the first frames of a sender the receiver has no numbers for. Both clocks are
:class:`SteadyClock`: the wall clock read once at start, advanced by the boot-time
clock. A wall-clock jump of either node while it runs therefore moves neither what the
sender stamps nor what the receiver compares with (the wall-clock fault test); a node *started*
with a clock more than ``max_skew`` off is refused (``stale``) and the log says so.

Presence is the exception: it is retained and its Last Will is signed when the
connection is made and delivered whenever it breaks, possibly hours later, so it
cannot be fresh by clock or counter. Presence is still signed and its certificate
checked; replaying an old one can only mark a node online or offline, i.e. affect
availability, which a broker controls anyway by withholding messages. Presence never
carries model content.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from fedagent.errors import ConfigError, FedagentError
from fedagent.protocols.codec import Envelope
from fedagent.security.pki import federation_in

log = logging.getLogger(__name__)

__all__ = [
    "UNFRESH_KINDS",
    "AuthError",
    "Identity",
    "ReplayGuard",
    "SequenceCounter",
    "SteadyClock",
    "Verifier",
    "sign",
    "sign_statement",
    "signing_digest",
]

_DOMAIN = b"fedagent-envelope-signature/1"
CHUNK_KIND = "chunk"
STREAM_KIND = "ustream"  # fedagent.protocols.streaming.STREAM_KIND (a chunk of a streamed update)
# Frames whose ``data`` is bound by the signed SHA-256 of the whole transfer.
DATA_BOUND_KINDS = frozenset({CHUNK_KIND, STREAM_KIND})
# Kinds that are retained or sent as a Last Will: signed, but not subject to freshness.
UNFRESH_KINDS = frozenset({"presence"})
SENDER_ROLES = frozenset({"agent", "coordinator", "aggregator"})


class AuthError(FedagentError):
    """A frame failed authentication; ``reason`` is the short code counted in metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def signing_digest(env: Envelope) -> bytes:
    """What the sender signs: SHA-256 over a fixed msgpack array of every field.

    msgpack packs the same values to the same bytes, and a decoded envelope holds
    exactly the values the sender packed, so both sides compute it from the envelope
    object without keeping the wire bytes.
    """
    body = env.body
    if env.kind in DATA_BOUND_KINDS and "data" in body:
        # The data is bound by the transfer digest in the same (signed) body.
        body = {k: v for k, v in body.items() if k != "data"}
    packer = msgpack.Packer(use_bin_type=True, datetime=False)
    fields = [_DOMAIN, env.version, env.kind, env.federation, env.sender, env.round, env.seq, env.ts, env.cert, body]
    if env.kind in DATA_BOUND_KINDS:
        # Without its data a chunk is a few hundred bytes: packed at once (the walk below
        # costs more in Python than the copy it saves).
        return hashlib.sha256(packer.pack(fields)).digest()
    h = hashlib.sha256()
    _hash_packed(h, packer, fields)
    return h.digest()


# Binary values at least this long are hashed where they lie instead of being packed.
_HASH_IN_PLACE = 1 << 14


def _hash_packed(h: Any, packer: msgpack.Packer, obj: object) -> None:
    """Feed ``h`` exactly the bytes of ``msgpack.packb(obj, use_bin_type=True,
    datetime=False)`` without building them: maps and arrays are walked, and a large
    binary value (a tensor of a model or gradient message) goes to the hash as it is,
    after its msgpack header, instead of being copied into one packed buffer first (a
    pass over every model byte on each side of every message). Anything else, and any
    type that is not exactly a dict, list, tuple, bytes, bytearray or memoryview, is
    packed by msgpack itself, so the bytes hashed are msgpack's by construction."""
    t = type(obj)
    if t is dict:
        h.update(packer.pack_map_header(len(obj)))  # type: ignore[arg-type]
        for k, v in obj.items():  # type: ignore[attr-defined]
            _hash_packed(h, packer, k)
            _hash_packed(h, packer, v)
        return
    if t is list or t is tuple:
        h.update(packer.pack_array_header(len(obj)))  # type: ignore[arg-type]
        for v in obj:  # type: ignore[attr-defined]
            _hash_packed(h, packer, v)
        return
    if t is bytes or t is bytearray or t is memoryview:
        view = memoryview(obj)  # type: ignore[arg-type]
        n = view.nbytes
        if n >= _HASH_IN_PLACE and view.c_contiguous and n < 2**32:
            h.update(b"\xc5" + n.to_bytes(2, "big") if n < 2**16 else b"\xc6" + n.to_bytes(4, "big"))
            h.update(view)
            return
    h.update(packer.pack(obj))


# --- clocks and counters -------------------------------------------------------------

_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class SteadyClock:
    """Wall-clock seconds that do not jump: the wall clock read once, at construction,
    advanced by ``CLOCK_BOOTTIME`` (monotonic, and unlike ``CLOCK_MONOTONIC`` it counts
    time spent suspended, so a device that sleeps does not fall behind). An NTP step
    after the start is not followed; slewing keeps the drift far below ``max_skew``.

    ``floor``: a time the wall clock is known to be past (the node's own certificate
    was issued then). A device without a real-time clock boots at 1970 or at the time it
    last shut down, and NTP steps its clock later: anchored at such a start, every
    certificate would stay "not yet valid" until a restart. While the wall clock is
    before ``floor`` it is followed as it is, and the clock is anchored at the first
    reading past it (a clock that is wrong but ahead cannot be told from a right one
    this way)."""

    def __init__(
        self, wall: float | None = None, *, floor: float | None = None, read: Callable[[], float] | None = None
    ) -> None:
        self._read: Callable[[], float] = read if read is not None else (lambda: time.time())
        self._floor = floor
        self._base = time.clock_gettime(_BOOT_CLOCK)
        self._wall = self._read() if wall is None else wall
        self.unset = floor is not None and self._wall < floor
        if floor is not None and self.unset:
            log.warning(
                "the wall clock (%s) is before this node's certificate was issued (%s): waiting for it to be set",
                _utc(self._wall),
                _utc(floor),
            )

    def __call__(self) -> float:
        if self.unset:
            now = self._read()
            assert self._floor is not None
            if now < self._floor:
                return now
            self.unset = False
            self._base, self._wall = time.clock_gettime(_BOOT_CLOCK), now
            log.warning("the wall clock was set (%s): this node's clock follows it from now on", _utc(now))
        return self._wall + (time.clock_gettime(_BOOT_CLOCK) - self._base)


def _utc(t: float) -> str:
    try:
        return f"{datetime.fromtimestamp(t, UTC):%Y-%m-%d %H:%M:%S} UTC"
    except (OverflowError, OSError, ValueError):
        return repr(t)


class SequenceCounter:
    """A node's outgoing sequence numbers, strictly increasing across restarts.

    Numbers start at the larger of the wall clock in microseconds (a per-boot epoch that
    needs no state) and the reservation persisted in ``path``; the reservation is moved
    ``block`` numbers ahead, atomically, before any number beyond it is used. So one
    write per ``block`` messages, and a clock that went back before a restart cannot
    make the node reuse numbers its peers have seen (they would refuse them as replays).
    """

    def __init__(self, path: Path | None = None, *, block: int = 1 << 20) -> None:
        from fedagent.storage import statefile

        self._path = Path(path) if path is not None else None
        self._block = block
        self._write = statefile.atomic_write
        start = time.time_ns() // 1000
        if self._path is not None:
            raw = statefile.read_bytes(self._path, 64)
            if raw is not None:
                try:
                    start = max(start, int(raw.decode("ascii").strip()))
                except ValueError:
                    raise ConfigError(
                        f"{self._path}: not a sequence reservation (remove it only if the clock is known to be right)"
                    ) from None
        self.value = start
        self._reserved = start
        self._reserve()

    def _reserve(self) -> None:
        self._reserved = self.value + self._block
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._write(self._path, f"{self._reserved}\n".encode())

    def take(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive numbers; returns the first."""
        first = self.value + 1
        self.value += n
        if self.value >= self._reserved:
            self._reserve()
        return first


# --- the sender's side ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    """A node's signing key and the certificate that binds it to the node id."""

    name: str
    key: ed25519.Ed25519PrivateKey = field(repr=False)
    cert_der: bytes
    ca: x509.Certificate = field(repr=False)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path, ca_path: Path) -> Identity:
        cert_path, key_path, ca_path = Path(cert_path), Path(key_path), Path(ca_path)
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot load the signing identity ({cert_path}, {key_path}, {ca_path}): {exc}") from exc
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        name = str(names[0].value) if names else ""
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(
                f"{key_path} is a {type(key).__name__.lstrip('_')}, but messages are signed with Ed25519: "
                f"issue a new certificate with `fedagent ca issue {name or cert_path.stem}` "
                "(agent and coordinator keys are Ed25519 since message signing was added)"
            )
        if key.public_key().public_bytes_raw() != _raw_key(cert):
            raise ConfigError(f"private key {key_path} does not match certificate {cert_path}")
        return cls(name, key, cert.public_bytes(serialization.Encoding.DER), ca)

    @property
    def issued(self) -> float:
        """When this node's certificate became valid (its clock is known to be past it)."""
        return x509.load_der_x509_certificate(self.cert_der).not_valid_before_utc.timestamp()

    def verifier(self, **kw) -> Verifier:
        return Verifier(self.ca, **kw)


def sign(env: Envelope, identity: Identity) -> Envelope:
    """``env`` with ``cert`` and ``sig`` set; the sender must be the identity's name."""
    if env.sender != identity.name:
        raise ValueError(f"cannot sign a message from {env.sender} as {identity.name}")
    unsigned = replace(env, cert=identity.cert_der, sig=b"")
    return replace(unsigned, sig=identity.key.sign(signing_digest(unsigned)))


_STATEMENT_DOMAIN = b"fedagent-statement/1"


def _statement_digest(data: bytes) -> bytes:
    return hashlib.sha256(_STATEMENT_DOMAIN + data).digest()


def sign_statement(identity: Identity, data: bytes) -> tuple[bytes, bytes]:
    """``(cert, sig)`` binding ``data`` to this node, for a third party to check after a
    relay (secure aggregation's public keys pass through the coordinator, which must not
    be able to swap them for its own)."""
    return identity.cert_der, identity.key.sign(_statement_digest(data))


def _raw_key(cert: x509.Certificate) -> bytes:
    pub = cert.public_key()
    if not isinstance(pub, ed25519.Ed25519PublicKey):
        return b""
    return pub.public_bytes_raw()


# --- the receiver's side -------------------------------------------------------------


#: Certificates kept checked and parsed, the most recently used. Only certificates of
#: this federation's CA get in, so the bound is the federation's size (the replay
#: guard's ``max_senders``), not a defence: with 1,024 a coordinator of 3,000 agents,
#: whose updates come round-robin, parsed and checked every certificate again on every
#: frame (its intake CPU per update grew with the number of agents).
SIGNER_CACHE = 100_000


@dataclass(frozen=True, slots=True)
class _Signer:
    name: str
    role: str
    federation: str
    key: ed25519.Ed25519PublicKey
    not_before: float
    not_after: float


class ReplayGuard:
    """Per-sender sequence numbers seen, in a sliding window, and a clock-skew window.

    A sequence number is accepted once, if it is above ``highest - window``; memory is
    ``window`` numbers per sender at most, and senders are only ever the holders of
    valid certificates (the guard runs after the signature check).

    Persistence: :meth:`snapshot` keeps, per sender, the ``keep`` largest numbers
    accepted; :meth:`restore` makes every number up to the smallest of them a replay
    and the kept ones too. Every number accepted above that floor is among the kept
    (they are the largest), so a restarted receiver refuses every frame it accepted
    before; what it loses is a frame it never saw that is older than ``keep`` newer
    ones from the same sender (delivery that late does not happen on one broker).

    A journal (:mod:`fedagent.security.replaylog`) persists the same state incrementally: with
    ``track`` set, :meth:`take_fresh` returns the numbers accepted since its last call
    (at most ``keep`` per sender: only the largest can be among the kept ones), and
    :meth:`merge` folds a journal record in. ``fence``: every frame stamped at or before
    it is a replay (set when a damaged journal may have lost numbers; see there).

    :meth:`hold` keeps an accepted number out of what is saved until :meth:`release`:
    a frame whose acknowledgement waits for its round journal record. Should that record
    fail, the broker delivers the frame again, and the receiver must take it, restarted
    or not: a held number is never saved, so a restart gives it back, and
    :meth:`withdraw` gives it back to this process. Until then a second copy is refused.
    """

    def __init__(
        self, *, window: int = 4096, max_skew: float = 300.0, max_senders: int = 100_000, keep: int = 64
    ) -> None:
        if window < 1 or keep < 1 or not (max_skew > 0 and math.isfinite(max_skew)):
            raise ValueError("replay window and keep must be >= 1 and max_skew positive")
        self.window = window
        self.max_skew = max_skew
        self.max_senders = max_senders
        self.keep = keep
        self._highest: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}
        self._floor: dict[str, int] = {}  # from a snapshot: this and below are replays
        self._top: dict[str, list[int]] = {}  # the `keep` largest accepted, ascending
        self.dirty = False
        self.track = False
        self._fresh: dict[str, list[int]] = {}  # accepted since take_fresh(), when tracked
        self._held: dict[str, set[int]] = {}  # accepted, kept out of saves (each in _top)
        self.fence = -math.inf

    def check(self, sender: str, seq: int, ts: float, now: float) -> None:
        if abs(ts - now) > self.max_skew:
            raise AuthError(
                "stale",
                f"timestamp {ts:.0f} is {ts - now:+.0f} s from this node's clock (allowed ±{self.max_skew:.0f} s)",
            )
        if ts <= self.fence:
            raise AuthError(
                "replay",
                f"stamped {ts:.0f}, before this node restarted from a damaged replay "
                f"journal ({self.fence:.0f}): it may have been delivered already",
            )
        if seq <= self._floor.get(sender, -1):
            raise AuthError(
                "replay",
                f"sequence number {seq} is not above {self._floor[sender]}, the oldest "
                "this node kept across its restart (a replay)",
            )
        high = self._highest.get(sender)
        if high is not None:
            if seq <= high - self.window:
                raise AuthError(
                    "replay",
                    f"sequence number {seq} is older than the window "
                    f"(newest seen {high}; a replay, or the sender's clock went back)",
                )
            if seq in self._seen[sender]:
                raise AuthError("replay", f"sequence number {seq} already seen")
        elif len(self._highest) >= self.max_senders:
            raise AuthError("replay", "too many senders tracked")
        self._accept(sender, seq)

    def record(self, sender: str, seq: int) -> None:
        """Count ``seq`` as seen without checking it: a frame this node accepted before a
        restart, read back from its own round journal (:mod:`fedagent.storage.roundjournal`), so
        that the broker's redelivery of the same frame is refused. Idempotent."""
        high = self._highest.get(sender)
        if seq <= self._floor.get(sender, -1) or (
            high is not None and (seq <= high - self.window or seq in self._seen[sender])
        ):
            return
        self._accept(sender, seq)

    def _accept(self, sender: str, seq: int) -> None:
        high = self._highest.get(sender)
        seen = self._seen.setdefault(sender, set())
        seen.add(seq)
        top = self._top.setdefault(sender, [])
        # (A number withdrawn and accepted again is still held, so among the kept ones.)
        if seq not in self._held.get(sender, ()) and (len(top) < self.keep or seq > top[0]):
            bisect.insort(top, seq)
            if len(top) > self.keep:
                # Below the kept ones it is in no save to come: nothing to hold back.
                self._unhold(sender, top.pop(0))
        self.dirty = True
        self._note_fresh(sender, seq)
        if high is None or seq > high:
            self._highest[sender] = seq
            floor = seq - self.window
            if len(seen) > self.window:
                seen.difference_update([s for s in seen if s <= floor])

    def _note_fresh(self, sender: str, seq: int) -> None:
        if self.track:
            fresh = self._fresh.setdefault(sender, [])
            fresh.append(seq)
            if len(fresh) > 2 * self.keep:
                fresh.sort()
                del fresh[: -self.keep]

    def hold(self, sender: str, seq: int) -> None:
        """Keep ``seq``, just accepted by :meth:`check`, out of every save until
        :meth:`release`: its frame is not taken yet. Never released (its round journal
        record failed, its acknowledgement withheld: :meth:`withdraw`), it stays out for
        good, and a restarted receiver takes the broker's redelivery, unless ``keep``
        newer numbers of the sender were saved since (a restart refuses anything older
        than those)."""
        fresh = self._fresh.get(sender)
        if fresh is not None and seq in fresh:
            fresh.remove(seq)
        top = self._top.get(sender, [])
        i = bisect.bisect_left(top, seq)
        if i < len(top) and top[i] == seq:
            self._held.setdefault(sender, set()).add(seq)

    def withdraw(self, sender: str, seq: int) -> None:
        """``seq``'s frame was not taken after all (its acknowledgement withheld): the
        broker delivers it again, to this process as well as to a restarted one, and this
        one must take it then. The number leaves those seen (a copy is accepted once more)
        and stays held, out of every save, until a copy is taken and released."""
        seen = self._seen.get(sender)
        if seen is not None:
            seen.discard(seq)

    def release(self, sender: str, seq: int) -> None:
        """Save ``seq`` from now on (its frame is taken); a number not held is left as it is."""
        held = self._held.get(sender)
        if held is None or seq not in held:
            return
        self._unhold(sender, seq)
        self.dirty = True
        self._note_fresh(sender, seq)

    def _unhold(self, sender: str, seq: int) -> None:
        held = self._held.get(sender)
        if held is not None:
            held.discard(seq)
            if not held:
                del self._held[sender]

    def _below_held(self, sender: str) -> int | None:
        """A number to save with the sender's numbers above one it holds, if any.

        A restart refuses every number below the smallest one saved of a sender (older
        ones were not kept): saved alone, the numbers after a held one would make it a
        replay. So the largest number kept below it goes with them, or, if there is none,
        the one just below it (a restart refuses that one either way, as it would had the
        held number been saved)."""
        held = self._held.get(sender)
        if not held:
            return None
        low = min(held)
        top = self._top[sender]
        i = bisect.bisect_left(top, low)
        return top[i - 1] if i else low - 1

    def snapshot(self) -> bytes:
        """What :meth:`restore` needs, as msgpack (``keep`` numbers per sender)."""
        self.dirty = False
        self._fresh = {}
        return msgpack.packb(self.tops(), use_bin_type=True)

    def tops(self) -> dict[str, list[int]]:
        """Per sender, the ``keep`` largest numbers accepted (what a snapshot holds),
        those held excepted and one below them added (see :meth:`_below_held`)."""
        tops = {}
        for sender, top in self._top.items():
            held = self._held.get(sender)
            if not held:
                tops[sender] = list(top)
                continue
            kept = [x for x in top if x not in held]
            below = self._below_held(sender)
            if below is not None:
                # (with every kept number held, still one: older numbers stay replays)
                tops[sender] = kept if below in kept else [below, *kept]
        return tops

    def take_fresh(self) -> dict[str, list[int]]:
        """The numbers accepted since the last call (or snapshot), at most ``keep`` per
        sender, the largest, those held excepted; clears them and :attr:`dirty`."""
        fresh, self._fresh = self._fresh, {}
        self.dirty = False
        taken = {}
        for sender, seqs in fresh.items():
            if not seqs:
                continue
            numbers = sorted(seqs)[-self.keep :]
            below = self._below_held(sender)
            if below is not None and numbers[-1] > below:
                # (at most keep - 1 numbers lie above a held one: it is among the kept)
                numbers = sorted({*numbers, below})[-self.keep :]
            taken[sender] = numbers
        return taken

    def merge(self, doc: dict[str, list[int]]) -> None:
        """Fold numbers in (validated ``{sender: [int, ...]}``, as :meth:`restore` checks):
        each sender's kept numbers become the ``keep`` largest of the old and the new,
        and every number up to the smallest of them a replay."""
        for sender, seqs in doc.items():
            if sender not in self._top and len(self._top) >= self.max_senders:
                raise FedagentError(f"replay state names more than {self.max_senders} senders")
            top = sorted(set(self._top.get(sender, ())) | set(seqs))[-self.keep :]
            self._floor[sender] = top[0] - 1
            self._seen[sender] = set(top)
            self._highest[sender] = top[-1]
            self._top[sender] = top

    def restore(self, data: bytes) -> None:
        """Load a snapshot (validated: it is read from disk, not trusted blindly)."""
        try:
            doc = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                max_array_len=self.keep,
                max_map_len=self.max_senders,
                max_str_len=256,
                max_bin_len=0,
                max_ext_len=0,
            )
        except (ValueError, msgpack.UnpackException) as exc:
            raise FedagentError(f"unreadable replay state: {exc}") from None
        if not isinstance(doc, dict) or not all(
            isinstance(s, str) and isinstance(v, list) and v and all(type(x) is int for x in v) for s, v in doc.items()
        ):
            raise FedagentError("replay state is not {sender: [sequence numbers]}")
        for sender, seqs in doc.items():
            seqs = sorted(set(seqs))[-self.keep :]
            self._floor[sender] = seqs[0] - 1
            self._seen[sender] = set(seqs)
            self._highest[sender] = seqs[-1]
            self._top[sender] = seqs


class Verifier:
    """Checks a frame's certificate, signature and freshness. Raises :class:`AuthError`."""

    def __init__(
        self,
        ca: x509.Certificate,
        *,
        max_skew: float = 300.0,
        window: int = 4096,
        cache_size: int = SIGNER_CACHE,
        clock=None,
    ) -> None:
        self.ca = ca
        # A member certificate without a fedagent:// URI (issued before federations were
        # bound into certificates) belongs to its CA's own federation.
        ou = ca.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        self.ca_federation = str(ou[0].value).removeprefix("federation ") if ou else ""
        self.clock = clock or SteadyClock()
        self.replay = ReplayGuard(window=window, max_skew=max_skew)
        self._cache: OrderedDict[bytes, _Signer] = OrderedDict()
        self._cache_size = cache_size

    def _signer(self, cert_der: bytes) -> _Signer:
        digest = hashlib.sha256(cert_der).digest()
        hit = self._cache.get(digest)
        if hit is not None:
            self._cache.move_to_end(digest)
            return hit
        # cryptography parses certificate fields lazily: any access may raise on a
        # malformed one, so everything read from it is read inside the guard.
        try:
            cert = x509.load_der_x509_certificate(cert_der)
            if cert.issuer != self.ca.subject:
                raise AuthError(
                    "certificate",
                    f"certificate not issued by this federation's CA (issuer {cert.issuer.rfc4514_string()[:120]})",
                )
            try:
                cert.verify_directly_issued_by(self.ca)
            except InvalidSignature:
                raise AuthError("certificate", "certificate not signed by this federation's CA") from None
            key = cert.public_key()
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise AuthError("certificate", "certificate key is not Ed25519")
            cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
            fed = federation_in(cert)
            signer = _Signer(
                str(cn[0].value) if cn else "",
                str(ou[0].value) if ou else "",
                self.ca_federation if fed is None else fed,
                key,
                cert.not_valid_before_utc.timestamp(),
                cert.not_valid_after_utc.timestamp(),
            )
        except AuthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a hostile DER blob; the parser's errors vary
            raise AuthError("certificate", f"malformed certificate: {type(exc).__name__}: {str(exc)[:200]}") from None
        self._cache[digest] = signer
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return signer

    def check(self, env: Envelope, now: float | None = None, *, journaled: bool = False) -> str:
        """Authenticate ``env`` (a frame as received); returns the signer's role. ``now``
        defaults to this node's :class:`SteadyClock` (certificate validity and timestamps).
        ``journaled``: a frame this node accepted before it restarted, read back from its
        round journal: certificate and signature are checked again, freshness is not (it
        was fresh when it came) and its sequence number is recorded as seen."""
        now = self.clock() if now is None else now
        if not env.sig or not env.cert:
            raise AuthError("unsigned", "frame carries no signature or no certificate")
        signer = self._signer(env.cert)
        if signer.name != env.sender:
            raise AuthError("certificate", f"signed by the certificate of {signer.name!r}, not of the claimed sender")
        if signer.role not in SENDER_ROLES:
            raise AuthError("certificate", f"certificate role {signer.role!r} may not send messages")
        if signer.federation != env.federation:
            raise AuthError(
                "certificate",
                f"certificate of a member of federation {signer.federation!r}, not of {env.federation!r}"[:200],
            )
        if not signer.not_before <= now <= signer.not_after:
            when = datetime.fromtimestamp(signer.not_after, UTC)
            raise AuthError("certificate", f"certificate not valid now (valid until {when:%Y-%m-%d %H:%M} UTC)")
        try:
            signer.key.verify(env.sig, signing_digest(env))
        except InvalidSignature:
            raise AuthError("signature", "signature does not match the message (altered in transit?)") from None
        if journaled:
            self.replay.record(env.sender, env.seq)
        elif env.kind not in UNFRESH_KINDS:
            self.replay.check(env.sender, env.seq, env.ts, now)
        return signer.role

    def check_statement(self, sender: str, data: bytes, cert: bytes, sig: bytes, now: float | None = None) -> None:
        """Raise :class:`AuthError` unless ``sig`` is ``sender``'s signature of ``data``
        (:func:`sign_statement`) under a certificate of this federation valid now. Not a
        frame: no freshness check (``data`` binds its own context)."""
        now = self.clock() if now is None else now
        if not sig or not cert:
            raise AuthError("unsigned", f"statement of {sender} carries no signature or no certificate")
        signer = self._signer(cert)
        if signer.name != sender:
            raise AuthError("certificate", f"statement signed by the certificate of {signer.name!r}, not of {sender!r}")
        if signer.role not in SENDER_ROLES:
            raise AuthError("certificate", f"certificate role {signer.role!r} may not sign statements")
        if not signer.not_before <= now <= signer.not_after:
            raise AuthError("certificate", "certificate not valid now")
        try:
            signer.key.verify(sig, _statement_digest(data))
        except InvalidSignature:
            raise AuthError("signature", f"statement of {sender} does not match its signature") from None
