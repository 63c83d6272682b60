"""Keys advertised a round ahead (no key stage after the first secure round): traces of
several rounds between a SecAggServer and SecAggAgents, in memory, with signed keys."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from fedagent.errors import CodecError
from fedagent.protocols import secagg as S
from fedagent.protocols.codec import Limits

D = 500


class Federation:
    """A coordinator (one SecAggServer per round) and agents (one SecAggAgent each, kept
    across rounds) over a perfect link. ``round()`` runs one secure round; the keys the
    survivors advertise with their masked inputs are used in the next round when every
    agent selected for it advertised, else that round has a key stage."""

    def __init__(self, n: int, params: S.SecAggParams | None = None) -> None:
        self.params = params or S.SecAggParams(bits=16)
        self.keys: dict[str, ed25519.Ed25519PrivateKey] = {}
        self.agents: dict[str, S.SecAggAgent] = {}
        for i in range(n):
            self.add(f"a{i:02d}")
        self.rng = np.random.default_rng(0)
        self.round_no = 0
        self.next_keys: dict[str, S.SecAggKeys] = {}
        self.next_round = 0
        self.sent: list[tuple[int, str, object]] = []  # (round, sender, message) to the coordinator
        self.tamper = None  # (server commands) -> server commands, before they are delivered
        self.up = None  # (sender, message) -> message, on its way to the coordinator
        self.server_checks = False  # the coordinator verifies the keys' signatures too

    def add(self, a: str) -> None:
        self.keys[a] = ed25519.Ed25519PrivateKey.generate()
        rng = random.Random(a)
        self.agents[a] = S.SecAggAgent(
            a,
            sign=lambda stmt, a=a: (a.encode(), self.keys[a].sign(stmt)),
            verify=self.verify,
            random_bytes=rng.randbytes,
        )

    def verify(self, name: str, stmt: bytes, cert: bytes, sig: bytes) -> None:
        if cert != name.encode():
            raise S.SecAggError("certificate of another agent")
        try:
            self.keys[name].public_key().verify(sig, stmt)
        except Exception:
            raise S.SecAggError(f"bad signature by {name}") from None

    def round(
        self, cohort: list[str] | None = None, die: dict[str, str] | None = None, last: bool = False
    ) -> tuple[S.ServerCommand, S.SecAggSetup, dict[str, np.ndarray]]:
        """``die``: agent -> "input" (vanishes before its masked input) or "unmask"
        (after it). Returns the result, the round's setup and the deltas."""
        die = die or {}
        self.round_no += 1
        r = self.round_no
        selected = sorted(cohort if cohort is not None else self.agents)
        ahead = self.next_round == r and set(selected) <= set(self.next_keys)
        setup = S.SecAggSetup(self.params, self.rng.bytes(16), 1, next_round=0 if last else r + 1, ahead=ahead)
        server = S.SecAggServer(
            r,
            selected,
            setup,
            D,
            now=0.0,
            stage_timeout=10.0,
            input_deadline=100.0,
            ahead=self.next_keys if ahead else None,
            verify=self.verify if self.server_checks else None,
        )
        deltas = {a: self.rng.uniform(-0.1, 0.1, D) for a in selected}
        out: list[S.ServerCommand] = []
        gone: set[str] = set()

        def to_server(a: str, msgs) -> None:
            for m in msgs:
                if die.get(a) == "input" and isinstance(m, S.SecAggMasked):
                    gone.add(a)
                    cmds = server.handle(S.Gone(a), 1.0)
                else:
                    if self.up is not None:
                        m = self.up(a, m)
                    self.sent.append((r, a, m))
                    cmds = server.handle(S.Received(a, m), 1.0)
                run(cmds)

        def run(cmds) -> None:
            if self.tamper is not None:
                cmds = self.tamper(cmds)
            for c in cmds:
                if isinstance(c, S.Send) and c.to not in gone:
                    if die.get(c.to) == "unmask" and isinstance(c.message, S.SecAggSurvivors):
                        gone.add(c.to)
                        run(server.handle(S.Gone(c.to), 1.0))
                        continue
                    to_server(c.to, self.agents[c.to].on_message(c.message))
                elif isinstance(c, (S.Unmasked, S.Failed)):
                    out.append(c)

        # The setup goes to every agent, then the first commands (rosters, if ahead).
        for a in selected:
            to_server(a, self.agents[a].on_round_start(r, selected, setup))
        run(server.start())
        for a in selected:  # trained
            if a not in gone:
                to_server(
                    a,
                    self.agents[a].on_trained(r, deltas[a], base_version=r - 1, num_samples=1, metrics={}),
                )
        if not out:
            run(server.handle(S.Tick(), 1000.0))
        assert len(out) == 1, out
        if isinstance(out[0], S.Unmasked):
            self.next_keys, self.next_round = dict(server.next_keys), setup.next_round
        else:
            self.next_keys, self.next_round = {}, 0
        return out[0], setup, deltas

    def kinds(self, r: int) -> set[str]:
        return {m.kind for rr, _, m in self.sent if rr == r}


