"""Codec cost: an Update envelope's encode (``encode_view``, as the messenger sends a
model) and decode + validation against a plain memcpy of the same bytes into a fresh
buffer (what any framework must at least do once)."""

from __future__ import annotations

import time

from bench.env import mb, model_sizes, model_weights
from bench.registry import Context, Row, section, summary
from fedagent.protocols.codec import Envelope, Limits, decode, encode_view
from fedagent.protocols.messages import Update, body_of


def _best(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


@section("codec", rows=lambda ctx: 2 * len(model_sizes(ctx)))
def codec(ctx: Context) -> list[Row]:
    rows = []
    for params in model_sizes(ctx):
        weights = model_weights(params)
        upd = Update(round=1, base_version=0, num_samples=1, metrics={}, weights=weights)

        def enc() -> memoryview:
            # What the messenger does with a model: encoded into the encoder's own buffer.
            return encode_view(
                Envelope(
                    kind="update",
                    federation="bench",
                    sender="agent-1",
                    round=1,
                    seq=1,
                    ts=time.time(),
                    body=upd.to_body(),
                )
            )

        payload = enc()
        limits = Limits(max_message_bytes=2**30, max_bin_len=2**30, max_tensor_bytes=2**30)

        def dec() -> None:
            env = decode(payload, limits)
            body_of(env.kind, env.body, limits)

        def memcpy() -> None:
            bytes(memoryview(payload))

        reps = max(10, ctx.repeats)  # cheap: enough repetitions for a stable median
        copy_med, _ = summary(_best(memcpy, reps))
        enc_med, enc_max = summary(_best(enc, reps))
        dec_med, dec_max = summary(_best(dec, reps))
        gbs = len(payload) / 1e9
        ctx.log(
            f"codec {mb(params)}: encode {enc_med * 1e3:.1f} ms, decode {dec_med * 1e3:.1f} ms, "
            f"memcpy {copy_med * 1e3:.1f} ms"
        )
        rows.append(
            Row(
                "codec",
                f"encode Update, {mb(params)}",
                enc_med,
                "memcpy",
                copy_med,
                note=f"{gbs / enc_med:.2f} GB/s; max {enc_max * 1e3:.0f} ms",
            )
        )
        rows.append(
            Row(
                "codec",
                f"decode+validate Update, {mb(params)}",
                dec_med,
                "memcpy",
                copy_med,
                note=f"{gbs / dec_med:.2f} GB/s; max {dec_max * 1e3:.0f} ms",
            )
        )
    return rows
