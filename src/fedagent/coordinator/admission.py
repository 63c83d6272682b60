"""Which agents the coordinator takes into its rounds, decided from their presence.

An agent is refused when what it announces cannot make a useful update: its model
differs from the coordinator's (the digests of the two fingerprints differ; see
:mod:`fedagent.protocols.fingerprint`), or it has no training samples (its update
would weigh nothing; a misspelt data option in ``[task]`` gives exactly that). A refused
agent is never counted online, so no round selects it or waits for it, and ``status``
lists it with the reason. An agent of this release refuses itself in both cases and
exits 78; the coordinator's check is what holds against any other.

A model refusal is answered with the coordinator's fingerprint
(:class:`~fedagent.protocols.messages.ModelCheck`), and the agent sends its own: each side
then names the first tensor that differs, with both views of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fedagent.protocols.fingerprint import Fingerprint, first_difference
from fedagent.protocols.messages import ModelCheck, Presence


@dataclass(slots=True)
class Refusal:
    reason: str  # "model" or "samples"
    detail: str
    digest: str = ""  # the agent's model digest (a model refusal)
    since: float = field(default_factory=time.time)

    def status(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "since": self.since}


class Admission:
    """The coordinator's refusals, one per agent, kept until the agent announces
    something acceptable (a refused agent that stops stays listed)."""

    def __init__(self, fingerprint: Fingerprint | None) -> None:
        self.fingerprint = fingerprint
        self.refused: dict[str, Refusal] = {}

    @property
    def digest(self) -> str:
        return self.fingerprint.digest if self.fingerprint is not None else ""

    def on_presence(self, agent: str, msg: Presence) -> tuple[Refusal | None, ModelCheck | None]:
        """The agent's refusal after this presence (None: taken) and, for a model newly
        found to differ, the fingerprint to send it."""
        if not msg.online:
            return self.refused.get(agent), None
        if self.fingerprint is not None and msg.model and msg.model != self.digest:
            known = self.refused.get(agent)
            if known is not None and known.digest == msg.model:
                return known, None
            refusal = Refusal(
                "model",
                f"its model ({msg.model}) differs from the coordinator's ({self.digest}); which tensor: once the "
                "agent's fingerprint is in",
                msg.model,
            )
            self.refused[agent] = refusal
            text = f"the agent's model differs from the coordinator's ({msg.model} vs {self.digest})"
            return refusal, ModelCheck.of(self.fingerprint, refused=text)
        if msg.num_samples == 0:
            known = self.refused.get(agent)
            if known is not None and known.reason == "samples":
                return known, None
            self.refused[agent] = Refusal(
                "samples", "no training samples: its update would weigh nothing (check its [task] options)"
            )
            return self.refused[agent], None
        self.refused.pop(agent, None)
        return None, None

    def on_check(self, agent: str, check: ModelCheck) -> str:
        """The agent's fingerprint, sent because the digests differ: the first tensor that
        differs, recorded as the reason of its refusal ("" when they do not differ)."""
        if self.fingerprint is None:
            return ""
        diff = first_difference(self.fingerprint, check.fingerprint, here="on the coordinator", there=f"on {agent}")
        if diff:
            self.refused[agent] = Refusal("model", f"its model differs from the coordinator's: {diff}", check.digest)
        return diff

    def is_refused(self, agent: str) -> bool:
        return agent in self.refused

    def status(self) -> dict[str, dict[str, Any]]:
        return {a: r.status() for a, r in sorted(self.refused.items())}
