"""How a setting is declared: once, as a field of the dataclass of its TOML table.

``setting(default, help, ...)`` is a dataclass field whose metadata holds what the loader
checks (the type comes from the annotation; bounds, choices), what the configuration
reference prints (help, default) and where the value goes in the pure machines'
configurations (``to``). The loader, docs/configuration.md (written by
scripts/config_reference.py) and the builders of the machines' configurations read these
fields; nothing else lists the settings.

Types are strict, as TOML has them: ``"false"`` is not a boolean, ``2.0`` is not an
integer, ``"abc"`` is not a port. An integer is taken for a float (``lr = 1``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fedagent.errors import CodecError, ConfigError

#: The default of a setting that must be given.
REQUIRED: Any = dataclasses.MISSING


@dataclass(frozen=True, slots=True)
class Setting:
    """What is known about one setting besides its name, type and default."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    # (machine, field) pairs: the value is that field of that machine's configuration
    to: tuple[tuple[str, str], ...] = ()
    key: str = ""  # the TOML key, when it is not the field's name
    table: str = ""  # fields of NodeConfig: the TOML table they are read from ("" = top level)
    shown: str = ""  # the default as the reference shows it, when the value alone would mislead
    env: str = ""  # an environment variable that takes the place of the default when set
    check: Callable[[Any], Any] | None = None  # a further check (and normal form) of the value

    def target(self, machine: str) -> str | None:
        return next((name for m, name in self.to if m == machine), None)


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Iterable[str] | None = None,
    to: str | Iterable[str] | Mapping[str, str] = (),
    key: str = "",
    table: str = "",
    shown: str = "",
    env: str = "",
    check: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field declaring one setting. ``to`` names the machines' configurations
    the value goes to: ``"round"`` (the field of the same name there) or
    ``{"vocab": "deadline"}`` (another name)."""
    if isinstance(to, str):
        to = (to,)
    pairs = tuple(to.items()) if isinstance(to, Mapping) else tuple((m, "") for m in to)
    meta = Setting(
        help=help,
        ge=ge,
        gt=gt,
        le=le,
        lt=lt,
        choices=tuple(choices) if choices is not None else None,
        to=pairs,
        key=key,
        table=table,
        shown=shown,
        env=env,
        check=check,
    )
    if default is REQUIRED:
        return dataclasses.field(metadata={"setting": meta})
    return dataclasses.field(default=default, metadata={"setting": meta})


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting of a table: its field, type and declaration."""

    name: str  # the attribute
    key: str  # the TOML key
    table: str  # the TOML table ("" = top level)
    type: Any
    default: Any  # REQUIRED when it must be given
    setting: Setting

    @property
    def where(self) -> str:
        return f"[{self.table}] {self.key}" if self.table else self.key

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def target(self, machine: str) -> str | None:
        name = self.setting.target(machine)
        return None if name is None else (name or self.name)


def declared(cls: type) -> tuple[Declared, ...]:
    """The settings a dataclass declares, in their order."""
    cached = _CACHE.get(cls)
    if cached is None:
        hints = typing.get_type_hints(cls)
        table = getattr(cls, "TABLE", "")
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("setting")
            if meta is None:
                continue
            default = f.default if f.default is not dataclasses.MISSING else REQUIRED
            out.append(Declared(f.name, meta.key or f.name, meta.table or table, hints[f.name], default, meta))
        cached = _CACHE[cls] = tuple(out)
    return cached


_CACHE: dict[type, tuple[Declared, ...]] = {}


class Table:
    """Base of the dataclass of a TOML table whose fields are all settings: values are
    checked (and brought to their declared type) on construction, then :meth:`check`
    applies the rules that involve several of them."""

    __slots__ = ()
    TABLE: ClassVar[str]

    def __post_init__(self) -> None:
        for d in declared(type(self)):
            value = getattr(self, d.name)
            normal = checked(d, value)
            if normal is not value:
                object.__setattr__(self, d.name, normal)
        self.check()

    def check(self) -> None:
        """Rules between settings of this table (ConfigError)."""


# ---- values --------------------------------------------------------------------------
def toml_repr(value: Any) -> str:
    """A value as it would be written in TOML, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_repr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table"
    return repr(value)


def base_type(tp: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation such as ``float | None``."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a setting's type must be one type or None, not {tp}")
        return rest[0], True
    return tp, False


def type_name(tp: Any) -> str:
    """How the reference and the messages name a setting's type."""
    base, _ = base_type(tp)
    if base is bool:
        return "boolean"
    if base is int:
        return "integer"
    if base is float:
        return "number"
    if base is Path:
        return "path"
    if typing.get_origin(base) is tuple:
        return "list of strings"
    return "string"


def _fail(d: Declared, what: str, value: Any) -> ConfigError:
    return ConfigError(f"{d.where} must be {what}, not {toml_repr(value)}")


