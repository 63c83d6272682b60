"""The wire codec: an :class:`Envelope` as one msgpack map, tensors as ``dtype/shape/data``.

Everything a peer sends passes through :func:`decode`, and the only exception that
leaves it is :class:`~fedagent.errors.CodecError`. The order of the checks is the
point of this module — validate before you allocate:

1. the payload size, before anything is parsed;
2. a header-only scan of the msgpack bytes (:func:`_scan`) that checks every length
   header against the limits *and* against the bytes actually present, the nesting
   depth, the number of objects, that every map key is a string and that no ext type
   appears — all without building a single Python object, so a lying length header,
   a 10^4-deep nesting or a 64 MiB run of one-byte objects costs nothing;
3. ``msgpack.unpackb`` with explicit limits (the same ones again: defence in depth),
   ``raw=False`` (invalid UTF-8 is an error), ``strict_map_key=True``, an
   ``object_pairs_hook`` that refuses duplicate and non-string keys, and an
   ``ext_hook`` that refuses instead of building objects;
4. the envelope fields and the body, validated by :class:`Envelope` itself.

Ext types are never mapped to classes and nothing here unpickles: a message field
never decides which code runs (NVFlare CVE-2026-24186 came from doing exactly that).
Tensors are decoded zero-copy from an allow-list of dtypes after their byte size has
been computed with Python ints and checked against the data actually received.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.topics import is_valid_name

__all__ = [
    "DTYPES",
    "PROTOCOL_VERSION",
    "Envelope",
    "Limits",
    "Segments",
    "check_finite",
    "decode",
    "decode_tensor",
    "decode_tensor_sliced",
    "decode_weights",
    "encode",
    "encode_segments",
    "encode_tensor",
    "encode_tensor_sliced",
    "encode_view",
    "encode_weights",
    "weights_nbytes",
]

PROTOCOL_VERSION = 1

# msgpack's packer refuses nesting deeper than 511 and its C unpacker's stack holds
# 1024 levels; no configuration may ask for more than this, so encoding a valid
# envelope can never hit either.
MAX_DEPTH_CAP = 256

_INT_MIN = -(2**63)
_INT_END = 2**64  # msgpack integers are int64 or uint64
_COUNTER_END = 2**63

_KIND = re.compile(r"[a-z0-9_]{1,32}")
_MAX_TENSOR_NAME = 200

# The allow-list of tensor dtypes: wire name -> little-endian numpy dtype. Nothing
# else is ever passed to np.dtype(), so "O", "V8", "<U4", "object" cannot get in.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
}
_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))

#: Binary values from this size on are referenced, not copied (encode_segments, decode's views).
_VIEW_FROM = 64 * 1024

_WIRE_KEYS = ("v", "k", "f", "s", "r", "q", "t", "b")
_WIRE_KEYSET = frozenset(_WIRE_KEYS)
# Authentication fields (see fedagent.security.signing): present on every frame a node sends,
# absent on the envelope inside a chunked transfer (its chunks carry them). Optional
# for the codec; the messenger refuses a frame without them.
_AUTH_KEYS = frozenset(("g", "c"))
SIGNATURE_LEN = 64  # Ed25519
MAX_CERT_LEN = 4096  # one DER certificate; an Ed25519 leaf is ~450 bytes


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver is willing to decode. Every limit is checked before allocation."""

    max_message_bytes: int = 64 * 2**20  # one MQTT payload (a chunk or a small message)
    max_str_len: int = 1 * 2**20
    max_bin_len: int = 64 * 2**20
    max_array_len: int = 100_000
    max_map_len: int = 100_000
    max_tensor_bytes: int = 2**31  # one decoded tensor
    max_tensor_dims: int = 8
    max_depth: int = 32  # nesting of maps/arrays in a body; the body map is depth 1
    # Every msgpack object (map keys included) in one message. Per-container limits
    # alone do not bound memory: 64 MiB of nested empty arrays would become ~3.5 GiB
    # of Python lists, and short strings cost ~17x their wire size.
    max_objects: int = 1_000_000

    def __post_init__(self) -> None:
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, not {value!r}")
        if self.max_depth > MAX_DEPTH_CAP:
            raise ValueError(f"Limits.max_depth must be at most {MAX_DEPTH_CAP}")


_DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Envelope:
    """One protocol message. Constructing it validates every field (CodecError)."""

    kind: str  # 1..32 chars of [a-z0-9_]
    federation: str  # topics.is_valid_name
    sender: str  # topics.is_valid_name
    round: int  # >= 0; round or step number, 0 when not applicable
    seq: int  # per-sender sequence number, 0 <= seq < 2**63
    ts: float  # sender's wall clock, finite
    body: dict[str, Any]  # msgpack-native values, str keys; tensors in encode_tensor form
    version: int = PROTOCOL_VERSION
    sig: bytes = b""  # Ed25519 signature over fedagent.security.signing.signing_digest, or empty
    cert: bytes = b""  # the signer's DER certificate, or empty

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version != PROTOCOL_VERSION:
            raise CodecError(_version_message(self.version))
        if type(self.kind) is not str or not _KIND.fullmatch(self.kind):
            raise CodecError(f"envelope: invalid kind {_short(self.kind)}")
        if not _valid_name(self.federation):
            raise CodecError(f"envelope: invalid federation {_short(self.federation)}")
        if not _valid_name(self.sender):
            raise CodecError(f"envelope: invalid sender {_short(self.sender)}")
        for name in ("round", "seq"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < _COUNTER_END:
                raise CodecError(f"envelope: {name} must be an int in [0, 2**63), not {_short(value)}")
        ts = self.ts
        if type(ts) not in (int, float) or not _finite(ts):
            raise CodecError(f"envelope: ts must be a finite number, not {_short(ts)}")
        if type(ts) is int:
            object.__setattr__(self, "ts", float(ts))
        if type(self.body) is not dict:
            raise CodecError(f"envelope: body must be a dict, not {type(self.body).__name__}")
        if type(self.sig) is not bytes or len(self.sig) not in (0, SIGNATURE_LEN):
            raise CodecError(f"envelope: signature must be {SIGNATURE_LEN} bytes")
        if type(self.cert) is not bytes or len(self.cert) > MAX_CERT_LEN:
            raise CodecError(f"envelope: certificate must be at most {MAX_CERT_LEN} bytes")
        _check_value(self.body, MAX_DEPTH_CAP)


def encode(env: Envelope) -> bytes:
    """The wire bytes of ``env``. Raises CodecError if its body was mutated into
    something msgpack cannot carry (the envelope was validated when it was built)."""
    if not isinstance(env, Envelope):
        raise TypeError(f"encode() takes an Envelope, not {type(env).__name__}")
    try:
        return msgpack.packb(_wire(env), use_bin_type=True, datetime=False)
    except Exception as exc:  # TypeError, OverflowError, ValueError (depth), UnicodeEncodeError
        raise CodecError(f"cannot encode envelope: {exc}") from exc


def _wire(env: Envelope) -> dict[str, Any]:
    """The envelope as the map that goes on the wire (both encoders use it, so neither
    can drop a field: the signature and certificate travel only when set)."""
    wire = {
        "v": env.version,
        "k": env.kind,
        "f": env.federation,
        "s": env.sender,
        "r": env.round,
        "q": env.seq,
        "t": env.ts,
        "b": env.body,
    }
    if env.cert:
        wire["c"] = env.cert
    if env.sig:
        wire["g"] = env.sig
    return wire


def encode_view(env: Envelope) -> memoryview:
    """Like :func:`encode`, as a view of the encoder's own buffer: a large message is
    then written once, not once into the buffer and once more into a bytes object.
    The view stays valid for as long as it is referenced."""
    if not isinstance(env, Envelope):
        raise TypeError(f"encode_view() takes an Envelope, not {type(env).__name__}")
    wire = _wire(env)
    # Sized up front: growing the buffer by doubling would copy a large model again.
    packer = msgpack.Packer(
        use_bin_type=True, datetime=False, autoreset=False, buf_size=_binary_bytes(env.body) + 65536
    )
    try:
        packer.pack(wire)
    except Exception as exc:  # TypeError, OverflowError, ValueError (depth), UnicodeEncodeError
        raise CodecError(f"cannot encode envelope: {exc}") from exc
    return packer.getbuffer()


class Segments:
    """An encoded envelope as a list of byte runs whose concatenation is exactly what
    :func:`encode` returns: msgpack's headers and small values as bytes, and every large
    binary value (a tensor's data) as the caller's own buffer, not copied. A sender that
    cuts a model into chunks copies each chunk out of it once (:meth:`read`) instead of
    first copying the whole model into one payload (a second model in memory for as
    long as the send takes). The buffers must not change until the last chunk is read."""

    __slots__ = ("_ends", "_parts", "nbytes")

    #: Binary values from this size on are referenced, not copied.
    VIEW_FROM = 64 * 1024  # = _VIEW_FROM

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._ends: list[int] = []
        total = 0
        for p in self._parts:
            total += p.nbytes
            self._ends.append(total)
        self.nbytes = total

    def __len__(self) -> int:
        return self.nbytes

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._parts)

    def read(self, start: int, end: int) -> bytes | bytearray | memoryview:
        """Bytes ``[start, end)``: a view when they lie in one run, else a copy (a
        bytearray: one copy, not a second one into bytes)."""
        end = min(end, self.nbytes)
        if start >= end:
            return b""
        k = bisect.bisect_right(self._ends, start)
        base = self._ends[k] - self._parts[k].nbytes
        if end <= self._ends[k]:
            return self._parts[k][start - base : end - base]
        out = bytearray()
        while start < end:
            base = self._ends[k] - self._parts[k].nbytes
            out += self._parts[k][start - base : min(end, self._ends[k]) - base]
            start = self._ends[k]
            k += 1
        return out


