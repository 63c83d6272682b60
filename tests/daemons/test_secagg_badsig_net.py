"""A survivor with a garbage signature of the survivor list, over Mosquitto with mTLS:
three honest digits agents and "mallory" (the test-only task tests/secagg_garbage_task.py),
which sends its masked update, then signs the survivor list with garbage and would
return altered shares if asked. The coordinator checks the signatures itself: mallory
is dropped (a list_signature rejection naming it, and the round's history), never
asked for shares, and its signature never reaches the honest agents, whose unmasking
completes the round with mallory's update in the sum."""

from __future__ import annotations

from pathlib import Path

from netfed import assert_only_masked_vectors, coordinator_in, history, secure_running, wait_for

from fedagent.local.federation import SEED
from fedagent.protocols.secagg import SecAggSignature, SecAggSurvivors, SecAggUnmask

HONEST = 3


def test_garbage_list_signature_is_dropped_by_the_coordinator(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    opts = {"min_agents": HONEST + 1, "expected_agents": HONEST + 1}
    with secure_running(tmp_path, tap=True, agents=HONEST, rounds=1, alpha=1.0, rounds_options=opts) as (fed, tap):
        fed.add_agent("mallory", "secagg_garbage_task:make", {"shard": 0, "shards": HONEST, "alpha": 1.0, "seed": SEED})
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the secure round", fed)
        lines = history(fed)
    everyone = sorted([*fed.agent_ids])
    assert "mallory" in everyone and len(everyone) == HONEST + 1
    (rnd,) = [ln for ln in lines if ln.get("event") == "round"]
    assert done["completed_rounds"] == 1
    assert rnd["participants"] == everyone  # mallory's update is on the list all signed
    assert list(rnd["secure"]["bad_signatures"]) == ["mallory"]
    assert "mallory" not in rnd["secure"]["silent_at_unmask"]
    refused = [x for x in done["recent_rejections"] if x["reason"] == "list_signature"]
    assert [x["sender"] for x in refused] == ["mallory"] and "mallory" in refused[0]["detail"]
    assert done["rejected"].get("list_signature") == 1
    assert_only_masked_vectors(lines, 20)

    # On the wire: mallory did send a (garbage) signature; every agent got the survivor
    # list; only the honest three were asked for shares, each request carrying their
    # three signatures and not mallory's.
    msgs = tap.messages()
    sigs = [m for m in msgs if isinstance(m.message, SecAggSignature)]
    assert sorted(m.sender for m in sigs) == everyone
    assert [m.message.sig for m in sigs if m.sender == "mallory"] == [bytes(64)]
    lists = [m.message.survivors for m in msgs if isinstance(m.message, SecAggSurvivors)]
    assert lists == [tuple(everyone)] * len(everyone)
    asks = [m for m in msgs if isinstance(m.message, SecAggUnmask)]
    honest = sorted(a for a in everyone if a != "mallory")
    assert sorted(m.topic.split("/to/")[1].split("/")[0] for m in asks) == honest, [m.topic for m in asks]
    assert all(sorted(m.message.signatures) == honest for m in asks)
