"""Fuzz the protocol machines with hostile event sequences (malformed and out-of-order inputs).

Run (from the repository root):

    .venv/bin/python tests/fuzz_machines.py                 # 10**6 events
    .venv/bin/python tests/fuzz_machines.py --count 100000 --seed 7

Each input is one event for one of the machines, built the way the daemons build it:
a message body (valid, mutated, or random) goes through ``body_of`` (the validation
every received body passes) and, if it survives, becomes an event for

* the coordinator's :class:`~fedagent.protocols.rounds.RoundMachine` (presence,
  updates with wrong rounds, senders, versions, shapes, dtypes, NaN/Inf, huge norms,
  wake-ups), under FedAvg and under a robust aggregator with clipping;
* the agent's :class:`~fedagent.protocols.participant.Participant` (round starts,
  results, global models, training results for any round);
* the :class:`~fedagent.protocols.gossip.GossipMachine` (models with any mass, age,
  weights; acks for unknown exchanges; peers coming and going; failed sends);
* the chunk :class:`~fedagent.protocols.chunking.Reassembler`;
* the signature :class:`~fedagent.security.signing.Verifier` (random certificates and signatures).

The only exception allowed to escape is :class:`~fedagent.errors.FedagentError` (the
project's own); anything else is printed with the event and counted, and the script
exits 1. Invariants are checked after every event: the round machine's round never
goes down and its model stays finite and of the reference shapes; the gossip model
stays finite and its mass positive. Machines are rebuilt every ``--episode`` events so
that fresh and long-lived states are both explored. The test suite runs a short
Hypothesis version (tests/protocols/test_fuzz_machines.py).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import traceback
from collections import Counter

import numpy as np

np.seterr(all="ignore")  # overflow in the hostile values themselves is expected

from fuzz_codec import LIMITS, random_value

from fedagent.errors import FedagentError
from fedagent.protocols import gossip as G
from fedagent.protocols import rounds as R
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.chunking import Reassembler, split
from fedagent.protocols.codec import DTYPES, Envelope, encode
from fedagent.protocols.messages import (
    GlobalModel,
    GossipAck,
    GossipModel,
    Presence,
    RoundResult,
    RoundStart,
    TrainConfig,
    Update,
    body_of,
)
from fedagent.protocols.participant import Participant
from fedagent.protocols.participant import TrainingDone as PTrainingDone

AGENTS = ["a", "b", "c", "d", "e", "f"]
REF = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.zeros((), np.int64)}
NASTY_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, 1e300, math.nan, math.inf, -math.inf]


def random_tensor(rnd: random.Random) -> np.ndarray:
    """Mostly the right names and shapes, often wrong dtypes, shapes or values."""
    how = rnd.randrange(8)
    shape = rnd.choice([(2, 3), (3, 2), (6,), (), (0,), (2, 3, 1)])
    dtype = rnd.choice(list(DTYPES))
    if how < 4:
        shape, dtype = (2, 3), "float32"
    a = np.zeros(shape, dtype=DTYPES[dtype])
    if a.dtype.kind == "f" and a.size:
        flat = a.reshape(-1)
        for i in range(flat.size):
            flat[i] = rnd.choice(NASTY_FLOATS) if rnd.random() < 0.3 else rnd.gauss(0, 1)
    return a


def random_weights(rnd: random.Random) -> dict[str, np.ndarray]:
    w = {
        "w": random_tensor(rnd),
        "b": np.asarray(np.float32(rnd.gauss(0, 1)) * np.ones(3, np.float32)),
        "n": np.asarray(rnd.randrange(-5, 5), np.int64),
    }
    r = rnd.random()
    if r < 0.1:
        w.pop(rnd.choice(list(w)))
    elif r < 0.2:
        w["extra"] = np.zeros(1, np.float32)
    elif r < 0.3:
        w["b"] = random_tensor(rnd)
    return w


def valid_message(rnd: random.Random, kind: str, cur_round: int):
    rnd_round = rnd.choice([0, cur_round, cur_round + 1, max(0, cur_round - 1), 2**53 - 1])
    if kind == "presence":
        return Presence(
            online=rnd.random() < 0.7, role=rnd.choice(["agent", "coordinator"]), num_samples=rnd.randrange(0, 1000)
        )
    if kind == "update":
        return Update(
            rnd_round,
            rnd.randrange(0, 4),
            rnd.randrange(1, 1000),
            {"loss": rnd.random()},
            random_weights(rnd),
            leaving=rnd.random() < 0.05,
        )
    if kind == "round_start":
        return RoundStart(
            rnd_round,
            rnd.randrange(0, 4),
            tuple(rnd.sample(AGENTS, rnd.randrange(0, 4))),
            30.0,
            TrainConfig(),
            random_weights(rnd),
        )
    if kind == "round_result":
        return RoundResult(
            rnd_round, rnd.randrange(0, 4), rnd.randrange(0, 3), {"loss": 0.1}, aggregated=rnd.random() < 0.8
        )
    if kind == "model":
        return GlobalModel(rnd.randrange(0, 4), rnd_round, rnd.random() < 0.3, random_weights(rnd))
    if kind == "gossip_model":
        return GossipModel(
            f"x{rnd.randrange(20)}",
            rnd.randrange(100),
            rnd.choice([0.5, 1.0, 1e-300, 1e300, 7.0]),
            rnd.choice([0.0, 3.0, 1e300]),
            rnd.random() < 0.1,
            random_weights(rnd),
        )
    return GossipAck(f"x{rnd.randrange(20)}", rnd.random() < 0.5, rnd.choice(["", "inbox-full", "x" * 50]))


def mutate_body(rnd: random.Random, body: dict) -> dict:
    body = dict(body)
    for _ in range(rnd.randrange(0, 3)):
        op = rnd.randrange(4)
        if op == 0 and body:
            body.pop(rnd.choice(list(body)))
        elif op == 1 and body:
            body[rnd.choice(list(body))] = random_value(rnd)
        elif op == 2:
            body[rnd.choice(["x", "round", "weights", "mass"])] = random_value(rnd)
        elif op == 3 and isinstance(body.get("weights"), dict) and body["weights"]:
            t = body["weights"][rnd.choice(list(body["weights"]))]
            if not isinstance(t, dict):
                continue
            t = dict(t)
            field = rnd.choice(["dtype", "shape", "data"])
            t[field] = rnd.choice([random_value(rnd), "object", [-1, 3], [2**40, 2**40], b"\x00" * rnd.randrange(30)])
            body["weights"] = {**body["weights"], "w": t}
    return body


class Harness:
    """One set of machines, rebuilt every episode; ``step`` feeds one random event."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        robust = rnd.random() < 0.5
        strategy = (
            Strategy(
                rnd.choice(["median", "trimmed_mean", "krum"]), byzantine=1, trim=0.3, clip_norm=rnd.choice([None, 1.0])
            )
            if robust
            else Strategy("fedavg")
        )
        cfg = (
            R.RoundConfig(
                rounds=rnd.randrange(1, 6),
                min_agents=2,
                min_updates=rnd.choice([1, 2]),
                round_timeout=10.0,
                start_grace=rnd.choice([0.0, 1.0]),
                max_norm=rnd.choice([None, 50.0]),
                strategy=strategy,
            )
            if not robust
            else R.RoundConfig(
                rounds=rnd.randrange(1, 6),
                min_agents=5,
                min_updates=5,
                round_timeout=10.0,
                start_grace=0.0,
                strategy=strategy,
            )
        )
        self.rounds = R.RoundMachine(cfg, {k: v.copy() for k, v in REF.items()})
        self.participant = Participant("a", leave_after=rnd.choice([0, 0, 2]))
        screening = rnd.random() < 0.3
        gcfg = G.GossipConfig(
            period_steps=1,
            max_incoming=rnd.choice([1, 2]),
            create="mu" if screening else rnd.choice(G.CREATE_MODES),
            merge="pushsum" if screening else rnd.choice(G.MERGE_MODES),
            periods=rnd.choice([0, 5]),
            send_timeout=5.0,
            max_norm=rnd.choice([None, 100.0]),
            clip_norm=rnd.choice([None, 2.0]),
            aggregation=rnd.choice(G.AGGREGATIONS[1:]) if screening else "mean",
            byzantine=rnd.choice([0, 1]) if screening else 0,
            fanout=rnd.choice([1, 3]),
            neighbour_ttl=rnd.choice([1, 5]),
        )
        self.gossip = G.GossipMachine("a", gcfg, {k: v.copy() for k, v in REF.items()}, num_samples=3)
        self.reassembler = Reassembler(4096, 16384, 5.0)
        self.now = 0.0
        self.max_round = 0
        self.train_ids: list[int] = []
        self.participant_rounds: list[int] = []

    def _commands(self, cmds) -> None:
        for c in cmds:
            if isinstance(c, G.Train):
                self.train_ids.append(c.train_id)

    def step(self) -> None:
        rnd = self.rnd
        self.now += rnd.choice([0.0, 0.01, 1.0, 11.0])
        target = rnd.randrange(6)
        if target == 0:
            self._round_machine()
        elif target == 1:
            self._participant()
        elif target == 2:
            self._gossip()
        elif target == 3:
            self._chunk()
        else:
            self._message()
        self._check()

    def _body(self, kind: str):
        msg = valid_message(self.rnd, kind, self.rounds.round)
        body = msg.to_body()
        if self.rnd.random() < 0.5:
            body = mutate_body(self.rnd, body)
        return body_of(kind, body, self.rnd.choice(LIMITS))  # CodecError: fine

    def _message(self) -> None:
        """A body through the messenger's validation, then to whichever machine takes it."""
        kind = self.rnd.choice(
            ["presence", "update", "round_start", "round_result", "model", "gossip_model", "gossip_ack"]
        )
        msg = self._body(kind)
        sender = self.rnd.choice(AGENTS)
        if isinstance(msg, Presence):
            ev = R.AgentOnline(sender, msg.num_samples) if msg.online else R.AgentOffline(sender)
            self.rounds.handle(ev, self.now)
        elif isinstance(msg, Update):
            self.rounds.handle(
                R.UpdateReceived(
                    sender, msg.round, msg.base_version, msg.num_samples, msg.weights, msg.metrics, msg.leaving
                ),
                self.now,
            )
        elif isinstance(msg, (RoundStart, RoundResult, GlobalModel)):
            for c in self.participant.handle(msg):
                if hasattr(c, "round") and type(c).__name__ == "Train":
                    self.participant_rounds.append(c.round)
        elif isinstance(msg, GossipModel):
            self._commands(
                self.gossip.handle(
                    G.ModelReceived(
                        sender, msg.exchange_id, msg.weights, mass=msg.mass, age=msg.age, returned=msg.returned
                    ),
                    self.now,
                )
            )
        elif isinstance(msg, GossipAck):
            self._commands(
                self.gossip.handle(G.AckReceived(sender, msg.exchange_id, msg.accepted, msg.reason), self.now)
            )

    def _round_machine(self) -> None:
        rnd = self.rnd
        m = self.rounds
        choice = rnd.randrange(4)
        if choice == 0:
            m.handle(R.Wakeup(), self.now)
        elif choice == 1:
            m.handle(R.AgentOnline(rnd.choice(AGENTS), rnd.randrange(0, 100)), self.now)
        elif choice == 2:
            m.handle(R.AgentOffline(rnd.choice(AGENTS)), self.now)
        else:
            # A well-formed update for the round in progress, from a selected agent.
            sender = rnd.choice(list(m.selected) or AGENTS)
            w = {k: (v + np.float32(rnd.gauss(0, 1))).astype(v.dtype) for k, v in m.weights.items()}
            if rnd.random() < 0.3:
                w["w"] = w["w"] * np.float32(rnd.choice([1e30, -1e30, 1e-30]))
            m.handle(R.UpdateReceived(sender, m.round, m.model_version, rnd.randrange(1, 100), w, {}), self.now)

    def _participant(self) -> None:
        rnd = self.rnd
        r = rnd.choice(self.participant_rounds or [0]) + rnd.choice([0, 0, 1, -1])
        self.participant.handle(
            PTrainingDone(r, rnd.randrange(3), rnd.randrange(1, 50), {"loss": 0.1}, random_weights(rnd))
        )

    def _gossip(self) -> None:
        rnd = self.rnd
        g = self.gossip
        choice = rnd.randrange(6)
        if choice == 0:
            cmds = g.handle(G.Start(), self.now) if not g.started else g.handle(G.Wakeup(), self.now)
        elif choice == 1:
            cmds = g.handle(G.PeerUp(rnd.choice(AGENTS[1:])), self.now)
        elif choice == 2:
            cmds = g.handle(G.PeerDown(rnd.choice(AGENTS[1:])), self.now)
        elif choice == 3:
            tid = rnd.choice(self.train_ids[-3:] or [0]) + rnd.choice([0, 0, 1])
            cmds = g.handle(G.TrainingDone(tid, random_weights(rnd), rnd.choice([None, 0, 1, 5])), self.now)
        elif choice == 4:
            cmds = g.handle(G.SendFailed(f"{rnd.choice(['', 'x'])}{rnd.randrange(5)}", "test"), self.now)
        else:
            cmds = g.handle(G.Wakeup(), self.now)
        self._commands(cmds)

    def _chunk(self) -> None:
        rnd = self.rnd
        payload = rnd.randbytes(rnd.randrange(0, 3000))
        bodies = split(payload, max_chunk=rnd.choice([256, 1024, 4096]), transfer_id=f"t{rnd.randrange(8)}")
        for b in rnd.sample(bodies, rnd.randrange(1, len(bodies) + 1)):
            if rnd.random() < 0.3:
                b = mutate_body(rnd, b)
            self.reassembler.feed(rnd.choice(AGENTS), b, self.now)  # CodecError: fine
        self.reassembler.expire(self.now)

    def _check(self) -> None:
        m = self.rounds
        if m.round < self.max_round:
            raise AssertionError(f"round went down from {self.max_round} to {m.round}")
        self.max_round = m.round
        for k, v in m.weights.items():
            if v.shape != REF[k].shape or v.dtype != REF[k].dtype:
                raise AssertionError(f"global {k} became {v.dtype}{v.shape}")
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise AssertionError(f"global {k} not finite")
        g = self.gossip
        for k, v in g.model.items():
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise AssertionError(f"gossip model {k} not finite")
        if not (g.mass > 0 or g.config.merge != "pushsum" or g.config.robust or g._in_flight):
            raise AssertionError(f"gossip mass {g.mass} with nothing in flight")


