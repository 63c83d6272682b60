"""One truth for `status` and `peers`: the peer table, the broker link's state, the
federation's held-out metrics, refusals, and the rows an operator reads.

Pure pieces are tested directly; the agent's two control commands are checked to return
the same table, and the messenger to count and list a refusal in one place."""

from __future__ import annotations

import asyncio
import time

import pytest
from fedfixtures import COORDINATOR, FEDERATION

from fedagent.cli.render import render_peers, render_status, status_rows
from fedagent.errors import CodecError
from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.codec import Envelope, Limits, encode
from fedagent.protocols.evaluation import HeldOut
from fedagent.protocols.messages import Evaluation, Presence, body_of
from fedagent.protocols.peerview import link_state, peer_table, silence_limit
from fedagent.security.signing import Identity, sign

NOW = 1_000_000.0


# -- the peer table ------------------------------------------------------------------------
def test_peer_table_merges_presence_mdns_and_last_message():
    table = peer_table(
        "a1",
        presence={
            "coordinator": {"role": "coordinator", "online": True, "last_seen": NOW - 300, "model_version": 7},
            "a2": {"role": "agent", "online": False, "last_seen": NOW - 50},
            "a1": {"role": "agent", "online": True, "last_seen": NOW},  # ourselves: never a peer
        },
        heard={"coordinator": NOW - 0.1, "a1": NOW},
        adverts={
            "coordinator": {"role": "coordinator", "broker": "mqtts://hub:8883", "last_seen": NOW - 100},
            "a3": {"role": "agent", "broker": "mqtts://hub:8883", "last_seen": NOW - 5},
        },
        broker="mqtts://hub:8883",
        link_ok=True,
    )
    assert list(table) == ["a2", "a3", "coordinator"]
    c = table["coordinator"]
    # "last seen" is the last message of any kind (a round start 0.1 s ago), not the presence.
    assert c["last_seen"] == NOW - 0.1 and c["online"] is True and c["mdns"] is True
    assert c["broker"] == "mqtts://hub:8883" and c["model_version"] == 7
    assert table["a2"] == {
        "role": "agent",
        "online": False,
        "broker": "mqtts://hub:8883",
        "mdns": False,
        "last_seen": NOW - 50,
    }
    # Known from mDNS only: whether it is online over MQTT is not known.
    assert table["a3"]["online"] is None and table["a3"]["mdns"] is True


def test_peer_table_claims_nobody_online_while_our_broker_link_is_lost():
    presence = {"coordinator": {"role": "coordinator", "online": True, "last_seen": NOW}}
    up = peer_table("a1", presence=presence, heard={}, adverts={}, broker="mqtts://h:1", link_ok=True)
    down = peer_table("a1", presence=presence, heard={}, adverts={}, broker="mqtts://h:1", link_ok=False)
    assert up["coordinator"]["online"] is True
    assert down["coordinator"]["online"] is None


def test_link_state_turns_unresponsive_within_the_keep_alive():
    for keepalive in (2.0, 4.0, 10.0, 60.0):
        limit = silence_limit(keepalive)
        assert 0 < limit < keepalive
        assert link_state("connected", limit - 0.01, keepalive) == "connected"
        assert link_state("connected", limit + 0.01, keepalive) == "unresponsive"
    assert link_state("backoff", None, 10.0) == "backoff"
    assert link_state("connected", None, 10.0) == "connected"


# -- held-out metrics ----------------------------------------------------------------------
def test_held_out_is_the_median_over_agents_of_the_newest_version_two_reported():
    h = HeldOut()
    assert h.summary() == {}
    assert h.add("a1", 19, 100, {"accuracy": 0.5})
    assert h.summary()["single_source"] is True  # one agent's word, and status says so
    assert h.add("a1", 20, 100, {"accuracy": 0.9, "test_loss": 0.3})
    assert h.add("a2", 20, 300, {"accuracy": 0.5, "test_loss": 0.7})
    s = h.summary()
    assert s["model_version"] == 20 and s["agents"] == ["a1", "a2"] and s["single_source"] is False
    # the lower median: one of two agents cannot raise it; the samples shown count an agent
    # at most twice the median count (a2's 300 count as 200)
    assert s["metrics"] == pytest.approx({"accuracy": 0.5, "test_loss": 0.3})
    assert s["samples"] == 300
    assert h.add("a2", 20, 300, {"accuracy": 0.9, "test_loss": 0.3})  # a repeat replaces
    assert h.summary()["metrics"]["accuracy"] == pytest.approx(0.9)
    # a newer version one agent reported is not shown while an older one has two
    assert h.add("a3", 21, 10, {"accuracy": 1.0}) and h.summary()["model_version"] == 20
    assert not h.add("a3", 21, 0, {"accuracy": 1.0}) and not h.add("a3", 21, 5, {})