def check_mean(res: S.ServerCommand, deltas: dict[str, np.ndarray], who) -> None:
    assert isinstance(res, S.Unmasked), res
    assert sorted(res.contributors) == sorted(who)
    plain = sum(deltas[a] for a in who) / len(who)
    assert np.abs(res.mean - plain).max() <= res.error_bound + 1e-12


def test_honest_rounds_skip_the_key_stage_after_the_first():
    fed = Federation(10)
    s_keys: list[bytes] = []
    for r in range(1, 5):
        res, setup, deltas = fed.round(last=r == 4)
        check_mean(res, deltas, fed.agents)
        assert setup.ahead is (r > 1)
        kinds = fed.kinds(r)
        assert ("secagg_keys" in kinds) is (r == 1)
        assert "secagg_shares" in kinds and "secagg_reveal" in kinds
        s_keys += [m.ahead.s_pk for rr, _, m in fed.sent if rr == r and isinstance(m, S.SecAggMasked) and m.ahead]
        assert not any(ag.error for ag in fed.agents.values())
    # Fresh key pairs for every round, never one twice; none advertised in the last round.
    assert len(s_keys) == 3 * 10 == len(set(s_keys))
    assert all(ag.ahead is None for ag in fed.agents.values())


def test_a_changed_cohort_falls_back_to_the_key_stage():
    fed = Federation(8)
    fed.round()
    fed.add("a99")  # a newcomer advertised nothing ahead
    res, setup, deltas = fed.round()
    assert not setup.ahead and "secagg_keys" in fed.kinds(2)
    check_mean(res, deltas, fed.agents)
    res, setup, deltas = fed.round()  # everyone advertised in round 2
    assert setup.ahead and "secagg_keys" not in fed.kinds(3)
    check_mean(res, deltas, fed.agents)
    # A smaller cohort (all of it advertised ahead) keeps the shortcut.
    few = sorted(fed.agents)[:6]
    res, setup, deltas = fed.round(cohort=few)
    assert setup.ahead and "secagg_keys" not in fed.kinds(4)
    check_mean(res, deltas, few)


@pytest.mark.parametrize("when", ["input", "unmask"])
def test_dropout_in_a_round_with_keys_ahead_still_recovers(when):
    fed = Federation(10)
    fed.round()
    res, setup, deltas = fed.round(die={"a03": when, "a06": when})
    assert setup.ahead
    survivors = sorted(a for a in fed.agents if a not in ("a03", "a06")) if when == "input" else sorted(fed.agents)
    check_mean(res, deltas, survivors)
    if when == "input":
        # The drop-outs advertised no keys for round 3: it has a key stage, for everyone.
        assert set(fed.next_keys) == set(survivors)
        res, setup, deltas = fed.round()
        assert not setup.ahead and "secagg_keys" in fed.kinds(3)
        check_mean(res, deltas, fed.agents)


def test_a_replayed_key_from_an_earlier_round_is_refused():
    fed = Federation(6)
    fed.round()
    fed.round()
    old = {a: k for rr, a, m in fed.sent if rr == 1 and isinstance(m, S.SecAggMasked) for k in [m.ahead]}
    # Round 3: the coordinator swaps in a01's keys advertised in round 1 (for round 2).
    swapped = []

    def tamper(cmds):
        out = []
        for c in cmds:
            if isinstance(c, S.Send) and isinstance(c.message, S.SecAggRoster) and "a01" in c.message.keys:
                keys = dict(c.message.keys)
                keys["a01"] = replace(old["a01"], round=3)  # claimed for this round
                swapped.append(c.to)
                c = S.Send(c.to, S.SecAggRoster(c.message.round, keys))
            out.append(c)
        return out

    fed.tamper = tamper
    res, setup, _ = fed.round()
    assert setup.ahead and swapped
    assert isinstance(res, S.Failed)
    for a in swapped:  # every agent handed the old key stopped before sharing anything
        assert "a01" in fed.agents[a].error
        assert not any(rr == 3 and s == a and isinstance(m, S.SecAggShares) for rr, s, m in fed.sent)


