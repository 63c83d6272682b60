"""SEEC vector-space mapping (Algorithm 2) in the live search, over a real Mosquitto
with mutual TLS and three real agent processes (no coordinator: nothing is averaged).

Every agent has ``[search] space = "mapped"``, its own Wikipedia articles and its own
model of its own dimension (16, 12, 20), so a query vector of the asker's space means
nothing to a peer. A search on agent-1 must: get the peers' vectors of the public
newsgroups posts, train one mapper per peer, send each peer the query mapped into that
peer's space (a peer refuses a vector of another dimension or space before any
arithmetic, so its answer shows the dimension was its own), and merge both peers'
top-k with its own. A second search reuses the mappers: the peers answer the exchange
with their space alone and send no vectors again.
"""

from __future__ import annotations

import pytest
from netfed import running, wait_for

from fedagent.local.federation import Federation
from fedagent.node.control import request

AGENTS = 3
DIMS = (16, 12, 20)
OPTIONS = {"corpus": "wiki", "limit": 30, "holdout": 0.0, "min_count": 1, "infer_epochs": 5, "seed": 0}
SEARCH = {
    "space": "mapped",
    "local_epochs": 2,
    "public_docs": 40,
    "mapper_epochs": 20,
    "mapper_lr": 1e-3,
    "mapper_hidden": 200,
}


def see_each_other(fed: Federation) -> None:
    """Each agent must see both peers online before a search can ask them."""
    wait_for(
        lambda: all(
            (p := request(fed.socket(a), "peers", timeout=2.0) if fed.status(a) else None)
            and sum(1 for r in p["peers"].values() if r.get("role") == "agent" and r.get("online")) >= AGENTS - 1
            for a in fed.agent_ids
        ),
        60,
        "every agent to see its peers",
        fed,
    )


@pytest.fixture
def federation(tmp_path):
    """Three agents of a mapped federation on one broker (no coordinator), each with a
    model of its own dimension, each seeing both peers online."""

    def configure(fed: Federation) -> None:
        for i, aid in enumerate(fed.agent_ids):
            options = {**fed.shard_options(i), "dim": DIMS[i]}
            fed._write(aid, aid, fed.broker_uri, options, None, "doc2vec", search=SEARCH)

    with running(
        tmp_path,
        configure=configure,
        start=False,
        agents=AGENTS,
        rounds=1,
        alpha=0.0,
        task="doc2vec",
        task_options=OPTIONS,
        agent_broker_by_mdns=False,
    ) as fed:
        for aid in fed.agent_ids:
            fed.spawn(aid)
        see_each_other(fed)
        yield fed


def test_mapped_search_maps_the_query_into_each_peers_space(federation):
    fed = federation
    me, peers = fed.agent_ids[0], fed.agent_ids[1:]
    out = request(
        fed.socket(me),
        "search",
        {"text": "the history of anarchism and the state", "k": 6, "timeout": 30.0},
        timeout=90,
    )
    assert out["mode"] == "mapped" and out["asked"] == peers
    assert sorted(out["answered"]) == peers and out["silent"] == [] and out["failed"] == []
    # One mapper per peer, into that peer's own dimension and named space.
    statuses = {a: fed.status(a) for a in fed.agent_ids}
    assert [(m["peer"], m["dim"], m["mapper"]) for m in out["mapped"]] == [
        (peers[0], DIMS[1], "trained"),
        (peers[1], DIMS[2], "trained"),
    ]
    assert [m["space"] for m in out["mapped"]] == [statuses[p]["search_space"] for p in peers]
    spaces = {s["search_space"] for s in statuses.values()}
    assert len(spaces) == AGENTS and all(sp.startswith("mapped:") for sp in spaces)
    # The public-vector exchange happened, and the peers ranked in their own spaces.
    assert statuses[me]["mappers_trained"] == 2 and statuses[me]["public_vectors_received"] == 2
    assert statuses[me]["mappers"] == {p: statuses[p]["search_space"] for p in peers}
    for p in peers:
        assert statuses[p]["public_vectors_sent"] == 1
        assert statuses[p]["search_queries_answered"] == 1 and statuses[p]["search_queries_refused"] == 0
    results = out["results"]
    assert len(results) == 6
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    # A second search reuses the mappers: no vectors are sent again.
    again = request(
        fed.socket(me), "search", {"text": "algorithms and mathematics", "k": 4, "timeout": 30.0}, timeout=90
    )
    assert sorted(again["answered"]) == peers
    assert [m["mapper"] for m in again["mapped"]] == ["cached", "cached"]
    for p in peers:
        s = fed.status(p)
        assert s["public_vectors_sent"] == 1 and s["search_queries_answered"] == 2
    assert fed.status(me)["mappers_trained"] == 2
    assert all(fed.status(a)["search_own_model"] == "trained" for a in fed.agent_ids)
    # kill -9 of a peer and a restart: its own model comes back from its state directory
    # (not trained again), so its space is unchanged and the asker's mapper stays valid.

    victim = peers[0]
    space_before = fed.status(victim)["search_space"]
    fed.restart(victim)  # kill -9 and start again
    wait_for(
        lambda: (
            (p := request(fed.socket(me), "peers", timeout=2.0))
            and p["peers"].get(victim, {}).get("online")
            and fed.status(victim)
        ),
        60,
        "the restarted peer to be online",
        fed,
    )
    third = request(fed.socket(me), "search", {"text": "music and instruments", "k": 4, "timeout": 30.0}, timeout=90)
    assert sorted(third["answered"]) == peers, third
    after = fed.status(victim)
    assert after["search_own_model"] == "restored" and after["search_space"] == space_before
    assert [m["mapper"] for m in third["mapped"]] == ["cached", "cached"] and after["public_vectors_sent"] == 0