def test_held_out_takes_no_report_of_a_model_version_that_does_not_exist():
    h = HeldOut()
    for a in ("a1", "a2", "a3"):
        assert h.add(a, 30, 100, {"accuracy": 0.98}, current=30)
    # a member vouching for version 10^9 with 1 sample: refused, and the line is unmoved
    assert HeldOut.refusal(10**9, 30) and not h.add("m", 10**9, 1, {"accuracy": 0.999}, current=30)
    assert not h.add("m", 20, 1, {"accuracy": 0.999}, current=30)  # and none of a version long gone
    assert h.add("m", 30, 10**9, {"accuracy": 0.1}, current=30)  # one report of four: the median holds
    s = h.summary()
    assert s["model_version"] == 30 and s["metrics"]["accuracy"] == pytest.approx(0.98)
    assert s["samples"] == 500
    assert h.add("a1", 31, 100, {"accuracy": 0.99}, current=31) and h.add("a2", 31, 100, {"accuracy": 0.99}, current=31)
    assert h.summary()["model_version"] == 31


def test_evaluation_message_round_trips_and_validates():
    ev = Evaluation(20, 1347, {"accuracy": 0.97})
    assert body_of("evaluation", ev.to_body(), Limits()) == ev
    with pytest.raises(CodecError):
        body_of("evaluation", {"model_version": 1, "num_samples": 5, "metrics": {"accuracy": float("nan")}}, Limits())
    with pytest.raises(CodecError):
        body_of("evaluation", {"model_version": -1, "num_samples": 5, "metrics": {}}, Limits())


# -- refusals: one count, one list -----------------------------------------------------------
def test_refusals_of_the_round_logic_and_of_the_messenger_are_counted_and_listed_together(pki):
    t = pki.tls(COORDINATOR)
    m = Messenger(
        federation=FEDERATION, node_id=COORDINATOR, transport=None, identity=Identity.load(t.cert, t.key, t.ca)
    )
    m.record_rejection("agent-a", "stale", "update for round 3 in round 4", round=3)
    topic = topics.direct(FEDERATION, "agent-a", COORDINATOR, "update")
    asyncio.run(m.receive(topic, b"\xc1", lambda inc: asyncio.sleep(0)))  # not msgpack
    assert m.rejected == {"stale": 1, "codec": 1}
    assert [(r["sender"], r["reason"]) for r in m.recent_rejections] == [("agent-a", "stale"), ("agent-a", "codec")]
    assert m.recent_rejections[0]["round"] == 3


def test_last_heard_is_any_verified_message(pki):
    t = pki.tls(COORDINATOR)
    me = Identity.load(t.cert, t.key, t.ca)
    m = Messenger(federation=FEDERATION, node_id=COORDINATOR, transport=None, identity=me)
    a = pki.tls("agent-a")
    sender = Identity.load(a.cert, a.key, a.ca)
    env = Envelope(
        kind="presence",
        federation=FEDERATION,
        sender="agent-a",
        round=0,
        seq=1,
        ts=time.time(),
        body=Presence(True, "agent").to_body(),
    )
    got = []

    async def deliver(inc):
        got.append(inc)

    before = time.time()
    asyncio.run(m.receive(topics.presence(FEDERATION, "agent-a"), encode(sign(env, sender)), deliver))
    assert got and before <= m.last_heard["agent-a"] <= time.time()
    # An unsigned (forged) frame is refused and does not count as hearing from agent-b.
    forged = Envelope(kind="presence", federation=FEDERATION, sender="agent-b", round=0, seq=1, ts=time.time(), body={})
    asyncio.run(m.receive(topics.presence(FEDERATION, "agent-b"), encode(forged), deliver))
    assert "agent-b" not in m.last_heard


# -- what the operator reads -----------------------------------------------------------------
def _rows(s):
    return dict(status_rows(s))


