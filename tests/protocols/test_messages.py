"""Typed protocol messages: round trips through the codec and refusal of bad bodies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.messages import (
    KINDS,
    GlobalModel,
    GossipAck,
    GossipModel,
    Presence,
    RoundResult,
    RoundStart,
    TrainConfig,
    Update,
    body_of,
)

W = {"layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "layer.bias": np.ones(3, np.float32)}


def roundtrip(msg):
    env = Envelope(kind=msg.kind, federation="fed", sender="agent-a", round=1, seq=5, ts=1.0, body=msg.to_body())
    back = decode(encode(env))
    return body_of(back.kind, back.body, Limits())


@pytest.mark.parametrize(
    "msg",
    [
        Presence(online=True, role="agent", num_samples=12),
        Presence(online=True, role="agent", num_samples=12, downlinks=("int8",)),
        RoundResult(3, 4, 2, {"loss": 0.5}),
        RoundResult(3, 4, 0, {}, aggregated=False, reason="deadline passed"),
        GossipAck("s1.7", True),
        GossipAck("s1.8", False, "inbox-full"),
    ],
)
def test_small_messages_roundtrip(msg):
    assert roundtrip(msg) == msg


@pytest.mark.parametrize(
    "msg",
    [
        RoundStart(2, 1, ("agent-a",), 60.0, TrainConfig(epochs=2, lr=0.1, batch_size=16), W),
        Update(2, 1, 50, {"loss": 1.25}, W),
        GlobalModel(5, 5, True, W),
        GossipModel("s1.7", 3, 12.5, 30.0, False, W),
    ],
)
def test_weight_messages_roundtrip(msg):
    back = roundtrip(msg)
    assert type(back) is type(msg)
    for k, v in W.items():
        np.testing.assert_array_equal(back.weights[k], v)
        assert back.weights[k].dtype == v.dtype


def good_update_body():
    return Update(2, 1, 50, {"loss": 1.25}, W).to_body()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("weights"),
        lambda b: b.update(num_samples=0),
        lambda b: b.update(num_samples=-3),
        lambda b: b.update(num_samples=True),
        lambda b: b.update(round="1"),
        lambda b: b.update(metrics={"loss": float("nan")}),
        lambda b: b.update(metrics={"x" * 100: 1.0}),
        lambda b: b.update(metrics=[1, 2]),
        lambda b: b.update(weights={"w": {"dtype": "object", "shape": [1], "data": b"x"}}),
    ],
)
def test_bad_update_bodies_raise_codec_error(mutate):
    body = good_update_body()
    mutate(body)
    with pytest.raises(CodecError):
        body_of("update", body, Limits())


def test_presence_of_an_earlier_release_reads_no_steps_and_bad_downlinks_are_refused():
    body = Presence(online=True, role="agent", downlinks=("int8",)).to_body()
    assert body["downlinks"] == ["int8"]
    del body["downlinks"]  # what an agent of a release before the int8 broadcast sends
    assert body_of("presence", body, Limits()).downlinks == ()
    for bad in ("int8", ["x" * 17], [""], [1], ["int8"] * 9):
        with pytest.raises(CodecError):
            body_of("presence", {**body, "downlinks": bad}, Limits())


def test_round_start_refuses_bad_selected_and_deadline():
    body = RoundStart(2, 1, ("agent-a",), 60.0, TrainConfig(), W).to_body()
    with pytest.raises(CodecError):
        body_of("round_start", {**body, "selected": ["agent/#"]}, Limits())
    with pytest.raises(CodecError):
        body_of("round_start", {**body, "deadline_s": -1}, Limits())
    with pytest.raises(CodecError):
        body_of("round_start", {**body, "train": {"epochs": 0, "lr": 0.1, "batch_size": 1}}, Limits())


def test_unknown_kind_is_not_looked_up():
    with pytest.raises(CodecError, match="unknown message kind"):
        body_of("__class__", {}, Limits())


def good_gossip_body():
    return GossipModel("s1.7", 3, 12.5, 30.0, False, W).to_body()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(mass=0.0),
        lambda b: b.update(mass=-1.0),
        lambda b: b.update(mass=float("inf")),
        lambda b: b.update(age=float("nan")),
        lambda b: b.update(age=-2.0),
        lambda b: b.update(exchange_id=""),
        lambda b: b.update(exchange_id="x" * 65),
        lambda b: b.update(returned=1),
        lambda b: b.update(period=-1),
        lambda b: b.pop("weights"),
    ],
)
def test_bad_gossip_bodies_raise_codec_error(mutate):
    body = good_gossip_body()
    body_of("gossip_model", body, Limits())  # the unmutated body is fine
    mutate(body)
    with pytest.raises(CodecError):
        body_of("gossip_model", body, Limits())


def test_every_message_declares_each_of_its_attributes_once():
    """The one declaration is complete: a message's attributes are its declared fields,
    but for the few a hook of its own reads and writes (or that never travel)."""
    own = {"SyncGradient": {"sliced"}, "PublicVectors": {"vectors"}}
    for cls in KINDS.values():
        declared = [f.key for f in cls.WIRE.fields]
        attrs = {f.name for f in dataclasses.fields(cls)}
        assert len(declared) == len(set(declared)), cls.__name__
        assert set(declared) | own.get(cls.__name__, set()) == attrs, cls.__name__
