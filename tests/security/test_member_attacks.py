"""One member against a running federation: a real Mosquitto with mutual TLS, a real
coordinator and three honest agent processes (digits, non-IID), and ``mallory``, a
fourth member whose every frame is made and signed by the project's own library
(tests/member.py). Each attack of docs/security.md's member table runs against the same
federation for a few seconds, and for each:

* the coordinator never exits (every wait fails at once if a daemon does);
* rounds per second during the attack are at least half those just before and after it
  (measured once more before a test fails on it: the machine is shared);
* the coordinator's resident memory stays within :data:`RSS_BOUND` of what it was before
  the first attack;
* the global model's accuracy after the attack is within 2 points of the model before
  any attack (digits plateaus within a few dozen rounds: the no-attack figure);
* what the operator sees (status, history) names what happened.

A coordinator killed after a flood and restarted on the same state completes rounds
again. ``-s`` prints the measured table. Under ``slow``: each kind of message flooded
alone at 100 a second and as fast as the broker takes it, and the 2^53 − 1 claim for 400
rounds.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from member import Runner, mallory_tls, running_mallory
from netfed import history, running, wait_for

from fedagent.local.federation import SEED, Federation
from fedagent.protocols import topics
from fedagent.protocols.messages import Evaluation, Heartbeat, ModelRequest, Presence
from fedagent.tasks.base import load_task, set_weights

pytestmark = pytest.mark.procs

HONEST = 3
#: How long a flood lasts (the member's own budget at the coordinator is 2-20 frames a
#: second by kind).
FLOOD_SECONDS = 3.0
#: The default run's floods, all at once: each kind at 3 times its budget or more (about
#: 100 frames a second in all); the slow run adds 100 a second of each kind alone, and
#: each kind as fast as the broker takes it.
FLOOD_RATES = {"heartbeat": 20.0, "model_request": 10.0, "presence": 10.0, "evaluation": 60.0}
#: Resident memory the coordinator may gain over the whole run (its idle RSS is ~300 MB,
#: mostly torch; a flood used to take it to 1.2 GB).
RSS_BOUND = 150 * 2**20
ACCURACY_SLACK = 0.02


@dataclass
class Measured:
    attack: str
    seconds: float
    rounds_before: float  # rounds/s without the attack: the mean of the windows just before and after
    rounds_during: float
    rss_mb: float  # the coordinator's peak RSS during the attack
    accuracy: float  # the global model's right after it
    cpu_before: float = 0.0  # the coordinator's CPU (share of a core) just before
    cpu_during: float = 0.0
    seen: str = ""  # what the operator sees


@dataclass
class Lab:
    fed: Federation
    runner: Runner
    pid: int
    rss0: int = 0
    accuracy0: float = 0.0
    results: list[Measured] = field(default_factory=list)

    @property
    def mallory(self):
        return self.runner.mallory

    def status(self) -> dict[str, Any]:
        return wait_for(lambda: self.fed.status("coordinator"), 30, "the coordinator's status", self.fed)

    def rounds(self) -> int:
        return int(self.status()["completed_rounds"])

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def accuracy(self) -> float:
        weights, _ = self.fed.final_weights()
        task = load_task("digits", {"seed": SEED})
        model = task.build_model()
        set_weights(model, weights)
        return float(task.evaluate(model)["accuracy"])

    def dropped(self) -> int:
        return sum((self.status().get("dropped") or {}).get("mallory", {}).values())

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the coordinator has read what mallory sent (its drops stop growing)."""
        last, since, t0 = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - t0 < timeout:
            n = self.dropped()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= 1.5:
                return
            time.sleep(0.25)

    def cpu(self) -> float:
        """The coordinator's CPU seconds so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rate(self, seconds: float) -> tuple[float, float]:
        """Rounds a second and the coordinator's CPU share over ``seconds``."""
        r0, c0, t0 = self.rounds(), self.cpu(), time.monotonic()
        time.sleep(seconds)
        self.fed.check_alive()
        took = time.monotonic() - t0
        return (self.rounds() - r0) / took, (self.cpu() - c0) / took

    def attack(
        self,
        name: str,
        start: Callable[[], Any],
        seconds: float,
        *,
        before: float = 3.0,
        settle: float = 0.0,
        stop: Callable[[], Any] | None = None,
    ) -> Measured:
        """Rounds/s for ``before`` seconds, then ``start()`` (returns a future, or None
        for an attack that runs by itself, ended by ``stop()``) for ``seconds`` with RSS
        sampled; the model's accuracy after ``settle`` more seconds, then rounds/s for
        ``before`` seconds again. The machine the suite runs on is shared: the rate
        without the attack is the mean of the windows before and after it."""
        rate0, cpu0 = self.rate(before)
        r0, c0, t0 = self.rounds(), self.cpu(), time.monotonic()
        fut = start()
        peak = self.rss()
        while time.monotonic() - t0 < seconds or (fut is not None and not fut.done()):
            self.fed.check_alive()
            peak = max(peak, self.rss())
            time.sleep(0.25)
        if fut is not None:
            fut.result()
        took = time.monotonic() - t0
        rate1, cpu1 = (self.rounds() - r0) / took, (self.cpu() - c0) / took
        if stop is not None:
            stop()
        time.sleep(settle)
        accuracy = self.accuracy()
        self.settle()
        rate2, cpu2 = self.rate(before)
        m = Measured(name, took, (rate0 + rate2) / 2, rate1, peak / 2**20, accuracy, (cpu0 + cpu2) / 2, cpu1)
        self.results.append(m)
        return m

    def check(self, m: Measured, *, rate: bool = True) -> None:
        self.fed.check_alive()
        assert m.accuracy >= self.accuracy0 - ACCURACY_SLACK, (m, self.accuracy0)
        assert m.rss_mb * 2**20 <= self.rss0 + RSS_BOUND, (m, self.rss0 / 2**20)
        if rate and m.rounds_during < 0.5 * m.rounds_before:
            raise SlowerByHalf(f"{m.attack}: {m.rounds_during:.1f} rounds/s against {m.rounds_before:.1f} without")


