"""Network faults between hosts made of network namespaces (tests/netns.py): mDNS
goodbyes and interfaces going down and up, a partition of a third of the agents
mid-round, and loss + rate limit + delay on gossip links."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from netns import Lab, requires_netns

from fedagent import config, mosquitto
from fedagent.config import TlsConfig
from fedagent.errors import FedagentError
from fedagent.local.federation import BATCH, LR, SEED
from fedagent.node.control import request
from fedagent.security import pki
from fedagent.storage import checkpoint
from fedagent.tasks.base import get_weights, load_task, set_weights

pytestmark = [pytest.mark.root, requires_netns]

PORT = 8883

# One mDNS node: advertises itself as an agent and browses its federation; on stdin
# "table" prints the peer ids it holds, "refresh" refreshes first, EOF/"quit" leaves
# cleanly (goodbye packets).
PEER = textwrap.dedent("""
    import asyncio, json, sys
    from fedagent.node.discovery import Advert, Discovery
    async def main():
        ip, fed, node = sys.argv[1:4]
        async with Discovery([ip]) as d:
            await d.register(Advert(federation=fed, node_id=node, role="agent",
                                    broker_uri=f"mqtts://{ip}:8883", fingerprint="ab"))
            d.start_browsing(fed)
            print("ready", flush=True)
            loop = asyncio.get_running_loop()
            while True:
                cmd = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
                if cmd in ("", "quit"):
                    break
                if cmd == "refresh":
                    await d.refresh(2.0)
                print(json.dumps(sorted(p for p in d.peers if p != node)), flush=True)
    asyncio.run(main())
