"""docs/configuration.md, written from the declaration of the settings.

``scripts/config_reference.py`` writes the page; a test fails when the page and
:func:`page` differ, so the reference cannot drift from what the loader reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedagent.config.declare import Declared, bounds, declared, type_name
from fedagent.config.settings import TABLE_CLASSES, TABLES, NodeConfig

INTRO = """\
# Configuration reference

<!-- Written by scripts/config_reference.py from src/fedagent/config/settings.py; edit
those, not this page (tests/project/test_config_reference.py compares the two). -->

One TOML file per node, read by `fedagent agent --config FILE` and `fedagent coordinator
--config FILE` (and by `status`, `join`, `leave` and `export` to find the node's files).
How to install and run a node is in the [operators' guide](operators.md); what each mode
does with its table is on the modes' pages ([fedavg](modes/fedavg.md),
[syncopt](modes/syncopt.md), [gossip](modes/gossip.md)) and in [privacy.md](privacy.md).

The whole file is checked when it is loaded, on agents and coordinators alike, and a
problem stops the daemon with one line naming the file, the table and the key, and exit
code 78 (systemd does not restart it in a loop):

- **Unknown keys** are refused with the keys the table knows (and the nearest one): a
  misspelt key never falls back to the default without a word. Only `[task]` takes keys
  of its own: they are the task's options.
- **Types are strict**, as TOML writes them: `advertise = "false"` is a string, not a
  boolean; `metrics_port = "9100"` is not a port; `torch_threads = 2.0` is not an
  integer. An integer is taken for a number (`lr = 1`).
- **Bounds and choices** below are checked, and so are the rules between keys that the
  machines would refuse later (e.g. a robust aggregation's preconditions against
  `min_updates`, or `[transfer]` settings that secure aggregation cannot use).
- **Paths** (`state_dir`, `runtime_dir`, `[tls]`) are relative to the config file's
  directory, after `$VARIABLES` (`$CREDENTIALS_DIRECTORY` under systemd) and `~` are
  expanded: a folder holding the file with its certificates can be moved as a whole.
  The same holds for the `[task]` options a task declares as files (`vocabulary` and
  `reference` of `word2vec`, `vocabulary` of `doc2vec`, and those of your own task:
  [tasks.md](tasks.md#files-in-task-options)).

In the tables, *number* is an integer or a decimal, an interval such as (0, 100] gives the
bounds (round brackets exclude the end), and *unset* means the key is left out.
"""

TITLES = {
    "": "Top level",
    "broker": "[broker]",
    "tls": "[tls]",
    "discovery": "[discovery]",
    "task": "[task]",
    "rounds": "[rounds]",
    "gossip": "[gossip]",
    "syncopt": "[syncopt]",
    "search": "[search]",
    "privacy": "[privacy]",
    "async": "[async]",
    "tier": "[tier]",
    "transfer": "[transfer]",
    "security": "[security]",
}

NOTES = {
    "": "Keys before the first table.",
    "task": "Every other key of `[task]` is an option of the task, passed to its factory as written "
    "(the built-in tasks' options are in [tasks.md](tasks.md)).",
    "rounds": "FedAvg: read by the coordinator, which sends the agents what they train each round; an agent "
    "reads `leave_after`. Checked on every node.",
    "gossip": '`mode = "gossip"`: how each agent exchanges models ([modes/gossip.md](modes/gossip.md)).',
    "syncopt": '`mode = "syncopt"`, coordinator: the vocabulary consensus and the steps '
    "([modes/syncopt.md](modes/syncopt.md)).",
    "search": "`fedagent search` across the members' documents ([search.md](search.md)).",
    "privacy": "Differential privacy of the updates; present only when wanted ([privacy.md](privacy.md)).",
    "async": '`mode = "async"`: asynchronous buffered FedAvg ([modes/async.md](modes/async.md)); the agents\' '
    "training settings and the server step are `[rounds]`'s.",
}


def _settings_of(table: str) -> tuple[Declared, ...]:
    if table in TABLE_CLASSES:
        return declared(TABLE_CLASSES[table])
    return tuple(d for d in declared(NodeConfig) if d.table == table)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(d: Declared) -> str:
    if d.setting.shown:
        return d.setting.shown
    if d.required:
        return "required"
    value: Any = d.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        return "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _type(d: Declared) -> str:
    s = d.setting
    if s.choices is not None:
        return "one of " + ", ".join(f"`{c}`" for c in s.choices)
    text = type_name(d.type)
    b = bounds(s)
    if b:
        text += f" in {b}" if "," in b else f" {b}"
    return text


def section(table: str) -> str:
    title = TITLES[table]
    lines = [f"## {title}", ""]
    if table in NOTES:
        lines += [NOTES[table], ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for d in _settings_of(table):
        lines.append(f"| `{d.key}` | {_cell(_type(d))} | {_cell(_default(d))} | {_cell(d.setting.help)} |")
    return "\n".join(lines) + "\n"


def page() -> str:
    """The whole reference page."""
    return "\n".join([INTRO, *(section(t) for t in ("", *TABLES))])


def keys() -> set[tuple[str, str]]:
    """Every (table, key) a config file may set ("" = the top level); ``[task]`` takes
    any key besides these."""
    return {(t, d.key) for t in ("", *TABLES) for d in _settings_of(t)}
