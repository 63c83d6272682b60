"""Fuzz the wire decoder: random and mutated inputs; nothing but CodecError may escape.

Run (from the repository root):

    .venv/bin/python tests/fuzz_codec.py                   # 10**6 inputs
    .venv/bin/python tests/fuzz_codec.py --count 100000 --seed 7
    .venv/bin/python tests/fuzz_codec.py --skip-scan       # the msgpack layer alone, header scan off
    .venv/bin/python tests/fuzz_codec.py --atheris         # coverage-guided, if atheris is installed

Every input goes through ``decode`` (under the default limits and under tight ones);
what decodes goes on through ``decode_weights`` and, for chunks, a ``Reassembler``.
Prints the count of inputs, how many decoded, and each exception that was not a
CodecError (with the input in hex); exits 1 if there was any. The name keeps pytest
from collecting it; the test suite runs a short Hypothesis version of the same.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter

import msgpack
import numpy as np

from fedagent.errors import CodecError
from fedagent.protocols.chunking import Reassembler, split
from fedagent.protocols.codec import Envelope, Limits, decode, decode_weights, encode, encode_weights

LIMITS = [
    Limits(),
    Limits(
        max_depth=3,
        max_objects=64,
        max_array_len=8,
        max_map_len=8,
        max_str_len=16,
        max_bin_len=256,
        max_tensor_bytes=64,
        max_tensor_dims=2,
    ),
]

# Headers that are most likely to find a bug: lying lengths, ext types, the unused 0xc1.
INTERESTING = [
    b"\xdd\x7f\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc7\x00\x05",
    b"\xc7\x00\xff",
    b"\xd6\xff\x00\x00\x00\x00",
    b"\xd4\x01\x00",
    b"\xc1",
    b"\x91" * 64,
    b"\x81\xa1k" * 64,
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",
    b"\xa2\xff\xfe",
    b"\xa3\xed\xa0\x80",
    b"\xc4\x00",
    b"\x80",
    b"\x90",
    b"\xc0",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xd3\x80" + b"\x00" * 7,
]
BYTES = [
    0x00,
    0x01,
    0x7F,
    0x80,
    0x81,
    0x88,
    0x8F,
    0x90,
    0x9F,
    0xA0,
    0xBF,
    0xC0,
    0xC1,
    0xC2,
    0xC3,
    0xC4,
    0xC5,
    0xC6,
    0xC7,
    0xCA,
    0xCB,
    0xCC,
    0xCF,
    0xD3,
    0xD4,
    0xD8,
    0xD9,
    0xDB,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0xE0,
    0xFF,
]


def seeds() -> list[bytes]:
    def env(kind: str, body: dict) -> bytes:
        return encode(Envelope(kind=kind, federation="fed", sender="agent-7", round=3, seq=41, ts=1.7e9, body=body))

    weights = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([1, 0], np.int8),
        "m": np.array([True]),
        "z": np.zeros((0, 4), np.float16),
    }
    whole = env(
        "update",
        {
            "round": 3,
            "base_version": 2,
            "num_samples": 10,
            "metrics": {"loss": 0.5},
            "weights": encode_weights(weights),
        },
    )
    chunks = [env("chunk", b) for b in split(whole, max_chunk=64, transfer_id="t-1")]
    # A gradient with a sliced tensor (columns 1 and 3 of a 2 x 5 float32 sent).
    sliced = {
        "dtype": "float32",
        "shape": [2, 5],
        "axis": 1,
        "index": np.array([1, 3], "<u4").tobytes(),
        "data": np.arange(4, dtype=np.float32).tobytes(),
    }
    gradient = env(
        "sync_gradient",
        {
            "step": 3,
            "base_version": 2,
            "num_samples": 8,
            "loss": 0.5,
            "gradient": {"w": sliced, **encode_weights({"b": weights["b"]})},
        },
    )
    return [
        whole,
        gradient,
        *chunks[:3],
        chunks[-1],
        env(
            "presence",
            {
                "online": True,
                "role": "agent",
                "mode": "fedavg",
                "num_samples": 0,
                "model_version": 0,
                "broker": "mqtts://x:8883",
            },
        ),
        env("round_result", {"participants": ["a", "b"], "reason": "ünïcödé ✓", "nested": [[[{"x": None}]]]}),
        env("x", {"ints": [0, -1, 127, 128, -33, 2**63 - 1, -(2**63), 2**64 - 1], "f": [0.0, -0.0, 1e308]}),
    ]


def random_value(rnd: random.Random, depth: int = 0) -> object:
    """Any msgpack value, including what the decoder must refuse (ext, non-str keys)."""
    choice = rnd.randrange(12 if depth < 5 else 9)
    if choice == 0:
        return None
    if choice == 1:
        return rnd.random() < 0.5
    if choice == 2:
        return rnd.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, rnd.randrange(-(2**40), 2**40)])
    if choice == 3:
        return rnd.choice([0.0, float("nan"), float("inf"), rnd.random()])
    if choice == 4:
        return "".join(chr(rnd.randrange(0x20, 0x3000)) for _ in range(rnd.randrange(8)))
    if choice == 5:
        return rnd.randbytes(rnd.randrange(16))
    if choice == 6:
        return msgpack.ExtType(rnd.randrange(128), rnd.randbytes(rnd.choice([0, 1, 4, 8, 12])))
    if choice == 7:
        return {
            "dtype": rnd.choice(["float32", "int8", "bool", "object", "V8", "<U4"]),
            "shape": [rnd.randrange(-2, 5) for _ in range(rnd.randrange(4))],
            "data": rnd.randbytes(rnd.randrange(40)),
        }
    if choice == 8:
        return rnd.choice(["", "a", "weights", "k"])
    if choice in (9, 10):
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    keys: list[object] = ["weights", "a", "b", 1, b"k", None, 1.5]
    return {rnd.choice(keys): random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))}


def generate(rnd: random.Random, corpus: list[bytes]) -> bytes:
    how = rnd.randrange(10)
    if how == 0:
        return rnd.randbytes(rnd.randrange(600))
    if how == 1:  # an envelope written by hand around an arbitrary body
        top = {
            "v": rnd.choice([1, 1, 1, 2, True]),
            "k": "update",
            "f": "fed",
            "s": "agent-7",
            "r": 1,
            "q": 2,
            "t": 1.0,
            "b": {"weights": random_value(rnd), "x": random_value(rnd)},
        }
        if rnd.random() < 0.2:
            top[rnd.choice(["x", 1, "b"])] = random_value(rnd)  # type: ignore[index]
        try:
            return msgpack.packb(top, use_bin_type=True)
        except (ValueError, TypeError, OverflowError):
            return b"\x80"
    if how == 2:  # splice two seeds
        a, b = rnd.choice(corpus), rnd.choice(corpus)
        return a[: rnd.randrange(len(a) + 1)] + b[rnd.randrange(len(b) + 1) :]
    data = bytearray(rnd.choice(corpus))
    for _ in range(rnd.randrange(1, 9)):
        op = rnd.randrange(7)
        at = rnd.randrange(len(data) + 1)
        if op == 0 and data:
            data[at % len(data)] = rnd.choice(BYTES) if rnd.random() < 0.5 else rnd.randrange(256)
        elif op == 1 and data:
            data[at % len(data)] ^= 1 << rnd.randrange(8)
        elif op == 2:
            data[at:at] = rnd.choice(INTERESTING)
        elif op == 3:
            del data[at : at + rnd.randrange(1, 16)]
        elif op == 4:
            end = rnd.randrange(at, len(data) + 1)
            data[end:end] = data[at:end]
        elif op == 5:
            del data[at:]
        elif op == 6 and data:  # rewrite a length: a following 1/2/4-byte big-endian field
            width = rnd.choice([1, 2, 4])
            data[at : at + width] = rnd.choice([0, 1, 2 ** (8 * width) - 1, rnd.randrange(2 ** (8 * width))]).to_bytes(
                width, "big"
            )
    return bytes(data)


def check(data: bytes, limits: Limits, reassembler: Reassembler, n: int) -> bool:
    """Run one input through the decoder and what follows it; True if it decoded."""
    try:
        env = decode(data, limits)
    except CodecError:
        return False
    weights = env.body.get("weights")
    if weights is not None:
        try:
            decode_weights(weights, limits)
        except CodecError:
            pass
    gradient = env.body.get("gradient")
    if gradient is not None:
        try:
            decode_weights(gradient, limits, sliced=True)
        except CodecError:
            pass
    if env.kind == "chunk":
        try:
            reassembler.feed(env.sender, env.body, float(n))
        except CodecError:
            pass
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10**6, help="inputs to try (default 10**6)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris instead")
    ap.add_argument(
        "--skip-scan", action="store_true", help="switch the header scan off, to fuzz the second line of defence alone"
    )
    args, rest = ap.parse_known_args()
    if args.skip_scan:
        from fedagent.protocols import codec

        codec._scan = lambda *a: None  # type: ignore[assignment]

    if args.atheris:
        try:
            import atheris  # type: ignore[import-not-found]
        except ImportError:
            print("atheris is not installed (pip install atheris)", file=sys.stderr)
            return 2
        r = Reassembler(2**20, 2**22, 60.0)

        def one_input(data: bytes) -> None:
            for limits in LIMITS:
                check(data, limits, r, 0)

        atheris.Setup([sys.argv[0], *rest], one_input)
        atheris.Fuzz()
        return 0

    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rnd = random.Random(seed)
    corpus = seeds()
    reassembler = Reassembler(2**20, 2**22, 60.0)
    decoded = 0
    failures: Counter[str] = Counter()
    shown = 0
    start = time.monotonic()
    for n in range(args.count):
        data = generate(rnd, corpus)
        limits = LIMITS[n % len(LIMITS)]
        try:
            decoded += check(data, limits, reassembler, n)
        except Exception as exc:  # the bug this script looks for
            key = f"{type(exc).__name__}: {exc}"[:200]
            failures[key] += 1
            if shown < 20:
                shown += 1
                print(f"\n!! input {n} escaped with {type(exc).__name__}: {exc}\n   hex: {data[:400].hex()}")
                traceback.print_exc(limit=4)
        if n % 1000 == 999:
            reassembler.expire(float(n))
        if (n + 1) % 100_000 == 0:
            print(
                f"{n + 1} inputs, {decoded} decoded, {sum(failures.values())} escapes, "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
    elapsed = time.monotonic() - start
    print(
        f"seed {seed}: {args.count} inputs in {elapsed:.1f} s; {decoded} decoded, "
        f"{args.count - decoded - sum(failures.values())} refused with CodecError, "
        f"{sum(failures.values())} other exceptions"
    )
    for key, count in failures.most_common():
        print(f"  {count} x {key}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
