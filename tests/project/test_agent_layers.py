"""The agent package's layering: the core knows no mode, modes and services know only the
core, and every configurable mode has a session class that can be instantiated."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from fedagent import config
from fedagent.agent.core import Session
from fedagent.agent.modes import MODES

AGENT = Path(__file__).resolve().parents[2] / "src" / "fedagent" / "agent"


def imported(module: str) -> set[str]:
    """Every fedagent.agent.* module that ``module`` imports, also inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse((AGENT / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedagent.agent"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fedagent.agent"))
    return {m.removeprefix("fedagent.agent.") for m in out if m.count(".") == 2}


def test_the_core_imports_no_mode_and_no_service():
    assert imported("core") == set()


def test_modes_and_services_import_neither_the_daemon_nor_each_other():
    for module in ("fedavg", "syncopt", "gossip", "search"):
        assert imported(module) <= {"core", "vocabulary"}, module


def test_every_mode_has_a_concrete_session_class():
    assert set(MODES) == set(config.MODES)
    for cls in MODES.values():
        assert issubclass(cls, Session)
        assert not inspect.isabstract(cls), cls
