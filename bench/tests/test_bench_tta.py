"""The time-to-accuracy benchmark's parts (bench/tta.py): its counting relay, the shared
model both frameworks train, the data file the Flower side reads, the arithmetic of a
run, and one tiny real fedagent run through the relays (no timing is asserted)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from bench import tta
from bench.flower_app.tta import data as tta_data
from bench.flower_app.tta import tta_model
from bench.relay import Relay
from bench.tta_task import make
from fedagent.tasks.base import get_weights


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_relay_counts_every_byte_both_ways():
    srv, port = _echo_server()
    with srv, Relay(port) as relay:
        before = time.time()
        with socket.create_connection(("127.0.0.1", relay.port)) as c:
            payload = np.random.default_rng(0).bytes(3 * 2**20 + 17)
            got = bytearray()

            def read() -> None:
                while len(got) < len(payload) and (chunk := c.recv(1 << 20)):
                    got.extend(chunk)

            reader = threading.Thread(target=read)
            reader.start()
            c.sendall(payload)
            reader.join(30)
        assert bytes(got) == payload
        assert relay.up == len(payload) and relay.down == len(payload)
        assert relay.connections == 1
        assert relay.bytes_at(before) == 0
        assert relay.bytes_at(time.time()) == 2 * len(payload) == relay.total


def test_the_shared_cnn_has_a_million_parameters_and_the_same_start_everywhere():
    task = make({"shard": 0, "shards": 10, "alpha": 0.5, "seed": 0})
    ours = task.build_model()
    assert sum(p.numel() for p in ours.parameters()) >= 1_000_000
    theirs = tta_model.build_model()
    for (k, a), (k2, b) in zip(get_weights(ours).items(), theirs.state_dict().items(), strict=True):
        assert k == k2 and np.array_equal(a, b.numpy())


def test_flower_reads_the_shards_fedagent_trains_on(tmp_path):
    path = tta.write_data(tmp_path / "d.npz")
    for shard in (0, 7):
        task = make({"shard": shard, "shards": 10, "alpha": 0.5, "seed": 0})
        x, y, xte, yte = tta_data.load(str(path), shard)
        assert torch.equal(x, task.x_train) and torch.equal(y, task.y_train)
        assert torch.equal(xte, task.x_test) and torch.equal(yte, task.y_test)
    # label skew: the shards do not all hold the same classes in the same proportions
    counts = [np.bincount(tta_data.load(str(path), s)[1].numpy(), minlength=10) for s in range(10)]
    assert max(c.argmax() for c in counts) != min(c.argmax() for c in counts)


def test_a_run_measures_from_round_one_to_the_first_model_at_the_target():
    run = tta.Run("x", launched=100.0, target=0.9)
    run.rounds = [
        {"round": 1, "start": 103.0, "end": 105.0, "accuracy": 0.5},
        {"round": 2, "start": 105.0, "end": 107.5, "accuracy": 0.91},
        {"round": 3, "start": 107.5, "end": 109.0, "accuracy": 0.89},
    ]
    assert run.rounds_to_target == 2
    assert run.time_to_target == pytest.approx(4.5)
    assert run.total_to_target == pytest.approx(7.5)
    assert run.final_accuracy == 0.89
    run.target = 0.95
    with pytest.raises(RuntimeError, match="did not reach"):
        _ = run.time_to_target


@pytest.mark.slow
@pytest.mark.procs
def test_a_tiny_fedagent_run_through_the_relays(tmp_path):
    """Two agents, two rounds of the real daemons over Mosquitto with mutual TLS; target 0
    is reached by the first model."""
    run = tta.run_fedagent(tmp_path, print, rounds=2, target=0.0, agents=2, timeout=240)
    assert [r["round"] for r in run.rounds] == [1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in run.rounds)
    assert run.rounds_to_target == 1 and run.time_to_target > 0
    model = 1_083_338 * 4
    # round 1 with the default int8 updates (a quarter of a model each): the model to
    # the broker and on to 2 agents, 2 updates to the broker and on to the coordinator,
    # 4 models in all; the agents' links carry 2.5 of them (float32 updates would make
    # it 7 and 4)
    assert 3.9 * model < run.bytes_to_target < 5.5 * model
    assert 2.4 * model < run.agent_bytes_to_target < 3.5 * model