""")


class MdnsNode:
    def __init__(self, lab: Lab, host: str, fed: str) -> None:
        self.host = host
        self.p = subprocess.Popen(
            ["ip", "netns", "exec", lab.ns(host), sys.executable, "-c", PEER, lab.ip[host], fed, host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        lab.procs.append((f"mdns-{host}", self.p))
        assert self.p.stdout.readline() == "ready\n"

    def ask(self, cmd: str = "table") -> list[str]:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def quit(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(20) == 0


def poll_table(node: MdnsNode, want: list[str], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if node.ask() == want:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{node.host}: peer table {node.ask()} never became {want} within {timeout}s")


@pytest.fixture
def lab_factory(tmp_path):
    labs: list[Lab] = []

    def make(hosts: list[str], work: Path | None = None) -> Lab:
        lab = Lab(work or tmp_path, hosts)
        labs.append(lab)
        return lab.up()

    try:
        yield make
    finally:
        for lab in labs:
            lab.close()


def test_mdns_goodbye_and_interfaces_down_and_up(lab_factory):
    """mDNS goodbyes and interfaces on three hosts. Pass: a clean stop's goodbye removes the peer
    from the others' tables at once and a restart re-adds it; a host whose interface
    goes down (no goodbye possible) is removed by one refresh and re-added by one
    refresh after its interface comes back; a host whose own interface was down
    (it missed a goodbye) has a consistent table after one refresh."""
    lab = lab_factory(["n1", "n2", "n3"])
    fed = "mdnsfaults"
    n1, n2, n3 = (MdnsNode(lab, h, fed) for h in ("n1", "n2", "n3"))
    timings: dict[str, float] = {}
    timings["found"] = poll_table(n1, ["n2", "n3"], 15)
    n2.quit()
    timings["goodbye"] = poll_table(n1, ["n3"], 5)
    n2 = MdnsNode(lab, "n2", fed)
    timings["readded"] = poll_table(n1, ["n2", "n3"], 15)

    lab.link("n3", up=False)
    assert n1.ask() == ["n2", "n3"]  # no goodbye came: still cached
    started = time.monotonic()
    assert n1.ask("refresh") == ["n2"]
    timings["refresh_removes"] = time.monotonic() - started
    lab.link("n3", up=True)
    started = time.monotonic()
    assert n1.ask("refresh") == ["n2", "n3"]
    timings["refresh_readds"] = time.monotonic() - started
    assert n3.ask("refresh") == ["n1", "n2"]

    lab.link("n1", up=False)
    n2.quit()  # n1 cannot hear this goodbye
    lab.link("n1", up=True)
    assert n1.ask() == ["n2", "n3"]  # stale until asked
    assert n1.ask("refresh") == ["n3"]
    assert n3.ask() == ["n1"]
    print("mdns:", {k: round(v, 2) for k, v in timings.items()})


# -- federations across namespaces -------------------------------------------------------
class LabFederation:
    """A hub (broker + coordinator) and agents, each agent in a namespace of its own."""

    def __init__(self, lab: Lab, work: Path, fed: str, agents: list[str]) -> None:
        self.lab, self.work, self.fed, self.agents = lab, work, fed, agents
        self.ca = work / "pki"
        pki.create_ca(self.ca, fed)
        pki.issue(self.ca, self.ca, "hub-broker", "broker", sans=[lab.ip["hub"]])
        for name in ("coordinator", *agents):
            pki.issue(self.ca, self.ca, name, "coordinator" if name == "coordinator" else "agent")
        d = work / "hub-broker"
        (d / "data").mkdir(parents=True)
        (d / "acl").write_text(mosquitto.render_acl([fed], ["coordinator"]))
        (d / "mosquitto.conf").write_text(
            mosquitto.render_config(
                port=PORT,
                bind=lab.ip["hub"],
                ca=self.ca / "ca.crt",
                cert=self.ca / "hub-broker.crt",
                key=self.ca / "hub-broker.key",
                acl=d / "acl",
                persistence_dir=d / "data",
                log_path=d / "mosquitto.log",
            )
        )
        lab.spawn("hub-broker", "hub", [mosquitto.find_mosquitto(), "-c", str(d / "mosquitto.conf")])
        self.uri = f"mqtts://{lab.ip['hub']}:{PORT}"

    def write(self, name: str, host: str, options: dict, **extra) -> Path:
        p = self.work / f"{name}.toml"
        p.write_text(
            config.render(
                node_id=name,
                federation=self.fed,
                broker=self.uri,
                interfaces=(self.lab.ip[host],),
                tls=TlsConfig(self.ca / "ca.crt", self.ca / f"{name}.crt", self.ca / f"{name}.key"),
                state_dir=self.work / "state" / name,
                runtime_dir=self.work / "run" / name,
                task_options=options,
                **extra,
            )
        )
        return p

    def start(self, name: str, host: str, role: str, cfg: Path) -> None:
        self.lab.spawn(name, host, [sys.executable, "-m", "fedagent", role, "--config", str(cfg)])

    def status(self, name: str) -> dict | None:
        role = "coordinator" if name == "coordinator" else "agent"
        try:
            return request(self.work / "run" / name / f"{role}.sock", "status", timeout=3)
        except FedagentError:
            return None

    def history(self) -> list[dict]:
        path = self.work / "state" / "coordinator" / "coordinator" / self.fed / "history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


def accuracy(weights) -> float:
    task = load_task("digits", {"seed": SEED})
    model = task.build_model()
    set_weights(model, weights)
    return task.evaluate(model)["accuracy"]


def fedavg_reference(n: int, alpha: float, rounds: int, epochs: int) -> float:
    """The fault-free run, computed in process: FedAvg over the same shards, weighted by
    samples, every agent in every round, each trained with seed = round number exactly
    as the agents do."""
    torch.set_num_threads(1)  # as the agents do; more threads only spin on a busy machine
    tasks = [load_task("digits", {"shard": i, "shards": n, "alpha": alpha, "seed": SEED}) for i in range(n)]
    model = load_task("digits", {"seed": SEED}).build_model()
    global_w = get_weights(model)
    for r in range(1, rounds + 1):
        acc: dict[str, np.ndarray] = {}
        total = 0
        for t in tasks:
            m = t.build_model()
            set_weights(m, global_w)
            t.fit(m, epochs=epochs, lr=LR, batch_size=BATCH, seed=r)
            k = t.num_samples()
            total += k
            for name, w in get_weights(m).items():
                acc[name] = acc.get(name, 0) + w.astype(np.float64) * k
        global_w = {name: (v / total).astype(np.float32) for name, v in acc.items()}
    return accuracy(global_w)


# Stated tolerance for the partition: the partitioned run may end this many accuracy points below
# the fault-free one (two of six shards are missing for a few rounds of a non-IID split).
PARTITION_TOLERANCE = 0.05
KEEPALIVE = 10  # the agents' default MQTT keep-alive: a silent agent is out of the round after it


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_partition_of_a_third_of_the_agents_mid_round(lab_factory, tmp_path):
    """A partition mid-round: six agents; two of them are cut off (nft drop-all, both ways)
    in the middle of a round and healed once the coordinator has declared them silent.
    Pass: the coordinator closes that round on the four it hears (min_updates 3) when the
    cut agents' heartbeats have been missing for a keep-alive (10 s), before its deadline
    (12 s), and goes on with a quorum of four (min_agents 4); anything the cut agents trained
    for a round that is over is refused as stale or discarded, never aggregated; after
    healing they reconnect and take part again; no round is aggregated twice; the final
    model's accuracy is within PARTITION_TOLERANCE of the fault-free run."""
    agents = [f"a{i}" for i in range(1, 7)]
    lab = lab_factory(["hub", *agents])
    # Many short rounds: rounds take a fraction of a second on this task, and the healed
    # agents must find rounds left to take part in after their reconnection back-off
    # (about 4 s; on an idle machine a round of four agents took 30-40 ms, and 120 rounds
    # were all over before the healed agents were back).
    rounds, alpha, epochs, timeout = 400, 1.0, 1, 12
    lf = LabFederation(lab, tmp_path, "partition", agents)
    coord_cfg = lf.write(
        "coordinator",
        "hub",
        {"seed": SEED},
        rounds={
            "rounds": rounds,
            "min_agents": 4,
            "expected_agents": 6,
            "min_updates": 3,
            "round_timeout": timeout,
            "local_epochs": epochs,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
            "server_momentum": 0,  # plain FedAvg, as fedavg_reference computes it
        },
    )
    lf.start("coordinator", "hub", "coordinator", coord_cfg)
    for i, a in enumerate(agents):
        lf.start(a, a, "agent", lf.write(a, a, {"shard": i, "shards": 6, "alpha": alpha, "seed": SEED}))
    cut = ["a5", "a6"]
    coord = lambda: lf.status("coordinator") or {}  # noqa: E731
    # Cut once two rounds are aggregated. Rounds take a fraction of a second here and one
    # `lf.status` about as long, so the round in progress may already hold a5's and a6's
    # updates: the cut round is then the next one, which selects them and cannot hear them.
    mid = lab.wait_for(
        lambda: (lambda s: s if s.get("completed_rounds", 0) >= 2 and s["phase"] == "training" else None)(coord()),
        150,
        "round 3 in progress",
    )
    assert mid["round"] <= 6, f"the cut came in round {mid['round']}: too late to see the agents come back"
    silenced_before = {a: mid.get("last_silenced", {}).get(a) for a in cut}
    for a in cut:
        lab.cut(a)
    cut_at = time.monotonic()
    # Healed as soon as the coordinator has given up on them: without the heartbeats it
    # waited for the broker's Last Wills (19 s after the cut), a deadline per round meanwhile.
    # `last_silenced` keeps the time an agent was declared silent after its Last Will has
    # taken it off the heartbeat table (which a poll can miss).
    lab.wait_for(
        lambda: all(coord().get("last_silenced", {}).get(a) not in (None, silenced_before[a]) for a in cut),
        60,
        "the coordinator to declare the cut agents silent",
    )
    dropped_after = time.monotonic() - cut_at
    lab.wait_for(lambda: coord().get("round", 0) > mid["round"] + 1, 30, "the cut round to close")
    during = coord()
    for a in cut:
        lab.heal(a)
    healed_at = time.monotonic()
    lab.wait_for(
        lambda: all(
            coord().get("peers", {}).get(a, {}).get("online")
            and not (coord().get("heartbeats", {}).get(a) or {}).get("silent", True)
            for a in cut
        ),
        90,
        "the healed agents to be heard again",
    )
    back_after = time.monotonic() - healed_at
    done = lab.wait_for(
        lambda: (lambda s: s if s.get("phase") == "done" else None)(coord()), 480, "the federation to finish"
    )
    records = lf.history()
    aggregated = [r for r in records if r["event"] == "round"]
    abandoned = [r for r in records if r["event"] == "abandoned"]
    assert [r["model_version"] for r in aggregated] == list(range(1, rounds + 1))
    assert len({r["round"] for r in aggregated}) == rounds
    assert all(len(r["participants"]) >= 3 for r in aggregated)
    # The round that was cut (the one in progress, or the next if a5 and a6 had already
    # sent theirs; one of them may have) closed on the agents it could hear: once the cut
    # agents were silent for a keep-alive (10 s; their last heartbeat up to 2.5 s before the
    # cut), or at its deadline.
    cut_round = next(r for r in aggregated if r["round"] >= mid["round"] and not set(cut) <= set(r["participants"]))
    assert cut_round["round"] <= mid["round"] + 1, (cut_round, mid["round"])
    assert {"a1", "a2", "a3", "a4"} <= set(cut_round["participants"]), cut_round
    assert 0.75 * KEEPALIVE - 1 <= cut_round["seconds"] <= timeout + 5
    partitioned = [r for r in aggregated if cut_round["round"] < r["round"] <= during["round"]]
    assert all(not set(cut) & set(r["participants"]) for r in partitioned)
    # Stale updates from the healed side went nowhere ...
    stale_refused = [r for r in done["recent_rejections"] if r["sender"] in cut and "round" in r]
    assert all(r["reason"] == "stale" for r in stale_refused)
    for a in cut:
        hist = tmp_path / "state" / a / "agent" / "partition" / "history.jsonl"
        sent = {
            (u["round"], u["base_version"])
            for u in map(json.loads, hist.read_text().splitlines())
            if u["event"] == "update"
        }
        # ... whenever a5/a6 are counted in a round, it is with an update trained for
        # that round on that round's model: nothing from an older round slipped in.
        for r in aggregated:
            if a in r["participants"]:
                assert (r["round"], r["model_version"] - 1) in sent
    # The healed agents took part again.
    assert set(cut) <= set(aggregated[-1]["participants"])
    weights, _ = checkpoint.load(tmp_path / "state" / "coordinator" / "coordinator" / "partition" / "global.ckpt")
    got = accuracy(weights)
    want = fedavg_reference(6, alpha, rounds, epochs)
    print(
        f"partition: cut during round {mid['round']}; round {cut_round['round']} closed after {cut_round['seconds']:.1f}s on {len(cut_round['participants'])} "
        f"agents; the cut agents were declared silent after {dropped_after:.1f}s; {len(partitioned)} rounds without them; "
        f"back {back_after:.1f}s after healing; {len(abandoned)} rounds abandoned, {len(stale_refused)} stale "
        f"updates refused; accuracy {got:.3f} vs fault-free {want:.3f}"
    )
    assert got >= want - PARTITION_TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_coordinator_cut_off_takes_nobody_for_silent_and_loses_no_update(lab_factory, tmp_path):
    """The coordinator's own link is partitioned (TCP stays open, nothing passes) for longer
    than its agents' heartbeat timeout, mid-round. It hears nobody, which says nothing about
    them: no agent may be declared silent, and once the link heals the updates the broker
    held for it are taken, so every round is aggregated from every agent."""
    agents = ["a1", "a2"]
    lab = lab_factory(["hub", "coord", *agents])
    rounds = 30
    lf = LabFederation(lab, tmp_path, "cutoff", agents)
    coord_cfg = lf.write(
        "coordinator",
        "coord",
        {"seed": SEED},
        rounds={"rounds": rounds, "min_agents": 2, "min_updates": 2, "round_timeout": 120, "seed": SEED},
    )
    lf.start("coordinator", "coord", "coordinator", coord_cfg)
    for i, a in enumerate(agents):
        lf.start(a, a, "agent", lf.write(a, a, {"shard": i, "shards": 2, "seed": SEED}))
    coord = lambda: lf.status("coordinator") or {}  # noqa: E731
    lab.wait_for(
        lambda: (lambda s: s if s.get("completed_rounds", 0) >= 2 and s["phase"] == "training" else None)(coord()),
        150,
        "round 3 in progress",
    )
    lab.cut("coord")
    cut_at = time.monotonic()

    def overdue() -> dict | None:
        # Every agent unheard for longer than its timeout (the status is read over the
        # control socket, which the partition does not touch).
        s = coord()
        beats = s.get("heartbeats", {})
        return s if all(a in beats and beats[a]["age"] >= beats[a]["timeout"] + 1.5 for a in agents) else None

    during = lab.wait_for(overdue, 60, "the agents' heartbeats to be overdue at the cut-off coordinator")
    held = time.monotonic() - cut_at
    lab.heal("coord")
    done = lab.wait_for(
        lambda: (lambda s: s if s.get("phase") == "done" else None)(coord()), 300, "the federation to finish"
    )
    log = lab.log("coordinator")
    assert "is silent" not in log, [line for line in log.splitlines() if "is silent" in line]
    assert not any(during["heartbeats"][a]["silent"] for a in agents), during["heartbeats"]
    aggregated = [r for r in lf.history() if r["event"] == "round"]
    assert [r["model_version"] for r in aggregated] == list(range(1, rounds + 1))
    short = [(r["round"], r["participants"]) for r in aggregated if sorted(r["participants"]) != agents]
    assert not short, f"rounds aggregated without an agent: {short}"
    print(
        f"cut-off coordinator: link cut {held:.1f}s (agents' timeout {during['heartbeats']['a1']['timeout']:.0f}s), "
        f"no agent declared silent; {len(aggregated)} rounds, each from both agents; "
        f"{done['completed_rounds']} completed"
    )


