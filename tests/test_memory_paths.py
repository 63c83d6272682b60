"""The coordinator's model-sized paths cost what the memory budget allows (issue 9):
a broadcast costs its encoded payload and a window of frames, not every frame at once;
a checkpoint is written from the weights without a model-sized buffer, in the same
format as before."""

from __future__ import annotations

import asyncio
import tracemalloc

import msgpack
import numpy as np

from fedagent import checkpoint
from fedagent.node.messaging import Messenger
from fedagent.protocols.codec import encode_weights
from fedagent.protocols.messages import GlobalModel
from fedagent.signing import Identity

MODEL_BYTES = 8 * 2**20


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal(MODEL_BYTES // 4 // 8, dtype=np.float32) for i in range(8)}


class _Sink:
    def __init__(self) -> None:
        self.nbytes = 0
        self.count = 0

    async def publish(self, topic, payload, qos=1, retain=False, timeout=None) -> None:
        self.nbytes += len(payload)
        self.count += 1
        await asyncio.sleep(0)


def test_a_broadcast_costs_one_payload_and_a_window_of_frames(pki) -> None:
    t = pki.tls("coord")
    sink = _Sink()
    m = Messenger(
        federation="testfed",
        node_id="coord",
        transport=sink,
        identity=Identity.load(t.cert, t.key, t.ca),
        max_chunk_bytes=256 * 1024,
        publish_window=2,
    )
    weights = _model()
    tracemalloc.start()
    try:
        asyncio.run(m.send("fedagent/v1/testfed/broadcast/model", GlobalModel(1, 1, True, weights), round_=1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sink.count >= 32 and sink.nbytes > MODEL_BYTES
    # Encoded payload (1 model) + a few 256 KiB frames; all frames at once were 2 models.
    assert peak < 1.4 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"


def test_checkpoint_is_written_piece_by_piece_in_the_same_format(tmp_path) -> None:
    weights = {
        **_model(),
        "small": np.arange(5, dtype=np.float32),
        "count": np.array(7, dtype=np.int64),
        "mid": np.ones(20_000, dtype=np.float16),
    }
    meta = {"model_version": 3, "participants": ["a", "b"]}
    path = tmp_path / "global.ckpt"
    tracemalloc.start()
    try:
        checkpoint.save(path, weights, meta)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.1 * MODEL_BYTES, f"peak {peak / MODEL_BYTES:.2f} models"
    assert path.read_bytes() == msgpack.packb(
        {"format": checkpoint.FORMAT, "meta": meta, "weights": encode_weights(weights)}, use_bin_type=True
    )
    back, meta_back = checkpoint.load(path)
    assert meta_back == meta
    for k, v in weights.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
