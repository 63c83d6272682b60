"""Streamed updates under message signing and next to the robust aggregators.

A ``ustream`` chunk is a frame like any other: signed by its sender (its data bound by
the signed SHA-256 of the whole stream), checked against the sender's certificate,
fresh (replay window), from an *agent* certificate only, and its inner header bound to
the chunks' signed round. Robust aggregators and ``clip_norm`` need whole updates: the
round says so to the agents, streams are refused, and compression (streams only) is
refused with them at start."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from fedagent.errors import ConfigError
from fedagent.node.messaging import Messenger
from fedagent.protocols import topics
from fedagent.protocols.aggregation import Strategy
from fedagent.protocols.codec import Envelope, decode, encode
from fedagent.protocols.compression import CompressionConfig, Compressor
from fedagent.protocols.messages import TrainConfig, Update
from fedagent.protocols.rounds import AgentOnline, Rejected, RoundConfig, RoundMachine, StartRound
from fedagent.protocols.streaming import (
    HEAD_KIND,
    STREAM_KIND,
    UpdateEnd,
    UpdateHead,
    UpdatePart,
    encode_stream,
    head_body,
    iter_stream_chunks,
)
from fedagent.security.signing import Identity, sign

FED = "testfed"
TOPIC = topics.direct(FED, "agent-a", "coord", "update")
MODEL = {"w": np.linspace(-1, 1, 3000, dtype=np.float32).reshape(60, 50), "b": np.arange(7, dtype=np.float32)}


def ident(pki, name: str) -> Identity:
    t = pki.tls(name)
    return Identity.load(t.cert, t.key, pki.ca)


class Capture:
    """A transport that keeps what is published (the frames as they go on the wire)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    async def publish(self, topic, payload, qos=1, retain=False, timeout=None) -> None:
        self.frames.append(bytes(payload))


def streamed(pki, *, sender="agent-a", mode="none", round_=3) -> list[bytes]:
    out = Capture()
    m = Messenger(federation=FED, node_id=sender, transport=out, identity=ident(pki, sender), max_chunk_bytes=1024)
    new = {k: v + np.float32(0.01) for k, v in MODEL.items()}
    upd = Update(round_, 0, 10, {"loss": 0.5}, new)
    asyncio.run(m.send_update(TOPIC, upd, base=MODEL, compressor=Compressor(CompressionConfig(mode, 0.1))))
    return out.frames


def receiver(pki) -> tuple[Messenger, list]:
    recv = Messenger(
        federation=FED, node_id="coord", transport=None, identity=ident(pki, "coord"), max_chunk_bytes=1024
    )
    events: list = []

    async def on_stream(evs):
        events.extend(evs)

    recv.on_stream = on_stream
    return recv, events


def feed(recv: Messenger, frames: list[bytes], topic: str = TOPIC) -> None:
    async def deliver(inc):
        raise AssertionError(f"a stream chunk was delivered as a message: {inc.message.kind}")

    async def run():
        for f in frames:
            await recv.receive(topic, f, deliver)

    asyncio.run(run())


def test_every_stream_chunk_is_signed_and_a_signed_stream_is_folded(pki) -> None:
    frames = streamed(pki, mode="int8")
    assert len(frames) > 3
    for f in frames:
        env = decode(f)
        assert env.kind == STREAM_KIND and env.sig and env.cert and env.round == 3
    recv, events = receiver(pki)
    feed(recv, frames)
    assert dict(recv.rejected) == {}
    assert isinstance(events[0], UpdateHead) and events[0].round == 3
    assert any(isinstance(e, UpdatePart) and e.delta for e in events)  # int8 deltas, decoded by the intake
    assert events[-1] == UpdateEnd("agent-a", events[0].tid, True)


def test_unsigned_altered_replayed_and_coordinator_streams_are_refused(pki) -> None:
    frames = streamed(pki)
    recv, events = receiver(pki)
    # Unsigned: the signature and certificate stripped.
    feed(recv, [encode(dataclasses.replace(decode(frames[0]), sig=b"", cert=b""))])
    # A signed field changed in transit (the round).
    feed(recv, [encode(dataclasses.replace(decode(frames[0]), round=4))])
    assert dict(recv.rejected) == {"unsigned": 1, "signature": 1} and events == []
    # The genuine first chunk is accepted once; the same frame again is a replay.
    feed(recv, [frames[0], frames[0]])
    assert recv.rejected["replay"] == 1
    assert isinstance(events[0], UpdateHead) and not any(isinstance(e, UpdateEnd) for e in events)
    # A coordinator's certificate may sign frames, but not an update stream.
    coord_frames = streamed(pki, sender="coord")
    recv2, events2 = receiver(pki)
    feed(recv2, coord_frames, topics.direct(FED, "coord", "coord", "update"))
    assert recv2.rejected["role"] == len(coord_frames) and events2 == []


def test_tampered_chunk_data_ends_the_stream_failed(pki) -> None:
    """Chunk data are outside the signature (bound by the signed stream digest): a
    changed byte passes the signature and fails the stream at its end."""
    frames = streamed(pki)
    env = decode(frames[2])
    data = bytearray(env.body["data"])
    data[10] ^= 0xFF
    frames[2] = encode(dataclasses.replace(env, body={**env.body, "data": bytes(data)}))
    recv, events = receiver(pki)
    feed(recv, frames)
    assert events[-1].ok is False and "sha256" in events[-1].reason
    assert recv.rejected["stream"] == 1


