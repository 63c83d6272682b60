"""Secure aggregation (SecAgg+) machines, driven in memory: whole rounds as traces."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from fedagent.errors import CodecError
from fedagent.protocols import secagg as S
from fedagent.protocols.codec import Limits
from fedagent.protocols.messages import KINDS

D = 2_000  # values in the flattened update


def det_bytes(seed: int):
    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


def _altered(share: bytes) -> bytes:
    return share[:-1] + bytes([share[-1] ^ 1])


@dataclass
class Trace:
    """One secure round between a SecAggServer and N SecAggClients over a perfect link.

    ``die_before`` agents vanish at the named stage ("keys": never advertise; "shares":
    advertise, then vanish; "input": share, then vanish before the masked input;
    "unmask": send the masked input, then vanish; "reveal": sign the survivor list too,
    then fall silent)."""

    n: int
    params: S.SecAggParams = field(default_factory=S.SecAggParams)
    die: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    signed: bool = False  # agents sign their keys and lists (ed25519), and check each other's
    d: int = D  # values in the flattened update
    premask: bool = False  # agents draw their mask sum as soon as their roster is in
    # agents that send a garbage signature of the survivor list and, if asked, altered shares
    garbage: set[str] = field(default_factory=set)
    server_checks: bool = True  # the coordinator verifies the list signatures (when signed)
    # agents whose key advertisement carries a garbage signature
    garbage_keys: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.agents = [f"a{i:02d}" for i in range(self.n)]
        self.samples = {a: int(rng.integers(20, 200)) for a in self.agents}
        self.deltas = {a: rng.uniform(-0.4, 0.4, self.d) for a in self.agents}
        self.setup = S.SecAggSetup(self.params, bytes(range(16)), max(self.samples.values()))
        self.server = S.SecAggServer(
            1,
            self.agents,
            self.setup,
            self.d,
            now=0.0,
            stage_timeout=10.0,
            input_deadline=100.0,
            verify=self.verify if self.signed and self.server_checks else None,
        )
        self.keys = {a: ed25519.Ed25519PrivateKey.generate() for a in self.agents}
        self.clients = {
            a: S.SecAggClient(
                a,
                1,
                self.agents,
                self.setup,
                random_bytes=det_bytes(hash((self.seed, a)) & 0xFFFF),
                sign=self.signer(a) if self.signed else None,
                verify=self.verify if self.signed else None,
            )
            for a in self.agents
        }
        self.sent_to_server: list[tuple[str, object]] = []
        self.result: list[S.ServerCommand] = []
        self.refusals: list[S.Refused] = []
        self.asked: list[str] = []  # agents sent a request for shares
        self.server_sent: list[S.Send] = []

    def signer(self, a: str):
        return lambda stmt: (a.encode(), self.keys[a].sign(stmt))

    def verify(self, name: str, stmt: bytes, cert: bytes, sig: bytes) -> None:
        if cert != name.encode():
            raise S.SecAggError("certificate of another agent")
        self.keys[name].public_key().verify(sig, stmt)

    def alive(self, a: str, stage: str) -> bool:
        order = ["keys", "shares", "input", "unmask", "reveal"]
        return a not in self.die or order.index(stage) < order.index(self.die[a])

    def to_server(self, a: str, msg, now: float) -> None:
        self.sent_to_server.append((a, msg))
        self.apply(self.server.handle(S.Received(a, msg), now), now)

    def apply(self, cmds, now: float) -> None:
        for c in cmds:
            if isinstance(c, S.Send):
                self.server_sent.append(c)
                self.deliver(c.to, c.message, now)
            elif isinstance(c, (S.Unmasked, S.Failed)):
                self.result.append(c)
            elif isinstance(c, S.Refused):
                self.refusals.append(c)

    def deliver(self, a: str, msg, now: float) -> None:
        cl = self.clients[a]
        if isinstance(msg, S.SecAggRoster):
            if self.alive(a, "shares"):
                self.to_server(a, cl.on_roster(msg), now)
                if self.premask:
                    cl.premask(self.d)
        elif isinstance(msg, S.SecAggShareBox):
            if self.alive(a, "input"):
                cl.on_sharebox(msg)
                self.pending_inputs.append(a)
        elif isinstance(msg, S.SecAggSurvivors):
            if self.alive(a, "unmask"):
                sig = cl.on_survivors(msg)
                if a in self.garbage:
                    sig = S.SecAggSignature(sig.round, sig.cert, bytes(64))
                self.to_server(a, sig, now)
        elif isinstance(msg, S.SecAggUnmask):
            self.asked.append(a)
            if self.alive(a, "reveal"):
                reveal = cl.on_unmask(msg)
                if a in self.garbage:
                    reveal = S.SecAggReveal(
                        reveal.round,
                        {o: _altered(x) for o, x in reveal.b_shares.items()},
                        {o: _altered(x) for o, x in reveal.sk_shares.items()},
                    )
                self.to_server(a, reveal, now)

    def masked(self, a: str) -> S.SecAggMasked:
        y = self.clients[a].masked_input(self.deltas[a], self.samples[a])
        return S.SecAggMasked(1, 0, self.samples[a], {"loss": 1.0}, {"masked": y.view(np.int32)})

    def run(self) -> S.ServerCommand:
        self.pending_inputs: list[str] = []
        self.apply(self.server.start(), 0.0)
        for a in self.agents:
            if self.alive(a, "keys"):
                keys = self.clients[a].advertise()
                if a in self.garbage_keys:
                    keys = S.SecAggKeys(keys.round, keys.c_pk, keys.s_pk, keys.cert, bytes(64))
                self.to_server(a, keys, 1.0)
        # Those that died are noticed (their presence goes offline).
        for stage in ("keys", "shares", "input"):
            for a, at in self.die.items():
                if at == stage:
                    self.apply(self.server.handle(S.Gone(a), 2.0), 2.0)
        # Training is done: masked inputs, after the share boxes arrived.
        for a in list(self.pending_inputs):
            self.to_server(a, self.masked(a), 50.0)
        for a, at in self.die.items():
            if at == "unmask":
                self.apply(self.server.handle(S.Gone(a), 60.0), 60.0)
        if not self.result:
            self.apply(self.server.handle(S.Tick(), 500.0), 500.0)
        assert len(self.result) == 1, self.result
        return self.result[0]

    def plain_mean(self, who) -> np.ndarray:
        r = {a: self.setup.ratio(self.samples[a]) for a in who}
        return sum(np.clip(r[a] * self.deltas[a], -self.params.clip, self.params.clip) for a in who) / sum(r.values())


def test_graph_is_symmetric_and_sparse():
    agents = [f"n{i}" for i in range(100)]
    g = S.neighbour_graph(agents, b"x" * 16)
    assert all(a in g[b] for a in g for b in g[a])
    assert {len(v) for v in g.values()} == {14}  # 2⌈log₂ 100⌉
    assert S.neighbour_graph(agents, b"y" * 16) != g  # the round's seed shuffles it
    small = S.neighbour_graph(agents[:5], b"x" * 16)
    assert {len(v) for v in small.values()} == {4}  # complete below ~8 agents


def test_quantisation_error_is_within_half_a_step():
    p = S.SecAggParams(clip=0.5, bits=12)
    rng = np.random.default_rng(1)
    xs = [rng.uniform(-0.5, 0.5, 10_000) for _ in range(7)]
    s = sum(S.quantise(x, p).astype(np.uint64) for x in xs).astype(np.uint32)
    err = np.abs(S.dequantise_sum(s, 7, p) - sum(xs))
    assert err.max() <= 7 * p.step / 2 + 1e-12
    assert err.max() > 7 * p.step / 2 * 0.5  # the bound is tight, not a wide margin
    assert p.max_agents == (2**32 - 1) // (2**12 - 1)


def test_honest_round_sum_matches_plain_fedavg_within_the_bound():
    t = Trace(20)
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    assert sorted(res.contributors) == t.agents
    # The graph is sparse here: 20 agents, 10 neighbours each.
    assert {len(c.graph_neighbours) for c in t.clients.values()} == {10}
    err = np.abs(res.mean - t.plain_mean(t.agents))
    assert err.max() <= res.error_bound
    assert res.error_bound == pytest.approx(20 * t.params.step / 2 / res.weight_sum)
    assert not t.refusals


def test_coordinator_only_sees_masked_vectors():
    t = Trace(6)
    t.run()
    kinds = {type(m).__name__ for _, m in t.sent_to_server}
    assert kinds == {"SecAggKeys", "SecAggShares", "SecAggMasked", "SecAggSignature", "SecAggReveal"}
    for a, m in t.sent_to_server:
        if isinstance(m, S.SecAggMasked):
            q = S.quantise(t.deltas[a] * t.setup.ratio(t.samples[a]), t.params)
            # masked values are spread over all of uint32, the quantised ones below 2^20
            assert m.masked.max() > 2**31 and q.max() < 2**20
            assert np.mean(m.masked == q) < 0.01
        if isinstance(m, S.SecAggShares):
            for box in m.boxes.values():
                with pytest.raises(Exception):
                    msgpack.unpackb(box)
    # the server keeps a running sum, not the inputs
    assert all(m.weights["masked"].size == 0 for m in t.server.inputs.values())


def test_dropout_after_key_sharing_before_masking():
    t = Trace(12, die={"a03": "input", "a07": "input"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    survivors = [a for a in t.agents if a not in t.die]
    assert sorted(res.contributors) == survivors
    assert res.dropped_before_input == ("a03", "a07")
    assert np.abs(res.mean - t.plain_mean(survivors)).max() <= res.error_bound


def test_dropout_after_sending_the_masked_input():
    t = Trace(12, die={"a05": "unmask"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    assert sorted(res.contributors) == t.agents  # its input counts: its seed comes from shares
    assert "a05" in res.silent_at_unmask  # (the masks come off once enough shares are in)
    assert np.abs(res.mean - t.plain_mean(t.agents)).max() <= res.error_bound


def test_dropout_at_every_stage_at_once():
    t = Trace(16, die={"a01": "keys", "a02": "shares", "a03": "input", "a04": "unmask"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    survivors = [a for a in t.agents if a not in ("a01", "a02", "a03")]
    assert sorted(res.contributors) == survivors
    assert np.abs(res.mean - t.plain_mean(survivors)).max() <= res.error_bound


def _reference_masked(cl: S.SecAggClient, delta: np.ndarray, scale: float) -> np.ndarray:
    """The masked input computed the plain way, whole vectors at a time: what every
    version of the protocol must produce (the coordinator removes these very streams)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    p = cl.params
    half = p.levels / 2
    y = np.rint(np.clip(delta * (scale / p.step), -half, half) + half).astype(np.uint32)

    def stream(seed: bytes, nonce: bytes = bytes(16)) -> np.ndarray:
        enc = Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor()
        return np.frombuffer(enc.update(bytes(4 * delta.size)), "<u4")

    y += stream(cl._b, S._SELF_NONCE)
    for j in cl.masking_with:
        m = stream(S.pair_seed(cl._s_sk, cl.keys[j].s_pk, cl.context))
        if S._sign(cl.agent, j) > 0:
            y += m
        else:
            y -= m
    return y


