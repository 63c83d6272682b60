"""Secure aggregation of FedAvg updates (SecAgg+, Bell et al., CCS 2020), as pure code.

The coordinator learns the sum of a round's updates and nothing about any single one.
Each selected agent, in five stages relayed by the coordinator over the per-agent inboxes:

1. **keys** — makes two fresh X25519 key pairs for the round: ``c`` (to encrypt share
   boxes) and ``s`` (to agree pairwise masks), and advertises the public halves, signed
   with its certificate's key so a coordinator cannot substitute its own. The
   coordinator sends each agent the keys of its neighbours in a sparse graph
   (:func:`neighbour_graph`: a ring over a per-round shuffle, each node linked to the
   ``k/2`` nodes on either side, ``k = 2⌈log₂ n⌉``; complete below about 8 agents).
   **Keys ahead** (setup version 2): a round's setup may name the next round
   (``next_round``); each agent then makes fresh key pairs for that round and sends
   their public halves with its masked input, signed for that round alone and bound to
   the round they were advertised in (:func:`ahead_statement`). When every agent
   selected for that round did so, its setup says ``ahead``: no key stage, the
   coordinator sends the rosters at once (ahead of the model). Any other cohort: a key
   stage for everyone. A key pair serves one round; unused ones are thrown away.
2. **shares** — draws a self-mask seed ``b``, and splits ``b`` and its ``s`` secret key
   into Shamir shares (t of its holders: itself and its neighbours). Each neighbour's
   pair of shares is encrypted with ChaCha20-Poly1305 under a key agreed with that
   neighbour's ``c`` key: the coordinator relays boxes it cannot open.
3. **masked input** — after training, quantises its weighted update into integers mod
   2³² and adds ``PRG(b)`` and, for each neighbour j that completed stage 2,
   ``±PRG(s_ij)`` (+ if its id sorts before j's, − after). Pairwise masks cancel in the
   sum; self masks do not. The mask sum may be drawn ahead, once the roster is in
   (:meth:`SecAggClient.premask`): it does not depend on the update.
4. **consistency** (Bonawitz et al. 2017, kept by Bell et al.) — the coordinator sends
   every survivor (sent a masked input) the list of survivors; each signs it, once per
   round, with its certificate's key. An agent never signs a second list, nor one that
   leaves itself out. The coordinator checks each signature as the agents will: a
   survivor whose signature is not valid takes no further part (its input stays in the
   sum, as a survivor's that falls silent) and its signature is not passed on.
5. **unmasking** — the coordinator names the survivors and the drop-outs (shared keys,
   sent no input) and passes on the signatures of the list. An agent answers only if
   more than ``threshold`` of the round's selected agents signed the very list it
   signed: honest agents sign one list each, so two different lists can never both
   gather that many, and a coordinator cannot tell different agents different survivor
   sets. Each agent returns its share of ``b`` for a survivor and its share of ``s``'s
   secret key for a drop-out, never both for one agent: with a threshold above half the
   holders, no coordinator can collect enough shares of both and strip a survivor's
   masks. With ≥ t shares per secret the coordinator removes the self masks of
   survivors and the dangling pairwise masks of drop-outs and is left with the sum.

Quantisation (:class:`SecAggParams`): an agent's contribution is ``v = r·Δ`` with Δ its
update minus the round's global model (floating tensors only, in name order) and
``r = min(n, W)/W`` its sample weight (n its samples, W the largest sample count among
the selected agents, sent with the round). Each coordinate of v is clipped to
``[-clip, clip]`` and rounded to the nearest of ``2^bits`` levels,
``q = round((v + clip)/step)`` with ``step = 2·clip/(2^bits − 1)``: rounding error
≤ step/2. Sums are taken mod 2³², so at most ``⌊(2³²−1)/(2^bits−1)⌋`` agents fit in a
round (4096 at 20 bits). The coordinator divides the dequantised sum by Σr (sample
counts are metadata it sees, as in plain FedAvg), so each coordinate of the averaged
update is off by at most ``(m/Σr)·step/2`` for m survivors — ``step/2`` when all agents
have the same number of samples — plus whatever the clip cut off.

What this guards against, and what not: the broker and an honest-but-curious coordinator
see only masked vectors and sealed share boxes. A coordinator that lies about who
dropped out is refused the second share of any one agent, and one that tells different
agents different survivor lists gathers too few signatures of either list to be given
any share.

The package, one idea a module: :mod:`.params` (the round's parameters and setup),
:mod:`.wire` (the messages), :mod:`.crypto` (the neighbour graph, key agreement, Shamir,
what agents sign), :mod:`.masks` (quantisation and the mask streams), :mod:`.client`
(the agent's side) and :mod:`.server` (the coordinator's). Everything here is
deterministic given ``random_bytes``; no clock, socket or thread.
"""

