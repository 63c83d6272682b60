"""A member inside a secure round, as traces: every way one agent can spoil its part
(bad keys, bad boxes, shares of a wrong secret, altered shares, an input of the wrong
length or out of range, silence after sharing) ends in a refusal of its contribution or
a failed round with a named cause, never an exception; the agent named is the one that
sent what failed; the round goes on without it where the protocol allows, and does not
wait for what was already refused."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from fedagent.protocols import rounds as R
from fedagent.protocols import secagg as S
from fedagent.protocols.rounds.bounds import Influence
from fedagent.protocols.secagg import server as secagg_server
from fedagent.protocols.secagg.wire import UNOPENED_BOX

D = 500
DEADLINE = 100.0  # the masked inputs' deadline in these traces
MALLORY = "a00"  # answers first at unmasking: its shares are in every first t


def det_bytes(seed: int) -> Callable[[int], bytes]:
    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


def flip(share: bytes) -> bytes:
    return share[:-1] + bytes([share[-1] ^ 1])


Hook = Callable[["Round", str, object], object]


@dataclass
class Round:
    """One secure round between a SecAggServer and n clients over a perfect link, with
    hooks through which one agent alters what it sends: ``hooks[stage](round, agent,
    message)`` returns what is sent instead (stages: keys, shares, input, reveal; None:
    nothing). ``silent``: agents that share their keys, then send nothing while online.
    Masked inputs arrive at t = ``input_at`` + i (agent i); the round's result and when
    it came are kept."""

    n: int = 4
    hooks: dict[str, Hook] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    gone_before_input: set[str] = field(default_factory=set)
    input_at: float = 50.0  # agent i's masked input arrives at input_at + i
    late: dict[str, float] = field(default_factory=dict)  # agent -> when its input arrives instead
    params: S.SecAggParams = field(default_factory=lambda: S.SecAggParams(clip=1.0, bits=16))

    def __post_init__(self) -> None:
        rng = np.random.default_rng(7)
        self.agents = [f"a{i:02d}" for i in range(self.n)]
        self.samples = {a: int(rng.integers(20, 200)) for a in self.agents}
        self.deltas = {a: rng.uniform(-0.4, 0.4, D) for a in self.agents}
        self.setup = S.SecAggSetup(self.params, bytes(range(16)), max(self.samples.values()))
        self.server = S.SecAggServer(
            1, self.agents, self.setup, D, now=0.0, stage_timeout=10.0, input_deadline=DEADLINE
        )
        self.agents_side = {a: S.SecAggAgent(a, random_bytes=det_bytes(i)) for i, a in enumerate(self.agents)}
        self.result: list[S.ServerCommand] = []
        self.refusals: list[S.Refused] = []
        self.at: float | None = None  # when the result came
        self.withdrew: list[str] = []

    def hook(self, stage: str, agent: str, msg: object) -> object:
        h = self.hooks.get(stage)
        return msg if h is None or agent != MALLORY else h(self, agent, msg)

    def to_server(self, a: str, msg: object, now: float) -> None:
        if msg is None:
            return
        self.apply(self.server.handle(S.Received(a, msg), now), now)

    def apply(self, cmds: list[S.ServerCommand], now: float) -> None:
        for c in cmds:
            if isinstance(c, S.Send):
                self.deliver(c.to, c.message, now)
            elif isinstance(c, (S.Unmasked, S.Failed)):
                self.result.append(c)
                self.at = now
            elif isinstance(c, S.Refused):
                self.refusals.append(c)

    def deliver(self, a: str, msg: object, now: float) -> None:
        ag = self.agents_side[a]
        if a in self.silent and not isinstance(msg, S.SecAggRoster):
            return
        for out in ag.on_message(msg):
            stage = {
                "secagg_shares": "shares",
                "secagg_masked": "input",
                "secagg_reveal": "reveal",
            }.get(out.kind, "")
            if isinstance(out, S.SecAggReveal) and out.refused.startswith(UNOPENED_BOX):
                self.withdrew.append(a)
                stage = ""
            self.to_server(a, self.hook(stage, a, out) if stage else out, now)

    @property
    def client(self) -> dict[str, S.SecAggClient]:
        return {a: ag.client for a, ag in self.agents_side.items() if ag.client is not None}

    def run(self) -> S.ServerCommand:
        self.apply(self.server.start(), 0.0)
        for a in self.agents:
            for msg in self.agents_side[a].on_round_start(1, self.agents, self.setup):
                self.to_server(a, self.hook("keys", a, msg), 1.0)
        for a in self.gone_before_input:
            self.apply(self.server.handle(S.Gone(a), 2.0), 2.0)
        arrivals = sorted(
            (self.late.get(a, self.input_at + i), a)
            for i, a in enumerate(self.agents)
            if a not in self.silent and a not in self.gone_before_input
        )
        # The inputs as they arrive, and the server's wake-ups: a tick at each whole
        # second after the first input, until the result.
        t = self.input_at
        while not self.result and t <= 500.0:
            while arrivals and arrivals[0][0] <= t and not self.result:
                now, a = arrivals.pop(0)
                for msg in self.agents_side[a].on_trained(
                    1, self.deltas[a], base_version=0, num_samples=self.samples[a], metrics={"loss": 1.0}
                ):
                    self.to_server(a, self.hook("input", a, msg), now)
            if not self.result and (t > self.input_at or not arrivals):
                self.apply(self.server.handle(S.Tick(), t), t)
            t += 1.0
        assert len(self.result) == 1, self.result
        return self.result[0]

    def plain_mean(self, who) -> np.ndarray:
        r = {a: self.setup.ratio(self.samples[a]) for a in who}
        p = self.params
        return sum(np.clip(r[a] * self.deltas[a], -p.clip, p.clip) for a in who) / sum(r.values())

    def assert_mean_of(self, res: S.ServerCommand, who) -> None:
        assert isinstance(res, S.Unmasked), res
        assert sorted(res.contributors) == sorted(who)
        assert np.abs(res.mean - self.plain_mean(who)).max() <= res.error_bound + 1e-9


# ---- shares: attributed to the holder that sent them ------------------------------------
def altered_reveal(how: Callable[[bytes], bytes]) -> Hook:
    def hook(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggReveal)
        return S.SecAggReveal(
            msg.round,
            {o: how(x) for o, x in msg.b_shares.items()},
            {o: how(x) for o, x in msg.sk_shares.items()},
            msg.refused,
        )

    return hook


@pytest.mark.parametrize(
    "how",
    [flip, lambda x: x[:2] + random.Random(x).randbytes(len(x) - 2)],
    ids=["one-bit-flipped", "random"],
)
def test_altered_shares_at_unmasking_name_the_holder_and_the_round_completes(how):
    # Before: the first t shares rebuilt a wrong seed and the round failed blaming the
    # honest owner, or shamir_combine's error ended the coordinator.
    r = Round(hooks={"reveal": altered_reveal(how)})
    res = r.run()
    r.assert_mean_of(res, r.agents)  # mallory's input counts; only its shares were bad
    assert isinstance(res, S.Unmasked)
    assert list(res.offenders) == [MALLORY] and "off its polynomial" in res.offenders[MALLORY]
    named = {x.sender for x in r.refusals if x.reason == "bad_share"}
    assert named == {MALLORY}


def test_altered_shares_of_a_drop_out_name_the_holder():
    # a04 drops after sharing: its mask key is rebuilt from its holders, mallory among them.
    r = Round(n=5, hooks={"reveal": altered_reveal(flip)}, gone_before_input={"a04"})
    res = r.run()
    r.assert_mean_of(res, [a for a in r.agents if a != "a04"])
    assert isinstance(res, S.Unmasked) and res.dropped_before_input == ("a04",)
    assert list(res.offenders) == [MALLORY]


def test_shares_at_the_wrong_x_or_for_owners_not_asked_are_refused_and_counted_against_the_holder():
    def relabel(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggReveal)
        b = dict(msg.b_shares)
        # its share of a01's seed presented at another holder's x, and a share of an
        # owner it was not asked about (its own key)
        b["a01"] = (7).to_bytes(2, "big") + b["a01"][2:]
        sk = {MALLORY: r.client[MALLORY].held[MALLORY][1]}
        return S.SecAggReveal(msg.round, b, sk)

    r = Round(hooks={"reveal": relabel})
    res = r.run()
    r.assert_mean_of(res, r.agents)
    assert isinstance(res, S.Unmasked) and list(res.offenders) == [MALLORY]
    (refused,) = [x for x in r.refusals if x.reason == "bad_share"]
    assert refused.sender == MALLORY and "x=7" in refused.detail and "not asked" in refused.detail


def deal_wrong_secret(which: str) -> Callable[[], None]:
    """Makes mallory's client deal shares of another secret than the one it committed
    to (its seed's digest) or advertised (its mask key's public half)."""
    real_roster = S.SecAggClient.on_roster

    def on_roster(self: S.SecAggClient, msg: S.SecAggRoster) -> S.SecAggShares:
        if self.agent != MALLORY:
            return real_roster(self, msg)
        if which == "seed":
            b = self._b
            self._b = bytes(32)
            out = real_roster(self, msg)
            self._b = b
            return S.SecAggShares(out.round, out.boxes, hashlib.sha256(b).digest())
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        sk = self._s_sk
        self._s_sk = X25519PrivateKey.from_private_bytes(bytes([9]) * 32)
        out = real_roster(self, msg)
        self._s_sk = sk
        return out

    return on_roster  # type: ignore[return-value]


def test_shares_of_a_wrong_seed_name_the_owner(monkeypatch):
    monkeypatch.setattr(S.SecAggClient, "on_roster", deal_wrong_secret("seed"))
    r = Round()
    res = r.run()
    assert isinstance(res, S.Failed) and list(res.culprits) == [MALLORY]
    assert "rebuild its commitment" in res.culprits[MALLORY] and MALLORY in res.reason


def test_shares_of_a_wrong_mask_key_name_the_owner_when_it_drops_out(monkeypatch):
    monkeypatch.setattr(S.SecAggClient, "on_roster", deal_wrong_secret("key"))
    r = Round(gone_before_input={MALLORY})
    res = r.run()
    assert isinstance(res, S.Failed) and list(res.culprits) == [MALLORY]
    assert "mask key" in res.culprits[MALLORY]


def lying(liars: set[str], owner: str | None = None) -> Callable[..., S.SecAggReveal]:
    """An on_unmask whose ``liars`` flip their seed shares (of ``owner``, or all)."""
    real = S.SecAggClient.on_unmask

    def on_unmask(self: S.SecAggClient, msg: S.SecAggUnmask) -> S.SecAggReveal:
        out = real(self, msg)
        if self.agent not in liars:
            return out
        b = {o: flip(x) if owner in (None, o) else x for o, x in out.b_shares.items()}
        return S.SecAggReveal(out.round, b, out.sk_shares)

    return on_unmask


def test_an_owner_is_named_only_when_no_threshold_of_its_shares_rebuild_it(monkeypatch):
    # Two of a01's four holders lie (more than the n - t = 1 the threshold allows): no 3
    # shares rebuild its seed; the protocol's assumption is broken and the owner is
    # named, as docs/privacy.md states. One liar alone never names the owner (above).
    monkeypatch.setattr(S.SecAggClient, "on_unmask", lying({"a02", MALLORY}, "a01"))
    res = Round().run()
    assert isinstance(res, S.Failed) and list(res.culprits) == ["a01"]


def test_subsets_tried_are_bounded_and_then_no_owner_is_named(monkeypatch):
    # a00 answers first, every share it gives altered: with one subset per owner tried,
    # the owners whose first t shares include a00's are not rebuilt, and not blamed.
    monkeypatch.setattr(secagg_server, "MAX_SUBSETS", 1)
    monkeypatch.setattr(S.SecAggClient, "on_unmask", lying({"a00"}))
    res = Round().run()
    assert isinstance(res, S.Failed) and "not told" in res.reason
    assert set(res.culprits) <= {"a00"}


# ---- boxes -------------------------------------------------------------------------------
def junk_boxes(r: Round, a: str, msg: object) -> object:
    assert isinstance(msg, S.SecAggShares)
    return S.SecAggShares(
        msg.round, {k: random.Random(k).randbytes(len(v)) for k, v in msg.boxes.items()}, msg.b_digest
    )


def test_junk_share_boxes_name_their_sealer_and_fail_without_waiting():
    # Every honest agent finds mallory's box unopenable: each withdraws at once (a
    # drop-out), two of them accuse mallory, and the round fails at once with one input.
    r = Round(hooks={"shares": junk_boxes})
    res = r.run()
    assert sorted(r.withdrew) == ["a01", "a02", "a03"]
    assert isinstance(res, S.Failed) and list(res.culprits) == [MALLORY]
    assert "did not open" in res.culprits[MALLORY]
    assert r.at is not None and r.at < DEADLINE
    assert {x.sender for x in r.refusals if x.reason == "withdrawn"} == {"a01", "a02", "a03"}


def test_boxes_for_agents_off_the_roster_are_refused_and_not_waited_for():
    def stray(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggShares)
        boxes = dict(msg.boxes)
        boxes.pop("a01")
        return S.SecAggShares(msg.round, {**boxes, "zz": b"x" * 100}, msg.b_digest)

    r = Round(hooks={"shares": stray})
    res = r.run()
    r.assert_mean_of(res, ["a01", "a02", "a03"])  # no one masked with mallory
    assert isinstance(res, S.Unmasked) and "other agents than its roster" in res.offenders[MALLORY]
    assert r.server.status()["shares"] == 3


def test_a_lying_holder_cannot_frame_an_honest_owner():
    # mallory claims a01's box did not open: it leaves the round as a drop-out (its masks
    # come off through its key's shares); a01 is not named, and the round completes.
    def claim(r: Round, a: str, msg: object) -> object:
        return S.SecAggReveal(1, {}, {}, refused=UNOPENED_BOX + "a01")

    r = Round(hooks={"input": claim})
    res = r.run()
    r.assert_mean_of(res, ["a01", "a02", "a03"])
    assert isinstance(res, S.Unmasked) and res.offenders == {}
    assert res.withdrawn == {MALLORY: "the share box from a01 did not open"}
    assert r.at is not None and r.at < DEADLINE


def test_low_order_public_keys_are_left_out_not_fatal():
    def zero_keys(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggKeys)
        return S.SecAggKeys(msg.round, bytes(32), bytes(32), msg.cert, msg.sig)

    r = Round(n=5, hooks={"keys": zero_keys})
    res = r.run()
    r.assert_mean_of(res, [a for a in r.agents if a != MALLORY])
    assert isinstance(res, S.Unmasked) and list(res.offenders) == [MALLORY]
    assert [x.reason for x in r.refusals if x.sender == MALLORY] == ["keys"]


def test_an_agent_refuses_a_roster_with_a_low_order_key():
    setup = S.SecAggSetup(S.SecAggParams(), bytes(16), 1)
    agent = S.SecAggAgent("a", random_bytes=det_bytes(1))
    agent.on_round_start(1, ["a", "b"], setup)
    bad = S.SecAggKeys(1, bytes(32), bytes(32), b"", b"")
    assert agent.on_message(S.SecAggRoster(1, {"b": bad})) == []
    assert "not a usable X25519 public key" in agent.error


# ---- inputs ------------------------------------------------------------------------------
def test_wrong_length_input_is_a_drop_out_and_not_waited_for():
    def short(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggMasked)
        return S.SecAggMasked(1, 0, msg.num_samples, {}, {"masked": msg.weights["masked"][:-1]})

    r = Round(hooks={"input": short})
    res = r.run()
    r.assert_mean_of(res, ["a01", "a02", "a03"])
    assert isinstance(res, S.Unmasked) and res.dropped_before_input == (MALLORY,)
    assert "values, not" in res.offenders[MALLORY]
    assert r.at == 53.0  # with the last honest input: nothing left to wait for


def test_silence_after_sharing_is_named_and_waited_for_about_a_training_not_the_deadline():
    r = Round(silent={MALLORY}, input_at=20.0)
    res = r.run()
    r.assert_mean_of(res, ["a01", "a02", "a03"])
    assert isinstance(res, S.Unmasked) and res.dropped_before_input == (MALLORY,)
    assert res.offenders == {MALLORY: "shared its keys, then sent no masked input"}
    # the last input came at t = 23, the inputs stage opened at t = 1: 22 s more
    assert r.at == 23.0 + 22.0


def test_inputs_are_not_given_up_on_while_too_few_are_in_for_the_survivors_to_finish():
    # Five selected: the survivor list needs 3 signatures. Two quick inputs, the other
    # agents three times slower (a loaded device, one stopped for a while): closing the
    # stage with two survivors would fail the round for certain, so the slow ones are
    # waited for, and once three are in, the usual quiet close applies again.
    r = Round(n=5, input_at=3.0, late={"a02": 12.0, "a03": 13.0, "a04": 14.0})
    res = r.run()
    r.assert_mean_of(res, r.agents)
    assert res.offenders == {}


def test_an_agent_gone_offline_after_sharing_is_a_drop_out_not_an_offender():
    r = Round(gone_before_input={MALLORY})
    res = r.run()
    assert isinstance(res, S.Unmasked) and res.offenders == {}


def noisy(sigma: float) -> Hook:
    """+σ·N(0,1) per coordinate added to mallory's quantised values, after the clip."""

    def hook(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggMasked)
        extra = np.rint(np.random.default_rng(1).normal(0, sigma, D) / r.params.step).astype(np.int64)
        y = (msg.masked.view(np.uint32).astype(np.int64) + extra) % 2**32
        return S.SecAggMasked(1, 0, msg.num_samples, {}, {"masked": y.astype(np.uint32).view(np.int32)})

    return hook