def signed_frames(rnd: random.Random, verifier, identity) -> None:
    """Random mutations of a signed frame through the verifier: AuthError or accepted."""
    from fedagent.security.signing import sign

    env = Envelope(
        kind=rnd.choice(["update", "chunk", "presence"]),
        federation="fed",
        sender=identity.name,
        round=rnd.randrange(5),
        seq=rnd.randrange(2**40),
        ts=time.time(),
        body={"x": rnd.randrange(9)},
    )
    env = sign(env, identity)
    data = bytearray(encode(env))
    for _ in range(rnd.randrange(0, 3)):
        data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
    from fedagent.protocols.codec import decode

    verifier.check(decode(bytes(data)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10**6, help="events to try (default 10**6)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    ap.add_argument("--episode", type=int, default=300, help="events before the machines are rebuilt")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rnd = random.Random(seed)
    identity, verifier = _identity()
    failures: Counter[str] = Counter()
    refused = 0
    shown = 0
    start = time.monotonic()
    h = Harness(rnd)
    for n in range(args.count):
        if n % args.episode == 0:
            h = Harness(rnd)
        try:
            if identity is not None and n % 50 == 49:
                signed_frames(rnd, verifier, identity)
            else:
                h.step()
        except FedagentError:
            refused += 1
        except Exception as exc:  # the bug this script looks for
            key = f"{type(exc).__name__}: {exc}"[:200]
            failures[key] += 1
            if shown < 20:
                shown += 1
                print(f"\n!! event {n} escaped with {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=6)
            h = Harness(rnd)
        if (n + 1) % 100_000 == 0:
            print(
                f"{n + 1} events, {refused} refused with a FedagentError, {sum(failures.values())} escapes, "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
    elapsed = time.monotonic() - start
    print(
        f"seed {seed}: {args.count} events in {elapsed:.1f} s; {refused} refused with a FedagentError, "
        f"{sum(failures.values())} other exceptions or broken invariants"
    )
    for key, count in failures.most_common():
        print(f"  {count} x {key}")
    return 1 if failures else 0


def _identity():
    """A throw-away CA and node identity for the verifier part (None if unavailable)."""
    import tempfile
    from pathlib import Path

    from fedagent.security import pki
    from fedagent.security.signing import Identity

    d = Path(tempfile.mkdtemp(prefix="fuzz-pki-"))
    pki.create_ca(d, "fed")
    crt, key = pki.issue(d, d, "agent-7", "agent")
    ident = Identity.load(crt, key, d / pki.CA_CERT)
    return ident, ident.verifier(window=64)


if __name__ == "__main__":
    sys.exit(main())
