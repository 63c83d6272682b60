"""The cryptographic building blocks of a secure round: the neighbour graph, key
agreement (X25519 and HKDF) for pairwise masks and share boxes, Shamir's secret sharing
over a prime field, and the statements an agent signs. Deterministic given the caller's
randomness."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedagent.protocols.secagg.params import SecAggError

PRIME = 2**521 - 1  # Shamir field; a Mersenne prime above every 32-byte secret
SHARE_BYTES = 66  # a field element, big-endian
KEY_DOMAIN = b"fedagent-secagg-keys/1"
AHEAD_DOMAIN = b"fedagent-secagg-keys-ahead/2"
LIST_DOMAIN = b"fedagent-secagg-survivors/1"

Signer = Callable[[bytes], tuple[bytes, bytes]]  # statement -> (cert, sig)
KeyVerifier = Callable[[str, bytes, bytes, bytes], None]  # (agent, statement, cert, sig); raises


# ---- the neighbour graph ---------------------------------------------------------------
def _degree(n: int, configured: int) -> int:
    if n <= 1:
        return 0
    k = configured or 2 * math.ceil(math.log2(n))
    if k >= n - 1:
        return n - 1
    return k + (k % 2)  # each node takes k/2 on either side of the ring


def neighbour_graph(agents: Sequence[str], seed: bytes, degree: int = 0) -> dict[str, tuple[str, ...]]:
    """The round's sparse graph: everyone computes the same one from the sorted agents
    and the round's seed (a hash order, the same on every platform)."""
    order = sorted(set(agents), key=lambda a: hashlib.sha256(seed + a.encode()).digest())
    n = len(order)
    k = _degree(n, degree)
    if k >= n - 1:
        return {a: tuple(sorted(b for b in order if b != a)) for a in order}
    out: dict[str, tuple[str, ...]] = {}
    for p, a in enumerate(order):
        near = {order[(p + d) % n] for d in range(1, k // 2 + 1)} | {order[(p - d) % n] for d in range(1, k // 2 + 1)}
        out[a] = tuple(sorted(near))
    return out


# ---- key agreement -----------------------------------------------------------------
def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def check_public_key(pk: bytes) -> None:
    """Raises :class:`SecAggError` unless ``pk`` is an X25519 public key that agrees a
    key with anyone: a low-order point (all zeros, say) makes every exchange with it
    fail, and would fail the agents and the coordinator later, deep in their stages."""
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(pk))
    except ValueError:
        raise SecAggError("not a usable X25519 public key (a low-order point?)") from None


_PROBE = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"fedagent-secagg-key-probe").digest())


def pair_seed(own_sk: X25519PrivateKey, their_pk: bytes, context: bytes) -> bytes:
    """The seed of the pairwise mask two agents agree on (the same from either side)."""
    shared = own_sk.exchange(X25519PublicKey.from_public_bytes(their_pk))
    return _hkdf(shared, b"fedagent-secagg-mask/1|" + context)


def box_key(own_sk: X25519PrivateKey, their_pk: bytes, context: bytes) -> bytes:
    """The ChaCha20-Poly1305 key of the share boxes between two agents in one round."""
    shared = own_sk.exchange(X25519PublicKey.from_public_bytes(their_pk))
    return _hkdf(shared, b"fedagent-secagg-box/1|" + context)


def box_nonce(sender: str, receiver: str) -> bytes:
    # One box per direction per round under a key used for one round: sender and
    # receiver in the nonce keep i→j and j→i apart.
    return hashlib.sha256(f"{sender}>{receiver}".encode()).digest()[:12]


# ---- Shamir's secret sharing ---------------------------------------------------------
def shamir_split(secret: bytes, xs: Sequence[int], t: int, random_bytes: Callable[[int], bytes]) -> dict[int, bytes]:
    s = int.from_bytes(secret, "big")
    coeffs = [s] + [int.from_bytes(random_bytes(SHARE_BYTES), "big") % PRIME for _ in range(t - 1)]
    out: dict[int, bytes] = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def shamir_at(shares: Mapping[int, bytes], at: int) -> int:
    """The value at ``at`` of the polynomial through ``shares`` (x -> y), by Lagrange
    interpolation; the secret is the value at 0."""
    pts = [(x, int.from_bytes(y, "big")) for x, y in shares.items()]
    if len({x for x, _ in pts}) != len(pts) or any(x % PRIME == 0 for x, _ in pts):
        raise SecAggError("shares at repeated or zero x")
    s = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        s = (s + yi * num * pow(den, -1, PRIME)) % PRIME
    return s


def shamir_combine(shares: Mapping[int, bytes], size: int = 32) -> bytes:
    s = shamir_at(shares, 0)
    if s >= 1 << (8 * size):
        raise SecAggError("shares do not rebuild a secret of the expected size")
    return s.to_bytes(size, "big")


def pack_share(x: int, y: bytes) -> bytes:
    return x.to_bytes(2, "big") + y


def unpack_share(data: bytes) -> tuple[int, bytes]:
    if len(data) != SHARE_BYTES + 2:
        raise SecAggError("malformed share")
    return int.from_bytes(data[:2], "big"), data[2:]


# ---- what agents sign ------------------------------------------------------------------
def key_statement(agent: str, context: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    """What an agent signs for its advertised keys (bound to the round and itself)."""
    return msgpack.packb([KEY_DOMAIN, context, agent, c_pk, s_pk], use_bin_type=True)


def ahead_statement(agent: str, round_: int, advertised_in: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    """What an agent signs for keys advertised ahead: bound to the one round they are for
    (``round_``) and to the round they were advertised in (its context: round and seed)."""
    return msgpack.packb([AHEAD_DOMAIN, round_, advertised_in, agent, c_pk, s_pk], use_bin_type=True)


def list_statement(agent: str, context: bytes, survivors: Sequence[str]) -> bytes:
    """What an agent signs in the consistency stage: the round's survivor list."""
    return msgpack.packb([LIST_DOMAIN, context, agent, sorted(survivors)], use_bin_type=True)