@pytest.mark.parametrize("premask", [False, True])
def test_block_by_block_masking_equals_whole_vectors(premask):
    # Several blocks and a partial one; an agent that advertised keys but never shared
    # leaves its neighbours a mask to take back (premask) or never to add.
    t = Trace(5, d=2 * S.BLOCK + 123, die={"a01": "shares"}, premask=premask)
    refs: dict[str, np.ndarray] = {}
    masked = t.masked

    def checked(a: str) -> S.SecAggMasked:
        cl = t.clients[a]
        refs[a] = _reference_masked(cl, t.deltas[a], t.setup.ratio(t.samples[a]))
        assert "a01" not in cl.masking_with
        assert (cl._premask is not None) == premask
        return masked(a)

    t.masked = checked  # type: ignore[method-assign]
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    sent = {a: m for a, m in t.sent_to_server if isinstance(m, S.SecAggMasked)}
    assert sorted(sent) == sorted(refs) == ["a00", "a02", "a03", "a04"]
    for a, m in sent.items():
        assert np.array_equal(m.masked, refs[a])
    survivors = sorted(sent)
    assert np.abs(res.mean - t.plain_mean(survivors)).max() <= res.error_bound


def test_premasked_round_with_dropouts_at_every_stage():
    t = Trace(16, die={"a01": "keys", "a02": "shares", "a03": "input", "a04": "unmask"}, premask=True)
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    survivors = [a for a in t.agents if a not in ("a01", "a02", "a03")]
    assert sorted(res.contributors) == survivors
    assert np.abs(res.mean - t.plain_mean(survivors)).max() <= res.error_bound
    # the mask sum drawn ahead was used up by the masked input
    assert all(t.clients[a]._premask is None for a in survivors)