def test_coordinator_rows_give_round_and_version_their_meaning_and_the_held_out_metrics():
    s = {
        "role": "coordinator",
        "mode": "fedavg",
        "federation": "lab",
        "connection": "connected",
        "phase": "training",
        "round": 4603,
        "completed_rounds": 4600,
        "rounds": 5000,
        "model_version": 4600,
        "metrics": {"loss": 0.12},
        "held_out": {
            "model_version": 4600,
            "agents": ["a1", "a2", "a3"],
            "samples": 1347,
            "metrics": {"accuracy": 0.973},
        },
        "rejected": {"stale": 4},
        "recent_rejections": [{"sender": "a3", "round": 4601, "reason": "stale", "detail": "x"}] * 4,
        "updates": {"compression": "int8", "streamed": True, "default": True},
    }
    rows = _rows(s)
    assert rows["updates"] == "int8 deltas, streamed (default)"
    assert "model broadcast" not in rows  # a coordinator from before [transfer] downlink
    s["updates"] = {"compression": "none", "streamed": False, "default": False}
    assert _rows(s)["updates"] == "uncompressed, whole ([transfer] compression)"
    s["updates"] = {**s["updates"], "downlink": "int8", "downlink_default": True}
    assert _rows(s)["model broadcast"] == "int8 steps from the previous model (default)"
    s["updates"]["whole_model_only"] = ["agent-7"]
    assert _rows(s)["model broadcast"] == (
        "int8 steps from the previous model (default); the whole model while agent-7 (an earlier release) is online"
    )
    s["updates"] = {**s["updates"], "downlink": "none", "downlink_default": False}
    assert _rows(s)["model broadcast"] == "the whole model ([transfer] downlink)"
    agent = {"role": "agent", "model_steps": {"rebuilt": 7, "fetched": 1}}
    assert _rows(agent)["model broadcast"] == "7 rebuilt from int8 steps, 1 fetched whole for a round"
    assert "model broadcast" not in _rows({"role": "agent", "model_steps": {"rebuilt": 0, "fetched": 0}})
    assert rows["round"] == "4603 (the latest round started)"
    assert rows["rounds"] == "4600 aggregated of 5000; 2 not aggregated (abandoned, or cut short by a restart)"
    assert rows["model version"] == "4600 (aggregations so far)"
    assert rows["training metrics"] == "loss=0.12"
    assert rows["held-out (agents)"].startswith("accuracy=0.973 (model version 4600, 3 agents, 1347 samples")
    s["held_out"] = {**s["held_out"], "single_source": False}
    assert _rows(s)["held-out (agents)"] == "accuracy=0.973 (model version 4600, median of 3 agents, 1347 samples)"
    s["held_out"] = {**s["held_out"], "agents": ["a3"], "single_source": True}
    assert _rows(s)["held-out (agents)"] == (
        "accuracy=0.973 (model version 4600: a3's report alone, no other agent's confirms it)"
    )
    assert rows["rejected"] == "stale=4; latest: a3 (round 4601) stale"


def test_coordinator_rows_name_the_members_bounded_benched_and_dropped():
    s = {"role": "coordinator", "mode": "fedavg", "rejected": {}}
    assert not {"update bounds", "bounded (last round)", "dropped unread"} & set(_rows(s))  # an earlier release
    s["bounds"] = {
        "weight_cap": 2.0,
        "norm_bound": {"bound": None, "warming_up": True, "multiplier": 3.0, "median": None, "window_rounds": 1},
        "last_round": {},
        "benched": {},
    }
    rows = _rows(s)
    assert rows["update bounds"] == "weight <= 2x the median announced samples; distance bound warming up"
    assert rows["bounded (last round)"] == "-"
    s["bounds"]["norm_bound"] = {"bound": 1.5, "warming_up": False, "multiplier": 3.0, "median": 0.5}
    s["bounds"]["last_round"] = {"mallory": {"samples": 1e9, "weight": 1068.0, "norm": 310.2, "bound": 1.5}}
    s["bounds"]["benched"] = {"eve": {"until_round": 812, "offences": 3}}
    s["dropped"] = {"mallory": {"rate:heartbeat": 459, "unexpected-transfer": 20}}
    rows = _rows(s)
    assert rows["update bounds"] == "weight <= 2x the median announced samples; distance <= 1.5 (3x the median 0.5)"
    assert rows["bounded (last round)"] == (
        "mallory: weight 1068 of 1000000000 claimed, distance 310.2 scaled to 1.5; "
        "eve sits out rounds until 812 (3 offences)"
    )
    assert rows["dropped unread"] == "mallory: rate:heartbeat=459, unexpected-transfer=20"
    s["bounds"] = {"weight_cap": None, "norm_bound": None, "last_round": {}, "benched": {}}
    assert _rows(s)["update bounds"] == "off"