class SlowerByHalf(AssertionError):
    pass


def once_more_if_slower(test: Callable[..., None]) -> Callable[..., None]:
    """The machine the suite runs on is shared with other work, whose load comes and goes
    within seconds: an attack measured below half the rounds per second is measured once
    more before the test fails (an attack that does slow the federation does it twice)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except SlowerByHalf as exc:
            print(f"\n{exc}; measured once more")
            test(*args, **kwargs)

    return run


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    options = {"local_steps": 5, "local_epochs": 1, "start_grace": 1.0, "min_updates": 1}
    with running(
        tmp_path_factory.mktemp("members"),
        agents=HONEST,
        rounds=10**6,
        alpha=0.5,
        round_timeout=10.0,
        agent_broker_by_mdns=False,
        rounds_options=options,
    ) as fed:
        wait_for(lambda: (s := fed.status("coordinator")) and s["completed_rounds"] >= 5, 120, "rounds", fed)
        with running_mallory(fed.broker_uri, mallory_tls(fed), fed.fed, samples=300) as runner:
            pid = fed.proc("coordinator").popen.pid
            lab = Lab(fed, runner, pid)
            # The no-attack reference: the model once digits has plateaued, with mallory
            # online and honest (a null step).
            wait_for(lambda: lab.rounds() >= 40, 240, "40 rounds", fed)
            samples = []
            for _ in range(3):
                samples.append(lab.accuracy())
                time.sleep(0.5)
            lab.accuracy0 = statistics.median(samples)
            lab.rss0 = lab.rss()
            yield lab
            _table(lab)


def _table(lab: Lab) -> None:
    print(f"\nno attack: accuracy {lab.accuracy0:.3f}, coordinator RSS {lab.rss0 / 2**20:.0f} MB")
    print("| attack | seconds | rounds/s before | during | CPU before | during | peak RSS MB | accuracy after | seen |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in lab.results:
        print(
            f"| {m.attack} | {m.seconds:.1f} | {m.rounds_before:.1f} | {m.rounds_during:.1f} | {m.cpu_before:.0%} "
            f"| {m.cpu_during:.0%} | {m.rss_mb:.0f} | {m.accuracy:.3f} | {m.seen} |"
        )


def _last_rounds(lab: Lab, n: int) -> list[dict]:
    return [r for r in history(lab.fed) if r.get("event") == "round"][-n:]


@once_more_if_slower
def test_a_claim_of_a_billion_samples_with_a_noise_update(lab: Lab) -> None:
    m = lab.mallory
    # The attack's own rounds: at 20 rounds a second (an idle machine) the windows after
    # it alone run past any fixed number of last rounds.
    r0 = len(history(lab.fed))
    # The attack is armed before the inflated announcement: an honest update sent in
    # between would claim the announced 10^9 samples (weight capped, distance in bound).
    m.claim, m.noise, m.attack = 10**9, 1.0, "noise"
    lab.runner.call(m.announce, 10**9)
    attacked = m.attacked
    res = lab.attack("10^9 samples, N(0,1) noise", lambda: None, 3.0, stop=lambda: _honest(lab))
    assert m.attacked > attacked
    rounds = [r for r in history(lab.fed)[r0:] if r.get("event") == "round" and "mallory" in r["participants"]]
    bounded = [r["bounded"]["mallory"] for r in rounds if "mallory" in r.get("bounded", {})]
    # its weight is at most twice the median the round's agents announced (the honest
    # shards hold 300-534 samples), its distance scaled down to the bound
    assert bounded and all(b["weight"] <= 2 * 534 and b["norm"] > b["bound"] for b in bounded), bounded
    share = max(r["agg_weights"]["mallory"] for r in rounds)
    res.seen = f"bounded in {len(bounded)} rounds: weight share <= {share:.2f}, distance scaled to the bound"
    lab.check(res)


@once_more_if_slower
def test_the_largest_exact_integer_claimed_round_after_round(lab: Lab) -> None:
    m = lab.mallory
    attacked = m.attacked
    m.claim, m.noise, m.attack = 2**53 - 1, 10.0, "noise"
    lab.runner.call(m.announce, 2**53 - 1)
    res = lab.attack("2^53-1 samples, N(0,10²) noise, every round", lambda: None, 4.0, stop=lambda: _honest(lab))
    res.seen = f"{m.attacked - attacked} rounds attacked, each one bounded"
    lab.check(res)


def _honest(lab: Lab) -> None:
    m = lab.mallory
    # Honest updates claim the announced count: the honest one is announced first.
    lab.runner.call(m.announce, 300)
    m.attack, m.claim = "honest", 0


def _flood_frames(lab: Lab, kind: str, count: int) -> tuple[str, list[bytes]]:
    m = lab.mallory
    coord = lab.fed.coordinator_id
    if kind == "presence":
        msg: Any = Presence(online=True, role="agent", mode="fedavg", num_samples=300, downlinks=("int8",))
        topic = topics.presence(lab.fed.fed, "mallory")
    elif kind == "heartbeat":
        msg, topic = Heartbeat(2.5), topics.direct(lab.fed.fed, "mallory", coord, "heartbeat")
    elif kind == "model_request":
        msg, topic = ModelRequest(0), topics.direct(lab.fed.fed, "mallory", coord, "model_request")
    else:
        msg, topic = Evaluation(1, 100, {"accuracy": 0.5}), topics.direct(lab.fed.fed, "mallory", coord, "evaluation")
    return topic, lab.runner.call(lambda: _frames(m, msg, count))


def _flood(lab: Lab, rates: dict[str, float], seconds: float) -> Measured:
    """Each kind of ``rates`` at its rate a second (0: as fast as the broker takes them),
    at the same time, for ``seconds``."""
    m = lab.mallory
    floods = [
        (kind, rate, *_flood_frames(lab, kind, int(rate * seconds) if rate else 40_000)) for kind, rate in rates.items()
    ]
    lab.settle()
    dropped0 = lab.dropped()

    def start():
        async def all_at_once() -> None:
            await asyncio.gather(
                *(
                    m.flood(topic, frames, seconds, retain=kind == "presence", rate=rate)
                    for kind, rate, topic, frames in floods
                )
            )

        return _start(lab.runner, all_at_once())

    what = ", ".join(f"{kind} ({rate:.0f}/s)" if rate else kind for kind, rate in rates.items())
    res = lab.attack(f"flood of {what}", start, seconds)
    sent = m.flooded
    m.flooded = 0
    t0 = time.monotonic()
    lab.settle()
    dropped = lab.dropped() - dropped0
    res.seen = f"{sent} published ({sent / res.seconds:.0f}/s), {dropped} dropped unread"
    if 0 in rates.values():
        res.seen += f"; backlog read {time.monotonic() - t0:.0f}s after the flood"
    return res


async def _frames(m, msg, n):
    return m.frames(msg, n)


def _start(runner: Runner, coro):
    return asyncio.run_coroutine_threadsafe(coro, runner.loop)


FLOODS = ["heartbeat", "model_request", "evaluation", "presence"]


@once_more_if_slower
def test_a_flood_of_every_kind_of_valid_message_at_once(lab: Lab) -> None:
    before = dict(lab.status()["dropped"].get("mallory") or {})
    res = _flood(lab, FLOOD_RATES, FLOOD_SECONDS)
    lab.check(res)
    after = lab.status()["dropped"]["mallory"]
    assert all(after.get(f"rate:{k}", 0) > before.get(f"rate:{k}", 0) for k in FLOODS), (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("kind", FLOODS)
@once_more_if_slower
def test_a_flood_of_valid_messages(lab: Lab, kind: str) -> None:
    before = (lab.status()["dropped"].get("mallory") or {}).get(f"rate:{kind}", 0)
    res = _flood(lab, {kind: 100.0}, FLOOD_SECONDS)
    lab.check(res)
    assert lab.status()["dropped"]["mallory"].get(f"rate:{kind}", 0) > before


@once_more_if_slower
def test_an_evaluation_of_a_model_version_that_does_not_exist(lab: Lab) -> None:
    m = lab.mallory
    coord = lab.fed.coordinator_id
    topic = topics.direct(lab.fed.fed, "mallory", coord, "evaluation")
    res = lab.attack(
        "evaluation of version 10^9 (accuracy 0.999, 1 sample)",
        lambda: _start(lab.runner, m.publish_once(topic, Evaluation(10**9, 1, {"accuracy": 0.999}))),
        3.0,
    )
    s = lab.status()
    held = s["held_out"]
    assert held["model_version"] <= s["model_version"] and held["metrics"]["accuracy"] < 0.999
    assert s["rejected"].get("version")
    res.seen = f"refused (version); held-out line: version {held['model_version']}, {held['metrics']['accuracy']:.3f}"
    lab.check(res)


@once_more_if_slower
def test_a_stream_that_stops_after_three_of_five_chunks(lab: Lab) -> None:
    m = lab.mallory
    m.attack = "stall"
    attacked = m.attacked
    r0 = len(history(lab.fed))
    res = lab.attack(
        "stream stops after 3 of 5 chunks, every time selected", lambda: None, 5.0, stop=lambda: _honest(lab)
    )
    assert m.attacked > attacked
    rounds = [r for r in history(lab.fed)[r0:] if r.get("event") == "round"]
    longest = max(r["seconds"] for r in rounds)
    res.seen = (
        f"{m.attacked - attacked} stalled; longest round {longest:.1f}s (round_timeout {lab.fed.round_timeout:g})"
    )
    assert longest < lab.fed.round_timeout
    lab.check(res)


@once_more_if_slower
def test_chunks_of_a_gigabyte_transfer_outside_any_round(lab: Lab) -> None:
    m = lab.mallory
    res = lab.attack(
        "chunk frames announcing 1 GiB, outside any round", lambda: _start(lab.runner, m.big_transfer(20)), 3.0
    )
    res.seen = f"dropped: {lab.status()['dropped'].get('mallory')}"
    lab.check(res)


@once_more_if_slower
def test_a_wrong_digest_after_folding_every_time_selected(lab: Lab) -> None:
    m = lab.mallory
    m.attack = "digest"
    r0 = len(history(lab.fed))
    res = lab.attack(
        "wrong digest after the parts were folded, every time selected", lambda: None, 5.0, stop=lambda: _honest(lab)
    )
    lines = history(lab.fed)[r0:]
    abandoned = [r for r in lines if r.get("event") == "abandoned"]
    aggregated = [r for r in lines if r.get("event") == "round"]
    res.seen = f"{len(aggregated)} aggregated, {len(abandoned)} abandoned"
    assert not abandoned
    rejected = lab.status()["recent_rejections"]
    assert all(r["sender"] == "mallory" for r in rejected if r["reason"] in ("transfer", "stale"))
    lab.check(res)


@once_more_if_slower
def test_a_presence_without_the_int8_steps(lab: Lab) -> None:
    m = lab.mallory
    before = _last_rounds(lab, 20)
    per0 = statistics.median(b["bytes_out"] - a["bytes_out"] for a, b in itertools.pairwise(before))
    during: list[dict] = []
    r0 = len(history(lab.fed))

    def stop() -> None:
        # the rounds of the attack's window only (the first one may have started before)
        during.extend(r for r in history(lab.fed)[r0:] if r.get("event") == "round")
        _honest(lab)

    res = lab.attack(
        "presence without downlinks", lambda: _start(lab.runner, m.announce(300, reads_steps=False)), 6.0, stop=stop
    )
    assert len(during) >= 6, during
    per1 = statistics.mean(b["bytes_out"] - a["bytes_out"] for a, b in itertools.pairwise(during))
    res.seen = f"bytes out per round {per1 / per0:.2f}x"
    assert per1 <= 1.8 * per0, (per0, per1)
    lab.check(res)


def test_a_coordinator_restarted_after_a_flood_completes_rounds(lab: Lab) -> None:
    fed = lab.fed
    m = lab.mallory
    coord = fed.coordinator_id
    topic = topics.direct(fed.fed, "mallory", coord, "model_request")
    frames = lab.runner.call(lambda: _frames(m, ModelRequest(0), 10_000))
    fut = _start(lab.runner, m.flood(topic, frames, 3.0))
    time.sleep(1.5)
    before = lab.rounds()
    fed.restart("coordinator", signal.SIGKILL)
    fut.result(120)
    t0 = time.monotonic()
    wait_for(lambda: (s := fed.status("coordinator")) and s["completed_rounds"] >= before + 3, 120, "rounds", fed)
    lab.pid = fed.proc("coordinator").popen.pid
    print(f"\nrestarted after a flood: 3 rounds completed {time.monotonic() - t0:.1f}s after the restart")


@pytest.mark.slow
@pytest.mark.parametrize("kind", FLOODS)
def test_a_flood_as_fast_as_the_broker_takes_it(lab: Lab, kind: str) -> None:
    """15 s at whatever rate mallory reaches: the coordinator survives it, its memory stays
    bounded and the model untouched; rounds slow down only while it reads a backlog."""
    res = _flood(lab, {kind: 0.0}, 15.0)
    lab.check(res, rate=False)


@pytest.mark.slow
def test_the_largest_exact_integer_claimed_for_four_hundred_rounds(lab: Lab) -> None:
    m = lab.mallory
    attacked = m.attacked
    m.claim, m.noise, m.attack = 2**53 - 1, 10.0, "noise"
    lab.runner.call(m.announce, 2**53 - 1)

    async def rounds_attacked(n: int) -> None:
        while m.attacked - attacked < n:
            await asyncio.sleep(0.5)

    res = lab.attack(
        "2^53-1 samples, N(0,10²) noise, 400 rounds",
        lambda: _start(lab.runner, rounds_attacked(400)),
        1.0,
        stop=lambda: _honest(lab),
    )
    res.seen = f"{m.attacked - attacked} rounds attacked"
    lab.check(res)