def test_delta_of_tensor_pairs_is_read_in_flatten_order():
    rng = np.random.default_rng(3)
    shapes = {"w": (300, 150), "b": (S.BLOCK + 5,), "n": (7,)}
    old = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    old["steps"] = np.array([3], np.int64)  # not floating: not part of the update
    new = {k: (v + 0.01).astype(v.dtype) for k, v in old.items()}
    d = S.Delta(new, old)
    work = np.empty(1000)
    got = np.concatenate([b.copy() for b in S._delta_blocks(d, work)])
    assert d.size == got.size == S.layout_size(old)
    assert np.array_equal(got, S.flatten(new)[1] - S.flatten(old)[1])
    with pytest.raises(S.SecAggError):
        S.Delta({k: v for k, v in new.items() if k != "b"}, old)


def test_too_few_inputs_aborts_the_round():
    t = Trace(4, params=S.SecAggParams(min_survivors=3), die={"a00": "input", "a01": "input"})
    res = t.run()
    assert isinstance(res, S.Failed)
    assert "2 masked inputs arrived, need 3" in res.reason
    assert t.server.stage == t.server.DONE and t.server._sum is None
    # nothing more is done for that round
    assert t.server.handle(S.Tick(), 1000.0) == []


def test_too_few_share_holders_aborts_the_round():
    # 5 agents, complete graph: each secret has 5 holders and needs 3 shares. Three
    # fall silent after signing the survivor list: the two left cannot rebuild the seeds.
    t = Trace(5, die={"a00": "reveal", "a01": "reveal", "a02": "reveal"})
    res = t.run()
    assert isinstance(res, S.Failed)
    assert "too few shares" in res.reason


def test_too_few_list_signatures_abort_the_round_before_any_share_is_asked():
    # Three of five drop after their input: two signatures of the survivor list are not
    # more than half of the five selected, so no agent is asked for a share.
    t = Trace(5, die={"a00": "unmask", "a01": "unmask", "a02": "unmask"})
    res = t.run()
    assert isinstance(res, S.Failed)
    assert "2 survivors signed the survivor list, need 3 of the 5 selected" in res.reason
    assert not any(isinstance(m, S.SecAggReveal) for _, m in t.sent_to_server)


def _through_input(n=5, signed=False):
    t = Trace(n, signed=signed)
    t.pending_inputs = []
    for a in t.agents:
        t.apply(t.server.handle(S.Received(a, t.clients[a].advertise()), 1.0), 1.0)
    for a in t.pending_inputs:
        t.clients[a].masked_input(t.deltas[a], t.samples[a])
    # everyone signs the (honest) list of survivors: the unmask requests below carry it
    listed = S.SecAggSurvivors(1, tuple(t.agents))
    t.sigs = {a: (lambda s: (s.cert, s.sig))(t.clients[a].on_survivors(listed)) for a in t.agents}
    return t


