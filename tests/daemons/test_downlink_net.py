"""The model broadcast as int8 steps through the daemons (real processes, Mosquitto, mutual
TLS): with the default int8 updates, round starts after the first carry the step from the
previous model, a quarter of its bytes; the agents rebuild the model from it and train.
An agent that joins mid-training holds no model to rebuild from: it fetches the current
one and takes part (one agent leaves first, so the rounds wait for the newcomer)."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from netfed import coordinator_in, running, wait_for

from bench.swarm import LightAgent
from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED, Federation
from fedagent.node.transport import TlsFiles
from fedagent.security import pki

ROUNDS = 8


def write_coordinator(fed: Federation, rounds: int, agents: int, **more: object) -> None:
    # No [transfer]: int8 updates and so int8 steps, the defaults.
    fed.write_coordinator(
        "digits",
        {"seed": SEED},
        {
            "rounds": rounds,
            "min_agents": agents,
            "expected_agents": agents,
            "round_timeout": 60,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
            **more,
        },
    )


def configure(fed: Federation) -> None:
    # Rounds start with whoever is online (the newcomer joins a later one).
    write_coordinator(fed, ROUNDS, 2, min_updates=1, local_epochs=LOCAL_EPOCHS)


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


OLD_ROUNDS = 3


def configure_mixed(fed: Federation) -> None:
    # Every round waits for all three: the two daemons and the agent of an earlier release.
    write_coordinator(fed, OLD_ROUNDS, 3, local_epochs=1)


@contextmanager
def agent_of_an_earlier_release(fed: Federation, name: str) -> Iterator[LightAgent]:
    """A light agent (bench.swarm) that announces no int8 steps and counts a
    round start carrying one as an error, as agents of releases before them do; it sends
    the model it gets back unchanged. Runs on its own event loop in a thread."""
    ca_dir = fed.work / "pki"
    cert, key = pki.issue(ca_dir, ca_dir, name, "agent")
    old = LightAgent(
        name, fed.broker_uri, TlsFiles(ca_dir / pki.CA_CERT, cert, key), step=0.0, reads_steps=False, federation=fed.fed
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    runs: list[asyncio.Task] = []

    async def connect() -> None:
        ready = asyncio.Event()
        runs.append(loop.create_task(old.run(ready)))
        await asyncio.wait_for(ready.wait(), 60)

    try:
        asyncio.run_coroutine_threadsafe(connect(), loop).result(90)
        yield old
    finally:
        asyncio.run_coroutine_threadsafe(old.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def test_round_starts_carry_the_whole_model_while_an_agent_of_an_earlier_release_is_online(tmp_path):
    with running(
        tmp_path,
        configure=configure_mixed,
        agents=2,
        rounds=OLD_ROUNDS,
        alpha=0.5,
        round_timeout=60,
        agent_broker_by_mdns=False,
    ) as fed:
        with agent_of_an_earlier_release(fed, "agent-old") as old:
            done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the federation to finish", fed)
            assert done["completed_rounds"] == OLD_ROUNDS
            assert done["updates"]["downlink"] == "int8"
            rounds = [r for r in history(fed, "coordinator", "coordinator") if r["event"] == "round"]
            # the rounds need all three (min_agents): the old agent took part in every one,
            # and never met a step it cannot read
            assert all("agent-old" in r["participants"] for r in rounds), rounds
            assert old.errors == [] and old.rounds_sent == OLD_ROUNDS
            # the daemons got every round start whole too: nothing rebuilt, nothing fetched
            for a in fed.agent_ids:
                assert fed.status(a)["model_steps"] == {"rebuilt": 0, "fetched": 0}
