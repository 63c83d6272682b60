"""The checks every field of a message body passes, written once.

A body comes from a peer: each value is checked for its type and bounds before it is
used or copied, and a refusal is a :class:`~fedagent.errors.CodecError` that names the
message and the field (``"update: num_samples must be a positive integer"``), so a log
line says which peer sent what. Each validator takes the value, the message's name and
the field's key, and returns the value as the message keeps it (a list becomes a
tuple, an integer where a float is meant becomes a float).

Booleans are never numbers here: msgpack keeps ``true`` and ``1`` apart, and so must a
receiver (``True`` is an ``int`` in Python).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from fedagent.errors import CodecError
from fedagent.protocols.topics import is_valid_name

T = TypeVar("T")

#: Counters (rounds, versions, sample counts) stay below 2**53: exact as a float too.
MAX_COUNT = 2**53
MAX_METRICS = 64
MAX_METRIC_NAME = 64


def refuse(msg: str, key: str, text: str) -> CodecError:
    """The error for field ``key`` of message ``msg``."""
    return CodecError(f"{msg}: {key} {text}")


def need(body: Mapping[str, Any], key: str, msg: str) -> Any:
    """The value of a field the body must have."""
    if key not in body:
        raise CodecError(f"{msg}: missing field {key!r}")
    return body[key]


def is_map(body: Any, msg: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise CodecError(f"{msg}: the body must be a map")
    return body


def exactly(body: Mapping[str, Any], keys: Sequence[str], msg: str) -> None:
    """Refuse a body with a field more or less than ``keys`` (a message that must not
    carry anything else, e.g. no document text beside a vocabulary)."""
    if set(body) != set(keys):
        names = ", ".join(keys)
        raise CodecError(
            f"{msg}: exactly the field{'s' if len(keys) > 1 else ''} {names} {'are' if len(keys) > 1 else 'is'} allowed"
        )


def count(value: Any, msg: str, key: str, low: int = 0) -> int:
    """An integer in ``[low, 2**53)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_COUNT:
        kind = "a non-negative" if low == 0 else "a positive" if low == 1 else f"an at least {low}"
        raise refuse(msg, key, f"must be {kind} integer")
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