def test_an_out_of_range_input_fails_the_round_instead_of_moving_the_model():
    # σ = 50 (far outside [0, 2^bits)): the sum proves it; who sent it stays hidden.
    res = Round(hooks={"input": noisy(50.0)}).run()
    assert isinstance(res, S.Failed) and "out of range" in res.reason and res.culprits == {}


def test_an_input_out_of_range_by_less_than_the_sum_allows_moves_the_mean_at_most_as_far_as_all_agents():
    # σ = 0.5·clip: mallory's input wraps below 0 or above 2^bits in places, and wherever
    # the sum stays within [0, m·levels] the check cannot see it. What it bounds: each
    # coordinate of the mean within m·clip/Σr, as far as all m agents pushing together.
    r = Round(hooks={"input": noisy(0.5)})
    res = r.run()
    if isinstance(res, S.Failed):
        assert "out of range" in res.reason
    else:
        assert isinstance(res, S.Unmasked)
        assert np.abs(res.mean).max() <= len(r.agents) * r.params.clip / res.weight_sum + res.error_bound


def test_an_in_range_input_is_not_refused():
    def extreme(r: Round, a: str, msg: object) -> object:
        # the largest lie within the range: every coordinate at +clip (after masking
        # the same as an honest agent's, as the masks are added mod 2^32)
        assert isinstance(msg, S.SecAggMasked)
        cl = r.client[MALLORY]
        y = cl._mask_streams(cl.masking_with)
        v = np.full(D, r.params.levels, np.uint32)
        y.add_all(v)
        return S.SecAggMasked(1, 0, msg.num_samples, {}, {"masked": v.view(np.int32)})

    r = Round(hooks={"input": extreme})
    res = r.run()
    assert isinstance(res, S.Unmasked) and sorted(res.contributors) == r.agents


