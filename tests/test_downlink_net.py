"""The model broadcast as int8 steps through the daemons (real processes, Mosquitto, mutual
TLS): with the default int8 updates, round starts after the first carry the step from the
previous model, a quarter of its bytes; the agents rebuild the model from it and train.
An agent that joins mid-training holds no model to rebuild from: it fetches the current
one and takes part (one agent leaves first, so the rounds wait for the newcomer)."""

from __future__ import annotations

import json
import signal
import statistics

from netfed import coordinator_in, running, wait_for

from fedagent.localfed import BATCH, LOCAL_EPOCHS, LR, SEED, Federation

ROUNDS = 8


def configure(fed: Federation) -> None:
    # Rounds start with whoever is online (the newcomer joins a later one); no [transfer]:
    # int8 updates and so int8 steps, the defaults.
    fed.write_coordinator(
        "digits",
        {"seed": SEED},
        {
            "rounds": ROUNDS,
            "min_agents": 2,
            "expected_agents": 2,
            "min_updates": 1,
            "round_timeout": 60,
            "local_epochs": LOCAL_EPOCHS,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
        },
    )


def history(fed: Federation, stem: str, role: str) -> list[dict]:
    path = fed.work / "state" / stem / role / fed.fed / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_round_starts_carry_int8_steps_and_a_newcomer_fetches_the_model(tmp_path):
    with running(
        tmp_path, configure=configure, agents=2, rounds=ROUNDS, alpha=0.5, round_timeout=60, agent_broker_by_mdns=False
    ) as fed:
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 2, 120, "two rounds", fed)
        gone = fed.proc(fed.agent_ids[1])
        fed.stop(gone, signal.SIGTERM)  # below the quorum: the rounds wait
        fed.procs.remove(gone)
        fed.add_agent("agent-new", "digits", fed.shard_options(1))
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the federation to finish", fed)
        assert done["completed_rounds"] == ROUNDS
        assert done["updates"]["downlink"] == "int8" and done["updates"]["downlink_default"] is True
        rounds = [r for r in history(fed, "coordinator", "coordinator") if r["event"] == "round"]
        joined = [r["round"] for r in rounds if "agent-new" in r["participants"]]
        assert joined, "the newcomer never took part"

        # Bytes the coordinator sent per round: round 1's start carries the whole model,
        # later ones the int8 step (plus the newcomer's fetched model in one of them).
        sent = [b - a for a, b in zip([0] + [r["bytes_out"] for r in rounds], [r["bytes_out"] for r in rounds])]
        later = statistics.median(sent[2:])
        assert later < 0.4 * sent[0], sent

        steps = fed.status(fed.agent_ids[0])["model_steps"]
        # every round start after the first was rebuilt from the step; none fetched
        assert steps["rebuilt"] == ROUNDS - 1 and steps["fetched"] == 0, steps
        new = fed.status("agent-new")["model_steps"]
        fetched = [r for r in history(fed, "agent-new", "agent") if r["event"] == "model_fetched"]
        assert fetched, "the newcomer did not fetch the model"
        updates = [r for r in history(fed, "agent-new", "agent") if r["event"] == "update"]
        assert len(updates) == len(joined) and all(u["base_version"] >= fetched[0]["model_version"] for u in updates)
        # its first round from the fetched model (or the round start waited for it), the
        # others rebuilt from steps
        assert new["rebuilt"] + new["fetched"] >= len(joined) - 1 and new["rebuilt"] >= 1, (new, joined)
