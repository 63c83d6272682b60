"""The README and docs/ say what the code does: links resolve, the own-task example runs,
the commands and configuration keys they name exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import numpy as np
import pytest
import torch

from fedagent.cli import main as cli_main
from fedagent.config import reference
from fedagent.storage import checkpoint
from fedagent.storage.export import export
from fedagent.tasks.base import Task, get_weights, load_task

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]

_FENCE = re.compile(r"^```(\w*)\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`]+)`")


def _split(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Prose lines (code blocks blanked) and the code blocks as (language, text)."""
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if lang is None and m:
            lang, body = m.group(1), []
            prose.append("")
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, "\n".join(body)))
            lang = None
            prose.append("")
        elif lang is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def _section(text: str, heading: str) -> str:
    """The text under a `## heading` up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    prose, _ = _split(page.read_text())
    out = set()
    for line in prose:
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            title = m.group(1).strip().lower().replace("`", "")
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move details to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    prose, _ = _split(page.read_text())
    broken = []
    for line in prose:
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _readme_task_source() -> str:
    _, blocks = _split(_section(README.read_text(), "Bring your own model"))
    return next(code for lang, code in blocks if lang == "python")


def _readme_task_options() -> dict:
    _, blocks = _split(_section(README.read_text(), "Bring your own model"))
    return tomllib.loads(next(code for lang, code in blocks if lang == "toml"))["task"]


def test_readme_own_task_loads_trains_evaluates_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_task.py").write_text(_readme_task_source() + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    options = _readme_task_options()
    name = options.pop("name")
    assert name == "my_task:make"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, options["features"])).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    np.savetxt(tmp_path / "train.csv", np.column_stack([x, y]), delimiter=",")
    options["csv"] = str(tmp_path / "train.csv")

    task = load_task(name, options)
    assert isinstance(task, Task)
    assert task.num_samples() == 32
    model = task.build_model()
    before = get_weights(model)
    metrics = task.fit(model, epochs=1, lr=0.1, batch_size=8, seed=0)
    assert np.isfinite(metrics["loss"])
    assert any(not np.array_equal(before[k], v) for k, v in get_weights(model).items())
    assert 0.0 <= task.evaluate(model)["accuracy"] <= 1.0

    # The coordinator's side: no data, the same architecture and initial weights.
    coordinator = load_task(name, {k: v for k, v in options.items() if k != "csv"})
    assert coordinator.num_samples() == 0
    assert all(np.array_equal(before[k], v) for k, v in get_weights(coordinator.build_model()).items())

    # "Getting the trained model out": the exported file loads into the task's model.
    checkpoint.save(tmp_path / "global.ckpt", get_weights(model), {"model_version": 1})
    export(tmp_path / "global.ckpt", tmp_path / "model.pt")
    fresh = task.build_model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert all(np.array_equal(get_weights(model)[k], v) for k, v in get_weights(fresh).items())


def _cli_commands(text: str) -> list[list[str]]:
    """`fedagent ...` command lines in code blocks and code spans, as tokens."""
    prose, blocks = _split(text)
    candidates = [line for lang, code in blocks if lang in ("", "sh") for line in code.splitlines()]
    candidates += [span for line in prose for span in _CODE_SPAN.findall(line)]
    commands = []
    for line in candidates:
        line = line.split("#", 1)[0].strip().removeprefix("sudo ")
        for prefix in (".venv/bin/", "nice -n 10 .venv/bin/"):
            line = line.removeprefix(prefix)
        if line.startswith("fedagent "):
            commands.append(line.split())
    return commands


@pytest.mark.procs
def test_readme_names_only_commands_the_cli_has() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "fedagent", "--help"], capture_output=True, text=True, env=env, check=True, timeout=120
    ).stdout
    listed = set(re.findall(r"^  ([a-z][a-z-]*)\s", out.split("Commands:", 1)[1], re.M))
    named = {tokens[1] for tokens in _cli_commands(README.read_text())}
    assert {"demo", "agent", "coordinator", "join", "status", "export", "ca"} <= named
    assert named <= listed, f"README names commands `fedagent --help` does not list: {sorted(named - listed)}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_and_options_in_docs_exist(page: Path) -> None:
    wrong = []
    for tokens in _cli_commands(page.read_text()):
        cmd: click.Command = cli_main
        for word in tokens[1:]:
            if isinstance(cmd, click.Group) and not word.startswith("-"):
                if word not in cmd.commands:
                    wrong.append(" ".join(tokens))
                    break
                cmd = cmd.commands[word]
            elif word.startswith("--"):
                opts = {o for p in cmd.params for o in getattr(p, "opts", [])} | {"--help"}
                if word.split("=", 1)[0] not in opts:
                    wrong.append(f"{' '.join(tokens)} ({word})")
    assert not wrong, f"{page.relative_to(ROOT)}: unknown commands or options: {wrong}"


def _table_keys(page: Path) -> list[tuple[str, str]]:
    """(section, key) from the first column of configuration tables: `[rounds] lr`,
    `id`, `metrics_port`, `metrics_host`, or bare keys under a "`[gossip]` key" header."""
    keys = []
    section_of_table = None
    for line in page.read_text().splitlines():
        if not line.startswith("|"):
            section_of_table = None
            continue
        first = line.split("|")[1].strip()
        header = re.fullmatch(r"`\[(\w+)\]` (key|option.*)", first)
        if first == "key" or header:
            section_of_table = header.group(1) if header else ""
            continue
        if section_of_table is None or first.startswith("---"):
            continue
        section = section_of_table  # `[rounds] a`, `b`: b is in [rounds] too
        for span in _CODE_SPAN.findall(first):
            m = re.fullmatch(r"\[(\w+)\] (.+)", span)
            section, names = (m.group(1), m.group(2)) if m else (section, span)
            for name in re.split(r",\s*", names):
                if name != "...":
                    keys.append((section, name))
    return keys


@pytest.mark.parametrize(
    "page",
    [ROOT / "docs/modes/gossip.md", ROOT / "docs/modes/syncopt.md", ROOT / "docs/privacy.md"],
    ids=str,
)
def test_configuration_keys_in_docs_exist(page: Path) -> None:
    """The modes' pages explain their tables' keys; each must be a declared setting
    (docs/configuration.md itself is written from the declaration)."""
    known = reference.keys()
    keys = _table_keys(page)
    assert len(keys) >= 10
    missing = [
        f"[{section}] {name}" if section else name
        for section, name in keys
        if section != "task" and (section, name) not in known  # task options belong to the task
    ]
    assert not missing, f"{page.relative_to(ROOT)} documents keys fedagent.config does not declare: {missing}"
