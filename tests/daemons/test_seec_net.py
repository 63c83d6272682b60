"""SEEC over a real Mosquitto with mutual TLS and real processes.

One federation (a coordinator and three doc2vec agents, each with its own third of the
newsgroups sample) serves both tests, which run in this order:

* joint learning (Algorithm 1): the agents offer their vocabularies, the coordinator
  merges them, every agent ends on the identical vocabulary (same digest, same size as
  the merge of the three shards' terms computed here), then FedAvg rounds of the
  doc2vec head run (``local_steps`` mini-batches a round, a server step), the model
  moves away from its zero initialisation, each agent trained exactly the asked
  mini-batches a round and the mean training loss the agents report falls from the
  first round to the last;
* the live search protocol: agent-3 is frozen (SIGSTOP: still "online" for the broker
  until its keep-alive runs out, but silent), `search` on agent-1 returns within the
  timeout with agent-2's answer merged with its own, and names agent-3 as silent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from netfed import agents_in, coordinator_in, running, wait_for

from fedagent.node.control import request
from fedagent.protocols.vocab import merge_vocabularies, vocabulary_digest
from fedagent.tasks.base import load_task

AGENTS = 3
ROUNDS = 3
LOCAL_STEPS = 5
OPTIONS = {
    "corpus": "newsgroups",
    "limit": 90,
    "holdout": 0.0,
    "dim": 24,
    "min_count": 2,
    "infer_epochs": 10,
    "seed": 0,
}
ROUND_SETTINGS = {
    "rounds": ROUNDS,
    "min_agents": AGENTS,
    "expected_agents": AGENTS,
    "min_updates": AGENTS,
    "round_timeout": 60.0,
    "local_epochs": 1,
    # As the SEEC experiment runs joint learning: rounds of a fraction of a local epoch
    # (a site has 13-16 mini-batches of 256 pairs an epoch here) and a server step.
    "local_steps": LOCAL_STEPS,
    "server_lr": 1.5,
    "lr": 0.025,
    "batch_size": 256,
    "seed": 0,
    "vocab_timeout": 30.0,
}


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    with running(
        tmp_path_factory.mktemp("seec"),
        configure=lambda fed: fed.write_coordinator("doc2vec", OPTIONS, ROUND_SETTINGS),
        agents=AGENTS,
        rounds=ROUNDS,
        alpha=0.0,
        task="doc2vec",
        task_options=OPTIONS,
        agent_broker_by_mdns=False,
    ) as fed:
        yield fed


def test_joint_learning_agrees_on_a_vocabulary_and_trains(federation):
    fed = federation
    done = wait_for(lambda: coordinator_in(fed, "done"), 120, "the joint-learning run to finish", fed)
    assert done["completed_rounds"] == ROUNDS
    # The common vocabulary is the merge of the three shards' term counts, nothing else.
    shards = [load_task("doc2vec", {**OPTIONS, "shard": i, "shards": AGENTS}) for i in range(AGENTS)]
    merged = merge_vocabularies([t.term_counts() for t in shards])
    expected = vocabulary_digest(t for t, _ in merged)
    assert done["vocab_digest"] == expected and done["vocabulary_size"] == len(merged)
    statuses = [fed.status(a) for a in fed.agent_ids]
    assert [s["vocab_digest"] for s in statuses] == [expected] * AGENTS
    assert [s["vocabulary_size"] for s in statuses] == [len(merged)] * AGENTS
    assert all(s["vocab_offers_sent"] >= 1 for s in statuses)
    # The model moved away from its zero start, and the reported loss fell.
    weights, meta = fed.final_weights()
    assert meta["vocab_digest"] == expected
    head = weights["out_embed.weight"]
    assert head.shape == (len(merged), OPTIONS["dim"]) and float(np.abs(head).max()) > 0.003
    history = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
    rounds = [r for r in map(json.loads, history.read_text().splitlines()) if r.get("event") == "round"]
    losses = [r["metrics"]["loss"] for r in rounds]
    assert len(losses) == ROUNDS and losses[-1] < losses[0], losses
    # Every agent trained LOCAL_STEPS mini-batches a round, not a whole epoch (one batch
    # may be short where a site's epoch of pairs runs out).
    pairs = [r["metrics"]["pairs"] for r in rounds]
    assert all((LOCAL_STEPS - 1) * 256 < p <= LOCAL_STEPS * 256 for p in pairs), pairs
    vocab_events = [r for r in map(json.loads, history.read_text().splitlines()) if r.get("event") == "vocabulary"]
    assert len(vocab_events) == 1 and sorted(vocab_events[0]["contributors"]) == fed.agent_ids


def test_search_merges_live_peers_and_names_the_silent_one(federation):
    fed = federation
    wait_for(lambda: agents_in(fed, "round_state", "finished"), 60, "every agent to hold the final model", fed)
    silent = fed.proc(fed.agent_ids[2])
    os.kill(silent.popen.pid, signal.SIGSTOP)
    try:
        timeout = 4.0
        started = time.monotonic()
        out = request(
            fed.socket(fed.agent_ids[0]),
            "search",
            {"text": "the space shuttle launch and the orbit of the moon", "k": 5, "timeout": timeout},
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        os.kill(silent.popen.pid, signal.SIGCONT)
    assert out["asked"] == fed.agent_ids[1:]
    assert out["answered"] == [fed.agent_ids[1]] and out["silent"] == [fed.agent_ids[2]] and out["timed_out"]
    assert took < timeout + 20
    results = out["results"]
    assert len(results) == 5
    assert {r["site"] for r in results} <= {fed.agent_ids[0], fed.agent_ids[1]}
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    # The answering peer ranked its documents: at least one of them is in the merge or
    # scores below the asker's last one (the merge kept the best five of both).
    assert fed.status(fed.agent_ids[1])["search_queries_answered"] >= 1
    # The CLI prints the same over the control socket.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent",
            "search",
            "god and religion",
            "--k",
            "3",
            "--timeout",
            "5",
            "--socket",
            str(fed.socket(fed.agent_ids[0])),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert cli.returncode == 0, cli.stderr
    reply = json.loads(cli.stdout)
    assert sorted(reply["answered"]) == fed.agent_ids[1:] and reply["silent"] == [] and len(reply["results"]) == 3


def test_a_flood_of_search_queries_from_one_peer_is_rate_limited(federation):
    """[search] requests_per_minute (default 30, burst 10): a member sending 25 queries
    at once to agent-2 gets the burst answered and the rest refused with error ``rate``
    (an answer, so it stops waiting), counted in agent-2's status; the refill over the
    flood's duration bounds how many more may pass."""
    import asyncio

    from fedagent.node.messaging import Messenger
    from fedagent.node.transport import TlsFiles, Transport
    from fedagent.protocols import topics
    from fedagent.protocols.messages import SearchAnswer, SearchQuery
    from fedagent.security import pki
    from fedagent.security.signing import Identity

    fed = federation
    target = fed.agent_ids[1]
    wait_for(lambda: (s := fed.status(target)) and s.get("round_state") == "finished", 60, "the final model", fed)
    space = fed.status(target)["search_space"]
    ca_dir = fed.work / "pki"
    cert, key = pki.issue(ca_dir, ca_dir, "agent-flood", "agent")
    tls = TlsFiles(ca_dir / pki.CA_CERT, cert, key)
    n = 25
    uri = fed.broker_uri

    async def flood() -> tuple[list[SearchAnswer], float]:
        transport = Transport(
            uri=uri,
            tls=tls,
            subscriptions=[topics.inbox(fed.fed, "agent-flood")],
            session_expiry=0,
        )
        m = Messenger(
            federation=fed.fed,
            node_id="agent-flood",
            transport=transport,
            identity=Identity.load(tls.cert, tls.key, tls.ca),
        )
        answers: list[SearchAnswer] = []

        async def deliver(inc) -> None:
            if isinstance(inc.message, SearchAnswer):
                answers.append(inc.message)

        ready = asyncio.Event()
        runner = asyncio.create_task(transport.run(lambda t, p: m.receive(t, p, deliver), ready))
        try:
            await asyncio.wait_for(ready.wait(), 30)
            vec = np.full(OPTIONS["dim"], 1.0 / np.sqrt(OPTIONS["dim"]), dtype=np.float32)
            started = time.monotonic()
            for i in range(n):
                await m.send(
                    topics.direct(fed.fed, "agent-flood", target, "search_query"),
                    SearchQuery(f"flood-{i}", 3, space, vec),
                )
            deadline = time.monotonic() + 60
            while len(answers) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return answers, time.monotonic() - started
        finally:
            await transport.close()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    before = fed.status(target)["search_requests_rate_limited"]
    answers, took = asyncio.run(flood())
    assert len(answers) == n, [a.query_id for a in answers]
    limited = [a for a in answers if a.error == "rate"]
    served = [a for a in answers if not a.error]
    assert len(limited) + len(served) == n, [a.error for a in answers]
    assert 10 <= len(served) <= 10 + int(took * 30 / 60) + 1, (len(served), took)
    assert limited and all(not a.doc_ids for a in limited)
    assert all(len(a.doc_ids) == 3 for a in served)
    assert fed.status(target)["search_requests_rate_limited"] - before == len(limited)
