"""A test-only task factory whose agent runs an altered secure-aggregation client: the
attack it makes is read, at each step it alters, from the file named by the task option
``attack_file`` (so one process can switch attacks while the federation runs):

* ``none`` (or no file): honest;
* ``bad_shares``: every share it reveals at unmasking has one bit flipped;
* ``bad_dealing``: the shares it seals for its neighbours are of another self-mask seed
  than the one it commits to (and masks with);
* ``bad_boxes``: the share boxes it sends hold random bytes;
* ``out_of_range``: +50·N(0,1) per coordinate added to its quantised update after the
  clip, so its masked input lies far outside the quantisation range.

Each step it could alter is logged, as ``<round> <attack>`` lines, in the file named by
``attack_file`` with ``.steps`` added: which attack a round's outcome may reflect does
not follow from when the file changed (a round under way at a switch has steps made
under the attack before).

The task option ``samples`` makes it claim that many training samples throughout.

Reachable only as ``task = { name = "secagg_mallory_task:make" }`` with this directory
on ``PYTHONPATH`` (see tests/daemons/test_secagg_members_net.py): it changes the
secure-aggregation client of the agent process that loads it, and nothing in the
installed package can.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedagent.protocols import secagg as S
from fedagent.tasks.digits import DigitsTask
from fedagent.tasks.digits import make as make_digits

_honest_unmask = S.SecAggClient.on_unmask
_honest_roster = S.SecAggClient.on_roster
_honest_input = S.SecAggClient.masked_input
_attack_file: Path | None = None


def attack(client: S.SecAggClient) -> str:
    """The attack of this step of ``client``'s round, logged before the step is sent."""
    try:
        name = _attack_file.read_text().strip() if _attack_file is not None else "none"
    except FileNotFoundError:
        name = "none"
    if _attack_file is not None:
        with steps_file(_attack_file).open("a") as f:
            f.write(f"{client.round} {name or 'none'}\n")
    return name


def steps_file(attack_file: Path) -> Path:
    return attack_file.with_name(attack_file.name + ".steps")


def _flip(share: bytes) -> bytes:
    return share[:-1] + bytes([share[-1] ^ 1])


def _unmask(self: S.SecAggClient, msg: S.SecAggUnmask) -> S.SecAggReveal:
    r = _honest_unmask(self, msg)
    if attack(self) != "bad_shares":
        return r
    return S.SecAggReveal(
        r.round, {o: _flip(x) for o, x in r.b_shares.items()}, {o: _flip(x) for o, x in r.sk_shares.items()}, r.refused
    )


def _roster(self: S.SecAggClient, msg: S.SecAggRoster) -> S.SecAggShares:
    name = attack(self)
    if name == "bad_boxes":
        out = _honest_roster(self, msg)
        return S.SecAggShares(out.round, {k: os.urandom(len(v)) for k, v in out.boxes.items()}, out.b_digest)
    if name != "bad_dealing":
        return _honest_roster(self, msg)
    seed = self._b
    self._b = hashlib.sha256(seed).digest()  # shares of another seed ...
    out = _honest_roster(self, msg)
    self._b = seed  # ... and the commitment to (and masks of) the real one
    return S.SecAggShares(out.round, out.boxes, hashlib.sha256(seed).digest())


def _input(self: S.SecAggClient, delta: Any, num_samples: int) -> np.ndarray:
    y = _honest_input(self, delta, num_samples)
    if attack(self) == "out_of_range":
        noise = np.random.default_rng().normal(0.0, 50.0, y.size) / self.params.step
        y += np.rint(noise).astype(np.int64).astype(np.uint32)  # wraps mod 2^32, as the sum does
    return y


def make(options: dict[str, Any]) -> DigitsTask:
    global _attack_file
    opts = dict(options)
    _attack_file = Path(opts.pop("attack_file"))
    S.SecAggClient.on_unmask = _unmask
    S.SecAggClient.on_roster = _roster
    S.SecAggClient.masked_input = _input
    claim = opts.pop("samples", None)
    task = make_digits(opts)
    if claim is not None:
        # its presence and every update claim this many samples
        task.num_samples = lambda: int(claim)
    return task
