r"""Message bodies declared field by field, and the checks every field passes, written once.

A message (:mod:`~fedagent.protocols.messages`, the secure-aggregation messages) declares
its body once: a :class:`Body` of :class:`Field`\ s, each with its wire key, its
:class:`Kind` (what a value must be, and how it is written), whether it may be absent
(and what it then is) and when it is left out of what is sent. One encoder and one
decoder read that declaration (:class:`WireMessage`); a rule that is not a check of one
field stays with its message, as a small hook of its own.

A body comes from a peer: each value is checked for its type and bounds before it is
used or copied, every cheap field before the first tensor is decoded, and a refusal is a
:class:`~fedagent.errors.CodecError` that names the message and the field (``"update:
num_samples must be a positive integer"``), so a log line says which peer sent what. A
field is read as the message keeps it (a list becomes a tuple, an integer where a float
is meant becomes a float) and written as it is kept: the bytes on the wire are what the
hand-written encoders sent before (tests/protocols/test_wire_golden.py holds them).

Booleans are never numbers here: msgpack keeps ``true`` and ``1`` apart, and so must a
receiver (``True`` is an ``int`` in Python).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from fedagent.errors import CodecError
from fedagent.protocols.limits import Limits
from fedagent.protocols.tensors import decode_weights, encode_weights
from fedagent.protocols.topics import is_valid_name

T = TypeVar("T")

#: Counters (rounds, versions, sample counts) stay below 2**53: exact as a float too.
MAX_COUNT = 2**53
MAX_METRICS = 64
MAX_METRIC_NAME = 64


def refuse(msg: str, key: str, text: str) -> CodecError:
    """The error for field ``key`` of message ``msg``."""
    return CodecError(f"{msg}: {key} {text}")


def is_map(body: Any, msg: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise CodecError(f"{msg}: the body must be a map")
    return body


def exactly(body: Mapping[str, Any], keys: Sequence[str], msg: str) -> None:
    """Refuse a body with a field more or less than ``keys`` (a message that must not
    carry anything else, e.g. no document text beside a vocabulary)."""
    if set(body) != set(keys):
        which = f"field {keys[0]} is" if len(keys) == 1 else f"fields {', '.join(keys)} are"
        raise CodecError(f"{msg}: exactly the {which} allowed")


def count(value: Any, msg: str, key: str, low: int = 0) -> int:
    """An integer in ``[low, 2**53)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_COUNT:
        what = "a non-negative integer" if low == 0 else "a positive integer" if low == 1 else f"an integer >= {low}"
        raise refuse(msg, key, f"must be {what}")
    return value


