"""The agent's side of secure aggregation: :class:`SecAggClient` for one round (keys,
shares, the masked input, the survivor list's signature, the shares it reveals) and
:class:`SecAggAgent` across rounds (the client of the round it is selected for, its
trained update held until its share box is in, the keys it advertised ahead)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedagent.protocols.secagg.crypto import (
    SHARE_BYTES,
    KeyVerifier,
    Signer,
    ahead_statement,
    box_key,
    box_nonce,
    check_public_key,
    key_statement,
    list_statement,
    neighbour_graph,
    pack_share,
    pair_seed,
    shamir_split,
)
from fedagent.protocols.secagg.masks import (
    BLOCK,
    SELF_NONCE,
    Delta,
    MaskStreams,
    delta_blocks,
    mask_sign,
    quantise_block,
)
from fedagent.protocols.secagg.params import SecAggError, SecAggSetup
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


class UnopenedBox(SecAggError):
    """A neighbour's share box did not open, or held no shares for this agent: without
    them this agent can neither mask with that neighbour nor hold its shares."""

    def __init__(self, sender: str, what: str) -> None:
        super().__init__(f"the share box from {sender} {what}")
        self.sender = sender


@dataclass(frozen=True, slots=True)
class AheadKeys:
    """An agent's key pairs for one future round, advertised (signed) with its masked
    input of the round before: the secret halves stay with the agent until that round
    starts, and are used in it or thrown away."""

    round: int  # the only round they are for
    advertised_in: bytes  # the context (round and seed) of the round they were advertised in
    c_sk: bytes = field(repr=False)
    s_sk: bytes = field(repr=False)
    public: SecAggKeys


class SecAggClient:
    """One agent's part in one secure round. Methods take what the coordinator relayed
    and return what to send; :class:`SecAggError` means: stop taking part in this round."""

    def __init__(
        self,
        agent: str,
        round_: int,
        selected: Sequence[str],
        setup: SecAggSetup,
        *,
        sign: Signer | None = None,
        verify: KeyVerifier | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
        keys: AheadKeys | None = None,
    ) -> None:
        """``keys``: the key pairs this agent advertised ahead for this round (the setup
        says ``ahead``); without them fresh pairs are made, to :meth:`advertise`."""
        if agent not in selected:
            raise SecAggError(f"{agent} is not selected for round {round_}")
        if setup.ahead and (keys is None or keys.round != round_):
            raise SecAggError(f"round {round_} uses keys advertised ahead, and I advertised none for it")
        self.agent = agent
        self.round = round_
        self.setup = setup
        self.params = setup.params
        self.context = setup.context(round_)
        self.graph_neighbours = neighbour_graph(selected, setup.seed, setup.params.neighbours)[agent]
        self.selected = frozenset(selected)
        self.signed: tuple[str, ...] | None = None  # the survivor list this agent signed
        self._rand = random_bytes
        self._sign = sign
        self._verify = verify
        # Where the neighbours' keys were signed: this round's context, or (keys
        # advertised ahead) the context of the round they were advertised in.
        self._ahead_ctx: bytes | None = None
        if setup.ahead:
            assert keys is not None
            self._c_sk = X25519PrivateKey.from_private_bytes(keys.c_sk)
            self._s_sk = X25519PrivateKey.from_private_bytes(keys.s_sk)
            self._ahead_ctx = keys.advertised_in
        else:
            self._c_sk = X25519PrivateKey.from_private_bytes(random_bytes(32))
            self._s_sk = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._b = random_bytes(32)
        self.keys: dict[str, SecAggKeys] = {}  # neighbours that advertised keys
        self.holders: tuple[str, ...] = ()  # who holds shares of my secrets (me first)
        self.held: dict[str, tuple[bytes, bytes]] = {}  # owner -> (b share, sk share) I hold
        self.masking_with: tuple[str, ...] = ()  # neighbours whose shares arrived
        self.revealed: dict[str, str] = {}  # owner -> "b" | "sk": the one share I gave out
        self.masked_sent = False
        # The mask sum drawn ahead (:meth:`premask`) and the neighbours it covers.
        self._premask: tuple[np.ndarray, frozenset[str]] | None = None

    def advertise(self) -> SecAggKeys:
        if self._ahead_ctx is not None:
            raise SecAggError("this round's keys were advertised ahead")
        c_pk = self._c_sk.public_key().public_bytes_raw()
        s_pk = self._s_sk.public_key().public_bytes_raw()
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(key_statement(self.agent, self.context, c_pk, s_pk))
        return SecAggKeys(self.round, c_pk, s_pk, cert, sig)

    def on_roster(self, msg: SecAggRoster) -> SecAggShares:
        if msg.round != self.round or self.holders:
            raise SecAggError("roster for another round, or a second roster")
        stray = set(msg.keys) - set(self.graph_neighbours)
        if stray:
            raise SecAggError(f"roster names agents outside my neighbourhood: {sorted(stray)[:3]}")
        for name, k in msg.keys.items():
            if k.round != self.round:
                raise SecAggError(f"the keys of {name} are for round {k.round}, not {self.round}")
            try:
                check_public_key(k.c_pk)
                check_public_key(k.s_pk)
            except SecAggError as exc:
                raise SecAggError(f"the keys of {name}: {exc}") from None
            if self._verify is not None:
                if self._ahead_ctx is None:
                    statement = key_statement(name, self.context, k.c_pk, k.s_pk)
                else:
                    # Signed for this round, advertised in the round before: keys of any
                    # other round (a replay) do not verify.
                    statement = ahead_statement(name, self.round, self._ahead_ctx, k.c_pk, k.s_pk)
                self._verify(name, statement, k.cert, k.sig)
        if not msg.keys:
            raise SecAggError("no neighbour advertised keys: my input would not be hidden")
        self.keys = dict(msg.keys)
        self.holders = (self.agent, *sorted(msg.keys))
        t = self.params.threshold_of(len(self.holders))
        xs = list(range(1, len(self.holders) + 1))
        b_sh = shamir_split(self._b, xs, t, self._rand)
        sk_sh = shamir_split(self._s_sk.private_bytes_raw(), xs, t, self._rand)
        self.held[self.agent] = (pack_share(1, b_sh[1]), pack_share(1, sk_sh[1]))
        boxes: dict[str, bytes] = {}
        for x, name in zip(xs[1:], self.holders[1:], strict=True):
            plain = msgpack.packb(
                [self.agent, name, self.round, pack_share(x, b_sh[x]), pack_share(x, sk_sh[x])], use_bin_type=True
            )
            key = box_key(self._c_sk, self.keys[name].c_pk, self.context)
            boxes[name] = ChaCha20Poly1305(key).encrypt(box_nonce(self.agent, name), plain, self.context)
        return SecAggShares(self.round, boxes, hashlib.sha256(self._b).digest())

    def on_sharebox(self, msg: SecAggShareBox) -> None:
        if msg.round != self.round or not self.holders or self.masking_with:
            raise SecAggError("share box for another round, before my roster, or twice")
        for sender, box in msg.boxes.items():
            if sender not in self.keys:
                raise SecAggError(f"share box from {sender}, not a neighbour with keys")
            key = box_key(self._c_sk, self.keys[sender].c_pk, self.context)
            try:
                plain = ChaCha20Poly1305(key).decrypt(box_nonce(sender, self.agent), box, self.context)
            except InvalidTag:
                raise UnopenedBox(sender, "does not open (altered?)") from None
            try:
                s, r, rnd, b_share, sk_share = msgpack.unpackb(plain, raw=False)
            except (ValueError, TypeError, msgpack.UnpackException):
                raise UnopenedBox(sender, "is malformed") from None
            if (s, r, rnd) != (sender, self.agent, self.round) or not all(
                isinstance(x, bytes) and len(x) == SHARE_BYTES + 2 for x in (b_share, sk_share)
            ):
                raise UnopenedBox(sender, "is not for me in this round")
            self.held[sender] = (b_share, sk_share)
        if not msg.boxes:
            raise SecAggError("no neighbour completed the share stage: my input would not be hidden")
        self.masking_with = tuple(sorted(msg.boxes))

    def advertise_ahead(self) -> AheadKeys | None:
        """Fresh key pairs for the setup's ``next_round``, signed for that round alone
        (and bound to this one), to go with the masked input; None if the setup names no
        next round."""
        target = self.setup.next_round
        if target <= self.round:
            return None
        c_raw, s_raw = self._rand(32), self._rand(32)
        c_pk = X25519PrivateKey.from_private_bytes(c_raw).public_key().public_bytes_raw()
        s_pk = X25519PrivateKey.from_private_bytes(s_raw).public_key().public_bytes_raw()
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(ahead_statement(self.agent, target, self.context, c_pk, s_pk))
        return AheadKeys(target, self.context, c_raw, s_raw, SecAggKeys(target, c_pk, s_pk, cert, sig))

    def premask(self, size: int) -> None:
        """Draws the mask sum for an update of ``size`` values ahead of the update: the
        self mask and the pairwise mask of every neighbour in the roster (the masks do
        not depend on the update, and the keys are agreed once the roster is in). The
        masked input then only quantises the update onto it, and takes back the mask of
        a neighbour whose shares never came (it will not be masking with this agent).
        Costs one uint32 vector of ``size`` values until the masked input is made."""
        if not self.holders or self.masked_sent or self._premask is not None or size < 1:
            return
        streams = self._mask_streams(sorted(self.keys))
        m = np.zeros(size, np.uint32)
        streams.add_all(m)
        self._premask = (m, frozenset(self.keys))

    def _mask_streams(self, neighbours: Sequence[str], sign: int = 1, self_mask: bool = True) -> MaskStreams:
        streams = MaskStreams()
        if self_mask:
            streams.add_stream(self._b, SELF_NONCE, sign)
        for j in neighbours:
            seed = pair_seed(self._s_sk, self.keys[j].s_pk, self.context)
            streams.add_stream(seed, sign=sign * mask_sign(self.agent, j))
        return streams

    def masked_input(self, delta: np.ndarray | Delta, num_samples: int) -> np.ndarray:
        """``delta``: this round's update minus the global model (:func:`flatten` order,
        or a :class:`Delta`). Quantised and masked in one pass, block by block: the self
        mask and each neighbour's pairwise mask (or the sum drawn by :meth:`premask`)
        are added to a block while it is in cache."""
        if not self.masking_with:
            raise SecAggError("no share box yet")
        if self.masked_sent:
            raise SecAggError("masked input already made for this round")
        size = delta.size
        pre, self._premask = self._premask, None
        if pre is not None and pre[0].size == size and set(self.masking_with) <= pre[1]:
            # The sum drawn ahead, less the masks of neighbours that did not share.
            y = pre[0]
            streams = self._mask_streams(sorted(pre[1] - set(self.masking_with)), sign=-1, self_mask=False)
            q = np.empty(min(size, BLOCK), np.uint32)
        else:
            y = np.empty(size, np.uint32)
            streams = self._mask_streams(self.masking_with)
            q = None
        work = np.empty(min(size, BLOCK))
        scale = self.setup.ratio(num_samples)
        pos = 0
        for v in delta_blocks(delta, work):
            out = y[pos : pos + v.size]
            if q is None:
                quantise_block(v, self.params, scale, out, work)
            else:
                quantise_block(v, self.params, scale, q[: v.size], work)
                np.add(out, q[: v.size], out=out)
            if streams:
                streams.apply(out)
            pos += v.size
        self.masked_sent = True
        return y

    def on_survivors(self, msg: SecAggSurvivors) -> SecAggSignature:
        """Sign the round's survivor list: once per round, and only a list that names
        this agent (it sent its input), agents of the round and enough of them."""
        if msg.round != self.round:
            raise SecAggError(f"survivor list for round {msg.round}, I am in round {self.round}")
        if not self.masked_sent:
            raise SecAggError("survivor list before I sent my masked input")
        survivors = tuple(sorted(set(msg.survivors)))
        if self.signed is not None:
            if survivors == self.signed:  # a redelivery: the same signature again
                return self._sign_list(survivors)
            raise SecAggError("a second, different survivor list for this round: not signed")
        if self.agent not in survivors:
            raise SecAggError("the survivor list leaves me out, but I sent my masked input")
        stray = set(survivors) - self.selected
        if stray:
            raise SecAggError(f"the survivor list names agents outside the round: {sorted(stray)[:3]}")
        if len(survivors) < self.params.min_survivors:
            raise SecAggError(f"a survivor list of {len(survivors)} is below min_survivors {self.params.min_survivors}")
        self.signed = survivors
        return self._sign_list(survivors)

    def _sign_list(self, survivors: tuple[str, ...]) -> SecAggSignature:
        cert, sig = b"", b""
        if self._sign is not None:
            cert, sig = self._sign(list_statement(self.agent, self.context, survivors))
        return SecAggSignature(self.round, cert, sig)

    def _list_signers(self, signatures: Mapping[str, tuple[bytes, bytes]]) -> int:
        """How many agents on the list this agent signed signed that same list."""
        assert self.signed is not None
        valid = 0
        for name, (cert, sig) in signatures.items():
            if name not in self.signed:
                continue
            if self._verify is not None:
                try:
                    self._verify(name, list_statement(name, self.context, self.signed), cert, sig)
                except Exception:  # noqa: BLE001 - any failure: the signature does not count
                    continue
            valid += 1
        return valid

    def on_unmask(self, msg: SecAggUnmask) -> SecAggReveal:
        """The shares asked for, unless the request could reveal a single input or does
        not come with enough signatures of the survivor list this agent signed: then a
        refusal, and nothing."""

        def refuse(why: str) -> SecAggReveal:
            return SecAggReveal(self.round, {}, {}, refused=why)

        if msg.round != self.round:
            return refuse(f"request for round {msg.round}, I am in round {self.round}")
        if not self.masked_sent:
            return refuse("I sent no masked input this round")
        both = set(msg.b_of) & set(msg.sk_of)
        if both:
            return refuse(f"both shares asked for {sorted(both)[0]}")
        if self.agent in msg.sk_of:
            return refuse("asked for my own key share, but I sent my input")
        for name in msg.b_of:
            if self.revealed.get(name, "b") != "b":
                return refuse(f"asked for the seed share of {name} after its key share")
        for name in msg.sk_of:
            if self.revealed.get(name, "sk") != "sk":
                return refuse(f"asked for the key share of {name} after its seed share")
        if msg.survivors < self.params.min_survivors:
            return refuse(f"a sum of {msg.survivors} input(s) is below min_survivors {self.params.min_survivors}")
        if self.signed is None:
            return refuse("asked for shares before I signed the survivor list")
        listed = set(self.signed)
        if msg.survivors != len(listed) or not set(msg.b_of) <= listed or set(msg.sk_of) & listed:
            return refuse("the request does not match the survivor list I signed")
        need = self.params.threshold_of(len(self.selected))
        signers = self._list_signers(msg.signatures)
        if signers < need:
            return refuse(
                f"only {signers} valid signatures of the survivor list I signed, need {need} "
                f"of the {len(self.selected)} agents selected"
            )
        unknown = (set(msg.b_of) | set(msg.sk_of)) - set(self.held)
        if unknown:
            return refuse(f"I hold no shares of {sorted(unknown)[0]}")
        for name in msg.b_of:
            self.revealed[name] = "b"
        for name in msg.sk_of:
            self.revealed[name] = "sk"
        return SecAggReveal(self.round, {n: self.held[n][0] for n in msg.b_of}, {n: self.held[n][1] for n in msg.sk_of})


@dataclass(frozen=True, slots=True)
class _Trained:
    base_version: int
    num_samples: int
    metrics: dict[str, float]
    leaving: bool
    delta: np.ndarray | Delta = field(repr=False)


class SecAggAgent:
    """An agent across secure rounds: a :class:`SecAggClient` for the round it is
    selected for, and its trained update held until its share box is in (training and
    the key stages run at the same time). Every method returns the messages to send to
    the coordinator; a protocol error ends this agent's part in the round (``error``)."""

    def __init__(
        self,
        agent: str,
        *,
        sign: Signer | None = None,
        verify: KeyVerifier | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.agent = agent
        self._sign = sign
        self._verify = verify
        self._rand = random_bytes
        self.client: SecAggClient | None = None
        self.round = 0
        self._trained: _Trained | None = None
        self.error = ""
        self.refusals: list[str] = []
        self.ahead: AheadKeys | None = None  # keys advertised for a later round (at most one set)
        self._early: SecAggRoster | None = None  # a roster that came before its round's start

    def on_round_start(self, round_: int, selected: Sequence[str], setup: SecAggSetup) -> list[SecAggMessage]:
        if round_ <= self.round:
            return []
        self.round, self.client, self._trained, self.error = round_, None, None, ""
        keys = self.ahead
        if keys is not None and keys.round <= round_:
            # Used in this round or never: a key pair serves one round.
            self.ahead = None
        early, self._early = self._early, None
        if self.agent not in selected:
            return []
        try:
            self.client = SecAggClient(
                self.agent,
                round_,
                selected,
                setup,
                sign=self._sign,
                verify=self._verify,
                random_bytes=self._rand,
                keys=keys if setup.ahead else None,
            )
        except SecAggError as exc:
            return self._fail(exc)
        if not setup.ahead:
            return [self.client.advertise()]
        if early is not None and early.round == round_:
            return self.on_message(early)
        return []

    def _fail(self, exc: SecAggError) -> list[SecAggMessage]:
        self.error = str(exc)
        self.client = None
        self._trained = None
        return []

    def on_message(self, msg: SecAggMessage) -> list[SecAggMessage]:
        cl = self.client
        if isinstance(msg, SecAggRoster) and msg.round > self.round:
            # Sent right after the round's start, but overtook it: kept for it.
            self._early = msg
            return []
        if cl is None or getattr(msg, "round", None) != cl.round:
            return []
        try:
            if isinstance(msg, SecAggRoster):
                return [cl.on_roster(msg)]
            if isinstance(msg, SecAggShareBox):
                try:
                    cl.on_sharebox(msg)
                except UnopenedBox as exc:
                    # Said to the coordinator, which can then go on without this agent
                    # at once (a drop-out) instead of waiting for its input.
                    self._fail(exc)
                    return [SecAggReveal(msg.round, {}, {}, refused=UNOPENED_BOX + exc.sender)]
                return self._maybe_input()
            if isinstance(msg, SecAggSurvivors):
                return [cl.on_survivors(msg)]
            if isinstance(msg, SecAggUnmask):
                reveal = cl.on_unmask(msg)
                if reveal.refused:
                    self.refusals.append(reveal.refused)
                return [reveal]
        except SecAggError as exc:
            return self._fail(exc)
        return []

    def on_trained(
        self,
        round_: int,
        delta: np.ndarray | Delta,
        *,
        base_version: int,
        num_samples: int,
        metrics: Mapping[str, float],
        leaving: bool = False,
    ) -> list[SecAggMessage]:
        """``delta``: the trained weights minus the round's model (:func:`flatten` order,
        or a :class:`Delta`)."""
        if self.client is None or round_ != self.client.round:
            return []
        self._trained = _Trained(base_version, num_samples, dict(metrics), leaving, delta)
        return self._maybe_input()

    def prepare(self, size: int | None = None) -> None:
        """Draws this round's mask sum ahead (:meth:`SecAggClient.premask`) once the
        roster is in, for an update of ``size`` values (default: the size of the update
        already trained, if any). Worth calling while the agent would otherwise wait
        (training, or the share stage's round trip); never needed."""
        cl = self.client
        if cl is None or cl.masked_sent:
            return
        if size is None and self._trained is not None:
            size = self._trained.delta.size
        if size:
            cl.premask(size)

    def _maybe_input(self) -> list[SecAggMessage]:
        cl, tr = self.client, self._trained
        if cl is None or tr is None or not cl.masking_with or cl.masked_sent:
            return []
        try:
            y = cl.masked_input(tr.delta, tr.num_samples)
        except SecAggError as exc:
            return self._fail(exc)
        self._trained = None
        ahead = cl.advertise_ahead()
        if ahead is not None:
            self.ahead = ahead
        return [
            SecAggMasked(
                cl.round,
                tr.base_version,
                tr.num_samples,
                tr.metrics,
                {"masked": y.view(np.int32)},
                tr.leaving,
                None if ahead is None else ahead.public,
            )
        ]