def checked(d: Declared, value: Any) -> Any:
    """``value`` of setting ``d`` in its declared type, or ConfigError naming the setting."""
    base, optional = base_type(d.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{d.where} must be given")
    if base is bool:
        if type(value) is not bool:
            hint = " (without quotes)" if isinstance(value, str) and value.lower() in ("true", "false") else ""
            raise _fail(d, f"true or false{hint}", value)
    elif base is int:
        if type(value) is not int:
            raise _fail(d, _bounds_text(d.setting, "an integer"), value)
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(d, _bounds_text(d.setting, "a number"), value)
        if not math.isfinite(value):
            raise _fail(d, _bounds_text(d.setting, "a finite number"), value)
        if type(value) is not float:
            value = float(value)
    elif base is str:
        if not isinstance(value, str):
            raise _fail(d, "a string", value)
    elif base is Path:
        if not isinstance(value, str | Path) or not str(value):
            raise _fail(d, "a path (a non-empty string)", value)
    elif typing.get_origin(base) is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise _fail(d, "a list of strings", value)
        if not all(isinstance(x, str) and x for x in value):
            raise _fail(d, "a list of non-empty strings", value)
        if type(value) is not tuple:
            value = tuple(value)
    s = d.setting
    if s.choices is not None and value not in s.choices:
        raise _fail(d, "one of " + ", ".join(json.dumps(c) for c in s.choices), value)
    if not _in_bounds(s, value):
        raise _fail(d, _bounds_text(s, "an integer" if base is int else "a number"), value)
    if s.check is not None:
        try:
            value = s.check(value)
        except ValueError as exc:
            raise ConfigError(f"{d.where}: {exc}") from None
    return value


def _in_bounds(s: Setting, v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return True
    return (
        (s.ge is None or v >= s.ge)
        and (s.gt is None or v > s.gt)
        and (s.le is None or v <= s.le)
        and (s.lt is None or v < s.lt)
    )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounds(s: Setting) -> str:
    """The bounds as an interval, e.g. ``(0, 100]``, ``>= 1``; empty without bounds."""
    lo = f"[{_num(s.ge)}" if s.ge is not None else (f"({_num(s.gt)}" if s.gt is not None else None)
    hi = f"{_num(s.le)}]" if s.le is not None else (f"{_num(s.lt)})" if s.lt is not None else None)
    if lo and hi:
        return f"{lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return ""


def _bounds_text(s: Setting, kind: str) -> str:
    if s.gt == 0 and s.ge is None and s.le is None and s.lt is None:
        return kind.replace("an integer", "a positive integer").replace("a number", "a positive number")
    if s.ge == 0 and s.gt is None and s.le is None and s.lt is None:
        return f"{kind} >= 0"
    b = bounds(s)
    if not b:
        return kind
    return f"{kind} in {b}" if "," in b else f"{kind} {b}"


# ---- tables --------------------------------------------------------------------------
def unknown_keys(raw: Mapping[str, Any], known: Iterable[str], table: str, tables: Iterable[str] = ()) -> None:
    """A misspelt key must not fall back to the default without a word: ConfigError
    naming the key, the nearest known one and all of them."""
    keys = list(known)
    unknown = [k for k in raw if k not in keys]
    if not unknown:
        return
    name = f"[{table}] {unknown[0]}" if table else unknown[0]
    near = difflib.get_close_matches(unknown[0], keys, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    more = f" (and {', '.join(unknown[1:])})" if unknown[1:] else ""
    scope = f"[{table}] takes" if table else "the top level takes"
    listed = ", ".join(keys) + "".join(f", [{t}]" for t in tables)
    raise ConfigError(f"unknown key {name}{more}{hint}; {scope}: {listed}")


def read_table(cls: type, raw: Mapping[str, Any]) -> Any:
    """A :class:`Table` from its TOML table: unknown keys refused, values checked."""
    known = [d.key for d in declared(cls)]
    unknown_keys(raw, known, cls.TABLE)  # type: ignore[attr-defined]
    by_key = {d.key: d.name for d in declared(cls)}
    return cls(**{by_key[k]: v for k, v in raw.items()})


def build(table: Any, machine: str, cls: Callable[..., Any], **extra: Any) -> Any:
    """The configuration ``cls`` of a pure machine from the settings of ``table`` declared
    ``to`` that ``machine`` (plus ``extra``); what the machine refuses is a ConfigError
    naming the table."""
    kwargs = {t: getattr(table, d.name) for d in declared(type(table)) if (t := d.target(machine)) is not None}
    kwargs.update(extra)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, CodecError) as exc:
        raise ConfigError(f"[{table.TABLE}]: {exc}") from None


def targets(cls: type, machine: str) -> Iterator[tuple[str, str]]:
    """(setting, machine field) pairs of ``cls`` declared ``to`` ``machine``."""
    for d in declared(cls):
        t = d.target(machine)
        if t is not None:
            yield d.name, t