def test_honest_agent_refuses_both_shares_of_one_agent():
    t = _through_input()
    me = t.clients["a00"]
    ask = S.SecAggUnmask(1, ("a00", "a01", "a02"), ("a02", "a03"), survivors=5)
    r = me.on_unmask(ask)
    assert r.refused.startswith("both shares asked for a02")
    assert r.b_shares == {} and r.sk_shares == {}
    # A split request is refused as well: the seed share of a01 first, its key share next.
    first = me.on_unmask(S.SecAggUnmask(1, ("a00", "a01"), (), survivors=5, signatures=t.sigs))
    assert not first.refused and set(first.b_shares) == {"a00", "a01"}
    second = me.on_unmask(S.SecAggUnmask(1, (), ("a01",), survivors=5))
    assert "key share of a01 after its seed share" in second.refused and not second.sk_shares
    # ... and its own key share, having sent its input, never
    assert "my own key share" in me.on_unmask(S.SecAggUnmask(1, (), ("a00",), survivors=5)).refused
    # ... nor a sum of a single input
    assert "below min_survivors" in me.on_unmask(S.SecAggUnmask(1, ("a01",), (), survivors=1)).refused


def test_consistency_round_every_survivor_signs_the_same_list():
    t = Trace(8, signed=True, die={"a02": "input", "a05": "unmask"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    survivors = tuple(a for a in t.agents if a != "a02")
    assert t.server.survivors == survivors  # a05 sent its input: it is on the list, silent or not
    assert {a for a, c in t.clients.items() if c.signed == survivors} == set(survivors) - {"a05"}
    assert set(t.server.signatures) == set(survivors) - {"a05"}
    sigs = [m for _, m in t.sent_to_server if isinstance(m, S.SecAggSignature)]
    reveals = [m for _, m in t.sent_to_server if isinstance(m, S.SecAggReveal)]
    assert len(sigs) == len(reveals) == 6 and not any(r.refused for r in reveals)


def test_garbage_list_signature_counts_as_a_dropout_and_the_round_completes():
    """a02 sends its masked input, then a garbage signature of the survivor list (and
    would return altered shares if asked). The coordinator checks the signature itself:
    a02 is dropped from the rest of the round, never asked for shares, its signature is
    not passed on, and the honest agents unmask the sum (a02's input in it, as a silent
    survivor's: everyone signed a list naming it)."""
    t = Trace(5, signed=True, garbage={"a02"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    assert sorted(res.contributors) == t.agents
    assert np.abs(res.mean - t.plain_mean(t.agents)).max() <= res.error_bound
    assert list(res.bad_signatures) == ["a02"] and res.bad_signatures["a02"]
    assert "a02" not in res.silent_at_unmask  # named apart, with its reason
    bad = [r for r in t.refusals if r.sender == "a02"]
    assert [r.reason for r in bad] == ["list_signature"] and "a02" in bad[0].detail
    assert set(t.server.signatures) == set(t.agents) - {"a02"}
    assert sorted(t.asked) == ["a00", "a01", "a03", "a04"]
    asks = [c for c in t.server_sent if isinstance(c.message, S.SecAggUnmask)]
    assert len(asks) == 4 and all(set(c.message.signatures) == set(t.agents) - {"a02"} for c in asks)
    reveals = [m for a, m in t.sent_to_server if isinstance(m, S.SecAggReveal)]
    assert len(reveals) == 4 and not any(r.refused for r in reveals)


def test_garbage_key_signature_is_left_out_and_the_round_completes():
    """a02 advertises keys with a garbage signature. Passed on, every neighbour (all of
    them, with five agents) would find it invalid and leave; the coordinator checks it
    itself, leaves a02 out of the rosters and the round completes with the other four,
    without waiting for the key stage's deadline."""
    t = Trace(5, signed=True, garbage_keys={"a02"})
    res = t.run()
    assert isinstance(res, S.Unmasked), res
    others = [a for a in t.agents if a != "a02"]
    assert sorted(res.contributors) == others
    assert np.abs(res.mean - t.plain_mean(others)).max() <= res.error_bound
    assert [(r.sender, r.reason) for r in t.refusals] == [("a02", "key_signature")]
    rosters = [c for c in t.server_sent if isinstance(c.message, S.SecAggRoster)]
    assert sorted(c.to for c in rosters) == others and all("a02" not in c.message.keys for c in rosters)
    assert t.server.status()["bad_keys"] == 1


def test_unchecked_garbage_signer_is_asked_and_its_altered_shares_are_found_out():
    # The same round with the coordinator passing signatures on unchecked: a02 is asked
    # for shares, and its altered shares lie off each owner's polynomial. The others'
    # shares rebuild every seed: the round completes, naming a02 as the holder that lied.
    t = Trace(5, signed=True, garbage={"a02"}, server_checks=False)
    res = t.run()
    assert isinstance(res, S.Unmasked) and list(res.offenders) == ["a02"]
    assert np.abs(res.mean - t.plain_mean(t.agents)).max() <= res.error_bound + 1e-9
    assert "a02" in t.asked and {r.sender for r in t.refusals if r.reason == "bad_share"} == {"a02"}


def test_too_few_valid_list_signatures_fail_at_once_naming_the_bad_ones():
    # Two of five drop after their input and a02's signature is garbage: two valid
    # signatures, not more than half of the five selected. The coordinator says so at
    # once instead of asking the agents, who would each refuse.
    t = Trace(5, signed=True, garbage={"a02"}, die={"a00": "unmask", "a01": "unmask"})
    res = t.run()
    assert isinstance(res, S.Failed)
    assert "2 survivors signed the survivor list, need 3 of the 5 selected" in res.reason
    assert "1 signatures not valid: a02" in res.reason
    assert not t.asked and not any(isinstance(m, S.SecAggReveal) for _, m in t.sent_to_server)


def test_a_signature_by_another_agents_certificate_is_not_valid():
    names = [f"a{i:02d}" for i in range(4)]
    t = Trace(4, signed=True, die={a: "unmask" for a in names})  # the list is signed by hand below
    t.pending_inputs = []
    for a in names:
        t.to_server(a, t.clients[a].advertise(), 1.0)
    for a in t.pending_inputs:
        t.to_server(a, t.masked(a), 50.0)
    srv = t.server
    assert srv.stage == srv.CONSISTENCY and srv.survivors == tuple(names)
    listed = S.SecAggSurvivors(1, tuple(names))
    sigs = {a: t.clients[a].on_survivors(listed) for a in names}
    # a00 hands in a01's (valid) signature: not a signature of a00
    out = srv.handle(S.Received("a00", sigs["a01"]), 51.0)
    assert [(c.sender, c.reason) for c in out if isinstance(c, S.Refused)] == [("a00", "list_signature")]
    assert "a00" in srv.bad_signatures and "a00" not in srv.signatures
    assert srv.status()["bad_signatures"] == 1
    # a second try in the same round is refused as out of stage, and not counted
    again = srv.handle(S.Received("a00", sigs["a00"]), 51.0)
    assert [c.reason for c in again if isinstance(c, S.Refused)] == ["stage"] and "a00" not in srv.signatures
    # honest signatures count; once the other three are in, the shares are asked for
    for a in ("a01", "a02", "a03"):
        t.apply(srv.handle(S.Received(a, sigs[a]), 52.0), 52.0)
    assert set(srv.signatures) == {"a01", "a02", "a03"} and srv.stage == srv.UNMASK
    assert sorted(srv.asked) == ["a01", "a02", "a03"]


def test_two_survivor_lists_from_one_coordinator_get_no_share():
    """A lying coordinator tells a00..a02 that everyone survived and a03..a05 that a00
    dropped (to get a00's seed from the first and its key from the second, and strip
    its masks). Each half signs its own list; neither list has more than half of the
    six selected behind it, so every agent refuses to reveal anything."""
    t = _through_input(6, signed=True)
    everyone = tuple(t.agents)
    without_a00 = tuple(a for a in t.agents if a != "a00")
    first, second = t.agents[:3], t.agents[3:]
    # _through_input had everyone sign the honest list; start these clients afresh on it
    for c in t.clients.values():
        c.signed = None
    sigs: dict[str, tuple[bytes, bytes]] = {}
    for a in first:
        s = t.clients[a].on_survivors(S.SecAggSurvivors(1, everyone))
        sigs[a] = (s.cert, s.sig)
    for a in second:
        s = t.clients[a].on_survivors(S.SecAggSurvivors(1, without_a00))
        sigs[a] = (s.cert, s.sig)
    answers = [t.clients[a].on_unmask(S.SecAggUnmask(1, ("a00",), (), len(everyone), sigs)) for a in first]
    answers += [t.clients[a].on_unmask(S.SecAggUnmask(1, (), ("a00",), len(without_a00), sigs)) for a in second]
    assert all(r.refused and not r.b_shares and not r.sk_shares for r in answers)
    assert all("only 3 valid signatures of the survivor list I signed, need 4" in r.refused for r in answers)
    # Signatures of one list do not count for the other, nor forged ones, nor outsiders'.
    forged = {a: (a.encode(), bytes(64)) for a in without_a00}
    r = t.clients["a03"].on_unmask(S.SecAggUnmask(1, (), ("a00",), len(without_a00), forged))
    assert "only 0 valid signatures" in r.refused
    # An agent signs one list per round: a second, different one is refused.
    with pytest.raises(S.SecAggError, match="second, different survivor list"):
        t.clients["a01"].on_survivors(S.SecAggSurvivors(1, without_a00))
    # ... and never one that leaves itself out although it sent its input.
    t.clients["a00"].signed = None
    with pytest.raises(S.SecAggError, match="leaves me out"):
        t.clients["a00"].on_survivors(S.SecAggSurvivors(1, without_a00))


def test_unmask_request_must_match_the_signed_list():
    t = _through_input(5, signed=True)
    me = t.clients["a01"]
    # a02 is on the list a01 signed: asking for its key share (as if it dropped) is refused
    r = me.on_unmask(S.SecAggUnmask(1, ("a00",), ("a02",), 5, t.sigs))
    assert "does not match the survivor list I signed" in r.refused and not r.sk_shares
    r = me.on_unmask(S.SecAggUnmask(1, ("a00",), (), 4, t.sigs))  # another survivor count
    assert "does not match" in r.refused
    ok = me.on_unmask(S.SecAggUnmask(1, ("a00", "a02"), (), 5, t.sigs))
    assert not ok.refused and set(ok.b_shares) == {"a00", "a02"}


def test_refusal_leaves_the_coordinator_without_the_secret():
    # A coordinator that claims a01 dropped (asking for its key share) while a01's input
    # is in the sum would strip a01's masks; with the seed shares given out it cannot.
    t = _through_input()
    for a in t.agents:
        assert not t.clients[a].on_unmask(S.SecAggUnmask(1, tuple(t.agents), (), 5, t.sigs)).refused
    answers = [t.clients[a].on_unmask(S.SecAggUnmask(1, (), ("a01",), 5, t.sigs)) for a in t.agents if a != "a01"]
    assert all(r.refused and not r.sk_shares for r in answers)


def test_substituted_keys_are_refused():
    keys = {a: ed25519.Ed25519PrivateKey.generate() for a in ("a00", "a01", "a02")}

    def signer(a):
        return lambda stmt: (a.encode(), keys[a].sign(stmt))

    def verify(name, stmt, cert, sig):
        if cert != name.encode():
            raise S.SecAggError("certificate of another agent")
        keys[name].public_key().verify(sig, stmt)

    setup = S.SecAggSetup(S.SecAggParams(), bytes(16), 10)
    agents = sorted(keys)
    cl = {a: S.SecAggClient(a, 1, agents, setup, sign=signer(a), verify=verify) for a in agents}
    adv = {a: c.advertise() for a, c in cl.items()}
    forged = S.SecAggKeys(1, bytes(32), adv["a01"].s_pk, adv["a01"].cert, adv["a01"].sig)
    with pytest.raises(Exception):
        cl["a00"].on_roster(S.SecAggRoster(1, {"a01": forged, "a02": adv["a02"]}))
    ok = cl["a00"].on_roster(S.SecAggRoster(1, {"a01": adv["a01"], "a02": adv["a02"]}))
    assert set(ok.boxes) == {"a01", "a02"}


def test_isolated_agent_is_not_masked_alone():
    setup = S.SecAggSetup(S.SecAggParams(), bytes(16), 10)
    c = S.SecAggClient("a00", 1, ["a00", "a01"], setup)
    with pytest.raises(S.SecAggError, match="would not be hidden"):
        c.on_roster(S.SecAggRoster(1, {}))


def test_tampered_share_box_is_detected():
    t = Trace(3)
    rosters = []
    for a in t.agents:
        rosters += t.server.handle(S.Received(a, t.clients[a].advertise()), 1.0)
    # driven by hand to tamper with one box
    sh = {c.to: t.clients[c.to].on_roster(c.message) for c in rosters if isinstance(c, S.Send)}
    box = bytearray(sh["a01"].boxes["a00"])
    box[5] ^= 1
    with pytest.raises(S.SecAggError, match="does not open"):
        t.clients["a00"].on_sharebox(S.SecAggShareBox(1, {"a01": bytes(box)}))


def test_messages_round_trip_and_validate():
    limits = Limits()
    t = _through_input(3)
    adv = t.clients["a00"].advertise()
    msgs = [
        S.SecAggStart(1, ("a00", "a01"), S.SecAggSetup(S.SecAggParams(bits=16), bytes(16), 7)),
        adv,
        S.SecAggRoster(1, {"a01": adv}),
        S.SecAggShares(1, {"a01": bytes(64)}, bytes(32)),
        S.SecAggShareBox(1, {"a01": bytes(64)}),
        S.SecAggMasked(1, 0, 5, {"loss": 0.5}, {"masked": np.arange(10, dtype=np.int32)}),
        S.SecAggUnmask(1, ("a00",), ("a01",), 3),
        S.SecAggSurvivors(1, ("a00", "a01")),
        S.SecAggSignature(1, b"cert", bytes(64)),
        S.SecAggUnmask(1, ("a00",), (), 2, {"a00": (b"cert", bytes(64)), "a01": (b"", b"")}),
        S.SecAggReveal(1, {"a00": bytes(68)}, {}, ""),
    ]
    for m in msgs:
        body = msgpack.unpackb(msgpack.packb(m.to_body(), use_bin_type=True), raw=False)
        back = KINDS[m.kind].from_body(body, limits)
        if isinstance(m, S.SecAggMasked):
            assert np.array_equal(back.masked, m.masked)
        else:
            assert back == m
    with pytest.raises(CodecError):
        S.SecAggKeys.from_body({"round": 1, "c_pk": b"x", "s_pk": bytes(32), "cert": b"", "sig": b""})
    with pytest.raises(CodecError):
        S.SecAggUnmask.from_body({"round": 1, "b_of": ["../x"], "sk_of": [], "survivors": 2})
    with pytest.raises(CodecError):
        S.SecAggUnmask.from_body({"round": 1, "b_of": [], "sk_of": [], "survivors": 2, "signatures": {"a0": [b""]}})
    with pytest.raises(CodecError):
        S.SecAggSurvivors.from_body({"round": 1, "survivors": ["a0", 3]})
    with pytest.raises(CodecError):
        S.SecAggParams(threshold=0.4)
    with pytest.raises(CodecError):
        S.SecAggMasked(1, 0, 5, {}, {"masked": np.zeros(3, np.float32)})


def test_too_many_agents_for_the_bits_are_refused():
    p = S.SecAggParams(bits=30)
    assert p.max_agents == 4
    with pytest.raises(S.SecAggError, match="exceed"):
        S.SecAggServer(
            1, [f"a{i}" for i in range(5)], S.SecAggSetup(p, bytes(16), 1), 10, now=0, stage_timeout=1, input_deadline=2
        )


# ---- the round machine with secure aggregation, in memory -----------------------------
from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.messages import TrainConfig

W0 = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(5, np.float32), "steps": np.zeros(1, np.int64)}


def secure_config(**kw) -> R.RoundConfig:
    base = dict(rounds=2, min_agents=4, expected_agents=4, min_updates=2, secure=S.SecAggParams(clip=1.0, bits=16))
    base.update(kw)
    return R.RoundConfig(**base)


def run_secure_federation(n=4, kill=None, samples=None, verify=None, **config):
    """Coordinator machine and n agents exchanging every message in memory; ``kill``
    = (agent, stage) stops an agent before it sends what that stage asks of it."""
    samples = samples or {f"a{i}": 10 * (i + 1) for i in range(n)}
    m = R.RoundMachine(secure_config(min_agents=n, expected_agents=n, **config), W0, verify_statement=verify)
    agents = {a: S.SecAggAgent(a, random_bytes=det_bytes(i)) for i, a in enumerate(samples)}
    offsets = {a: 0.01 * (i + 1) for i, a in enumerate(samples)}
    dead: set[str] = set()
    log: list = []
    pending_training: list[tuple[str, int]] = []
    seen_by_coordinator: list[str] = []

    def deliver(cmds, now):
        for c in cmds:
            log.append(c)
            if isinstance(c, R.StartRound):
                for a, ag in agents.items():
                    if a in dead:
                        continue
                    to_coord(a, ag.on_round_start(c.round, c.selected, c.secagg), now)
                    if a in c.selected:
                        pending_training.append((a, c.round))
                deliver(c.secagg_first, now)  # (the rosters, when the keys came ahead)
            elif isinstance(c, R.SendSecAgg) and c.to not in dead:
                to_coord(c.to, agents[c.to].on_message(c.message), now)

    def to_coord(a, msgs, now):
        for msg in msgs:
            stage = {"secagg_masked": "input", "secagg_reveal": "unmask"}.get(msg.kind)
            if kill and kill[0] == a and stage == kill[1]:
                dead.add(a)
                deliver(m.handle(R.AgentOffline(a), now), now)
                return
            seen_by_coordinator.append(msg.kind)
            deliver(m.handle(R.SecAggReceived(a, msg), now), now)

    for a, ns in samples.items():
        deliver(m.handle(R.AgentOnline(a, ns), 0.0), 0.0)
    now = 1.0
    while pending_training:
        a, rnd = pending_training.pop(0)
        if a in dead:
            continue
        _, base = S.flatten(m.weights) if m.round == rnd else (None, None)
        if base is None:
            continue
        delta = np.full(base.shape, offsets[a])
        to_coord(
            a,
            agents[a].on_trained(
                rnd, delta, base_version=m.model_version, num_samples=samples[a], metrics={"loss": offsets[a]}
            ),
            now,
        )
        now += 1.0
    return m, log, seen_by_coordinator, samples, offsets


def test_secure_rounds_through_the_round_machine():
    # plain FedAvg's server step: the model after two rounds is twice the mean offset
    m, log, seen, samples, offsets = run_secure_federation(server_momentum=0)
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert [a.round for a in aggs] == [1, 2] and m.phase is R.Phase.DONE
    p = m.config.secure
    w = {a: samples[a] / max(samples.values()) for a in samples}
    expected = sum(w[a] * offsets[a] for a in w) / sum(w.values())
    bound = len(w) * p.step / 2 / sum(w.values())
    assert np.abs(m.weights["w"] - 2 * expected).max() <= 2 * bound + 1e-6
    assert m.weights["steps"].dtype == np.int64 and m.weights["steps"][0] == 0  # not a float: kept
    assert set(seen) == {"secagg_keys", "secagg_shares", "secagg_masked", "secagg_signature", "secagg_reveal"}
    starts = [c for c in log if isinstance(c, R.StartRound)]
    assert all(s.secagg is not None and not s.train.stream for s in starts)
    # Round 2's keys came with round 1's masked inputs: its rosters go with its start.
    assert [(s.secagg.ahead, s.secagg.next_round, len(s.secagg_first)) for s in starts] == [(False, 2, 0), (True, 0, 4)]
    assert m.aggregated_ahead


def test_secure_rounds_take_the_server_momentum_step():
    """The unmasked mean is the aggregate the server optimizer steps from: each round's
    agents move the model by the same mean d, so with momentum β the model is d after
    round 1 and d + (1 + β)·d after round 2, and the velocity (1 + β)·d."""
    beta = 0.5
    m, log, _, samples, offsets = run_secure_federation(server_momentum=beta)
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert [a.round for a in aggs] == [1, 2]
    p = m.config.secure
    w = {a: samples[a] / max(samples.values()) for a in samples}
    d = sum(w[a] * offsets[a] for a in w) / sum(w.values())
    bound = len(w) * p.step / 2 / sum(w.values())
    assert np.abs(aggs[0].weights["w"] - d).max() <= bound + 1e-6
    assert np.abs(m.weights["w"] - (2 + beta) * d).max() <= 3 * bound + 1e-6
    assert np.abs(aggs[1].velocity["w"] - (1 + beta) * d).max() <= 2 * bound + 1e-6
    assert "steps" not in aggs[1].velocity and m.weights["steps"].dtype == np.int64


def test_secure_round_survives_an_agent_killed_before_its_input():
    m, log, _, samples, offsets = run_secure_federation(n=5, kill=("a2", "input"))
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert aggs and aggs[0].participants == ("a0", "a1", "a3", "a4")


def test_secure_round_survives_an_agent_killed_after_its_input():
    m, log, _, samples, offsets = run_secure_federation(n=5, kill=("a2", "unmask"))
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert aggs and aggs[0].participants == ("a0", "a1", "a2", "a3", "a4")


def test_round_machine_drops_a_survivor_whose_list_signature_fails():
    checked: list[str] = []

    def verify(name, stmt, cert, sig):
        checked.append(name)
        if name == "a2" and S.LIST_DOMAIN in stmt:  # its keys are fine, its list signature not
            raise S.SecAggError("not signed by a2")

    m, log, _, samples, offsets = run_secure_federation(n=5, verify=verify)
    aggs = [c for c in log if isinstance(c, R.RoundAggregated)]
    assert [a.round for a in aggs] == [1, 2]
    assert aggs[-1].participants == ("a0", "a1", "a2", "a3", "a4")  # a2's input is on the signed list
    assert sorted(set(checked)) == ["a0", "a1", "a2", "a3", "a4"]
    bad = [c for c in log if isinstance(c, R.Rejected) and c.reason == "list_signature"]
    assert [(c.sender, c.round) for c in bad] == [("a2", 1), ("a2", 2)] and "not signed by a2" in bad[0].detail
    assert m.secure_result is not None and m.secure_result.bad_signatures == {"a2": "not signed by a2"}
    asks = [c for c in log if isinstance(c, R.SendSecAgg) and isinstance(c.message, S.SecAggUnmask)]
    assert asks and all(c.to != "a2" and "a2" not in c.message.signatures for c in asks)


def test_plain_updates_are_refused_in_a_secure_federation():
    m = R.RoundMachine(secure_config(), W0)
    for a in ("a0", "a1", "a2", "a3"):
        m.handle(R.AgentOnline(a, 1), 0.0)
    out = m.handle(R.UpdateReceived("a0", 1, 0, 1, W0, {}), 1.0)
    assert [c.reason for c in out if isinstance(c, R.Rejected)] == ["secure"]


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(strategy=Strategy("median")), "reads every update"),
        (dict(strategy=Strategy("trimmed_mean")), "reads every update"),
        (dict(strategy=Strategy("fedavg", clip_norm=1.0)), "hides each update's norm"),
        (dict(max_norm=5.0), "hides each update's norm"),
        (dict(strategy=Strategy("drop_above", "speed", 1.0)), "weighs or drops"),
        (dict(train=TrainConfig(compression="topk")), "different supports"),
    ],
)
def test_impossible_combinations_are_refused_at_start(kw, words):
    with pytest.raises(ValueError, match=words):
        secure_config(**kw)