def test_agent_rows_show_the_final_model_eval_and_a_lost_broker():
    s = {
        "role": "agent",
        "mode": "fedavg",
        "connection": "unresponsive",
        "broker_silent_s": 7.9,
        "round_state": "finished",
        "round": 20,
        "rounds_trained": 20,
        "model_version": 20,
        "global_model_eval": {"model_version": 20, "accuracy": 0.96},
        "rejected": {},
        "peers": {"coordinator": {"role": "coordinator", "online": None, "broker": "mqtts://h:1", "mdns": True}},
    }
    rows = _rows(s)
    assert rows["connection"].startswith("unresponsive: nothing from the broker for 7.9 s")
    assert rows["global model eval"] == "accuracy=0.96 (model version 20, the final model)"
    assert rows["rejected"] == "-"
    # Training ended but the final model is still being scored: the rows say so instead
    # of passing the previous model's evaluation off as the final one.
    evaluating = {
        **s,
        "round_state": "evaluating the final model, version 20",
        "final_model_version": 20,
        "global_model_eval": {"model_version": 19, "accuracy": 0.95},
    }
    rows = _rows(evaluating)
    assert rows["phase"] == "evaluating the final model, version 20"
    assert (
        rows["global model eval"] == "accuracy=0.95 (model version 19; the final model, version 20, is being evaluated)"
    )
    assert _rows({**s, "final_model_version": 20})["global model eval"].endswith("(model version 20, the final model)")
    from rich.console import Console

    console = Console(width=200, record=True)
    render_status(s, console)
    render_peers(s, console)
    text = console.export_text()
    # The peers part of `status` is the `peers` table: the same row twice.
    line = next(ln for ln in text.splitlines() if "mqtts://h:1" in ln)
    assert text.count(line) == 2 and "│ ?" in line


def test_syncopt_rows_count_steps():
    rows = _rows(
        {"role": "coordinator", "mode": "syncopt", "step": 55, "steps_done": 54, "steps": 300, "model_version": 54}
    )
    assert rows["step"] == "55" and rows["steps done"] == "54 of 300" and rows["model version"] == "54"
    rows = _rows({"role": "agent", "mode": "syncopt", "step": 55, "steps_computed": 40, "model_version": 54})
    assert rows["steps done"] == "40 (by this agent)"


def test_gossip_rows_say_how_stale_the_merged_models_are():
    from rich.console import Console

    gossip = {"merge": "pushsum", "create": "mu", "sent": 9, "received": 8, "dropped": 0, "refused": 0}
    s = {"role": "agent", "mode": "gossip", "period": 9, "model_age": 90.0, "gossip": {**gossip, "timeouts": 0}}
    s["gossip"]["in_flight"] = 0
    for lag, mean, want in (
        (None, None, "merged models' lag │ -"),
        (42.4, 17.6, "merged models' lag │ 42 local steps behind this model at the last merge, 18 on average"),
    ):
        console = Console(width=200, record=True)
        render_status({**s, "lag": lag, "lag_mean": mean}, console)
        assert want in console.export_text()


def test_peers_draws_a_hubs_sites_and_a_sites_agents_as_a_tree():
    from rich.console import Console

    now = time.time()
    hub = {
        "id": "coordinator",
        "federation": "lab",
        "peers": {
            "site-1-up": {"role": "aggregator", "online": True, "broker": "mqtts://h:1", "last_seen": now},
            "site-2-up": {"role": "aggregator", "online": False, "broker": "mqtts://h:1", "last_seen": now - 60},
        },
        "tier": {
            "role": "hub",
            "sites": {
                "site-1-up": {"agents": 3, "samples": 120, "state": "training"},
                "site-2-up": {"agents": 2, "samples": 80, "state": "offline"},
            },
        },
    }
    site = {
        "id": "site-1",
        "federation": "lab",
        "peers": {
            "agent-1": {"role": "agent", "online": True, "last_seen": now},
            "agent-2": {"role": "agent", "online": False, "last_seen": now - 30},
        },
        "tier": {
            "role": "site",
            "upstream": {
                "id": "site-1-up",
                "broker": "mqtts://hub:8883",
                "connection": "connected",
                "coordinator": "coordinator",
            },
            "upstream_round": 4,
            "agents": {"agent-1": 40},
            "samples": 40,
        },
    }
    console = Console(width=200, record=True)
    render_peers(hub, console)
    render_peers(site, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].startswith("coordinator hub of lab: 2 sites")
    one = next(ln for ln in lines if "site-1-up" in ln)
    assert one.startswith("├── ") and "online" in one and "3 agents, 120 samples" in one and "training" in one
    two = next(ln for ln in lines if "site-2-up" in ln)
    assert two.startswith("└── ") and "offline" in two and "2 agents" in two
    assert any(ln.startswith("site-1 site aggregator in lab") for ln in lines)
    up = next(ln for ln in lines if "upstream:" in ln)
    assert "coordinator" in up and "connected" in up and "upstream round 4" in up and "site-1-up" in up
    a1 = next(ln for ln in lines if "agent-1" in ln)
    a2 = next(ln for ln in lines if "agent-2" in ln)
    assert a1.startswith("    ├── ") and "40 samples" in a1 and "offline" not in a1
    assert a2.startswith("    └── ") and "offline" in a2
    # A node without a tier keeps the table.
    console = Console(width=200, record=True)
    render_peers({**site, "tier": None}, console)
    assert "peers in lab" in console.export_text()