# ---- the round machine: named, benched, W bounded ----------------------------------------
W0 = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(5, np.float32)}


def machine_federation(monkeypatch, samples, rounds=3, alter: Callable[[], None] | None = None, **config):
    """A RoundMachine and SecAggAgents exchanging every message in memory; returns the
    machine and its commands."""
    base = dict(
        rounds=rounds,
        min_agents=3,
        expected_agents=len(samples),
        min_updates=2,
        secure=S.SecAggParams(clip=1.0, bits=16),
        server_momentum=0.0,
    )
    base.update(config)
    m = R.RoundMachine(R.RoundConfig(**base), W0)
    agents = {a: S.SecAggAgent(a, random_bytes=det_bytes(i)) for i, a in enumerate(samples)}
    log: list = []
    training: list[tuple[str, int]] = []

    def deliver(cmds, now):
        for c in cmds:
            log.append(c)
            if isinstance(c, R.StartRound):
                for a, ag in agents.items():
                    to_coord(a, ag.on_round_start(c.round, c.selected, c.secagg), now)
                    if a in c.selected:
                        training.append((a, c.round))
                deliver(c.secagg_first, now)
            elif isinstance(c, R.SendSecAgg):
                to_coord(c.to, agents[c.to].on_message(c.message), now)

    def to_coord(a, msgs, now):
        for msg in msgs:
            deliver(m.handle(R.SecAggReceived(a, msg), now), now)

    for a, ns in samples.items():
        deliver(m.handle(R.AgentOnline(a, ns), 0.0), 0.0)
    now = 1.0
    while training and m.phase is not R.Phase.DONE and now < 10_000:
        a, rnd = training.pop(0)
        if m.round != rnd:
            continue
        _, base_w = S.flatten(m.weights)
        out = agents[a].on_trained(
            rnd, np.full(base_w.shape, 0.01), base_version=m.model_version, num_samples=samples[a], metrics={}
        )
        to_coord(a, out, now)
        now += 1.0
        if not training and m.phase is R.Phase.TRAINING:
            deliver(m.handle(R.Wakeup(), now + 200), now + 200)
            now += 400
    return m, log


