"""The coordinator's side of secure aggregation: :class:`SecAggServer` runs one round's
stages (relays keys and share boxes, sums the masked inputs as they come, has the
survivor list signed, asks for shares and takes the masks off), as events in and
commands out."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedagent.protocols.secagg.crypto import (
    KeyVerifier,
    ahead_statement,
    check_public_key,
    key_statement,
    list_statement,
    neighbour_graph,
    pair_seed,
    shamir_at,
    shamir_combine,
    unpack_share,
)
from fedagent.protocols.secagg.masks import BLOCK, SELF_NONCE, MaskStreams, mask_sign
from fedagent.protocols.secagg.params import MODULUS_BITS, SecAggError, SecAggSetup
from fedagent.protocols.secagg.wire import (
    UNOPENED_BOX,
    SecAggKeys,
    SecAggMasked,
    SecAggMessage,
    SecAggReveal,
    SecAggRoster,
    SecAggShareBox,
    SecAggShares,
    SecAggSignature,
    SecAggSurvivors,
    SecAggUnmask,
)


@dataclass(frozen=True, slots=True)
class Received:
    """A SecAgg message from ``sender`` (its certificate's name)."""

    sender: str
    message: SecAggMessage


@dataclass(frozen=True, slots=True)
class Gone:
    agent: str


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Send:
    to: str
    message: SecAggMessage


@dataclass(frozen=True, slots=True)
class Refused:
    sender: str
    reason: str  # short code
    detail: str


@dataclass(frozen=True, slots=True)
class Wake:
    at: float


@dataclass(frozen=True, slots=True)
class Contribution:
    num_samples: int
    metrics: dict[str, float]
    leaving: bool
    base_version: int


@dataclass(frozen=True, slots=True)
class Unmasked:
    """The round's result: the sample-weighted mean of the survivors' updates."""

    mean: np.ndarray = field(repr=False)  # float64, the flattened layout
    contributors: dict[str, Contribution]
    weight_sum: float
    error_bound: float
    dropped_before_input: tuple[str, ...]  # shared keys, sent no masked input
    silent_at_unmask: tuple[str, ...]  # had sent no shares when enough were in
    # survivor -> why its signature of the survivor list did not verify (its input is in
    # the sum, like a silent survivor's; it was not asked for shares)
    bad_signatures: dict[str, str] = field(default_factory=dict)
    # agent -> how it spoiled its part (bad keys, input or shares, silence after sharing):
    # the round went on without what it sent; the caller benches it
    offenders: dict[str, str] = field(default_factory=dict)
    # agent -> why it left the round after the share stage (a share box it could not open)
    withdrawn: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str
    # agent -> how it spoiled the round or its part in it: the caller benches it
    culprits: dict[str, str] = field(default_factory=dict)


#: Most t-subsets of one secret's shares tried in search of one that rebuilds its
#: commitment (holders are at most 2⌈log₂ n⌉ + 1, so this is rarely the limit).
MAX_SUBSETS = 2048


ServerCommand = Send | Refused | Wake | Unmasked | Failed


class SecAggServer:
    """The coordinator's part in one secure round: relays keys and boxes, collects
    masked inputs, asks for shares and removes the masks. ``handle`` returns commands;
    the round ends with exactly one :class:`Unmasked` or :class:`Failed`.

    Stages close early once every agent still online has answered; otherwise at their
    deadline: keys and shares ``stage_timeout`` after they open, masked inputs at
    ``input_deadline`` (training happens meanwhile), the survivor list's signatures and the
    shares ``stage_timeout`` each."""

    KEYS, SHARES, INPUTS, CONSISTENCY, UNMASK, DONE = "keys", "shares", "inputs", "consistency", "unmask", "done"
    QUIET_GRACE = 1.0  # seconds an owed masked input is waited for at least, once the others are in

    def __init__(
        self,
        round_: int,
        selected: Sequence[str],
        setup: SecAggSetup,
        size: int,
        *,
        now: float,
        stage_timeout: float,
        input_deadline: float,
        online: set[str] | None = None,
        admit: Callable[[int], str] | None = None,
        verify: KeyVerifier | None = None,
        ahead: Mapping[str, SecAggKeys] | None = None,
    ) -> None:
        """``admit(survivors)``: asked once the masked inputs are in, before anything is
        unmasked; a reason returned abandons the round (a privacy budget the sum of that
        many updates would overdraw). ``verify``: checks a survivor's signature of the
        survivor list as the agents will (raises if it is not valid); a survivor whose
        signature fails is dropped from the rest of the round, and its signature is
        never passed on. Without it every signature is passed on unchecked. ``ahead``:
        when the setup says so, the keys every selected agent advertised for this round
        with its masked input of the round before (:attr:`next_keys` of that round's
        server); the key stage is skipped and :meth:`start` sends the rosters."""
        if len(selected) > setup.params.max_agents:
            raise SecAggError(
                f"{len(selected)} agents exceed the {setup.params.max_agents} whose masked sum fits "
                f"2^{MODULUS_BITS} at {setup.params.bits} bits"
            )
        self.round = round_
        self.setup = setup
        self.params = setup.params
        self.context = setup.context(round_)
        self.selected = tuple(sorted(selected))
        self.graph = neighbour_graph(self.selected, setup.seed, self.params.neighbours)
        self.size = size
        self.stage_timeout = stage_timeout
        self.input_deadline = input_deadline
        self.online = set(self.selected if online is None else online & set(self.selected))
        self.stage = self.KEYS
        self.deadline = now + stage_timeout
        self.keys: dict[str, SecAggKeys] = {}
        self.rosters: dict[str, tuple[str, ...]] = {}  # agent -> neighbours whose keys it got
        self.shares: dict[str, SecAggShares] = {}
        self.inputs: dict[str, SecAggMasked] = {}
        self._sum: np.ndarray | None = None
        self.admit = admit
        self.survivors: tuple[str, ...] = ()  # the list sent out in the consistency stage
        self.signatures: dict[str, tuple[bytes, bytes]] = {}  # survivor -> (cert, sig) of the list
        self.verify = verify
        self.bad_signatures: dict[str, str] = {}  # survivor -> why its list signature failed
        self.bad_keys: dict[str, str] = {}  # agent -> why its key advertisement failed
        self.asked: set[str] = set()
        self.answered: set[str] = set()
        # holder -> (owners whose seed share it was asked for, ... whose key share)
        self.asked_for: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self.b_shares: dict[str, dict[int, bytes]] = {}
        self.sk_shares: dict[str, dict[int, bytes]] = {}
        # owner -> its secret (seed of a survivor, mask key of a drop-out) rebuilt and
        # checked against its commitment, and the t shares that rebuilt it
        self.secrets: dict[str, bytes] = {}
        self._basis: dict[str, dict[int, bytes]] = {}
        self._tried: dict[str, set[tuple[int, ...]]] = {}  # owner -> t-subsets (x) tried
        self.offenders: dict[str, str] = {}  # agent -> how it spoiled its part
        self.refused_shares: set[str] = set()  # sent share boxes that were refused
        self.refused_inputs: set[str] = set()  # shared keys, then sent an input refused
        self.withdrawn: dict[str, str] = {}  # agent -> why it left after the share stage
        self._accused: dict[str, set[str]] = {}  # owner -> holders that could not open its box
        self._inputs_open = now  # when the masked inputs began to be owed
        self._named: set[str] = set()  # holders already refused for what they revealed
        self._last_input: float | None = None
        self._self_off: set[str] = set()  # survivors whose self mask is off the sum already
        self.received_kinds: list[tuple[str, str]] = []  # (sender, kind): what this round was sent
        # Keys for the setup's next_round, advertised with the masked inputs.
        self.next_keys: dict[str, SecAggKeys] = {}
        self.bad_ahead: dict[str, str] = {}  # agent -> why its keys ahead did not verify
        if setup.ahead:
            missing = [a for a in self.selected if ahead is None or a not in ahead]
            if missing:
                raise SecAggError(f"no keys advertised ahead by {', '.join(missing[:3])}: the round needs a key stage")
            assert ahead is not None
            stray = [a for a in self.selected if ahead[a].round != round_]
            if stray:
                raise SecAggError(f"the keys advertised by {', '.join(stray[:3])} are not for round {round_}")
            self.keys = {a: ahead[a] for a in self.selected}

    def start(self) -> list[ServerCommand]:
        """The first commands: a wake-up at the key stage's deadline, or (keys advertised
        ahead) every agent's roster and a wake-up at the share stage's."""
        if self.setup.ahead:
            return self._rosters(self.deadline - self.stage_timeout)
        return [Wake(self.deadline)]

    def status(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "keys": len(self.keys),
            "shares": len(self.shares),
            "inputs": len(self.inputs),
            "signatures": len(self.signatures),
            "bad_signatures": len(self.bad_signatures),
            "bad_keys": len(self.bad_keys),
            "reveals": len(self.answered),
        }

    def handle(self, event: Received | Gone | Tick, now: float) -> list[ServerCommand]:
        if self.stage == self.DONE:
            return []
        if isinstance(event, Gone):
            self.online.discard(event.agent)
            return self._maybe_close(now)
        if isinstance(event, Tick):
            return self._maybe_close(now)
        return self._on_message(event.sender, event.message, now)

    # -- messages ----------------------------------------------------------------------
    def _on_message(self, sender: str, msg: SecAggMessage, now: float) -> list[ServerCommand]:
        self.received_kinds.append((sender, msg.kind))

        def refuse(reason: str, detail: str) -> list[ServerCommand]:
            return [Refused(sender, reason, detail)]

        if getattr(msg, "round", None) != self.round:
            return refuse("stale", f"{msg.kind} for round {getattr(msg, 'round', '?')}, current {self.round}")
        if sender not in self.graph:
            return refuse("unselected", f"{sender} is not in secure round {self.round}")
        if isinstance(msg, SecAggKeys):
            if self.stage != self.KEYS or sender in self.keys or sender in self.bad_keys:
                return refuse("stage", f"keys from {sender} in stage {self.stage}")
            why = self._check_signature(sender, key_statement(sender, self.context, msg.c_pk, msg.s_pk), msg)
            if why:
                # Passed on, every neighbour would find it invalid and leave the round (below
                # about 8 agents that is everyone): the sender is left out, as if it had
                # never advertised.
                self.bad_keys[sender] = why
                return refuse(
                    "key_signature", f"{sender}'s key advertisement is not validly signed ({why}): left out"
                ) + self._maybe_close(now)
            why = _unusable_keys(msg)
            if why:
                # Neighbours could agree neither a box key nor a mask with it.
                self.bad_keys[sender] = why
                self.offenders[sender] = f"advertised {why}"
                return refuse("keys", f"{sender} advertised {why}: left out") + self._maybe_close(now)
            self.keys[sender] = msg
        elif isinstance(msg, SecAggShares):
            if (
                self.stage != self.SHARES
                or sender not in self.rosters
                or sender in self.shares
                or sender in self.refused_shares
            ):
                return refuse("stage", f"shares from {sender} in stage {self.stage}")
            if set(msg.boxes) != set(self.rosters[sender]):
                # As if it had not shared (no one masks with it), and no longer waited for.
                self.refused_shares.add(sender)
                self.offenders[sender] = "sealed share boxes for other agents than its roster"
                return refuse("shares", f"{sender} sealed boxes for other agents than its roster") + self._maybe_close(
                    now
                )
            self.shares[sender] = msg
        elif isinstance(msg, SecAggMasked):
            if (
                self.stage != self.INPUTS
                or sender not in self.shares
                or sender in self.inputs
                or sender in self.refused_inputs
                or sender in self.withdrawn
            ):
                return refuse("stage", f"masked input from {sender} in stage {self.stage}")
            if msg.masked.size != self.size:
                # Refused before it is folded: a drop-out after sharing (its pairwise
                # masks come off through its key's shares), and no longer waited for.
                self.refused_inputs.add(sender)
                self.offenders[sender] = f"sent a masked input of {msg.masked.size} values, not {self.size}"
                return refuse(
                    "shape", f"masked input of {msg.masked.size} values, the model has {self.size}"
                ) + self._maybe_close(now)
            self._last_input = now
            # Fold at once: the coordinator keeps one running sum, never the inputs.
            if self._sum is None:
                self._sum = msg.masked.copy()
            else:
                self._sum += msg.masked
            self.inputs[sender] = SecAggMasked(
                msg.round,
                msg.base_version,
                msg.num_samples,
                msg.metrics,
                {"masked": np.zeros(0, np.int32)},
                msg.leaving,
            )
            if msg.ahead is not None and self.setup.next_round and msg.ahead.round == self.setup.next_round:
                k = msg.ahead
                why = self._check_signature(sender, ahead_statement(sender, k.round, self.context, k.c_pk, k.s_pk), k)
                why = why or _unusable_keys(k)
                if why:
                    # The input counts; the next round has a key stage instead.
                    self.bad_ahead[sender] = why
                    return refuse(
                        "key_signature",
                        f"{sender}'s keys for round {k.round} are not validly signed ({why}): "
                        "that round has a key stage",
                    ) + self._maybe_close(now)
                self.next_keys[sender] = k
        elif isinstance(msg, SecAggSignature):
            if (
                self.stage != self.CONSISTENCY
                or sender not in self.survivors
                or sender in self.signatures
                or sender in self.bad_signatures
            ):
                return refuse("stage", f"list signature from {sender} in stage {self.stage}")
            why = self._check_list_signature(sender, msg)
            if why:
                # Passed on, it would count for nothing with the honest agents (they check
                # every signature) and could leave them short of the signatures they want:
                # the sender takes no further part, as if it had dropped out after its input.
                self.bad_signatures[sender] = why
                return refuse(
                    "list_signature", f"{sender}'s signature of the survivor list is not valid ({why}): dropped"
                ) + self._maybe_close(now)
            self.signatures[sender] = (msg.cert, msg.sig)
        elif isinstance(msg, SecAggReveal):
            if (
                self.stage == self.INPUTS
                and msg.refused.startswith(UNOPENED_BOX)
                and sender in self.shares
                and sender not in self.inputs
                and sender not in self.refused_inputs
                and sender not in self.withdrawn
            ):
                return self._withdraw(sender, msg.refused[len(UNOPENED_BOX) :]) + self._maybe_close(now)
            if self.stage != self.UNMASK or sender not in self.asked or sender in self.answered:
                return refuse("stage", f"shares from {sender} in stage {self.stage}")
            self.answered.add(sender)
            if msg.refused:
                return refuse("refused", f"{sender} refused to reveal shares: {msg.refused}") + self._maybe_close(now)
            return self._take_shares(sender, msg) + self._maybe_close(now)
        else:
            return refuse("kind", f"{msg.kind} is not sent to a coordinator")
        return self._maybe_close(now)

    def _check_list_signature(self, sender: str, msg: SecAggSignature) -> str:
        """Why ``sender``'s signature of the survivor list is not valid, or ''."""
        return self._check_signature(sender, list_statement(sender, self.context, self.survivors), msg)

    def _check_signature(self, sender: str, statement: bytes, msg: SecAggSignature | SecAggKeys) -> str:
        """Why ``msg``'s signature of ``statement`` is not ``sender``'s, or '' (also
        without a verifier: then everything is passed on unchecked)."""
        if self.verify is None:
            return ""
        try:
            self.verify(sender, statement, msg.cert, msg.sig)
        except Exception as exc:  # noqa: BLE001 - any failure: the signature does not count
            return str(exc) or type(exc).__name__
        return ""

    # -- stages ------------------------------------------------------------------------
    def _owed(self) -> set[str]:
        if self.stage == self.KEYS:
            return set(self.selected) - set(self.keys) - set(self.bad_keys)
        if self.stage == self.SHARES:
            return set(self.rosters) - set(self.shares) - self.refused_shares
        if self.stage == self.INPUTS:
            return set(self.shares) - set(self.inputs) - self.refused_inputs - set(self.withdrawn)
        if self.stage == self.CONSISTENCY:
            return set(self.survivors) - set(self.signatures) - set(self.bad_signatures)
        return self.asked - self.answered

    def _maybe_close(self, now: float) -> list[ServerCommand]:
        owed_online = self._owed() & self.online
        if self.stage == self.UNMASK and self._can_unmask():
            return self._finish()
        if owed_online and now < self.deadline:
            quiet = self._quiet_close()
            if quiet is None or now < quiet:
                return [] if quiet is None else [Wake(quiet)]
        return self._close(now)

    def _quiet_close(self) -> float | None:
        """When the masked inputs stop being waited for although some are owed: every
        input that came is in and the rest have been silent for as long again as the
        last of those took (at least ``QUIET_GRACE``): a member silent after sharing
        holds the round about twice an honest agent's training, not to its deadline.
        None: no such time (another stage, or too few inputs to go on without the
        silent ones: fewer than the survivors' signatures the next stage needs would fail
        the round for certain, and name slow honest agents as silent ones)."""
        enough = max(self.params.min_survivors, self.params.threshold_of(len(self.selected)))
        if self.stage != self.INPUTS or self._last_input is None or len(self.inputs) < enough:
            return None
        return self._last_input + max(self.QUIET_GRACE, self._last_input - self._inputs_open)

    def _fail(self, reason: str, culprits: Mapping[str, str] | None = None) -> list[ServerCommand]:
        self.stage = self.DONE
        self._sum = None
        blame = dict(self.offenders)
        blame.update(culprits or {})
        return [Failed(reason, dict(sorted(blame.items())))]

    def _withdraw(self, sender: str, accused: str) -> list[ServerCommand]:
        """``sender`` leaves the round after the share stage, saying ``accused``'s share
        box did not open: a drop-out (its key's shares take its masks off). One holder's
        word names no one; two holders that could not open the same owner's boxes do
        (one lying member cannot frame an honest owner alone)."""
        self.withdrawn[sender] = f"the share box from {accused} did not open"
        if accused in self.rosters.get(sender, ()) and accused in self.shares:
            who = self._accused.setdefault(accused, set())
            who.add(sender)
            if len(who) >= 2:
                self.offenders[accused] = f"the share boxes it sealed for {', '.join(sorted(who))} did not open"
        return [Refused(sender, "withdrawn", self.withdrawn[sender])]

    def _close(self, now: float) -> list[ServerCommand]:
        p = self.params
        if self.stage == self.KEYS:
            if len(self.keys) < p.min_survivors:
                return self._fail(f"{len(self.keys)} agents advertised keys, need {p.min_survivors}")
            return self._rosters(now)
        if self.stage == self.SHARES:
            if len(self.shares) < p.min_survivors:
                return self._fail(f"{len(self.shares)} agents shared their keys, need {p.min_survivors}")
            out: list[ServerCommand] = []
            for j in sorted(self.shares):
                boxes = {i: self.shares[i].boxes[j] for i in self.rosters[j] if i in self.shares}
                if boxes:
                    out.append(Send(j, SecAggShareBox(self.round, boxes)))
            self.stage, self.deadline = self.INPUTS, max(self.input_deadline, now)
            self._inputs_open = now
            return out + [Wake(self.deadline)]
        if self.stage == self.INPUTS:
            for a in sorted(set(self.shares) - set(self.inputs) - self.refused_inputs - set(self.withdrawn)):
                if a in self.online:
                    # Online, sharing done, and no input: its masks must be stripped off
                    # the others' through its key's shares, at every honest agent's cost.
                    self.offenders.setdefault(a, "shared its keys, then sent no masked input")
            if len(self.inputs) < p.min_survivors:
                return self._fail(f"{len(self.inputs)} masked inputs arrived, need {p.min_survivors}")
            why = self.admit(len(self.inputs)) if self.admit is not None else ""
            if why:
                return self._fail(why)
            self.survivors = tuple(sorted(self.inputs))
            out = [Send(j, SecAggSurvivors(self.round, self.survivors)) for j in self.survivors]
            self.stage, self.deadline = self.CONSISTENCY, now + self.stage_timeout
            return out + [Wake(self.deadline)]
        if self.stage == self.CONSISTENCY:
            need = p.threshold_of(len(self.selected))
            if len(self.signatures) < need:
                bad = sorted(self.bad_signatures)
                return self._fail(
                    f"{len(self.signatures)} survivors signed the survivor list, need {need} "
                    f"of the {len(self.selected)} selected"
                    + (f" ({len(bad)} signatures not valid: {', '.join(bad[:5])})" if bad else "")
                )
            u2 = set(self.inputs)
            needed = self._needed()
            out = []
            for j in sorted(self.signatures):
                owners = [o for o in (j, *self.rosters[j]) if o in needed]
                b_of = tuple(o for o in owners if o in u2)
                sk_of = tuple(o for o in owners if o not in u2)
                self.asked.add(j)
                self.asked_for[j] = (frozenset(b_of), frozenset(sk_of))
                out.append(Send(j, SecAggUnmask(self.round, b_of, sk_of, len(u2), dict(self.signatures))))
            self.stage, self.deadline = self.UNMASK, now + self.stage_timeout
            return out + [Wake(self.deadline)]
        if self.stage == self.UNMASK:
            if self._can_unmask():
                return self._finish()
            return self._unmask_failed()
        return []

    def _unmask_failed(self) -> list[ServerCommand]:
        """The shares are all in (or their time is up) and some secret was not rebuilt:
        too few shares came, or no t of them rebuild its commitment. Then the owner dealt
        shares off one polynomial (or more of its holders lie than the threshold
        allows, which the protocol's assumptions exclude): the owner is named."""
        unsettled = sorted(self._needed() - set(self.secrets))
        bad: dict[str, str] = {}
        untold: list[str] = []
        short: list[str] = []
        for o in unsettled:
            store = self.b_shares if o in self.inputs else self.sk_shares
            got, t = len(store.get(o, {})), self._t(o)
            if got < t:
                short.append(o)
            elif len(self._tried.get(o, ())) < math.comb(got, t):
                untold.append(o)  # the search stopped at MAX_SUBSETS: no one is named
            else:
                what = "self-mask seed" if o in self.inputs else "mask key"
                bad[o] = f"no {t} of the {got} shares of its {what} rebuild its commitment"
        if bad:
            return self._fail(
                "shares rebuild no secret matching its commitment for "
                + "; ".join(f"{o} ({why})" for o, why in sorted(bad.items())[:5]),
                bad,
            )
        if untold:
            return self._fail(
                f"shares of {', '.join(untold[:5])} disagree beyond the {MAX_SUBSETS} subsets tried: "
                "whose shares are wrong is not told"
            )
        return self._fail(f"too few shares to remove the masks of {', '.join(short[:5])}")

    def _rosters(self, now: float) -> list[ServerCommand]:
        """Each agent with keys gets its neighbours' keys; the share stage opens."""
        out: list[ServerCommand] = []
        for a in sorted(self.keys):
            nb = tuple(b for b in self.graph[a] if b in self.keys)
            if not nb:
                continue  # isolated: its input could not be hidden, so it takes no part
            self.rosters[a] = nb
            out.append(Send(a, SecAggRoster(self.round, {b: self.keys[b] for b in nb})))
        self.stage, self.deadline = self.SHARES, now + self.stage_timeout
        return out + [Wake(self.deadline)]

    def _needed(self) -> set[str]:
        """Whose secret is rebuilt: every survivor's seed, and the key of each drop-out
        that a survivor masked with (one whose neighbours all dropped too left no mask)."""
        u2 = set(self.inputs)
        return u2 | {d for d in self.shares if d not in u2 and any(j in u2 for j in self.rosters[d])}

    def _t(self, owner: str) -> int:
        return self.params.threshold_of(len(self.rosters[owner]) + 1)

    def _x(self, owner: str, holder: str) -> int:
        """The x at which ``holder`` holds ``owner``'s shares: its place among the
        owner's holders, the owner first and then its roster in name order (as the
        owner dealt them); 0 if it holds none."""
        if holder == owner:
            return 1
        roster = self.rosters.get(owner, ())
        return roster.index(holder) + 2 if holder in roster else 0

    def _can_unmask(self) -> bool:
        return all(o in self.secrets for o in self._needed())

    def _take_shares(self, holder: str, msg: SecAggReveal) -> list[ServerCommand]:
        """Keeps the shares ``holder`` was asked for, each at the x it holds for its
        owner (anything else is refused and counts against the holder), checks each
        against what its owner's secret is known to be, and rebuilds the secrets that
        now can be; a survivor's self mask comes off as soon as its seed is rebuilt."""
        out: list[ServerCommand] = []
        b_of, sk_of = self.asked_for.get(holder, (frozenset(), frozenset()))
        wrong: list[str] = []
        for store, got, asked in ((self.b_shares, msg.b_shares, b_of), (self.sk_shares, msg.sk_shares, sk_of)):
            for owner, share in sorted(got.items()):
                try:
                    x, y = unpack_share(share)
                except SecAggError:
                    wrong.append(f"a malformed share of {owner}")
                    continue
                if owner not in asked:
                    wrong.append(f"a share of {owner}, not asked for")
                elif x != self._x(owner, holder):
                    wrong.append(f"{owner}'s share at x={x}, where it holds x={self._x(owner, holder)}")
                else:
                    store.setdefault(owner, {})[x] = y
        if wrong:
            self._offend(holder, "revealed " + "; ".join(wrong[:3]))
        for owner in sorted(set(msg.b_shares) | set(msg.sk_shares)):
            if owner in self._needed():
                self._settle(owner)
        for owner in sorted(msg.b_shares):
            if owner in self.inputs and owner in self.secrets and owner not in self._self_off:
                self._remove_self_mask(owner)
        # Each holder found out (now, or by a later share that settled its owner's
        # polynomial) is named once.
        for o, why in sorted(self.offenders.items()):
            if o in self.answered and o not in self._named and why.startswith("revealed"):
                self._named.add(o)
                out.append(Refused(o, "bad_share", f"{o} {why}"))
        return out

    def _offend(self, agent: str, why: str) -> None:
        if agent not in self.offenders:
            self.offenders[agent] = why

    def _commits(self, owner: str, secret: bytes) -> bool:
        """Whether ``secret`` is what ``owner`` committed to: its self-mask seed's
        sha256 (sent with its shares) or its mask key's public half (signed)."""
        if owner in self.inputs:
            return hashlib.sha256(secret).digest() == self.shares[owner].b_digest
        try:
            sk = X25519PrivateKey.from_private_bytes(secret)
        except ValueError:
            return False
        return sk.public_key().public_bytes_raw() == self.keys[owner].s_pk

    def _settle(self, owner: str) -> None:
        """Rebuilds ``owner``'s secret if t of its shares rebuild its commitment, and
        names each holder whose share lies off the polynomial those t define. Tries the
        t-subsets in order, at most :data:`MAX_SUBSETS` per owner; a subset containing
        a bad share almost never passes the commitment, so one that passes is the
        owner's polynomial."""
        store = self.b_shares if owner in self.inputs else self.sk_shares
        got = store.get(owner, {})
        t = self._t(owner)
        if owner not in self.secrets:
            if len(got) < t:
                return
            tried = self._tried.setdefault(owner, set())
            for subset in itertools.combinations(sorted(got), t):
                if subset in tried:
                    continue  # (a share once given is kept: the same subset fails again)
                if len(tried) >= MAX_SUBSETS:
                    return
                tried.add(subset)
                pts = {x: got[x] for x in subset}
                try:
                    secret = shamir_combine(pts)
                except SecAggError:
                    continue
                if self._commits(owner, secret):
                    self.secrets[owner], self._basis[owner] = secret, pts
                    break
            else:
                return
        basis = self._basis[owner]
        holders = (owner, *self.rosters[owner])
        for x, y in got.items():
            if x not in basis and shamir_at(basis, x) != int.from_bytes(y, "big"):
                liar = holders[x - 1]
                what = "self-mask seed" if owner in self.inputs else "mask key"
                self._offend(liar, f"revealed a share of {owner}'s {what} off its polynomial")

    def _remove_self_mask(self, owner: str) -> None:
        """Takes ``owner``'s self-mask stream (its seed rebuilt) off the sum."""
        assert self._sum is not None
        streams = MaskStreams()
        streams.add_stream(self.secrets[owner], SELF_NONCE, sign=-1)
        streams.add_all(self._sum)
        self._self_off.add(owner)

    def _finish(self) -> list[ServerCommand]:
        assert self._sum is not None
        p = self.params
        total = self._sum
        streams = MaskStreams()
        dropped = sorted(self._needed() - set(self.inputs))
        for owner in sorted(set(self.inputs) - self._self_off):
            self._remove_self_mask(owner)
        for d in dropped:
            sk = X25519PrivateKey.from_private_bytes(self.secrets[d])
            for j in self.rosters[d]:
                if j in self.inputs:
                    # j added sign(j, d)·PRG(s_jd) for a neighbour that never sent its input
                    streams.add_stream(pair_seed(sk, self.keys[j].s_pk, self.context), sign=-mask_sign(j, d))
        survivors = len(self.inputs)
        contributors = {
            a: Contribution(m.num_samples, dict(m.metrics), m.leaving, m.base_version) for a, m in self.inputs.items()
        }
        weight_sum = sum(self.setup.ratio(c.num_samples) for c in contributors.values())
        # One pass, block by block: the masks come off and the block is dequantised and
        # divided while it is in cache.
        mean = np.empty(total.size)
        # Each honest input lies in [0, levels]: a sum above survivors·levels proves
        # that some input did not (a masked input can be any value mod 2^32).
        top = survivors * p.levels
        for lo in range(0, total.size, BLOCK):
            blk = total[lo : lo + BLOCK]
            streams.apply(blk)
            if int(blk.max(initial=0)) > top:
                out_of = int(np.count_nonzero(blk > top))
                return self._fail(
                    f"the unmasked sum is out of range ({out_of} of the first {min(lo + BLOCK, total.size)} "
                    f"values above {survivors} inputs' largest): some masked input lay outside the "
                    "quantisation range; the sum is not applied"
                )
            m = mean[lo : lo + BLOCK]
            np.copyto(m, blk)
            m *= p.step
            m -= survivors * p.clip
            m /= weight_sum
        silent = tuple(sorted(self.asked - self.answered))
        self.stage = self.DONE
        self._sum = None
        gone = tuple(sorted(set(self.shares) - set(self.inputs)))
        # ... and the survivors never asked: they did not sign the survivor list (or not
        # validly: those are named apart)
        unsigned = set(self.inputs) - set(self.signatures) - set(self.bad_signatures)
        silent = tuple(sorted(set(silent) | unsigned))
        bound = p.error_bound(weight_sum, survivors)
        return [
            Unmasked(
                mean,
                contributors,
                weight_sum,
                bound,
                gone,
                silent,
                dict(sorted(self.bad_signatures.items())),
                dict(sorted(self.offenders.items())),
                dict(sorted(self.withdrawn.items())),
            )
        ]


def _unusable_keys(keys: SecAggKeys) -> str:
    """What makes advertised public keys unusable, or ''."""
    for name, pk in (("c_pk", keys.c_pk), ("s_pk", keys.s_pk)):
        try:
            check_public_key(pk)
        except SecAggError as exc:
            return f"{name}: {exc}"
    return ""