def encode_segments(env: Envelope) -> Segments:
    """:func:`encode` as :class:`Segments` (byte-identical when joined)."""
    if not isinstance(env, Envelope):
        raise TypeError(f"encode_segments() takes an Envelope, not {type(env).__name__}")
    parts: list[bytes | memoryview] = []
    small = bytearray()
    packer = msgpack.Packer(use_bin_type=True, datetime=False)

    def walk(v: Any, depth: int) -> None:
        nonlocal small
        if depth > MAX_DEPTH_CAP:
            raise CodecError("cannot encode envelope: nested too deeply")
        t = type(v)
        if t is dict:
            small += packer.pack_map_header(len(v))
            for k, item in v.items():
                small += packer.pack(k)
                walk(item, depth + 1)
        elif t is list or t is tuple:
            small += packer.pack_array_header(len(v))
            for item in v:
                walk(item, depth + 1)
        elif t is memoryview or t is bytes or t is bytearray:
            mv = memoryview(v)
            n = mv.nbytes
            if n < Segments.VIEW_FROM or not mv.c_contiguous:
                small += packer.pack(v)
                return
            small += (b"\xc6" + n.to_bytes(4, "big")) if n > 0xFFFF else (b"\xc5" + n.to_bytes(2, "big"))
            parts.append(bytes(small))
            small = bytearray()
            parts.append(mv.cast("B"))
        else:
            small += packer.pack(v)

    try:
        walk(_wire(env), 0)
    except CodecError:
        raise
    except Exception as exc:  # TypeError, OverflowError, ValueError, UnicodeEncodeError
        raise CodecError(f"cannot encode envelope: {exc}") from exc
    if small:
        parts.append(bytes(small))
    return Segments(parts)


def _binary_bytes(root: Any) -> int:
    """Bytes of the binary values in a body (already checked: nesting is bounded)."""
    total, stack = 0, [root]
    while stack:
        c = stack.pop()
        for v in c.values() if type(c) is dict else c:
            t = type(v)
            if t is bytes or t is bytearray:
                total += len(v)
            elif t is memoryview:
                total += v.nbytes
            elif t is dict or t is list or t is tuple:
                stack.append(v)
    return total


def decode(data: bytes | bytearray | memoryview, limits: Limits = _DEFAULT_LIMITS, *, views: bool = False) -> Envelope:
    """Validate and decode one envelope. Raises CodecError and nothing else.

    ``views``: binary values of :attr:`Segments.VIEW_FROM` bytes or more (a tensor's or a
    chunk's data) come back as read-only memoryviews of ``data`` instead of copies, so a
    received model is not copied once more by the decoder. ``data`` must then not change
    while they are in use (bytes never do; a reassembled buffer nobody else holds)."""
    try:
        return _decode(data, limits, views)
    except CodecError:
        raise
    except Exception as exc:  # belt and braces: nothing but CodecError leaves the decoder
        raise CodecError(f"undecodable message ({type(exc).__name__}: {exc})") from exc