def test_a_member_that_deals_bad_shares_is_benched_and_the_next_rounds_go_on(monkeypatch):
    monkeypatch.setattr(S.SecAggClient, "on_roster", deal_wrong_secret("seed"))
    samples = {MALLORY: 60, "a01": 50, "a02": 60, "a03": 70}
    m, log = machine_federation(monkeypatch, samples)
    (abandoned, *_) = [c for c in log if isinstance(c, R.RoundAbandoned)]
    assert MALLORY in abandoned.reason and "sitting out" in abandoned.reason
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert aggs and all(MALLORY not in a.participants for a in aggs)
    starts = [c for c in log if isinstance(c, R.StartRound)]
    assert MALLORY in starts[0].selected and MALLORY not in starts[1].selected


def test_honest_answers_after_a_round_ended_are_not_refusals(monkeypatch):
    # Each round ends once a threshold of the four has unmasked: the last answers come
    # after it, and are no one's fault.
    samples = {"a01": 50, "a02": 60, "a03": 70, "a04": 80}
    m, log = machine_federation(monkeypatch, samples, rounds=3)
    assert len([c for c in log if isinstance(c, R.RoundAggregated)]) == 3
    assert [c for c in log if isinstance(c, R.Rejected)] == []
    # A straggler's first message of the round that ended passes quietly (here the
    # fourth answer of the last round already did); a second one is refused as stale.
    last = m.round
    for a in samples:
        m.handle(R.SecAggReceived(a, S.SecAggReveal(last, {}, {})), 1e6)
        again = m.handle(R.SecAggReceived(a, S.SecAggReveal(last, {}, {})), 1e6)
        assert [(c.sender, c.reason) for c in again] == [(a, "stale")]
    # ... as is one for an older round
    older = m.handle(R.SecAggReceived("a03", S.SecAggReveal(last - 1, {}, {})), 1e6)
    assert [(c.sender, c.reason) for c in older] == [("a03", "stale")]
    # ... as is one from an agent that was not in the round
    outsider = m.handle(R.SecAggReceived("a99", S.SecAggReveal(last, {}, {})), 1e6)
    assert [(c.sender, c.reason) for c in outsider] == [("a99", "stale")]


