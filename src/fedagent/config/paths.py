"""Paths in a config file: ``$VARIABLES`` and ``~`` expanded, relative ones taken from the
file's directory, so a folder holding ``agent.toml`` with its certificates and data can
be moved as a whole."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def resolve_path(value: str | Path, base: Path | None) -> Path:
    """``value`` with ``$VARIABLES`` and ``~`` expanded, relative to ``base`` when given.

    ``$CREDENTIALS_DIRECTORY`` etc.: systemd hands keys to a DynamicUser service there.
    Unset variables stay as written: ``fedagent status`` reads the file outside the unit,
    and a daemon that needs the file reports it missing by that name."""
    path = Path(os.path.expandvars(str(value))).expanduser()
    return path if path.is_absolute() or base is None else base / path


class TaskOptions(dict[str, Any]):
    """``[task]`` without ``name``: what the task's factory gets, and the directory of the
    config file the options were read from. The options a task declares as files
    (:func:`fedagent.tasks.base.file_options`) are resolved against it before the factory
    sees them; :meth:`path` resolves any other option the same way."""

    __slots__ = ("base_dir",)

    def __init__(self, options: Mapping[str, Any] | None = None, base_dir: Path | None = None) -> None:
        super().__init__(options or {})
        self.base_dir = base_dir

    def path(self, key: str) -> Path:
        return resolve_path(self[key], self.base_dir)

    def with_files(self, keys: tuple[str, ...]) -> TaskOptions:
        """A copy with the non-empty string values of ``keys`` resolved to paths (as
        strings, the type the option has in the file)."""
        out = TaskOptions(self, self.base_dir)
        for key in keys:
            value = out.get(key)
            if isinstance(value, str) and value:
                out[key] = str(self.path(key))
        return out