from __future__ import annotations

from fedagent.protocols.secagg.client import AheadKeys, SecAggAgent, SecAggClient
from fedagent.protocols.secagg.crypto import (
    AHEAD_DOMAIN,
    KEY_DOMAIN,
    LIST_DOMAIN,
    PRIME,
    KeyVerifier,
    Signer,
    ahead_statement,
    key_statement,
    list_statement,
    neighbour_graph,
    pair_seed,
    shamir_combine,
    shamir_split,
)
from fedagent.protocols.secagg.masks import (
    BLOCK,
    SELF_NONCE,
    Delta,
    MaskStreams,
    delta_blocks,
    dequantise_sum,
    flatten,
    layout_size,
    mask_sign,
    quantise,
    unflatten,
)
from fedagent.protocols.secagg.params import (
    MAX_CERT,
    MAX_CLIP,
    MAX_LIST,
    MAX_NEIGHBOURS,
    MODULUS_BITS,
    SECAGG_VERSION,
    SecAggError,
    SecAggParams,
    SecAggSetup,
)
from fedagent.protocols.secagg.server import (
    Contribution,
    Failed,
    Gone,
    Received,
    Refused,
    SecAggServer,
    Send,
    ServerCommand,
    Tick,
    Unmasked,
    Wake,
)
from fedagent.protocols.secagg.wire import (
    MESSAGES,
    SecAggKeys,
    SecAggMasked,
    SecAggMessage,
    SecAggReveal,
    SecAggRoster,
    SecAggShareBox,
    SecAggShares,
    SecAggSignature,
    SecAggStart,
    SecAggSurvivors,
    SecAggUnmask,
)

# The names these had when secagg was one module (tests reach for them).
_SELF_NONCE = SELF_NONCE
_delta_blocks = delta_blocks
_sign = mask_sign

__all__ = [
    "AHEAD_DOMAIN",
    "BLOCK",
    "KEY_DOMAIN",
    "LIST_DOMAIN",
    "MAX_CERT",
    "MAX_CLIP",
    "MAX_LIST",
    "MAX_NEIGHBOURS",
    "MESSAGES",
    "MODULUS_BITS",
    "PRIME",
    "SECAGG_VERSION",
    "SELF_NONCE",
    "AheadKeys",
    "Contribution",
    "Delta",
    "Failed",
    "Gone",
    "KeyVerifier",
    "MaskStreams",
    "Received",
    "Refused",
    "SecAggAgent",
    "SecAggClient",
    "SecAggError",
    "SecAggKeys",
    "SecAggMasked",
    "SecAggMessage",
    "SecAggParams",
    "SecAggReveal",
    "SecAggRoster",
    "SecAggServer",
    "SecAggSetup",
    "SecAggShareBox",
    "SecAggShares",
    "SecAggSignature",
    "SecAggStart",
    "SecAggSurvivors",
    "SecAggUnmask",
    "Send",
    "ServerCommand",
    "Signer",
    "Tick",
    "Unmasked",
    "Wake",
    "ahead_statement",
    "delta_blocks",
    "dequantise_sum",
    "flatten",
    "key_statement",
    "layout_size",
    "list_statement",
    "mask_sign",
    "neighbour_graph",
    "pair_seed",
    "quantise",
    "shamir_combine",
    "shamir_split",
    "unflatten",
]