def test_secure_rounds_weight_is_bounded_against_the_median_claim(monkeypatch):
    # mallory announces 10^9 samples: W is at most weight_cap × the median announced, so
    # honest updates keep their weight (before: W = 10^9 and they quantised to zero).
    samples = {MALLORY: 10**9, "a01": 50, "a02": 60, "a03": 70}
    m, log = machine_federation(monkeypatch, samples, rounds=1, weight_cap=2.0)
    (start,) = [c for c in log if isinstance(c, R.StartRound)]
    assert start.secagg.max_weight == 2 * 60  # lower median of (50, 60, 70, 10^9)
    (agg,) = [c for c in log if isinstance(c, R.RoundAggregated)]
    # every agent moved by 0.01: the mean is 0.01 whatever the weights
    assert np.allclose(agg.weights["w"], 0.01, atol=1e-4)
    assert agg.weights_used[MALLORY] == pytest.approx(1.0 / (50 / 120 + 60 / 120 + 70 / 120 + 1.0))


def test_without_the_cap_the_largest_claim_is_w(monkeypatch):
    samples = {MALLORY: 10**9, "a01": 50, "a02": 60, "a03": 70}
    m, log = machine_federation(monkeypatch, samples, rounds=1)
    (start,) = [c for c in log if isinstance(c, R.StartRound)]
    assert start.secagg.max_weight == 10**9