# -- a degraded network under gossip ------------------------------------------------------
GOSSIP_PERIODS = 60
FAULT_PERIODS = 20
# Periods are paced in wall time. Measured with 0.3 s periods and a 5 s send timeout:
# the 40 periods after the heal took 12 s, little more than two send timeouts, while the
# backlog of the degraded phase (delayed publishes, late acknowledgements, returned
# mass) was still draining: 37 late acks, 77 refusals and 91 drops came *after* the heal,
# and the agents finished before they agreed again (relative disagreement 0.29 at the
# end against 0.001-0.02 clean; accuracy 0.47-0.71). With 1 s periods the 40 healthy
# periods last 40 s, eight timeouts, and the backlog is gone in a few. (A 3 s timeout
# converged as well but timed out 30 % of the degraded sends: TCP under 20 % loss
# each way needs longer than that to get a model through.)
GOSSIP = {
    "periods": GOSSIP_PERIODS,
    "period_steps": 10,
    "lr": 0.1,
    "batch_size": BATCH,
    "seed": SEED,
    "period_seconds": 1.0,
    "send_timeout": 5.0,
    "eval_every": 10,
    "min_peers": 3,
}
# Stated budgets for the degraded network: while the link is degraded at most this share of the models sent
# may time out (no timeout storm); after it heals the agents end within these accuracy
# points of the same federation run on a clean network (mean, worst agent), and agree
# again: every agent's relative distance to the models it merged last at most CONSENSUS.
TIMEOUT_SHARE, MEAN_MARGIN, WORST_MARGIN, CONSENSUS = 0.25, 0.05, 0.10, 0.05


