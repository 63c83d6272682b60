"""A test-only task factory whose agent, in secure rounds, signs the survivor list with
garbage and returns altered shares when asked for them (see test_secagg_badsig_net.py).

Reachable only as ``task = { name = "secagg_garbage_task:make" }`` with this directory on
``PYTHONPATH``: it changes the secure-aggregation client of the agent process that loads
it, and nothing in the installed package can.
"""

from __future__ import annotations

from typing import Any

from fedagent.protocols import secagg as S
from fedagent.tasks.digits import DigitsTask
from fedagent.tasks.digits import make as make_digits

_honest_unmask = S.SecAggClient.on_unmask


def _garbage_signature(self: S.SecAggClient, survivors: tuple[str, ...]) -> S.SecAggSignature:
    cert, _ = self._sign(S.list_statement(self.agent, self.context, survivors)) if self._sign else (b"", b"")
    return S.SecAggSignature(self.round, cert, bytes(64))  # its own certificate, a signature of nothing


def _altered(share: bytes) -> bytes:
    return share[:-1] + bytes([share[-1] ^ 1])


def _altered_unmask(self: S.SecAggClient, msg: S.SecAggUnmask) -> S.SecAggReveal:
    r = _honest_unmask(self, msg)
    return S.SecAggReveal(
        r.round,
        {o: _altered(x) for o, x in r.b_shares.items()},
        {o: _altered(x) for o, x in r.sk_shares.items()},
        r.refused,
    )


def make(options: dict[str, Any]) -> DigitsTask:
    S.SecAggClient._sign_list = _garbage_signature  # type: ignore[method-assign]
    S.SecAggClient.on_unmask = _altered_unmask  # type: ignore[method-assign]
    return make_digits(options)