def test_the_unmasked_mean_is_scaled_to_the_adaptive_bound():
    cfg = R.RoundConfig(
        rounds=10,
        min_agents=2,
        secure=S.SecAggParams(),
        norm_bound=R.NormBound(multiplier=3.0, window=5, warmup=3),
    )
    inf = Influence(cfg)
    assert inf.bounds_norms
    for _ in range(3):
        inf.open(["a", "b"], {"a": 1, "b": 1})
        assert inf.bound_mean(1.0) == 1.0
        inf.aggregated(["a", "b"])
    inf.open(["a", "b"], {"a": 1, "b": 1})
    assert inf.bound == 3.0
    assert inf.bound_mean(30.0) == pytest.approx(0.1)
    assert inf.aggregated(["a", "b"]) == {"(mean)": {"norm": 30.0, "bound": 3.0}}
    assert inf.status()["norm_bound"]["median"] == 1.0


# ---- what was already refused stays refused ------------------------------------------
def test_a_duplicate_masked_input_is_refused_and_counted_once():
    def twice(r: Round, a: str, msg: object) -> object:
        r.to_server(a, msg, 50.0)
        return msg

    r = Round(hooks={"input": twice})
    res = r.run()
    r.assert_mean_of(res, r.agents)
    assert [x.reason for x in r.refusals if x.sender == MALLORY] == ["stage"]


