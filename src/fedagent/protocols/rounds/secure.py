"""The secure-aggregation path of FedAvg rounds, beside the round machine: a round's
:class:`~fedagent.protocols.secagg.SecAggServer` and its setup, the keys the agents
advertised for the next round (a round whose cohort all did so has no key stage), the
server's commands as the machine's, and the unmasked mean as the next model's
aggregate (:mod:`fedagent.protocols.secagg` has the protocol)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from fedagent.protocols import secagg as SA
from fedagent.protocols.dp import quantisation_range
from fedagent.protocols.messages import TrainConfig
from fedagent.protocols.rounds.config import RoundConfig
from fedagent.protocols.rounds.events import Command, Rejected, RequestWakeup, SendSecAgg

Weights = dict[str, np.ndarray]


class LateAnswers:
    """The members of the secure round that ended last (aggregated or abandoned), and
    which of them were heard from since. A round ends once enough of its members have
    answered (a threshold of shares, or a withdrawal), so the others' answers arriving
    after it are the protocol working, not a fault."""

    def __init__(self) -> None:
        self.round = 0
        self.members: frozenset[str] = frozenset()
        self.heard: set[str] = set()

    def ended(self, server: SA.SecAggServer) -> None:
        self.round, self.members, self.heard = server.round, frozenset(server.selected), set()

    def late(self, sender: str, round_: object) -> bool:
        """Whether a message is an honest straggler's: the first one a member sends for
        the round that ended, to be dropped without being counted as refused (more than
        one a member is refused as stale)."""
        if round_ != self.round or sender not in self.members or sender in self.heard:
            return False
        self.heard.add(sender)
        return True


class SecureRounds:
    """The secure rounds of one round machine. ``verify``: checks an agent's signature
    of a statement (the survivor list), raising if it is not valid; without it
    signatures are passed on unchecked (the agents check them in any case)."""

    def __init__(self, config: RoundConfig, verify: SA.KeyVerifier | None = None) -> None:
        self.config = config
        self.verify = verify
        self.server: SA.SecAggServer | None = None  # the secure round in progress
        self.result: SA.Unmasked | None = None  # of the last secure round aggregated
        self.params: SA.SecAggParams | None = None  # of the secure round in progress (or last)
        # Keys the last secure round's survivors advertised for the round after it.
        self.ahead_keys: dict[str, SA.SecAggKeys] = {}
        self.ahead_round = 0
        self.ahead = False  # the secure round in progress had no key stage
        self.aggregated_ahead = False  # ... and the last one aggregated
        self.late_answers = LateAnswers()  # of the secure round that ended last

    def open(
        self,
        round_: int,
        agents: tuple[str, ...],
        online: Mapping[str, int],
        weights: Weights,
        train: TrainConfig,
        *,
        now: float,
        last: bool,
        seed: bytes,
        admit: Callable[[int], str],
        max_weight: Callable[[tuple[str, ...], Mapping[str, int]], int],
        dp_weight: int = 1,
    ) -> tuple[SA.SecAggSetup, tuple[SendSecAgg, ...], float]:
        """A secure round's setup, the messages to send before its model (the rosters,
        when the keys were advertised ahead) and when to be woken. ``online``: the
        samples each agent announced; ``last``: no round follows (no keys ahead);
        ``admit``: asked before a sum of that many inputs is unmasked under distributed
        DP (a reason abandons the round); ``max_weight``: the round's W from the counts
        its agents announced (bounded against their median). ``dp_weight``: W when the
        round carries distributed DP's noise (``train.dp_clip``): 1, every agent's update
        weighing 1; across tiers the cohort, a site's mean weighing its agents."""
        cfg = self.config
        assert cfg.secure is not None
        # DP-FedAvg weighs every update equally (its noise is calibrated so): W = 1. The
        # noise may be the upstream tier's (a site round passes the hub's calibration
        # down): the round is private whenever its agents noise, accounted here or not.
        clip = train.dp_clip
        top = dp_weight if clip is not None else max_weight(agents, online)
        params = cfg.secure
        admit_sum = None
        size = SA.layout_size(weights)
        if clip is not None:
            # Distributed DP: the noised update must fit the quantisation range whole
            # (a coordinate cut there would no longer carry its Gaussian noise).
            wide = quantisation_range(clip, train.dp_noise_std, size, len(agents))
            if train.dp_count_std:
                # ... and so must the noised clipped-or-not bit, one value more
                size += 1
                wide = max(wide, quantisation_range(0.5, train.dp_count_std, size, len(agents)))
            params = replace(params, clip=min(max(params.clip, wide), SA.MAX_CLIP))
            # Only the tier that accounts checks the budget before unmasking.
            admit_sum = admit if cfg.dp is not None else None
        self.params = params
        # Every selected agent advertised keys for this round with its masked input
        # of the last one: no key stage. Anyone else in the cohort: a key stage for all.
        ahead = self.ahead_round == round_ and set(agents) <= set(self.ahead_keys)
        keys, self.ahead_keys, self.ahead_round = self.ahead_keys, {}, 0
        self.ahead = ahead
        setup = SA.SecAggSetup(params, seed, top, next_round=0 if last else round_ + 1, ahead=ahead)
        self.server = SA.SecAggServer(
            round_,
            agents,
            setup,
            size,
            now=now,
            stage_timeout=cfg.stage_timeout,
            # after the inputs: the survivor list's signatures, then the shares
            input_deadline=now + cfg.round_timeout - 2 * cfg.stage_timeout,
            online=set(online),
            admit=admit_sum,
            verify=self.verify,
            ahead=keys if ahead else None,
        )
        first = tuple(SendSecAgg(c.to, c.message) for c in self.server.start() if isinstance(c, SA.Send))
        return setup, first, self.server.deadline

    def end(self) -> None:
        """The secure round in progress (if any) ends, aggregated or abandoned."""
        if self.server is not None:
            self.late_answers.ended(self.server)
        self.server = None

    @staticmethod
    def command(c: SA.Send | SA.Refused | SA.Wake, round_: int) -> Command:
        """A secure round's command as the machine's."""
        if isinstance(c, SA.Send):
            return SendSecAgg(c.to, c.message)
        if isinstance(c, SA.Refused):
            return Rejected(c.sender, round_, c.reason, c.detail)
        return RequestWakeup(c.at)

    @staticmethod
    def aggregate(
        weights: Weights, res: SA.Unmasked, after_unmask: Callable[[np.ndarray], np.ndarray]
    ) -> tuple[Weights, float | None]:
        """The model the unmasked mean update makes: global + mean of the deltas (floating
        tensors; the others keep the global model's values), and, with adaptive clipping
        under distributed DP, the noised Σ(bᵢ − ½) of the clipped-or-not bits (else None).
        ``after_unmask``: what a privacy stage makes of the mean (flat, before it is added)."""
        layout, base = SA.flatten(weights)
        mean = res.mean
        count = None
        if mean.size == base.size + 1:
            # Adaptive clipping under distributed DP: the last value is the noised count's
            # mean; times the weight sum (each weighs 1) it is the noised Σ(bᵢ − ½).
            count, mean = float(mean[-1]) * res.weight_sum, mean[:-1]
        mean = after_unmask(mean)
        new = dict(weights)
        new.update(SA.unflatten(layout, base + mean, weights))
        return new, count

    def aggregated(self, res: SA.Unmasked) -> dict[str, float]:
        """The round in progress was aggregated: its keys ahead serve the next one. Each
        contributor's share of the mean (its sample weight over the weight sum)."""
        assert self.server is not None
        setup = self.server.setup
        self.result = res
        self.ahead_keys, self.ahead_round = dict(self.server.next_keys), setup.next_round
        self.aggregated_ahead = self.ahead
        return {a: setup.ratio(res.contributors[a].num_samples) / res.weight_sum for a in sorted(res.contributors)}