def test_stream_header_of_another_round_than_its_signed_chunks_is_refused(pki) -> None:
    a = ident(pki, "agent-a")
    tensors = Compressor().encode(MODEL, None)
    head = Envelope(
        kind=HEAD_KIND,
        federation=FED,
        sender="agent-a",
        round=2,
        seq=1,
        ts=time.time(),
        body=head_body(2, 0, 10, {}, False, tensors),
    )
    payload = encode_stream(head, tensors)
    seq = time.time_ns() // 1000
    frames = [
        encode(
            sign(
                Envelope(
                    kind=STREAM_KIND, federation=FED, sender="agent-a", round=3, seq=seq + i, ts=time.time(), body=body
                ),
                a,
            )
        )
        for i, body in enumerate(iter_stream_chunks(payload, max_chunk=2048, transfer_id="t"))
    ]
    recv, events = receiver(pki)
    feed(recv, frames)
    assert not any(isinstance(e, (UpdateHead, UpdatePart)) for e in events)
    assert len(events) == 1 and events[0].ok is False and "round" in events[0].reason


@pytest.mark.parametrize(
    "strategy",
    [Strategy("median"), Strategy("trimmed_mean", trim=0.2), Strategy("krum"), Strategy("fedavg", clip_norm=1.0)],
)
def test_whole_update_aggregators_ask_for_whole_updates_and_refuse_streams(strategy) -> None:
    sizes = dict(min_agents=3, min_updates=3, expected_agents=3)
    cfg = RoundConfig(rounds=1, start_grace=0.0, strategy=strategy, **sizes)
    assert cfg.train.stream is False
    m = RoundMachine(cfg, {k: v.copy() for k, v in MODEL.items()})
    m.handle(AgentOnline("agent-b", 10), 0.0)
    m.handle(AgentOnline("agent-c", 10), 0.0)
    start = m.handle(AgentOnline("agent-a", 10), 0.0)
    assert isinstance(start[0], StartRound) and start[0].train.stream is False
    assert TrainConfig.from_body(start[0].train.to_body()).stream is False
    tensors = Compressor().encode(MODEL, None)
    head = UpdateHead("agent-a", "t", 1, 0, 10, {}, False, tuple(s for s, _ in tensors))
    out = m.handle(head, 1.0)
    assert out and isinstance(out[0], Rejected) and out[0].reason == "stream"
    with pytest.raises(ValueError, match="compression"):
        RoundConfig(rounds=1, strategy=strategy, train=TrainConfig(compression="int8"), **sizes)


def test_fedavg_streams_by_default() -> None:
    assert RoundConfig().train.stream is True
    assert TrainConfig.from_body(TrainConfig().to_body()).stream is True


def _config(tmp_path, pki, aggregation: str, transfer: str, extra: str = "") -> ConfigError | None:
    rc = _round_config(tmp_path, pki, aggregation, transfer, extra)
    return rc if isinstance(rc, ConfigError) else None


def _round_config(tmp_path, pki, aggregation: str, transfer: str, extra: str = ""):
    from fedagent.config import load
    from fedagent.coordinator.fedavg import round_config

    t = pki.tls("coord")
    p = tmp_path / f"{aggregation}.toml"
    p.write_text(
        f'id = "coord"\nfederation = "{FED}"\nstate_dir = "{tmp_path}"\n'
        f'[broker]\nuri = "mqtts://127.0.0.1:1"\n[tls]\nca = "{t.ca}"\ncert = "{t.cert}"\nkey = "{t.key}"\n'
        f'[rounds]\naggregation = "{aggregation}"\nmin_agents = 5\nmin_updates = 5\n'
        f"{extra}\n[transfer]\n{transfer}\n"
    )
    try:
        return round_config(load(p, role="coordinator"))
    except ConfigError as exc:
        return exc


def test_config_refuses_streams_or_compression_with_a_whole_update_aggregator(tmp_path, pki) -> None:
    err = _config(tmp_path, pki, "median", 'compression = "int8"')
    assert err is not None and "compression" in str(err)
    err = _config(tmp_path, pki, "krum", "stream_updates = true")
    assert err is not None and "stream_updates" in str(err)
    err = _config(tmp_path, pki, "fedavg", 'stream_updates = false\ncompression = "fp16"')
    assert err is not None and "compression" in str(err)
    assert _config(tmp_path, pki, "median", "") is None
    assert _config(tmp_path, pki, "fedavg", 'compression = "topk"') is None


@pytest.mark.parametrize(
    ("aggregation", "transfer", "extra", "expected"),
    [
        ("fedavg", "", "", ("int8", True)),  # the default: streamed int8 deltas
        ("metric", "", 'weight_key = "loss"\n', ("int8", True)),
        ("fedavg", 'compression = "none"', "", ("none", True)),  # how to turn it off
        ("fedavg", 'compression = "fp16"', "", ("fp16", True)),
        ("fedavg", "stream_updates = false", "", ("none", False)),
        ("median", "", "", ("none", False)),  # whole updates: no default compression to refuse
        ("fedavg", "", "clip_norm = 5.0\n", ("none", False)),
        ("fedavg", "", "secure_aggregation = true\n", ("none", False)),
        ("fedavg", "", '[privacy]\nmode = "central"\nnoise_multiplier = 1.0\n', ("none", False)),
    ],
)
def test_default_compression_is_int8_where_updates_stream(tmp_path, pki, aggregation, transfer, extra, expected):
    # extra lands in [rounds] (or opens a table of its own)
    rc = _round_config(tmp_path, pki, aggregation, transfer, extra)
    assert not isinstance(rc, ConfigError), rc
    assert (rc.train.compression, rc.train.stream) == expected