def test_keys_ahead_serve_their_own_round_only():
    fed = Federation(4)
    fed.round()
    assert fed.next_round == 2
    keys = dict(fed.next_keys)
    # Offered to a server for another round: refused before anything is sent.
    setup = S.SecAggSetup(fed.params, bytes(16), 1, next_round=4, ahead=True)
    with pytest.raises(S.SecAggError, match="not for round 3"):
        S.SecAggServer(3, sorted(keys), setup, D, now=0, stage_timeout=1, input_deadline=2, ahead=keys)
    # An agent asked to use keys ahead in a round it advertised none for stops there.
    ag = fed.agents["a00"]
    assert ag.on_round_start(3, sorted(keys), setup) == []
    assert "advertised none" in ag.error and ag.client is None
    assert ag.ahead is None  # and the keys for round 2 are gone for good
    # Keys for round 2 presented in an explicit key stage do not verify (another statement).
    fed2 = Federation(4)
    fed2.round()
    cl = S.SecAggClient("a00", 2, sorted(fed2.agents), S.SecAggSetup(fed2.params, bytes(16), 1), verify=fed2.verify)
    roster = S.SecAggRoster(2, {a: fed2.next_keys[a] for a in cl.graph_neighbours})
    with pytest.raises(S.SecAggError, match="bad signature"):
        cl.on_roster(roster)


def test_a_roster_overtaking_its_round_start_is_kept():
    fed = Federation(4)
    fed.round()
    r, selected = 2, sorted(fed.agents)
    setup = S.SecAggSetup(fed.params, bytes(16), 1, next_round=3, ahead=True)
    server = S.SecAggServer(2, selected, setup, D, now=0, stage_timeout=1, input_deadline=2, ahead=fed.next_keys)
    rosters = {c.to: c.message for c in server.start() if isinstance(c, S.Send)}
    ag = fed.agents["a00"]
    assert ag.on_message(rosters["a00"]) == []  # before the start: held
    msgs = ag.on_round_start(r, selected, setup)
    assert [m.kind for m in msgs] == ["secagg_shares"]


def test_wire_carries_the_version_and_the_keys_ahead():
    setup = S.SecAggSetup(S.SecAggParams(), bytes(16), 3, next_round=8, ahead=True)
    body = setup.to_body()
    assert body["version"] == S.SECAGG_VERSION == 2
    assert S.SecAggSetup.from_body(body) == setup
    with pytest.raises(CodecError, match="version 1"):
        S.SecAggSetup.from_body({k: v for k, v in body.items() if k not in ("version", "next_round", "ahead")})
    with pytest.raises(CodecError, match="ahead"):
        S.SecAggSetup.from_body({**body, "ahead": 1})
    keys = S.SecAggKeys(8, bytes(32), bytes(range(32)), b"c", b"s" * 64)
    m = S.SecAggMasked(7, 0, 5, {}, {"masked": np.arange(4, dtype=np.int32)}, ahead=keys)
    back = S.SecAggMasked.from_body(m.to_body(), Limits())
    assert back.ahead == keys
    with pytest.raises(CodecError):
        S.SecAggMasked.from_body({**m.to_body(), "ahead": {"round": 8}}, Limits())
    # An agent of version 1 sends no keys ahead: its masked update is taken as it is.
    old = {k: v for k, v in m.to_body().items() if k != "ahead"}
    assert S.SecAggMasked.from_body(old, Limits()).ahead is None


def test_keys_ahead_with_a_bad_signature_bring_back_the_key_stage():
    """The coordinator checks the keys advertised ahead: a02's, badly signed, are not
    kept (its input still counts), so the next round has a key stage, which completes."""
    fed = Federation(5)
    fed.server_checks = True
    refused: list[S.Refused] = []

    def spoil(a: str, m):
        if a == "a02" and isinstance(m, S.SecAggMasked) and m.ahead is not None:
            return replace(m, ahead=replace(m.ahead, sig=bytes(64)))
        return m

    def watch(cmds):
        refused.extend(c for c in cmds if isinstance(c, S.Refused))
        return cmds

    fed.up, fed.tamper = spoil, watch
    res, _, deltas = fed.round()
    check_mean(res, deltas, fed.agents)
    assert [(c.sender, c.reason) for c in refused] == [("a02", "key_signature")]
    assert "a02" not in fed.next_keys and len(fed.next_keys) == 4
    fed.up = None
    res, setup, deltas = fed.round()
    assert not setup.ahead and "secagg_keys" in fed.kinds(2)
    check_mean(res, deltas, fed.agents)