@pytest.mark.parametrize(
    "rounds, extra, words",
    [
        ({"aggregation": "median", "byzantine": 0}, "", "reads every update"),
        ({}, "[transfer]\nstream_updates = true\n", "stream_updates = true"),
        ({}, '[transfer]\ncompression = "int8"\n', "cannot be combined with secure aggregation"),
        ({"round_timeout": 30.0, "secure_stage_timeout": 20.0}, "", "a third of round_timeout"),
    ],
)
def test_coordinator_config_refuses_what_cannot_work(tmp_path, rounds, extra, words):
    from fedagent.config import TlsConfig, load, render
    from fedagent.coordinator.fedavg import round_config
    from fedagent.errors import ConfigError

    tls = TlsConfig(tmp_path / "ca.crt", tmp_path / "c.crt", tmp_path / "c.key")
    text = render(
        node_id="coordinator",
        federation="f",
        tls=tls,
        state_dir=tmp_path,
        broker="mqtts://127.0.0.1:1",
        rounds={"secure_aggregation": True, **rounds},
    )
    path = tmp_path / "c.toml"
    path.write_text(text + extra)
    with pytest.raises(ConfigError, match=words):
        round_config(load(path, "coordinator"))


def test_secure_rounds_with_distributed_dp_are_charged_and_weigh_equally():
    from fedagent.protocols.dp import DPConfig

    dp = DPConfig(mode="distributed", noise_multiplier=1.0, clip_norm=1.0)
    m = R.RoundMachine(secure_config(dp=dp), W0)
    starts = [c for a in ("a0", "a1", "a2", "a3") for c in m.handle(R.AgentOnline(a, 10 * (len(a) + ord(a[1]))), 0.0)]
    (start,) = [c for c in starts if isinstance(c, R.StartRound)]
    assert start.secagg is not None and start.secagg.max_weight == 1  # equal weights, as DP-FedAvg
    assert start.train.dp_clip == 1.0 and start.train.dp_noise_std > 0  # each agent's share of the noise
    agents = {a: S.SecAggAgent(a, random_bytes=det_bytes(i)) for i, a in enumerate(start.selected)}
    out: list = []
    pending = [(a, agents[a].on_round_start(1, start.selected, start.secagg)) for a in agents]
    for a in agents:
        pending.append((a, agents[a].on_trained(1, np.full(25, 0.01), base_version=0, num_samples=5, metrics={})))
    while pending:
        a, msgs = pending.pop(0)
        for msg in msgs:
            for c in m.handle(R.SecAggReceived(a, msg), 1.0):
                out.append(c)
                if isinstance(c, R.SendSecAgg):
                    pending.append((c.to, agents[c.to].on_message(c.message)))
    (agg,) = [c for c in out if isinstance(c, R.RoundAggregated)]
    assert agg.privacy is not None and agg.privacy["epsilon"] > 0
    assert set(agg.weights_used.values()) == {0.25}


@pytest.mark.parametrize("kw", [dict(mode="central"), dict(mode="central", adaptive=True)])
def test_secure_aggregation_refuses_dp_that_clips_at_the_coordinator(kw):
    from fedagent.protocols.dp import DPConfig

    with pytest.raises(ValueError, match="in mode 'distributed' only"):
        secure_config(dp=DPConfig(noise_multiplier=1.0, clip_norm=1.0, **kw))
