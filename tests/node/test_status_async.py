"""`fedagent status` of an asynchronous federation: the buffer, the staleness and the
model version each agent trains from (coordinator); the link and the outbox (agent)."""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console

from fedagent.cli.render import render_status, status_rows
from fedagent.protocols.fedbuff import AgentOnline, BufferConfig, BufferMachine, WholeUpdate
from fedagent.protocols.messages import TrainConfig


def coordinator_status() -> dict:
    w = {"w": np.zeros(4, np.float32)}
    m = BufferMachine(BufferConfig(buffer_size=3, min_agents=1, start_grace=0, train=TrainConfig(stream=False)), w)
    for a in ("a", "b", "c"):
        m.handle(AgentOnline(a, 10), 0.0)
    for task, base in ((1, 0), (2, 0), (3, 0), (4, 1)):
        agent = "abc"[(task - 1) % 3]
        m.handle(WholeUpdate(agent, task, base, 10, {}, {"w": np.ones(4, np.float32)}), 1.0)
    return {"role": "coordinator", "mode": "async", "id": "coordinator", "journal": {"frames": 2}, **m.status()}


def text(s: dict) -> str:
    console = Console(record=True, width=200)
    render_status(s, console)
    return console.export_text()


def test_the_coordinator_shows_the_buffer_staleness_and_each_agents_model_version():
    s = coordinator_status()
    rows = dict(status_rows(s))
    assert rows["model version"] == "1 of 50 (models published)"
    assert rows["update bounds"] == "off" and rows["bounded (last model)"] == "-"
    until_stopped = dict(status_rows({**s, "versions": 0}))["model version"]
    assert until_stopped == "1 (models published; no end set: until the coordinator is stopped)"
    assert rows["buffer"] == "1 of 3 updates"
    assert rows["staleness"].startswith("median 0, 90% 0, max 0") and "4 taken (bound 20)" in rows["staleness"]
    assert rows["staleness counts"] == "0: 4"
    step = {"lr": 1.0, "momentum": 0.0, "default": True, "default_reason": "default in async mode"}
    assert (
        dict(status_rows({**s, "server_step": step}))["server step"]
        == "plain FedAvg, no momentum (default in async mode)"
    )
    out = text(s)
    assert "agents (asynchronous" in out and "training from" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("│ a "))
    assert "yes" in line and line.split("│")[4].strip() == "1"  # a trains from model version 1


def test_an_agent_cut_off_says_what_it_holds_and_since_when():
    since = time.time() - 42
    s = {
        "role": "agent",
        "mode": "async",
        "model_version": 7,
        "link": {"up": False, "down_since": since, "down_s": 42.0},
        "training": {"task": 0, "from_version": 7, "training": 2, "offline": True},
        "outbox": {"task": 12, "base_version": 7, "trainings": 1, "since": since, "held_s": 41.5},
        "updates_sent": 3,
        "trained": 4,
    }
    rows = dict(status_rows(s))
    assert rows["link"].startswith("down for 42.0 s (since ")
    assert rows["training"] == "on its own from model version 7 (training 2)"
    assert rows["outbox"].startswith("the update of task 12 from model version 7 (1 training), held 41.5 s")
    assert rows["updates sent"] == "3 of 4 trained"
