"""A user's mistakes are found when a node starts, each with what to fix, through the real
daemons: an agent whose model differs from the coordinator's, one whose [task] option is
misspelt (no training samples) and one whose model holds a dtype fedagent cannot send
each exit 78 (which the shipped systemd unit does not restart) with one line naming the
problem; the coordinator lists whom it refused and why and says it waits for a quorum,
and the federation trains once a good agent comes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from netfed import coordinator_in, running, wait_for

from fedagent.errors import EXIT_CONFIG
from fedagent.local.federation import SEED, Federation, Proc
from fedagent.tasks.digits import load_digits_arrays

ZOO = {"model": "fp16", "alpha": 0.3}


def refused_exit(fed: Federation, proc: Proc, timeout: float = 180.0) -> str:
    """The process's exit status must be 78; its last line (the error), returned. It leaves
    the federation's processes, so that ``wait_for`` does not take its exit for a crash."""
    code = proc.popen.wait(timeout)
    fed.procs.remove(proc)
    lines = [ln for ln in proc.log.read_text(errors="replace").splitlines() if ln.strip()]
    assert code == EXIT_CONFIG, lines[-20:]
    return lines[-1]


def test_mistakes_are_refused_at_start_and_say_what_to_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    x, y = load_digits_arrays()
    csv = tmp_path / "site.csv"
    np.savetxt(csv, np.c_[x[:300], y[:300]], delimiter=",", fmt="%.6g")
    with running(
        tmp_path,
        agents=1,
        rounds=2,
        alpha=0.3,
        task="zoo:make",
        task_options=ZOO,
        agent_broker_by_mdns=False,
        rounds_options={"min_agents": 2, "expected_agents": 2, "min_updates": 1, "round_timeout": 30.0},
    ) as fed:
        # Three agents with a mistake each, started together (each start imports torch:
        # the longest part of this test): another model (a hidden layer 64 wide instead of
        # 32), a misspelt data option ("cvs" for "csv": no samples), a dtype that cannot travel.
        wide = fed.add_agent("agent-wide", "zoo:make", {**ZOO, "hidden": 64, "shard": 1, "shards": 2, "seed": SEED})
        typo = fed.add_agent("agent-typo", "zoo:make_csv", {"cvs": str(csv), "seed": SEED})
        odd = fed.add_agent("agent-complex", "zoo:make", {"model": "complex", "seed": SEED})

        line = refused_exit(fed, typo)
        assert "has no training samples on this agent" in line and f"cvs = '{csv}'" in line
        line = refused_exit(fed, odd)
        assert "model tensor 'mix' has dtype complex64, which fedagent cannot send" in line
        line = refused_exit(fed, wide)
        assert line.startswith("error: ") and "differs from coordinator's" in line
        # (the first entry of the state_dict that differs: the model's own buffer comes first)
        assert "tensor 'act_mean': float16[64] buffer here, float16[32] buffer on coordinator" in line

        # The coordinator names the tensor from its side, and with a quorum of two and
        # agent-1 the only one it takes, it waits and says for whom.
        def named() -> dict | None:
            s = fed.status("coordinator") or {}
            found = s.get("refused_agents", {}).get("agent-wide", {})
            waits = (s.get("waiting") or {}).get("online") == ["agent-1"]
            return s if "act_mean" in found.get("detail", "") and waits else None

        s = wait_for(named, 60, "the coordinator to name the tensor", fed)
        detail = s["refused_agents"]["agent-wide"]["detail"]
        assert "tensor 'act_mean': float16[32] buffer on the coordinator, float16[64] buffer on agent-wide" in detail
        assert s["phase"] == "waiting"
        assert s["waiting"] == {"for": "quorum", "need": 2, "online": ["agent-1"]}

        # The same CSV named right: a good agent, and the federation trains.
        fed.add_agent("agent-csv", "zoo:make_csv", {"csv": str(csv), "seed": SEED})
        done = wait_for(lambda: coordinator_in(fed, "done"), 180, "the federation to finish", fed)
        assert done["completed_rounds"] == 2
        assert set(done["refused_agents"]) == {"agent-wide"}
        history = (fed.work / "state" / "agent-wide" / "agent" / fed.fed / "history.jsonl").read_text()
        assert '"event": "refused"' in history


def test_gossip_peers_whose_models_differ_refuse_each_other(tmp_path: Path, monkeypatch) -> None:
    """Two gossip agents, agent-2's hidden layer 64 wide: each refuses the other (no model
    goes either way), names the first differing tensor from its side in ``status`` and
    keeps running."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))

    def wider(fed: Federation) -> None:
        path = fed.config_path("agent-2")
        path.write_text(path.read_text().replace('model = "fp16"', 'model = "fp16"\nhidden = 64'))

    gossip = {"periods": 10_000, "period_steps": 1, "period_seconds": 0.2, "send_timeout": 5.0}
    with running(
        tmp_path,
        configure=wider,
        agents=2,
        rounds=1,
        alpha=0.3,
        mode="gossip",
        gossip=gossip,
        task="zoo:make",
        task_options=ZOO,
        agent_broker_by_mdns=False,
    ) as fed:

        def refused() -> dict | None:
            out = {a: (fed.status(a) or {}).get("refused_peers") or {} for a in ("agent-1", "agent-2")}
            return out if all("act_mean" in str(r) for r in out.values()) else None

        out = wait_for(refused, 120, "both gossip agents to refuse each other", fed)
        assert "tensor 'act_mean': float16[32] buffer here, float16[64] buffer on agent-2" in str(out["agent-1"])
        assert "tensor 'act_mean': float16[64] buffer here, float16[32] buffer on agent-1" in str(out["agent-2"])
        for a in ("agent-1", "agent-2"):
            assert (fed.status(a) or {})["gossip"]["merged"] == 0
