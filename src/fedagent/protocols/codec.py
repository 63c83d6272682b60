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
been computed with Python ints and checked against the data actually received
(:mod:`fedagent.protocols.tensors`; its names, and :class:`Limits`
(:mod:`fedagent.protocols.limits`), are importable from here too).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from fedagent.errors import CodecError
from fedagent.protocols.limits import DEFAULT_LIMITS as _DEFAULT_LIMITS
from fedagent.protocols.limits import MAX_DEPTH_CAP, Limits
from fedagent.protocols.limits import short as _short
from fedagent.protocols.tensors import (
    DTYPES,
    SLICE_FROM,
    bin_header,
    check_finite,
    decode_tensor,
    decode_tensor_sliced,
    decode_weights,
    encode_tensor,
    encode_tensor_sliced,
    encode_weights,
    weights_nbytes,
)
from fedagent.protocols.topics import is_valid_name

__all__ = [
    "DTYPES",
    "MAX_DEPTH_CAP",
    "PROTOCOL_VERSION",
    "SLICE_FROM",
    "Envelope",
    "Limits",
    "Segments",
    "bin_header",
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

_INT_MIN = -(2**63)
_INT_END = 2**64  # msgpack integers are int64 or uint64
_COUNTER_END = 2**63

_KIND = re.compile(r"[a-z0-9_]{1,32}")

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