def number(
    value: Any,
    msg: str,
    key: str,
    *,
    finite: bool = False,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
) -> float:
    """A number (an integer is taken as a float); with bounds, inside them (NaN never is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(msg, key, "must be a number")
    v = float(value)
    if (
        (finite and not math.isfinite(v))
        or (above is not None and not v > above)
        or (at_least is not None and not v >= at_least)
        or (at_most is not None and not v <= at_most)
    ):
        lo = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else "(-inf"
        hi = f"{at_most:g}]" if at_most is not None else "inf)"
        raise refuse(
            msg, key, f"must be a finite number in {lo}, {hi}" if finite else f"must be a number in {lo}, {hi}"
        )
    return v


def flag(value: Any, msg: str, key: str) -> bool:
    if type(value) is not bool:
        raise refuse(msg, key, "must be true or false")
    return value


def text(value: Any, msg: str, key: str, *, max_len: int, min_len: int = 0, printable: bool = False) -> str:
    """A string of ``min_len..max_len`` characters (``printable``: no control characters,
    for what ends up in a log or a terminal)."""
    if not isinstance(value, str) or not min_len <= len(value) <= max_len or (printable and not value.isprintable()):
        what = "printable string" if printable else "string"
        raise refuse(msg, key, f"must be a {what} of {min_len}..{max_len} characters")
    return value


def binary(value: Any, msg: str, key: str, *, min_len: int, max_len: int) -> bytes:
    if not isinstance(value, bytes) or not min_len <= len(value) <= max_len:
        size = f"{min_len}" if min_len == max_len else f"{min_len}..{max_len}"
        raise refuse(msg, key, f"must be {size} bytes")
    return value


def items(value: Any, msg: str, key: str, limit: int) -> list[Any]:
    """A list of at most ``limit`` items (checked before anything is copied out of it)."""
    if not isinstance(value, list) or len(value) > limit:
        raise refuse(msg, key, f"must be a list of at most {limit} items")
    return value


def node_ids(value: Any, msg: str, key: str, limit: int) -> tuple[str, ...]:
    """A list of node ids (:func:`~fedagent.protocols.topics.is_valid_name`)."""
    if not isinstance(value, list) or len(value) > limit:
        raise refuse(msg, key, f"must be a list of at most {limit} node ids")
    if not all(is_valid_name(v) for v in value):
        raise refuse(msg, key, "holds an invalid node id")
    return tuple(value)


def strings(value: Any, msg: str, key: str, limit: int, *, max_len: int, min_len: int = 1) -> tuple[str, ...]:
    """A list of at most ``limit`` strings of ``min_len..max_len`` characters."""
    if not isinstance(value, list) or len(value) > limit:
        raise refuse(msg, key, f"must be a list of at most {limit} strings")
    if not all(isinstance(v, str) and min_len <= len(v) <= max_len for v in value):
        raise refuse(msg, key, f"holds something else than a string of {min_len}..{max_len} characters")
    return tuple(value)


def metrics(value: Any, msg: str, key: str = "metrics") -> dict[str, float]:
    """Named finite numbers, at most :data:`MAX_METRICS` of them."""
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        raise refuse(msg, key, f"must be a map of at most {MAX_METRICS} entries")
    out: dict[str, float] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_METRIC_NAME:
            raise refuse(msg, key, f"has a name that is not a string of 1..{MAX_METRIC_NAME} characters")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise refuse(msg, key, f"entry {k!r} is not a finite number")
        out[k] = float(v)
    return out


def by_node(value: Any, msg: str, key: str, limit: int, item: Callable[[Any], T]) -> dict[str, T]:
    """A map from node ids to values, each checked by ``item``."""
    if not isinstance(value, dict) or len(value) > limit:
        raise refuse(msg, key, f"must be a map of at most {limit} entries")
    out: dict[str, T] = {}
    for k, v in value.items():
        if not is_valid_name(k):
            raise refuse(msg, key, "has an invalid node id")
        out[k] = item(v)
    return out


# ---- kinds: what one field's value must be -------------------------------------------
class Kind:
    """How a field's value is read from a body (checked; CodecError otherwise) and
    written into one."""

    __slots__ = ()
    #: Read after every field that is not (tensors): nothing large is decoded before the
    #: cheap checks have passed.
    costly: ClassVar[bool] = False

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> Any:
        raise NotImplementedError

    def write(self, value: Any) -> Any:
        return value


@dataclass(frozen=True, slots=True)
class Count(Kind):
    """An integer in ``[low, 2**53)`` (:func:`count`)."""

    low: int = 0

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> int:
        return count(value, msg, key, self.low)


@dataclass(frozen=True, slots=True)
class Number(Kind):
    """A number, read as a float (:func:`number`); ``send_float``: written as a float too."""

    finite: bool = False
    above: float | None = None
    at_least: float | None = None
    at_most: float | None = None
    send_float: bool = False

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> float:
        return number(
            value, msg, key, finite=self.finite, above=self.above, at_least=self.at_least, at_most=self.at_most
        )

    def write(self, value: Any) -> Any:
        return float(value) if self.send_float else value


@dataclass(frozen=True, slots=True)
class Flag(Kind):
    """``true`` or ``false``."""

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> bool:
        return flag(value, msg, key)


@dataclass(frozen=True, slots=True)
class Text(Kind):
    """A string of ``min_len..max_len`` characters (:func:`text`)."""

    max_len: int
    min_len: int = 0
    printable: bool = False

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> str:
        return text(value, msg, key, max_len=self.max_len, min_len=self.min_len, printable=self.printable)


@dataclass(frozen=True, slots=True)
class Binary(Kind):
    """Bytes of ``min_len..max_len``."""

    min_len: int
    max_len: int

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> bytes:
        return binary(value, msg, key, min_len=self.min_len, max_len=self.max_len)


@dataclass(frozen=True, slots=True)
class Items(Kind):
    """A list of at most ``limit`` items, kept as a tuple; each item is the message's to
    check (its ``__post_init__``), or ``item``'s."""

    limit: int
    item: Kind | None = None

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> tuple[Any, ...]:
        values = items(value, msg, key, self.limit)
        if self.item is None:
            return tuple(values)
        return tuple(self.item.read(v, msg, key, limits) for v in values)

    def write(self, value: Any) -> Any:
        return list(value) if self.item is None else [self.item.write(v) for v in value]


