"""The intake of streamed updates of the FedAvg round machine, and the replays that
take a failed or over-bound update back out of the round's sums (the package's docstring
says what they guarantee).

:class:`StreamedUpdates` is a mixin of :class:`~fedagent.protocols.rounds.machine.RoundMachine`,
not a collaborator it owns: a header is judged by the round's state (its number, the
selection, who answered, the base version), and a part or an end changes it (the running
sums, who the round still waits for, the influence bounds, the bench), so a collaborator
would hold most of the machine. What it reads of the machine and calls on it is declared
at the top of the class, for the type checker and the reader; what it owns (the streams
in flight, the ones refused at their header, the updates to replay) it sets up and resets
itself."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedagent.protocols.aggregation import Plan, StrategyAggregator, UpdateRejected
from fedagent.protocols.dp import DPAggregator
from fedagent.protocols.rounds.bounds import Bench, Influence, Replay, part_sq_distance, part_sq_norm_change
from fedagent.protocols.rounds.config import RoundConfig
from fedagent.protocols.rounds.events import Command, Phase, Refold, Refolded, Rejected, Weights
from fedagent.protocols.streaming import UpdateEnd, UpdateHead, UpdatePart


@dataclass(slots=True)
class Inflight:
    """A streamed update being folded: what it weighs and what was seen of it."""

    tid: str
    head: UpdateHead
    plan: Plan
    sq_norm: float  # of the update's weights (max_norm)
    samples: int = 0  # the weight it carries (num_samples, capped)
    dsq: float = 0.0  # squared distance from the global model so far (the norm bound)
    folded: int = 0  # values folded at the plan's weight (a prefix of the stream)
    held: bool = False  # past the bound (or warming up): the rest waits for a replay
    last_at: float = 0.0  # when its last part (or its header) came


class StreamedUpdates:
    """Streamed updates (``UpdateHead``, parts, ``UpdateEnd``) folded into the round's
    sums as they come, and the replays (:class:`Refold`) at the round's end."""

    # -- what it reads of the round machine, and calls on it ---------------------------
    config: RoundConfig
    weights: Weights
    phase: Phase
    round: int
    model_version: int
    online: dict[str, int]
    selected: tuple[str, ...]
    received: dict[str, tuple[int, dict[str, float]]]
    departing: set[str]
    replays: bool
    influence: Influence
    bench: Bench
    _outstanding: set[str]
    _acc: StrategyAggregator | DPAggregator | None

    if TYPE_CHECKING:

        def _admit(self, sender: str, round_: int, base_version: int, now: float) -> list[Command] | None: ...

        def _counted_out(
            self, sender: str, refusal: Rejected | None = None, now: float | None = None
        ) -> list[Command]: ...

        def _maybe_finish(self, now: float) -> list[Command]: ...

        def _abandon(self, reason: str, now: float, *, at_once: bool = False) -> list[Command]: ...

    # -- what it owns -------------------------------------------------------------------
    def _init_intake(self) -> None:
        self.inflight: dict[str, Inflight] = {}  # sender -> its streamed update in progress
        self.ignored: set[tuple[str, str]] = set()  # (sender, tid) of streams refused at their header
        self._replay: dict[str, Replay] = {}  # sender -> its update to replay at the round's end
        self._replaying = False  # a Refold is out; its Refolded ends it
        self._ref_sq = 0.0  # squared norm of the global model (norm bound of deltas)

    def _open_intake(self) -> None:
        """A round opens: nothing of it is in flight or to replay."""
        self.inflight = {}
        self.ignored = set()
        self._replay = {}
        self._replaying = False
        if self.config.max_norm is not None:
            self._ref_sq = sum(
                float(np.square(w, dtype=np.float64).sum()) for w in self.weights.values() if w.dtype.kind == "f"
            )

    def _close_intake(self) -> None:
        """The round ended: its streams and replays with it (the streams refused at their
        header stay ignored until their end comes)."""
        self.inflight = {}
        self._replay = {}
        self._replaying = False

    # -- streamed updates ----------------------------------------------------------------
    def _on_head(self, ev: UpdateHead, now: float) -> list[Command]:
        def reject(reason: str, detail: str) -> list[Command]:
            self.ignored.add((ev.sender, ev.tid))
            return [Rejected(ev.sender, ev.round, reason, detail)]

        def refuse(reason: str, detail: str) -> list[Command]:
            self.ignored.add((ev.sender, ev.tid))
            return self._counted_out(ev.sender, Rejected(ev.sender, ev.round, reason, detail), now)

        if self.config.secure is not None:
            self.ignored.add((ev.sender, ev.tid))
            # Not ``now``: a secure round ends by its own stages, never by a plain update.
            return self._counted_out(
                ev.sender,
                Rejected(
                    ev.sender,
                    ev.round,
                    "secure",
                    "plain update in a federation with secure aggregation (never aggregated)",
                ),
            )
        instead = self._admit(ev.sender, ev.round, ev.base_version, now)
        if instead is not None:
            self.ignored.add((ev.sender, ev.tid))  # its parts are not read
            return instead
        names = {t.name: t for t in ev.tensors}
        if names.keys() != self.weights.keys():
            missing = sorted(set(self.weights) - set(names))
            extra = sorted(set(names) - set(self.weights))
            return refuse("names", f"missing {missing[:3]}, unexpected {extra[:3]}")
        for name, ref in self.weights.items():
            t = names[name]
            if t.shape != ref.shape:
                return refuse("shape", f"{name}: {t.shape} != {ref.shape}")
            if t.dtype != ref.dtype.name:
                return refuse("dtype", f"{name}: {t.dtype} != {ref.dtype}")
        assert self._acc is not None
        samples = self.influence.samples(ev.sender, ev.num_samples)
        try:
            plan = self._acc.plan(samples, ev.metrics)
        except UpdateRejected as exc:
            return refuse(exc.reason, exc.detail)
        if plan.dropped is not None:
            # Counted as dropped, never folded: its parts are ignored.
            self._acc.dropped[ev.sender] = plan.dropped
            self.ignored.add((ev.sender, ev.tid))
            self.received[ev.sender] = (samples, dict(ev.metrics))
            self._outstanding.discard(ev.sender)
            if ev.leaving:
                self.departing.add(ev.sender)
            return self._maybe_finish(now)
        fl = Inflight(ev.tid, ev, plan, self._ref_sq, samples, last_at=now)
        # While the bound warms up nothing is folded before the round's end.
        fl.held = self.influence.bounds_norms and self.influence.bound is None
        self.inflight[ev.sender] = fl
        if (
            self.replays
            and len(self.selected) > 1
            and len(self.inflight) == 1
            and not any(a in self.online and a != ev.sender for a in self._outstanding)
        ):
            # The only update still owed starts after all the others are in: its stall
            # clock starts now, or a stream that stops after a few parts would hold the
            # round to its deadline (nothing else is left to look at it).
            return self._maybe_finish(now)
        return []

    def _on_part(self, ev: UpdatePart, now: float) -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            return []  # refused at its header, or from an ended round
        fl.last_at = now
        vals = ev.values
        if vals.dtype.kind == "f" and not np.isfinite(vals).all():
            return self._on_end(
                UpdateEnd(ev.sender, ev.tid, False, f"{ev.name} contains NaN or Inf"), now, reason="non-finite"
            )
        floating = self.weights[ev.name].dtype.kind == "f"
        # The bound covers floating tensors only, as check_update's does.
        if self.config.max_norm is not None and floating:
            fl.sq_norm += part_sq_norm_change(self.weights[ev.name], ev)
        if self.influence.bounds_norms and floating:
            fl.dsq += part_sq_distance(self.weights[ev.name], ev)
            bound = self.influence.bound
            if not fl.held and (bound is None or fl.dsq > bound * bound):
                # Past the bound: its distance is known only at its end, so the rest is not
                # folded; the whole update is replayed scaled to the bound once it has ended.
                fl.held = True
        if fl.held:
            return []
        assert self._acc is not None
        self._acc.fold(fl.plan, ev.name, ev.start, vals, ev.indices, delta=ev.delta)
        fl.folded += vals.size
        return []

    def _on_end(self, ev: UpdateEnd, now: float, *, reason: str = "transfer") -> list[Command]:
        fl = self.inflight.get(ev.sender)
        if fl is None or fl.tid != ev.tid:
            if (ev.sender, ev.tid) in self.ignored:
                self.ignored.discard((ev.sender, ev.tid))
                return []
            if not ev.ok and self.phase is Phase.TRAINING and ev.sender not in self.inflight:
                # Broken off before its header was read (the messenger's stream intake
                # refused it: counted and logged there): the update it carried will not come.
                return self._counted_out(ev.sender, now=now)
            return []
        del self.inflight[ev.sender]
        head = fl.head
        if ev.ok and self.config.max_norm is not None and fl.sq_norm > self.config.max_norm**2:
            ev, reason = (
                UpdateEnd(
                    ev.sender,
                    ev.tid,
                    False,
                    f"norm {max(fl.sq_norm, 0.0) ** 0.5:.3g} above bound {self.config.max_norm:.3g}",
                ),
                "norm",
            )
        if not ev.ok:
            return self._failed(fl, ev.sender, reason, ev.reason, now)
        norm = math.sqrt(max(fl.dsq, 0.0))
        if fl.held:
            bound = self.influence.bound
            self._replay[ev.sender] = Replay(
                fl.tid,
                fl.plan,
                fl.folded,
                None if bound is None else self.influence.scale(norm, bound),
                norm,
                True,
                fl.samples,
                dict(head.metrics),
                head.leaving,
            )
            self._outstanding.discard(ev.sender)
            return self._maybe_finish(now)
        assert self._acc is not None
        self._acc.commit(ev.sender, fl.plan)
        if self.influence.bounds_norms:
            self.influence.accepted(ev.sender, norm, self.influence.bound)
        self.bench.forgive(ev.sender)
        self.received[ev.sender] = (fl.samples, dict(head.metrics))
        self._outstanding.discard(ev.sender)
        if head.leaving:
            self.departing.add(ev.sender)
        return self._maybe_finish(now)

    def _failed(self, fl: Inflight, sender: str, reason: str, detail: str, now: float) -> list[Command]:
        """A streamed update refused after its header: taken out if parts of it were folded
        (a replay at the round's end), or the round spoilt when it cannot be."""
        # Not ``now`` to count it out: the round's end is looked at below, also when it
        # was no longer waited for (the stream's end alone can let it finish).
        out = self._counted_out(sender, Rejected(sender, fl.head.round, reason, detail))
        if not fl.folded:
            return out + self._maybe_finish(now)
        rounds = self.bench.offend(sender, self.round)
        if self.replays:
            self._replay[sender] = Replay(fl.tid, fl.plan, fl.folded, 0.0, count=False)
            return out + self._maybe_finish(now)
        # Parts of it are in the sums and cannot be taken out: the round is spoilt.
        detail = (
            f"update from {sender} failed after parts of it were aggregated ({detail}); "
            f"round restarted without it (it sits out {rounds} round{'s' if rounds > 1 else ''})"
        )
        return out + self._abandon(detail, now, at_once=True)

    def _drop_inflight(self, now: float, stalled: Callable[[Inflight], bool] | None = None) -> list[Command]:
        """Updates still arriving are dropped: all of them at the deadline, or those
        ``stalled`` says have stopped (what was folded of them is taken out at the round's
        end, and counts as an offence)."""
        out: list[Command] = []
        for sender, fl in list(self.inflight.items()):
            if stalled is not None and not stalled(fl):
                continue
            del self.inflight[sender]
            self.ignored.add((sender, fl.tid))
            if stalled is None:
                detail = "update still arriving at the round's deadline"
            else:
                detail = f"no part of its update for {now - fl.last_at:.1f}s while every other update was in"
            # Not ``now``: this is the round's end being decided.
            out += self._counted_out(
                sender, Rejected(sender, fl.head.round, "deadline" if stalled is None else "stalled", detail)
            )
            if fl.folded:
                self.bench.offend(sender, self.round)
                self._replay[sender] = Replay(fl.tid, fl.plan, fl.folded, 0.0, count=False)
        return out

    # -- replays -----------------------------------------------------------------------
    def _refold(self) -> list[Command]:
        """Every update of the round is in: the held ones get their scale from the round's
        bound, and the caller is asked to replay them (and those to take out)."""
        if self.influence.bounds_norms:
            pending = [r.norm for r in self._replay.values() if r.count and r.scale is None]
            # Decided now for the whole round (while warming up, from its own updates).
            bound = self.influence.bound = self.influence.final_bound(pending)
            for r in self._replay.values():
                if r.scale is None:
                    r.scale = self.influence.scale(r.norm, bound)
        self._replaying = True
        return [
            Refold(
                self.round,
                tuple((a, r.tid) for a, r in sorted(self._replay.items())),
                frozenset(a for a, r in self._replay.items() if r.count),
            )
        ]

    def refold(self, sender: str, part: UpdatePart) -> None:
        """One part of ``sender``'s update, replayed (in the order its parts came) for a
        :class:`Refold`: what was folded of it at full weight is taken out, and the update
        folded at its scale. Parts of other senders, or past its end, are ignored."""
        r = self._replay.get(sender)
        if r is None or not self._replaying or self._acc is None or (r.tid is not None and part.tid != r.tid):
            return
        assert isinstance(self._acc, StrategyAggregator)
        r.fold(self._acc, part, delta=part.delta)

    def _on_refolded(self, ev: Refolded, now: float) -> list[Command]:
        if not self._replaying or ev.round != self.round or self.phase is not Phase.TRAINING:
            return []
        self._replaying = False
        replays, self._replay = self._replay, {}
        assert self._acc is not None
        out: list[Command] = []
        bound = self.influence.bound
        for sender, r in sorted(replays.items()):
            if r.done < r.prefix or (r.count and sender in ev.incomplete and r.done):
                # Part of it is in the sums and could not be taken out: the round is spoilt.
                return out + self._abandon(
                    f"the update of {sender} could not be read back to take it out of the sums; round restarted",
                    now,
                    at_once=True,
                )
            if not r.count:
                continue
            if sender in ev.incomplete:
                out.append(
                    Rejected(sender, self.round, "journal", "its update could not be read back from the journal")
                )
                continue
            assert isinstance(self._acc, StrategyAggregator)
            self._acc.commit(sender, r.plan)
            if self.influence.bounds_norms:
                self.influence.accepted(sender, r.norm, bound)
            self.bench.forgive(sender)
            self.received[sender] = (r.samples, dict(r.metrics))
            if r.leaving:
                self.departing.add(sender)
        return out + self._maybe_finish(now)
