"""The agent's outbox: one finished update on disk, read back after a restart."""

from __future__ import annotations

import numpy as np

from fedagent.protocols.fedbuff.worker import Pending, Work
from fedagent.protocols.messages import TrainConfig
from fedagent.storage.outbox import Outbox


def weights(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full((3, 2), v, np.float32), "n": np.array(4, np.int64)}


def pending(v: float, trainings: int = 1) -> Pending:
    train = TrainConfig(compression="int8", lr=0.1, dp_clip=None)
    return Pending(Work(7, 3, train, weights(0.0), trainings), weights(v), 25, {"loss": 0.5})


def test_an_update_kept_comes_back_after_a_restart_as_it_was(tmp_path):
    box = Outbox(tmp_path)
    assert box.get() is None and box.status() is None
    box.put(pending(1.5))
    since = box.since
    back = Outbox(tmp_path).get()
    assert back is not None
    assert (back.work.task, back.work.base_version, back.work.trainings) == (7, 3, 1)
    assert back.work.train == TrainConfig(compression="int8", lr=0.1)
    assert back.num_samples == 25 and back.metrics == {"loss": 0.5}
    np.testing.assert_array_equal(back.weights["w"], weights(1.5)["w"])
    np.testing.assert_array_equal(back.work.base["w"], weights(0.0)["w"])
    assert back.weights["n"].dtype == np.int64
    # trained further while cut off: replaced, the date it was first kept stays
    box.put(pending(2.5, trainings=2), since=since)
    again = Outbox(tmp_path)
    assert again.get().work.trainings == 2 and again.since == since
    again.clear()
    assert Outbox(tmp_path).get() is None and again.status() is None


def test_a_damaged_outbox_is_set_aside_never_trained_from(tmp_path, caplog):
    box = Outbox(tmp_path)
    box.put(pending(1.0))
    data = box.path.read_bytes()
    box.path.write_bytes(data[: len(data) // 2])
    assert Outbox(tmp_path).get() is None
    assert not box.path.exists() and box.path.with_name("outbox.ckpt.damaged").exists()
    assert "set aside" in caplog.text