def _decode(data: bytes | bytearray | memoryview, limits: Limits, views: bool = False) -> Envelope:
    if not isinstance(limits, Limits):
        raise CodecError("decode() limits must be a Limits")
    if isinstance(data, memoryview):
        size = data.nbytes
    elif isinstance(data, bytes | bytearray):
        size = len(data)
    else:
        raise CodecError(f"expected bytes, not {type(data).__name__}")
    # Guard against oversized payloads before a single byte is parsed.
    if size > limits.max_message_bytes:
        raise CodecError(f"message of {size} bytes exceeds the limit of {limits.max_message_bytes}")
    if isinstance(data, memoryview):  # index it as bytes, whatever its format or shape
        data = data.cast("B") if data.c_contiguous else data.tobytes()
    if size == 0:
        raise CodecError("empty message")
    head = data[0]
    if not (0x80 <= head <= 0x8F or head in (0xDE, 0xDF)):
        raise CodecError("not a fedagent envelope (expected a msgpack map)")
    # The envelope map is depth 1, so its body may reach max_depth + 1.
    bins: list[tuple[int, int, int]] | None = [] if views else None
    _scan(data, limits, limits.max_depth + 1, bins)
    ext_hook: Any = _refuse_ext
    max_ext_len = 0
    if bins:
        # The large binaries are cut out and replaced by an ext placeholder holding their
        # index; msgpack decodes the small rest, and the hook puts the views in. The
        # scan refused every ext type in ``data``, so every ext left is a placeholder.
        whole = memoryview(data).toreadonly()
        cut = [whole[start : start + n] for _h, start, n in bins]
        small = bytearray()
        last = 0
        for k, (head, start, n) in enumerate(bins):
            small += whole[last:head]
            small += b"\xd6" + bytes([_VIEW_EXT]) + k.to_bytes(4, "big")  # fixext 4
            last = start + n
        small += whole[last:]
        data = small
        max_ext_len = 4

        def ext_hook(code: int, index: bytes) -> memoryview:
            if code != _VIEW_EXT:
                raise CodecError(f"msgpack ext type {code} is not allowed")
            return cut[int.from_bytes(index, "big")]

    try:
        wire = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            timestamp=0,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=max_ext_len,
            object_pairs_hook=_pairs_to_dict,
            ext_hook=ext_hook,
        )
    except CodecError:
        raise
    except msgpack.ExtraData as exc:
        raise CodecError("trailing bytes after the message") from exc
    except UnicodeDecodeError as exc:
        raise CodecError(f"invalid UTF-8 in a string: {exc.reason}") from exc
    except RecursionError as exc:
        raise CodecError("message nested too deeply") from exc
    except Exception as exc:  # ValueError/StackError/FormatError/TypeError/MemoryError...
        raise CodecError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc

    if not isinstance(wire, dict):
        raise CodecError("not a fedagent envelope (expected a msgpack map)")
    # The version first: a newer peer's message must say so, not "missing field".
    if "v" not in wire:
        raise CodecError("envelope without a protocol version")
    version = wire["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise CodecError(_version_message(version))
    if wire.keys() != _WIRE_KEYSET and (wire.keys() - _AUTH_KEYS) != _WIRE_KEYSET:
        missing = sorted(_WIRE_KEYSET - wire.keys())
        unknown = sorted(wire.keys() - _WIRE_KEYSET - _AUTH_KEYS)
        raise CodecError(f"envelope fields wrong: missing {missing}, unknown {[_short(k) for k in unknown[:5]]}")
    body = wire["b"]
    if not isinstance(body, dict):
        raise CodecError("envelope: body must be a map")
    # Already guaranteed by _scan; checked again on the objects themselves, iteratively.
    _check_value(body, limits.max_depth)
    sig, cert = wire.get("g", b""), wire.get("c", b"")
    if type(sig) is not bytes or type(cert) is not bytes:
        raise CodecError("envelope: signature and certificate must be binary")
    return Envelope(
        kind=wire["k"],
        federation=wire["f"],
        sender=wire["s"],
        round=wire["r"],
        seq=wire["q"],
        ts=wire["t"],
        body=body,
        version=version,
        sig=sig,
        cert=cert,
    )


def _version_message(version: object) -> str:
    return f"unsupported protocol version {_short(version)}; this agent speaks {PROTOCOL_VERSION}"


def _pairs_to_dict(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    if not isinstance(pairs, list):  # msgpack's pure-Python fallback passes a generator
        pairs = list(pairs)
    # msgpack itself keeps the last of duplicate keys; a duplicate is refused here so
    # two readers can never disagree about what a message says.
    d = dict(pairs)
    if len(d) != len(pairs):
        raise CodecError("duplicate key in a map")
    for k in d:
        if type(k) is not str:  # strict_map_key still lets bytes through
            raise CodecError(f"map key of type {type(k).__name__}; only strings are allowed")
    return d


#: The ext type code of decode()'s view placeholders (never accepted from a peer).
_VIEW_EXT = 0x42


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CodecError(f"msgpack ext type {code} is not allowed")


# --- the header scan -------------------------------------------------------------

# What each of the 256 header bytes is: (operation, argument).
_SCALAR, _FIXMAP, _FIXARRAY, _FIXSTR, _STR, _BIN, _ARRAY, _MAP, _EXT, _INVALID = range(10)


def _header_table() -> tuple[tuple[int, int], ...]:
    table: list[tuple[int, int]] = []
    for h in range(256):
        if h <= 0x7F or h >= 0xE0:
            table.append((_SCALAR, 0))  # fixint
        elif h <= 0x8F:
            table.append((_FIXMAP, h & 0x0F))
        elif h <= 0x9F:
            table.append((_FIXARRAY, h & 0x0F))
        elif h <= 0xBF:
            table.append((_FIXSTR, h & 0x1F))
        elif h in (0xC0, 0xC2, 0xC3):
            table.append((_SCALAR, 0))  # nil, false, true
        elif h in (0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
            table.append(
                (_SCALAR, {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}[h])
            )
        elif h in (0xC4, 0xC5, 0xC6):
            table.append((_BIN, {0xC4: 1, 0xC5: 2, 0xC6: 4}[h]))  # argument: width of the length
        elif h in (0xD9, 0xDA, 0xDB):
            table.append((_STR, {0xD9: 1, 0xDA: 2, 0xDB: 4}[h]))
        elif h in (0xDC, 0xDD):
            table.append((_ARRAY, 2 if h == 0xDC else 4))
        elif h in (0xDE, 0xDF):
            table.append((_MAP, 2 if h == 0xDE else 4))
        elif h in (0xC7, 0xC8, 0xC9):
            table.append((_EXT, {0xC7: 1, 0xC8: 2, 0xC9: 4}[h]))  # argument: where the type code is
        elif 0xD4 <= h <= 0xD8:
            table.append((_EXT, 0))
        else:
            table.append((_INVALID, 0))  # 0xc1, never used by msgpack
    return tuple(table)


_HEADERS = _header_table()


def _scan(
    buf: bytes | bytearray | memoryview, limits: Limits, max_depth: int, bins: list[tuple[int, int, int]] | None = None
) -> None:
    """Walk the msgpack headers of ``buf`` without building any object.

    ``bins``: where to list ``(header position, data position, length)`` of every binary
    value of :attr:`Segments.VIEW_FROM` bytes or more (for :func:`decode`'s views).

    Refuses (CodecError) any length beyond a limit or beyond the bytes present, nesting
    deeper than ``max_depth``, more than ``limits.max_objects`` objects, a non-string
    map key, an ext type, the never-used header 0xc1, truncation and trailing bytes.
    Iterative, so depth costs no stack; stops at the first violation, so its time is
    bounded by ``max_objects`` whatever the input.
    """
    headers = _HEADERS
    from_bytes = int.from_bytes
    end = len(buf)
    pos = 0
    budget = limits.max_objects
    # Items still to read in each open container; a map of n entries is 2n items, and
    # its keys are the items read when an even number remains. Negative for maps.
    remaining: list[int] = []
    while True:
        must_be_key = False
        if remaining:
            left = remaining[-1]
            if left < 0:
                must_be_key = left % 2 == 0
                remaining[-1] = left + 1
            else:
                remaining[-1] = left - 1
        budget -= 1
        if budget < 0:
            raise CodecError(f"message has more than {limits.max_objects} objects")
        if pos >= end:
            raise CodecError(f"truncated message (at byte {pos})")
        start = pos
        op, arg = headers[buf[pos]]
        pos += 1
        if must_be_key and op != _FIXSTR and op != _STR:
            raise CodecError(f"map key at byte {start} is not a string")
        count = -1  # items of a container; -1 for a scalar
        is_map = False
        if op == _SCALAR:
            pos += arg
        elif op == _FIXSTR:
            pos += arg
        elif op == _FIXMAP:
            count, is_map = 2 * arg, True
        elif op == _FIXARRAY:
            count = arg
        elif op == _EXT:
            code = from_bytes(buf[pos + arg : pos + arg + 1], "big", signed=True) if pos + arg < end else None
            raise CodecError(f"msgpack ext type {code} at byte {start} is not allowed")
        elif op == _INVALID:
            raise CodecError(f"invalid msgpack header 0x{buf[start]:02x} at byte {start}")
        else:
            if pos + arg > end:
                raise CodecError(f"truncated message (length header at byte {start})")
            n = from_bytes(buf[pos : pos + arg], "big")
            pos += arg
            if op == _STR:
                if n > limits.max_str_len:
                    raise CodecError(f"string of {n} bytes at byte {start} exceeds max_str_len {limits.max_str_len}")
                pos += n
            elif op == _BIN:
                if n > limits.max_bin_len:
                    raise CodecError(f"binary of {n} bytes at byte {start} exceeds max_bin_len {limits.max_bin_len}")
                if bins is not None and n >= _VIEW_FROM:
                    bins.append((start, pos, n))
                pos += n
            elif op == _ARRAY:
                if n > limits.max_array_len:
                    raise CodecError(f"array of {n} items at byte {start} exceeds max_array_len {limits.max_array_len}")
                count = n
            else:
                if n > limits.max_map_len:
                    raise CodecError(f"map of {n} entries at byte {start} exceeds max_map_len {limits.max_map_len}")
                count, is_map = 2 * n, True

        if pos > end:
            raise CodecError(f"truncated message (object at byte {start} runs past the end)")
        if count >= 0:
            if len(remaining) >= max_depth:
                raise CodecError(f"message nested deeper than {max_depth - 1} levels in the body")
            # Each item needs at least one byte: a count larger than what is left lies.
            if count > end - pos:
                raise CodecError(f"truncated message (container at byte {start} claims {count} items)")
            if count:
                remaining.append(-count if is_map else count)
                continue
        while remaining and remaining[-1] == 0:
            remaining.pop()
        if not remaining:
            break
    if pos != end:
        raise CodecError(f"{end - pos} trailing bytes after the message")


# --- body validation ----------------------------------------------------------------

# Exact types: a subclass (an IntEnum, a namedtuple such as msgpack.ExtType) would not
# come back as itself.
_SCALARS = (type(None), bool, int, float, str, bytes, bytearray, memoryview)


def _check_value(root: dict[str, Any], max_depth: int) -> None:
    """Iteratively check that ``root`` holds msgpack-native values only: str keys,
    ints in the int64/uint64 range, no nesting deeper than ``max_depth`` (root = 1)."""
    # (container, depth, where): ``where`` is (parent's where, key), formatted on error only.
    stack: list[tuple[Any, int, Any]] = [(root, 1, None)]
    while stack:
        container, depth, where = stack.pop()
        if depth > max_depth:
            raise CodecError(f"{_path(where)}: nested deeper than {max_depth} levels")
        is_map = type(container) is dict
        for key, value in container.items() if is_map else enumerate(container):
            if is_map and type(key) is not str:
                raise CodecError(f"{_path(where)}: map key of type {type(key).__name__}; only strings are allowed")
            t = type(value)
            if t is int:
                if not _INT_MIN <= value < _INT_END:
                    raise CodecError(f"{_path((where, key))}: integer out of the 64-bit range")
            elif t in _SCALARS:
                pass
            elif t is dict or t is list or t is tuple:  # exact: ExtType is a tuple subclass
                stack.append((value, depth + 1, (where, key)))
            else:
                raise CodecError(
                    f"{_path((where, key))}: {t.__module__}.{t.__qualname__} is not a msgpack-native value"
                )


def _path(where: Any) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    return "body" + "".join(f"[{_short(k)}]" for k in reversed(keys))


def _valid_name(name: object) -> bool:
    # topics._NAME ends in "$", which also matches before a final "\n": refuse that here.
    return is_valid_name(name) and not name.endswith("\n")


def _finite(x: int | float) -> bool:
    return math.isfinite(x) if type(x) is float else True


def _short(value: object, limit: int = 40) -> str:
    """A bounded repr: peer-controlled values go into error messages and logs."""
    if isinstance(value, dict | list | tuple):  # never repr a structure: it may be deep
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- tensors ---------------------------------------------------------------------------


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` with the data little-endian in C order.

    Raises CodecError for a dtype outside the allow-list :data:`DTYPES`.
    """
    if not isinstance(a, np.ndarray):
        raise CodecError(f"expected a numpy array, not {type(a).__name__}")
    name = a.dtype.name
    wire = DTYPES.get(name)
    if wire is None or a.dtype.kind not in "biuf" or a.dtype.fields is not None:
        raise CodecError(f"dtype {a.dtype.str!r} cannot be sent; allowed: {', '.join(DTYPES)}")
    if a.dtype != wire:
        a = a.astype(wire)
    if a.flags.c_contiguous:
        # A view of the array, not a copy: the encoder copies the bytes once, into the
        # message (a.tobytes() here was one more pass over every model byte).
        data: bytes | memoryview = a.reshape(-1).view(np.uint8).data
    else:
        data = a.tobytes(order="C")
    return {"dtype": name, "shape": list(a.shape), "data": data}


def _tensor_head(
    obj: dict[str, Any], limits: Limits, expect_dtype: str | None, expect_shape: tuple[int, ...] | None
) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """A wire tensor's dtype name, numpy dtype, shape and dense byte size, checked
    against the allow-list, the limits and the expectations (Python ints: no overflow)."""
    name = obj["dtype"]
    if type(name) is not str or name not in DTYPES:
        raise CodecError(f"tensor dtype {_short(name)} not allowed; allowed: {', '.join(DTYPES)}")
    if expect_dtype is not None and name != expect_dtype:
        raise CodecError(f"tensor dtype {name} where {expect_dtype} was expected")
    dtype = DTYPES[name]
    dims = obj["shape"]
    if not isinstance(dims, list | tuple):
        raise CodecError("tensor shape must be a list of ints")
    if len(dims) > limits.max_tensor_dims:
        raise CodecError(f"tensor of {len(dims)} dimensions exceeds max_tensor_dims {limits.max_tensor_dims}")
    for d in dims:
        if type(d) is not int:
            raise CodecError(f"tensor dimension {_short(d)} is not an int")
        if d < 0:
            raise CodecError(f"negative tensor dimension {d}")
        if d > limits.max_tensor_bytes:  # also keeps every dim inside numpy's intp
            raise CodecError(f"tensor dimension {_short(d)} exceeds max_tensor_bytes")
    shape = tuple(dims)
    if expect_shape is not None and shape != tuple(expect_shape):
        raise CodecError(f"tensor shape {list(shape)} where {list(expect_shape)} was expected")
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: cannot overflow
    if nbytes > limits.max_tensor_bytes:
        raise CodecError(f"tensor of {nbytes} bytes exceeds max_tensor_bytes {limits.max_tensor_bytes}")
    return name, dtype, shape, nbytes


def _binary_len(data: object, what: str) -> int:
    if isinstance(data, bytes | bytearray):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    raise CodecError(f"tensor {what} must be binary, not {type(data).__name__}")


def decode_tensor(
    obj: object,
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect_dtype: str | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The array described by ``obj`` (a read-only view of its bytes, no copy).

    The byte size is computed from the shape with Python ints and must equal the data
    length exactly, before numpy sees anything.
    """
    if not isinstance(obj, dict):
        raise CodecError(f"tensor must be a map, not {type(obj).__name__}")
    if obj.keys() != _TENSOR_KEYS:
        raise CodecError(f"tensor must have exactly the fields dtype, shape, data; got {sorted(map(_short, obj))[:5]}")
    name, dtype, shape, nbytes = _tensor_head(obj, limits, expect_dtype, expect_shape)
    data = obj["data"]
    have = _binary_len(data, "data")
    if have != nbytes:
        raise CodecError(f"tensor data has {have} bytes; {name}{list(shape)} needs {nbytes}")
    try:
        if name == "bool" and nbytes and np.frombuffer(data, dtype=np.uint8).max() > 1:
            # numpy would carry a byte 2 as a bool that is neither True nor False.
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except CodecError:
        raise
    except Exception as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"tensor data unusable: {exc}") from exc


# --- sliced tensors: the non-zero slices of a tensor along one axis ---------------------
#
# A gradient often has whole slices that are exactly zero: the first layer of a
# bag-of-words encoder gets no gradient for the terms its mini-batch does not contain.
# Sent as ``{dtype, shape, axis, index, data}``: ``index`` the positions along ``axis``
# of the slices that are sent (uint32 little-endian, strictly increasing), ``data`` those
# slices in C order; every other slice is zero. Lossless: a slice is left out only when
# every one of its bytes is 0 (so -0.0 travels), and the receiver rebuilds the tensor
# bit for bit.

_SLICED_KEYS = frozenset(("dtype", "shape", "axis", "index", "data"))
#: Tensors smaller than this are always sent whole (the search is not worth it).
SLICE_FROM = 64 * 1024
#: A tensor is sliced only when that leaves out at least this share of its bytes.
#: Gathering the slices (sender) and scattering them into zeros (receiver) cost about
#: 1.5 + 2.3 ms of CPU for a 100 x 5000 float32 gradient, more than 9 % fewer bytes
#: save in hashing, TLS and copies on the way (measured: a net loss); at a third of
#: the bytes the two are about even.
SLICE_MIN_SAVING = 1 / 3
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode_tensor_sliced(a: np.ndarray) -> dict[str, Any]:
    """The wire form of ``a`` without its all-zero slices along the axis that leaves the
    fewest bytes, when that (index included) is at most ``1 - SLICE_MIN_SAVING`` of the
    whole tensor's bytes; else the plain :func:`encode_tensor` form."""
    dense = encode_tensor(a)
    if a.nbytes < SLICE_FROM or a.ndim == 0 or a.size == 0 or max(a.shape) >= 2**32:
        return dense
    wire = DTYPES[a.dtype.name]
    a = np.ascontiguousarray(a, dtype=wire)
    bits = a.view(_UINT_OF_SIZE[wire.itemsize])
    if a.size - np.count_nonzero(bits) < a.size * SLICE_MIN_SAVING:
        return dense  # too few zero elements for any slicing to save enough (a quick count)
    nonzero = bits != 0
    best: tuple[int, int, np.ndarray] | None = None  # (bytes, axis, kept positions)
    for axis in range(a.ndim):
        others = tuple(i for i in range(a.ndim) if i != axis)
        kept = np.flatnonzero(nonzero.any(axis=others)) if others else np.flatnonzero(nonzero)
        size = 4 * kept.size + kept.size * (a.size // a.shape[axis]) * wire.itemsize
        if best is None or size < best[0]:
            best = (size, axis, kept)
    assert best is not None
    size, axis, kept = best
    if size > a.nbytes * (1 - SLICE_MIN_SAVING):
        return dense
    part = np.ascontiguousarray(np.take(a, kept, axis=axis))
    return {
        "dtype": dense["dtype"],
        "shape": dense["shape"],
        "axis": axis,
        "index": kept.astype("<u4").tobytes(),
        "data": part.reshape(-1).view(np.uint8).data,
    }


def decode_tensor_sliced(
    obj: dict[str, Any],
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect_dtype: str | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The dense array of a sliced tensor (a new, writable array). Everything is checked
    before the array is allocated: the dtype, the shape and its dense size against the
    limits, the axis, that the index holds whole uint32s, at most as many as the axis
    has positions, strictly increasing and in range, and that the data holds exactly
    that many slices."""
    if obj.keys() != _SLICED_KEYS:
        raise CodecError(
            f"sliced tensor must have exactly the fields {', '.join(sorted(_SLICED_KEYS))}; "
            f"got {sorted(map(_short, obj))[:6]}"
        )
    name, dtype, shape, _dense = _tensor_head(obj, limits, expect_dtype, expect_shape)
    axis = obj["axis"]
    if type(axis) is not int or not 0 <= axis < len(shape):
        raise CodecError(f"sliced tensor axis {_short(axis)} is not an axis of shape {list(shape)}")
    index = obj["index"]
    have_index = _binary_len(index, "index")
    if have_index % 4:
        raise CodecError(f"sliced tensor index of {have_index} bytes is not a whole number of uint32")
    k = have_index // 4
    if k > shape[axis]:
        raise CodecError(f"sliced tensor index of {k} positions for an axis of {shape[axis]}")
    slice_items = math.prod(shape[:axis]) * math.prod(shape[axis + 1 :])
    data = obj["data"]
    want = k * slice_items * dtype.itemsize
    have = _binary_len(data, "data")
    if have != want:
        raise CodecError(f"sliced tensor data has {have} bytes; {k} slices of {name}{list(shape)} need {want}")
    try:
        idx = np.frombuffer(index, dtype="<u4")
        if k and int(idx[-1]) >= shape[axis]:
            raise CodecError(f"sliced tensor index {int(idx[-1])} out of range for an axis of {shape[axis]}")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise CodecError("sliced tensor index is not strictly increasing")
        part = np.frombuffer(data, dtype=dtype)
        if name == "bool" and part.size and part.view(np.uint8).max() > 1:
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        out = np.zeros(shape, dtype=dtype)  # its bytes (_dense) <= max_tensor_bytes: checked above
        cut = list(shape)
        cut[axis] = k
        where: tuple[Any, ...] = (slice(None),) * axis + (idx.astype(np.intp),)
        out[where] = part.reshape(cut)
        return out
    except CodecError:
        raise
    except Exception as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"sliced tensor unusable: {exc}") from exc


def _check_tensor_name(name: object) -> str:
    if type(name) is not str or not 1 <= len(name) <= _MAX_TENSOR_NAME or not name.isprintable():
        raise CodecError(f"invalid tensor name {_short(name)}: use 1-{_MAX_TENSOR_NAME} printable characters")
    return name


def encode_weights(w: Mapping[str, np.ndarray], *, sliced: bool = False) -> dict[str, dict[str, Any]]:
    """A named set of tensors in wire form; ``sliced``: without the all-zero slices of
    the tensors that have them (:func:`encode_tensor_sliced`; only for a receiver that
    decodes with ``sliced=True``)."""
    enc = encode_tensor_sliced if sliced else encode_tensor
    if not isinstance(w, Mapping):
        raise CodecError(f"weights must be a mapping, not {type(w).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for name, a in w.items():
        _check_tensor_name(name)
        try:
            out[name] = enc(a)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from exc
    return out


def decode_weights(
    obj: object,
    limits: Limits = _DEFAULT_LIMITS,
    *,
    expect: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    sliced: bool = False,
) -> dict[str, np.ndarray]:
    """Decode a named set of tensors; with ``expect`` (name -> (dtype, shape)) the names,
    dtypes and shapes must match exactly. ``sliced``: tensors may also come without
    their zero slices (:func:`decode_tensor_sliced`; those come back as new dense
    arrays). Errors name the tensor."""
    if not isinstance(obj, dict):
        raise CodecError(f"weights must be a map, not {type(obj).__name__}")
    if len(obj) > limits.max_map_len:
        raise CodecError(f"{len(obj)} tensors exceed max_map_len {limits.max_map_len}")
    for name in obj:
        _check_tensor_name(name)
    if expect is not None:
        missing = sorted(expect.keys() - obj.keys())
        if missing:
            raise CodecError(
                f"tensor {missing[0]!r} missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        unexpected = sorted(obj.keys() - expect.keys())
        if unexpected:
            raise CodecError(
                f"unexpected tensor {unexpected[0]!r}"
                + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            )
    out: dict[str, np.ndarray] = {}
    for name, t in obj.items():
        want_dtype, want_shape = expect[name] if expect is not None else (None, None)
        try:
            if sliced and isinstance(t, dict) and "axis" in t:
                out[name] = decode_tensor_sliced(t, limits, expect_dtype=want_dtype, expect_shape=want_shape)
            else:
                out[name] = decode_tensor(t, limits, expect_dtype=want_dtype, expect_shape=want_shape)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from exc
    return out


def weights_nbytes(weights: Mapping[str, Any]) -> int:
    """Total tensor bytes of ``weights``, decoded (arrays) or in wire form (dicts)."""
    total = 0
    for name, t in weights.items():
        if isinstance(t, np.ndarray):
            total += t.nbytes
        elif isinstance(t, dict) and isinstance(t.get("data"), bytes | bytearray | memoryview):
            data = t["data"]
            total += data.nbytes if isinstance(data, memoryview) else len(data)
        else:
            raise CodecError(f"tensor {_short(name)}: neither an array nor a wire tensor")
    return total


_FINITE_BLOCK = 1 << 20  # elements checked at a time: bounds the temporary bool array


def check_finite(weights: Mapping[str, np.ndarray]) -> None:
    """Raise CodecError naming the first tensor that holds a NaN or an infinity.

    The codec itself only checks structure; this is for aggregation to call.
    """
    for name, a in weights.items():
        if not isinstance(a, np.ndarray):
            raise CodecError(f"tensor {_short(name)}: not an array")
        if a.dtype.kind not in "fc":
            continue
        flat = a.reshape(-1)
        bad = 0
        for start in range(0, flat.size, _FINITE_BLOCK):
            bad += int(np.count_nonzero(~np.isfinite(flat[start : start + _FINITE_BLOCK])))
        if bad:
            raise CodecError(f"tensor {_short(name)} holds {bad} non-finite values (NaN or Inf)")


def bin_header(n: int) -> bytes:
    """msgpack's header of a binary value of ``n`` bytes (bin 8, 16 or 32), for a body
    written separately (a file record or checkpoint tensor written from where it lies)."""
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 2**16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")