def test_a_both_shares_request_through_an_agents_inbox_gets_nothing():
    # What reaches SecAggAgent.on_message (the daemon's inbox path, after its check that
    # the coordinator sent it): seed and key shares of one agent asked at once.
    r = Round()
    res = r.run()
    assert isinstance(res, S.Unmasked)
    ag = r.agents_side["a01"]
    ask = S.SecAggUnmask(1, ("a02",), ("a02",), 4, {})
    (reveal,) = ag.on_message(ask)
    assert isinstance(reveal, S.SecAggReveal) and reveal.b_shares == {} and reveal.sk_shares == {}
    assert "both shares" in reveal.refused


@pytest.mark.parametrize("seed", range(12))
def test_whatever_a_holder_reveals_the_server_never_raises(seed):
    # Random mixes of shares: right or wrong owner, x, kind and bytes; the result is a
    # completed round or a failed one, and no honest agent is named when mallory alone
    # lies (three honest holders of four always rebuild every secret).
    rng = random.Random(seed)

    def scramble(r: Round, a: str, msg: object) -> object:
        assert isinstance(msg, S.SecAggReveal)
        owners = [*r.agents, "zz"]
        out: list[dict[str, bytes]] = [dict(msg.b_shares), dict(msg.sk_shares)]
        for _ in range(rng.randint(1, 6)):
            d = out[rng.randint(0, 1)]
            x = rng.choice([0, 1, 2, 3, 4, 5, 65535])
            d[rng.choice(owners)] = x.to_bytes(2, "big") + rng.randbytes(66)
        return S.SecAggReveal(msg.round, out[0], out[1])

    r = Round(hooks={"reveal": scramble})
    res = r.run()
    if isinstance(res, S.Unmasked):
        r.assert_mean_of(res, r.agents)
        assert set(res.offenders) <= {MALLORY}
    else:
        assert isinstance(res, S.Failed) and set(res.culprits) <= {MALLORY}
