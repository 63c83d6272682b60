"""What the gossip chaos soak holds against its fault-free twin (bench/chaos_setups.py),
on crafted checkpoints, without starting anything: the federation's model is the
agents' saved models averaged with their push-sum masses; each agent's own model must be
readable and not far below the twin's worst."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench import chaos_setups
from bench.chaos import AGENT_MARGIN, agents_invariant
from bench.chaos_setups import GossipSetup
from fedagent.storage import checkpoint


def gossip_site(tmp_path: Path, saved: dict[str, tuple[float, float] | None]) -> tuple[GossipSetup, SimpleNamespace]:
    """Agents whose saved model is one weight ``w`` (and a step counter) with mass ``m``."""
    setup = GossipSetup()
    setup.agents = list(saved)
    site = SimpleNamespace(fed=SimpleNamespace(model_path=lambda a: tmp_path / a / "model.ckpt"))
    for a, wm in saved.items():
        if wm is not None:
            w, m = wm
            weights = {"w": np.array([w], dtype=np.float32), "steps": np.array([int(w)], dtype=np.int64)}
            checkpoint.save(site.fed.model_path(a), weights, {"period": 10, "mass": m})
    return setup, site


def test_the_federations_model_is_the_mass_weighted_mean_of_the_saved_models(tmp_path, monkeypatch):
    judged = []
    monkeypatch.setattr(chaos_setups, "digits_accuracy", lambda weights: judged.append(weights) or 0.5)
    setup, site = gossip_site(tmp_path, {"agent-1": (0.0, 1.0), "agent-2": (4.0, 3.0), "agent-3": None})
    assert setup.accuracy(site) == 0.5
    (consensus,) = judged
    assert consensus["w"].dtype == np.float32 and consensus["w"].tolist() == [3.0]
    assert consensus["steps"].dtype == np.int64 and consensus["steps"].tolist() == [3]
    judged.clear()
    assert setup.agent_accuracies(site) == {"agent-1": 0.5, "agent-2": 0.5, "agent-3": None}
    assert [j["w"].tolist() for j in judged] == [[0.0], [4.0]]


def test_no_readable_model_no_accuracy(tmp_path):
    setup, site = gossip_site(tmp_path, {"agent-1": None})
    (tmp_path / "agent-1").mkdir()
    site.fed.model_path("agent-1").write_bytes(b"not a checkpoint")
    assert setup.accuracy(site) is None
    assert setup.agent_accuracies(site) == {"agent-1": None}


def test_each_agents_own_model_readable_and_not_far_below_the_twins_worst():
    twin = {"agent-1": 0.95, "agent-2": 0.97}
    assert agents_invariant({"agent-1": 0.95 - AGENT_MARGIN + 0.001, "agent-2": 0.99}, twin)["ok"]
    low = agents_invariant({"agent-1": 0.95 - AGENT_MARGIN - 0.001, "agent-2": 0.99}, twin)
    assert not low["ok"] and low["detail"]["too low"] == ["agent-1"]
    lost = agents_invariant({"agent-1": None, "agent-2": 0.99}, twin)
    assert not lost["ok"] and lost["detail"]["unreadable"] == ["agent-1"]
    assert agents_invariant({"agent-1": 0.5}, {})["ok"]  # no twin: readable is all it asks