def gossip_accuracy(work: Path, fed: str, aid: str) -> float:
    loaded = checkpoint.load(work / "state" / aid / "agent" / fed / "model.ckpt")
    assert loaded is not None, f"{aid} wrote no model"
    return accuracy(loaded[0])


def run_gossip(lab_factory, work: Path, fed: str, faulty: bool) -> dict:
    agents = ["g1", "g2", "g3", "g4"]
    lab = lab_factory(["hub", *agents], work)
    lf = LabFederation(lab, work, fed, agents)
    if faulty:
        lab.loss("hub", 0.2)
        lab.rate("hub", "1mbit")
        lab.delay("hub", 75, queue_num=7)
    for i, a in enumerate(agents):
        lf.start(
            a,
            a,
            "agent",
            lf.write(a, a, {"shard": i, "shards": 4, "alpha": 0.3, "seed": SEED}, mode="gossip", gossip=GOSSIP),
        )
    status = lambda: {a: lf.status(a) or {} for a in agents}  # noqa: E731
    keys = (
        "sent",
        "timeouts",
        "acked",
        "retries",
        "refused",
        "reclaimed",
        "late_acks",
        "merged",
        "dropped",
        "returned",
    )
    # Start-up (processes, mDNS, min_peers) took ~50 s on the loaded machine, clean or
    # not: the degraded phase is timed from the first period on.
    lab.wait_for(lambda: all(s.get("period", 0) >= 1 for s in status().values()), 400, "the first period")
    started = time.monotonic()
    first = lab.wait_for(
        lambda: (lambda ss: ss if all(s.get("period", 0) >= FAULT_PERIODS for s in ss.values()) else None)(status()),
        400,
        f"{FAULT_PERIODS} periods",
    )
    first_s = time.monotonic() - started
    if faulty:
        lab.clear("hub")
    healed_at = time.monotonic()
    done = lab.wait_for(
        lambda: (lambda ss: ss if all(s.get("round_state") == "finished" for s in ss.values()) else None)(status()),
        300,
        "the agents to finish",
    )
    out = {
        "first_s": round(first_s, 1),
        "rest_s": round(time.monotonic() - healed_at, 1),
        "first": {k: sum(s["gossip"][k] for s in first.values()) for k in keys},
        "total": {k: sum(s["gossip"][k] for s in done.values()) for k in keys},
        "periods": [s["period"] for s in done.values()],
        "acc_at_heal": {a: round(s.get("local_model_eval", {}).get("accuracy", 0.0), 3) for a, s in first.items()},
        "disagreement_at_heal": [s.get("disagreement_rel") for s in first.values()],
        "disagreement_end": [s.get("disagreement_rel") for s in done.values()],
        "acc": {a: round(gossip_accuracy(work, fed, a), 3) for a in agents},
    }
    lab.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gossip_under_loss_rate_limit_and_delay(lab_factory, tmp_path):
    """A degraded network under gossip: four gossip agents behind one broker. The same federation runs
    twice: on a clean network, and with the broker's host dropping 20% of packets both
    ways, sending at most 1 mbit/s (tbf) and holding every outgoing packet 75 ms
    (NFQUEUE holder) for the first third of the periods, then healed. Pass: slower,
    not divergent: under the fault a smaller share of the sends is acknowledged than on
    the clean network, every agent finishes every period; no timeout storm (timed-out
    models <= TIMEOUT_SHARE of those sent under the fault); after healing, gossip
    converges: every agent's final relative disagreement <= CONSENSUS and accuracy
    within MEAN_MARGIN / WORST_MARGIN of the clean run. Bounded: 400 s per phase wait."""
    torch.set_num_threads(1)  # the accuracy evaluations below, on a busy machine
    clean = run_gossip(lab_factory, tmp_path / "clean", "clean", faulty=False)
    faulty = run_gossip(lab_factory, tmp_path / "faulty", "degraded", faulty=True)
    print(f"degraded: clean {clean}\ndegraded: faulty {faulty}")
    assert faulty["periods"] == [GOSSIP_PERIODS] * 4
    # Slower: a node never waits for the network (periods are paced by the clock), so
    # the degraded phase shows in how few exchanges complete, not in its duration.
    under = faulty["first"]
    # (How much varies from run to run: 90 of 103, 92 of 124, 32 of 168 acknowledged in
    # three runs, against 95-100 % clean.)
    assert under["acked"] / under["sent"] < clean["first"]["acked"] / clean["first"]["sent"], (under, clean)
    assert under["sent"] > 0 and under["timeouts"] <= TIMEOUT_SHARE * under["sent"], under
    mean = lambda accs: sum(accs.values()) / len(accs)  # noqa: E731
    # ... not divergent: once healed, every agent's model got better, not worse.
    assert all(faulty["acc"][a] > faulty["acc_at_heal"][a] for a in faulty["acc"]), faulty
    gap_mean = mean(clean["acc"]) - mean(faulty["acc"])
    gap_worst = min(clean["acc"].values()) - min(faulty["acc"].values())
    print(
        f"degraded: accuracy gap to the clean run {gap_mean:.3f} mean (budget {MEAN_MARGIN}), {gap_worst:.3f} worst "
        f"(budget {WORST_MARGIN}); final disagreement {faulty['disagreement_end']}"
    )
    # ... and converged after the heal: the agents agree again, near the clean result.
    assert all(d is not None and d <= CONSENSUS for d in faulty["disagreement_end"]), faulty
    assert gap_mean <= MEAN_MARGIN and gap_worst <= WORST_MARGIN, (gap_mean, gap_worst)
