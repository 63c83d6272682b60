"""Golden wire bytes: one fixed instance of every message kind, with its optional fields
absent and present, encoded through the real envelope and codec and compared with the
bytes recorded in ``data/wire_golden.json``.

The round-trip and fuzz tests say that what is sent is read back; this says that what is
sent has not changed, byte for byte, so peers of an earlier release still read it. A
message's code may be rewritten freely as long as these bytes stay the same.

Record again only when the wire format changes on purpose (then say so in the changelog):

    .venv/bin/python tests/protocols/test_wire_golden.py --record
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fedagent.protocols import secagg as S
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.downlink import ModelDelta
from fedagent.protocols.fingerprint import Fingerprint, TensorInfo
from fedagent.protocols.messages import (
    KINDS,
    AsyncModel,
    AsyncTask,
    AsyncUpdate,
    Evaluation,
    GlobalModel,
    GossipAck,
    GossipModel,
    Heartbeat,
    ModelCheck,
    ModelRequest,
    Presence,
    PublicVectors,
    PublicVectorsRequest,
    RoundResult,
    RoundStart,
    SearchAnswer,
    SearchQuery,
    SyncGradient,
    SyncStep,
    SyncValidation,
    TrainConfig,
    Update,
    VocabDigest,
    VocabOffer,
    Vocabulary,
    body_of,
)
from fedagent.protocols.vocab import vocabulary_digest

GOLDEN = Path(__file__).parent / "data" / "wire_golden.json"

# Tensors of several dtypes and shapes, one of them a scalar and one empty.
W = {
    "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
    "layer.bias": np.array([-1.5, 0.0, 2.25], np.float32),
    "steps": np.array(7, np.int64),
    "half": np.array([0.5, -0.25], np.float16),
    "mask": np.array([True, False, True]),
    "empty": np.zeros((0, 4), np.float64),
}
# A gradient whose first layer has zero rows only, large enough to travel sliced.
SPARSE = np.zeros((200, 100), np.float32)
SPARSE[3] = 1.0
SPARSE[150, :7] = np.arange(7, dtype=np.float32) - 3
GRADIENT = {"enc.weight": SPARSE, "enc.bias": np.array([0.125, -0.5], np.float32)}
SETUP = S.SecAggSetup(S.SecAggParams(), bytes(range(16)), 120)
SETUP_AHEAD = S.SecAggSetup(
    S.SecAggParams(clip=0.5, bits=16, neighbours=4, threshold=0.75, min_survivors=3), b"\xaa" * 16, 7, 9, True
)
KEYS = S.SecAggKeys(4, b"\x01" * 32, b"\x02" * 32)
KEYS_SIGNED = S.SecAggKeys(5, b"\x03" * 32, b"\x04" * 32, b"\x30\x82" + b"c" * 40, b"\x05" * 64)
MASKED = {"masked": np.array([0, 1, -1, 2**31 - 1, -(2**31)], np.int32)}
TERMS = ("alpha", "beta", "gamma")
DELTA = ModelDelta(
    4,
    {"layer.weight": (np.array([[1, -2, 3], [0, 127, -127]], np.int8), 0.0078125)},
    {"steps": np.array(9, np.int64)},
)


# A model's fingerprint: a parameter, one tied to it, a bfloat16 one, a frozen one and
# the buffers of a normalisation layer.
FINGERPRINT = Fingerprint(
    (
        TensorInfo("embed.weight", "float32", (10, 4), "parameter"),
        TensorInfo("head.weight", "float32", (10, 4), "parameter", tied_to="embed.weight"),
        TensorInfo("proj.weight", "bfloat16", (4, 4), "parameter"),
        TensorInfo("stem.weight", "float16", (4,), "frozen"),
        TensorInfo("bn.running_var", "float32", (4,), "buffer", norm=True),
        TensorInfo("bn.num_batches_tracked", "int64", (), "buffer", norm=True),
    )
)


def instances() -> dict[str, object]:
    """Every message kind, each optional field both absent (the default) and present."""
    train_full = TrainConfig(
        epochs=3,
        lr=0.025,
        batch_size=64,
        compression="topk",
        topk_ratio=0.05,
        dp_clip=1.5,
        dp_noise_std=0.3,
        dp_count_std=0.1,
        steps=40,
    )
    # Integers where floats are meant: the encoders pass them on as they are (only the
    # receiver makes them floats), so these instances pin that too ("_ints").
    train_ints = TrainConfig(lr=1, compression="topk", topk_ratio=1, dp_clip=2, dp_noise_std=1, dp_count_std=1)
    return {
        "presence": Presence(online=True, role="agent"),
        "presence_full": Presence(False, "coordinator", "syncopt", 12, 3, "mqtts://10.0.0.2:8883", ("int8",)),
        "presence_model": Presence(True, "agent", "fedavg", 40, 2, "", ("int8",), FINGERPRINT.digest),
        "model_check": ModelCheck.of(FINGERPRINT),
        "model_check_refused": ModelCheck.of(FINGERPRINT, "the model differs from the coordinator's"),
        "heartbeat": Heartbeat(2.5),
        "heartbeat_int": Heartbeat(3),
        "round_start": RoundStart(2, 1, ("agent-a", "agent-b"), 60.0, TrainConfig(), W),
        "round_start_full": RoundStart(7, 5, ("agent-a",), 30.0, train_full, None, SETUP, DELTA),
        "round_start_ints": RoundStart(7, 5, ("agent-a",), 30, train_ints, W),
        "round_start_stream_off": RoundStart(1, 0, (), 5.5, TrainConfig(stream=False, dp_clip=2.0), W),
        "round_start_int8": RoundStart(1, 0, ("a",), 5.0, TrainConfig(compression="int8"), W, SETUP_AHEAD),
        "round_start_local_norm": RoundStart(2, 1, ("a",), 5.0, TrainConfig(compression="int8", local_norm=True), W),
        "round_start_everyone": RoundStart(3, 2, (), 60.0, TrainConfig(), W, everyone=True, agents=10_000),
        "update": Update(2, 1, 50, {"loss": 1.25, "accuracy": 1.0}, W),
        "update_ints": Update(2, 1, 50, {"accuracy": 1}, W),
        "update_leaving": Update(3, 2, 1, {}, W, leaving=True),
        "round_result": RoundResult(3, 4, 2, {"loss": 0.5}),
        "round_result_full": RoundResult(3, 3, 0, {}, aggregated=False, reason="deadline passed"),
        "round_result_ints": RoundResult(3, 4, 1, {"loss": 2}),
        "model": GlobalModel(5, 5, False, W),
        "model_final": GlobalModel(6, 6, True, W),
        "evaluation": Evaluation(4, 30, {"loss": 0.75, "accuracy": 0.5}),
        "evaluation_ints": Evaluation(4, 30, {"correct": 12}),
        "model_request": ModelRequest(3),
        "gossip_model": GossipModel("s1.7", 3, 12.5, 30.0, False, W),
        "gossip_model_returned": GossipModel("s2.9", 0, 1.0, 0.0, True, W),
        "gossip_model_ints": GossipModel("s2.9", 0, 1, 0, True, W),
        "gossip_ack": GossipAck("s1.7", True),
        "gossip_ack_full": GossipAck("s1.8", False, "inbox-full"),
        "vocab_offer": VocabOffer(TERMS, (3, 1, 2)),
        "vocabulary": Vocabulary(TERMS, (5, 4, 2), ("agent-a", "agent-b"), vocabulary_digest(TERMS)),
        "vocab_digest": VocabDigest(vocabulary_digest(TERMS), ("agent-a",)),
        "vocab_digest_agreed": VocabDigest(vocabulary_digest(TERMS), ("agent-a", "agent-b"), True),
        "sync_step": SyncStep(4, 2, ("agent-a",), 30.0, ""),
        "sync_step_full": SyncStep(5, 3, ("agent-a", "agent-b"), 12.0, "d" * 64, W, True, True),
        "sync_step_ints": SyncStep(5, 3, ("agent-a",), 12, "d"),
        "sync_gradient": SyncGradient(1, 0, 4, 0.5, W),
        "sync_gradient_sliced": SyncGradient(2, 1, 8, 1.0, GRADIENT, sliced=True),
        "sync_gradient_ints": SyncGradient(2, 1, 8, 1, W),
        "sync_validation": SyncValidation(4, 2, 1.0, 3),
        "sync_validation_none": SyncValidation(4, 2, float("nan"), 0),
        "search_query": SearchQuery("q-1", 5, "space", np.array([0.5, -1.0, 2.0], np.float32)),
        "search_answer": SearchAnswer("q-1", ("doc-1", "doc-2"), (0.9, 0.25)),
        "search_answer_error": SearchAnswer("q-2", (), (), "space-mismatch"),
        "search_answer_ints": SearchAnswer("q-3", ("doc-1",), (1,)),
        "public_vectors_request": PublicVectorsRequest("r-1", "p" * 64),
        "public_vectors_request_full": PublicVectorsRequest("r-2", "pub", "space-1"),
        "public_vectors": PublicVectors("r-1", "space-1", np.arange(6, dtype=np.float32).reshape(2, 3)),
        "public_vectors_current": PublicVectors("r-2", "space-1"),
        "public_vectors_error": PublicVectors("r-3", "", error="no-public-corpus"),
        "secagg_start": S.SecAggStart(4, ("agent-a", "agent-b", "agent-c"), SETUP),
        "secagg_start_ahead": S.SecAggStart(9, ("agent-a",), SETUP_AHEAD),
        "secagg_start_ints": S.SecAggStart(9, ("agent-a",), S.SecAggSetup(S.SecAggParams(clip=2), b"\x00" * 16, 1)),
        "secagg_keys": KEYS,
        "secagg_keys_signed": KEYS_SIGNED,
        "secagg_roster": S.SecAggRoster(4, {"agent-b": KEYS, "agent-c": KEYS_SIGNED}),
        "secagg_roster_empty": S.SecAggRoster(4, {}),
        "secagg_shares": S.SecAggShares(4, {"agent-b": b"\x11" * 40, "agent-c": b"\x12" * 300}, b"\x13" * 32),
        "secagg_sharebox": S.SecAggShareBox(4, {"agent-a": b"\x21" * 32}),
        "secagg_masked": S.SecAggMasked(4, 3, 20, {"loss": 0.5}, MASKED),
        "secagg_masked_full": S.SecAggMasked(4, 3, 20, {}, MASKED, True, KEYS_SIGNED),
        "secagg_masked_ints": S.SecAggMasked(4, 3, 20, {"loss": 1}, MASKED),
        "secagg_survivors": S.SecAggSurvivors(4, ("agent-a", "agent-b")),
        "secagg_signature": S.SecAggSignature(4),
        "secagg_signature_signed": S.SecAggSignature(4, b"\x30" * 20, b"\x31" * 64),
        "secagg_unmask": S.SecAggUnmask(4, ("agent-a",), ("agent-c",), 2),
        "secagg_unmask_full": S.SecAggUnmask(
            4, ("agent-a", "agent-b"), (), 2, {"agent-a": (b"ca", b"\x41" * 64), "agent-b": (b"", b"")}
        ),
        "secagg_reveal": S.SecAggReveal(4, {"agent-a": b"\x51" * 68}, {"agent-c": b"\x52" * 68}),
        "secagg_reveal_refused": S.SecAggReveal(4, {}, {}, "both shares asked for agent-a"),
        "async_task": AsyncTask(12, 4, TrainConfig(compression="int8"), 60.0),
        "async_task_ints": AsyncTask(13, 5, train_ints, 30),
        "async_model": AsyncModel(5, 3, ("agent-a", "agent-b"), {"loss": 0.5}, W),
        "async_model_step": AsyncModel(5, 4, ("agent-a",), {}, None, DELTA),
        "async_model_ints": AsyncModel(6, 1, ("agent-a",), {"loss": 1}, W),
        "async_update": AsyncUpdate(12, 4, 50, {"loss": 1.25}, W),
        "async_update_offline": AsyncUpdate(0, 3, 7, {}, W),
    }


def wire(msg: object) -> bytes:
    env = Envelope(kind=msg.kind, federation="fed", sender="agent-a", round=3, seq=17, ts=1.5, body=msg.to_body())
    return encode(env)


def recorded() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())


def test_every_kind_has_golden_bytes():
    kinds = {m.kind for m in instances().values()}
    assert kinds == set(KINDS)
    assert set(recorded()) == set(instances())


@pytest.mark.parametrize("name", sorted(instances()))
def test_encoding_is_byte_identical(name):
    assert wire(instances()[name]).hex() == recorded()[name]


@pytest.mark.parametrize("name", sorted(instances()))
def test_recorded_bytes_decode_to_the_message_that_encodes_them(name):
    data = bytes.fromhex(recorded()[name])
    env = decode(data)
    back = body_of(env.kind, env.body, Limits())
    msg = instances()[name]
    assert type(back) is type(msg)
    if isinstance(msg, SyncGradient):  # not a wire field: the encoder's choice
        back = dataclasses.replace(back, sliced=msg.sliced)
    if name.endswith("_ints"):
        # Read back as floats: what the decoded message sends is stable from then on.
        again = decode(wire(back))
        assert wire(body_of(again.kind, again.body, Limits())) == wire(back)
    else:
        assert wire(back) == data


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({k: wire(m).hex() for k, m in sorted(instances().items())}, indent=1) + "\n")
    print(f"recorded {len(instances())} messages in {GOLDEN}")