@dataclass(frozen=True, slots=True)
class NodeIds(Kind):
    """A list of node ids, kept as a tuple (:func:`node_ids`)."""

    limit: int

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> tuple[str, ...]:
        return node_ids(value, msg, key, self.limit)

    def write(self, value: Any) -> Any:
        return list(value)


@dataclass(frozen=True, slots=True)
class Strings(Kind):
    """A list of short strings, kept as a tuple (:func:`strings`)."""

    limit: int
    max_len: int

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> tuple[str, ...]:
        return strings(value, msg, key, self.limit, max_len=self.max_len)

    def write(self, value: Any) -> Any:
        return list(value)


@dataclass(frozen=True, slots=True)
class Metrics(Kind):
    """Named finite numbers (:func:`metrics`)."""

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> dict[str, float]:
        return metrics(value, msg, key)

    def write(self, value: Any) -> Any:
        return dict(value)


@dataclass(frozen=True, slots=True)
class ByNode(Kind):
    """A map from node ids to values of ``item`` (:func:`by_node`)."""

    limit: int
    item: Kind

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> dict[str, Any]:
        return by_node(value, msg, key, self.limit, lambda v: self.item.read(v, msg, key, limits))

    def write(self, value: Any) -> Any:
        return {k: self.item.write(v) for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class Pair(Kind):
    """Two values in a list, kept as a tuple."""

    first: Kind
    second: Kind

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> tuple[Any, Any]:
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise refuse(msg, key, "must hold pairs")
        return self.first.read(value[0], msg, key, limits), self.second.read(value[1], msg, key, limits)

    def write(self, value: Any) -> Any:
        return [self.first.write(value[0]), self.second.write(value[1])]


@dataclass(frozen=True, slots=True)
class Tensors(Kind):
    """Named tensors (:func:`~fedagent.protocols.codec.decode_weights` under the
    receiver's limits); ``sliced``: they may come without their all-zero slices;
    ``names``: exactly these tensors, none other."""

    sliced: bool = False
    names: tuple[str, ...] | None = None
    costly: ClassVar[bool] = True

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> dict[str, Any]:
        if self.names is not None and (not isinstance(value, dict) or set(value) != set(self.names)):
            raise refuse(msg, key, f"must hold exactly the tensors {', '.join(self.names)}")
        return decode_weights(value, limits, sliced=self.sliced)

    def write(self, value: Any) -> Any:
        return encode_weights(value)


@dataclass(frozen=True, slots=True)
class Nested(Kind):
    """A value with a body of its own (``cls.from_body``, ``to_body``): the train config
    of a round start, the keys of a secure round, a model step."""

    cls: Any  # a class with from_body(body, limits) and to_body()
    heavy: bool = False  # it holds tensors: read with the costly fields

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> Any:
        return self.cls.from_body(value, limits)

    def write(self, value: Any) -> Any:
        return value.to_body()


@dataclass(frozen=True, slots=True)
class Nullable(Kind):
    """``nil``, or a value of ``kind``."""

    kind: Kind

    def read(self, value: Any, msg: str, key: str, limits: Limits) -> Any:
        return None if value is None else self.kind.read(value, msg, key, limits)

    def write(self, value: Any) -> Any:
        return None if value is None else self.kind.write(value)


def _costly(kind: Kind) -> bool:
    if isinstance(kind, Nested):
        return kind.heavy
    if isinstance(kind, Nullable):
        return _costly(kind.kind)
    return kind.costly


# ---- the declaration of a body -------------------------------------------------------
class _Required:
    __slots__ = ()

    def __repr__(self) -> str:
        return "REQUIRED"


#: A field's default when a body must carry it.
REQUIRED: Any = _Required()


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a body: its wire key (the message's attribute of the same name) and
    :class:`Kind`. ``default``: what it is when a body lacks it (:data:`REQUIRED`: a
    body must have it); ``omit_default``: not sent while it is the default (fields a
    later release added, so that earlier ones read what is sent); ``send``: sent only
    when this holds for the message; ``value``: the wire value from the message, when it
    is not the kind's writing of the attribute."""

    key: str
    kind: Kind
    default: Any = REQUIRED
    omit_default: bool = False
    send: Callable[[Any], bool] | None = None
    value: Callable[[Any], Any] | None = None


class Body:
    """The declared fields of a message body, in wire order. ``exact``: a body may carry
    no other field (those of ``hooked``, read and written by the message's own hook,
    aside)."""

    __slots__ = ("_cheap", "_costly", "exact", "fields", "keys", "name")

    def __init__(self, name: str, *fields: Field, exact: bool = False, hooked: tuple[str, ...] = ()) -> None:
        self.name = name
        self.fields = fields
        self.keys = tuple(f.key for f in fields) + hooked
        self.exact = exact
        self._cheap = tuple(f for f in fields if not _costly(f.kind))
        self._costly = tuple(f for f in fields if _costly(f.kind))

    def read(self, body: Any, limits: Limits) -> dict[str, Any]:
        """The message's attributes from ``body``, every field checked (CodecError)."""
        msg = self.name
        body = is_map(body, msg)
        if self.exact:
            exactly(body, self.keys, msg)
        out: dict[str, Any] = {}
        for group in (self._cheap, self._costly):
            for f in group:
                if f.key in body:
                    out[f.key] = f.kind.read(body[f.key], msg, f.key, limits)
                elif f.default is REQUIRED:
                    raise CodecError(f"{msg}: missing field {f.key!r}")
                else:
                    out[f.key] = f.default
        return out

    def write(self, message: Any) -> dict[str, Any]:
        """The body that carries ``message``, in the declared order."""
        body: dict[str, Any] = {}
        for f in self.fields:
            if f.send is not None and not f.send(message):
                continue
            if f.value is not None:
                body[f.key] = f.value(message)
                continue
            v = getattr(message, f.key)
            if f.omit_default and (v is None if f.default is None else v == f.default):
                continue
            body[f.key] = f.kind.write(v)
        return body


DEFAULT_LIMITS = Limits()


class WireMessage:
    """A message (or a part of one) whose body is declared in ``WIRE``: mixed into the
    frozen dataclasses, whose ``__post_init__`` checks what a constructor is given."""

    __slots__ = ()
    WIRE: ClassVar[Body]

    def to_body(self) -> dict[str, Any]:
        return self.WIRE.write(self)

    @classmethod
    def from_body(cls, body: Any, limits: Limits = DEFAULT_LIMITS) -> Self:
        """The message ``body`` carries; CodecError names the field that is wrong."""
        return cls(**cls.WIRE.read(body, limits))
