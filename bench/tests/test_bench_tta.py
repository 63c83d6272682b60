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


def _fake_run(framework: str, rounds_to_target: int, seconds_per_round: float) -> tta.Run:
    run = tta.Run(framework, launched=0.0)
    run.rounds = [
        {
            "round": r,
            "start": 1 + (r - 1) * seconds_per_round,
            "end": 1 + r * seconds_per_round,
            "accuracy": 0.96 if r >= rounds_to_target else 0.5,
        }
        for r in range(1, max(rounds_to_target, tta.FINAL_ROUNDS) + 1)
    ]
    run.bytes_to_target = rounds_to_target * 10**7
    return run


@pytest.fixture
def fake_tta(monkeypatch, tmp_path):
    """The section with every run replaced by one of known rounds and seconds: fedagent
    0.5 s a round (7 rounds with momentum, 12 without), Flower 2 s a round (8 with
    FedAvgM, 12 with FedAvg); ``calls`` records each run's settings."""
    calls: list[tuple] = []

    def fedagent(work, log, *, compression=None, rounds_options=None, seed=tta_model.SEED, **kw):
        calls.append(("fedagent", compression, rounds_options, seed))
        plain = (rounds_options or {}).get("server_momentum") == 0
        return _fake_run(tta.fedagent_label(compression, rounds_options), 12 if plain else 7, 0.5)

    def flower(py, work, data, log, *, strategy, tls, seed, **kw):
        calls.append(("flower", strategy, tls is not None, seed))
        return _fake_run(tta.flower_label(strategy), 8 if strategy == tta.FEDAVGM else 12, 2.0)

    monkeypatch.setattr(tta, "flower_torch_python", lambda log: tmp_path / "python")
    monkeypatch.setattr(tta, "write_data", lambda path, seed=0: path)
    monkeypatch.setattr(tta, "run_fedagent", fedagent)
    monkeypatch.setattr(tta, "run_flower_deployment", flower)
    monkeypatch.delenv("FEDAGENT_TTA_SEED", raising=False)
    return calls


def test_tta_compares_the_same_algorithm_and_the_defaults(fake_tta, tmp_path):
    from bench.registry import Context, check_rows

    ctx = Context(quick=False, work=tmp_path, repeats=5, sizes=[], log=lambda s: None)
    rows = tta.tta(ctx)
    assert check_rows("tta", ctx, rows) == []
    assert len(rows) == 6 + len(tta.COMPRESSIONS)
    # Flower always with TLS, FedAvgM given fedagent's default momentum
    assert [c for c in fake_tta if c[0] == "flower"] == [
        ("flower", tta.FEDAVGM, True, tta_model.SEED),
        ("flower", tta.FEDAVG, True, tta_model.SEED),
    ]
    assert ("fedagent", None, {"server_momentum": 0}, tta_model.SEED) in fake_tta
    times = [r for r in rows if r.unit == "s"]
    pairs = [(r.subject.split(":")[0], r.baseline, r.note.split(";")[0]) for r in times[:3]]
    assert pairs == [
        (tta.fedagent_label(), tta.flower_label(tta.FEDAVGM), tta.LIKE_FOR_LIKE),
        (tta.fedagent_label(rounds_options={"server_momentum": 0}), tta.flower_label(tta.FEDAVG), tta.LIKE_FOR_LIKE),
        (tta.fedagent_label(), tta.flower_label(tta.FEDAVG), tta.DEFAULTS),
    ]
    assert all("goal <= 0.6x" in r.note for r in times[:2]) and "goal" not in times[2].note
    # 7 rounds of 0.5 s against 8 of 2 s; 12 of 0.5 s against 12 of 2 s; 7 x 0.5 against 12 x 2
    assert [round(r.value / r.baseline_value, 4) for r in times[:3]] == [0.2188, 0.25, 0.1458]
    assert [r.unit for r in rows[:6]] == ["s", "B"] * 3
    assert "FedAvgM, momentum 0.7" in tta.flower_label(tta.FEDAVGM) and "TLS" in tta.flower_label(tta.FEDAVGM)
    assert len(rows[0].extra["runs"]) == 4 + len(tta.COMPRESSIONS)


def test_quick_tta_runs_the_fedavgm_pair_only(fake_tta, tmp_path):
    from bench.registry import Context, check_rows

    ctx = Context(quick=True, work=tmp_path, repeats=2, sizes=[], log=lambda s: None)
    rows = tta.tta(ctx)
    assert check_rows("tta", ctx, rows) == [] and len(rows) == 2
    assert fake_tta == [("fedagent", None, None, 0), ("flower", tta.FEDAVGM, True, 0)]
    assert rows[0].baseline == tta.flower_label(tta.FEDAVGM) and rows[0].note.startswith(tta.LIKE_FOR_LIKE)


def test_a_flower_run_that_fails_leaves_its_rows_missing(fake_tta, monkeypatch, tmp_path):
    from bench.registry import Context, check_rows

    def broken(py, work, data, log, *, strategy, **kw):
        if strategy == tta.FEDAVG:
            raise RuntimeError("flwr run ended (exit 1) before the target")
        return _fake_run(tta.flower_label(strategy), 8, 2.0)

    monkeypatch.setattr(tta, "run_flower_deployment", broken)
    ctx = Context(quick=False, work=tmp_path, repeats=5, sizes=[], log=lambda s: None)
    rows = tta.tta(ctx)
    assert ctx.shared["failures"] == [f"tta: {tta.flower_label(tta.FEDAVG)}: flwr run ended (exit 1) before the target"]
    assert check_rows("tta", ctx, rows) == [f"section tta: {2 + len(tta.COMPRESSIONS)} of the 9 rows it should measure"]


def test_fedagent_runs_are_named_by_algorithm_and_compression():
    assert tta.fedagent_label() == "fedagent, FedAvgM, momentum 0.7 (its default), compression int8 (its default)"
    assert tta.fedagent_label("none") == "fedagent, FedAvgM, momentum 0.7 (its default), compression none"
    assert tta.fedagent_label(rounds_options={"server_momentum": 0}).startswith(
        "fedagent, FedAvg (server_momentum = 0)"
    )


def _arrays(d: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in d.items()}


@pytest.mark.slow
@pytest.mark.procs
@pytest.mark.flower
@pytest.mark.parametrize(("momentum", "lr"), [(0.7, 1.0), (0.7, 1.5), (0.0, 1.0)])
def test_flowers_fedavgm_takes_the_same_server_step_as_fedagent(momentum, lr, flower_python):
    """Flower's FedAvgM (run in bench/.venv-flower) and fedagent's server step, given the
    same FedAvg mean each round, make the same next model to the bit: momentum applied
    to the step before the server learning rate, the velocity starting at the first
    step, Flower's pseudo-gradient being fedagent's step with the sign turned."""
    import json
    import subprocess

    from fedagent.protocols.serveropt import momentum_step

    probe = tta.TTA_APP / "server_step_probe.py"
    spec = {"seed": 3, "momentum": momentum, "lr": lr, "rounds": 4}
    out = subprocess.run(
        [str(flower_python), str(probe)],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout)
    model, velocity = _arrays(result["initial"]), {}
    for r in result["rounds"]:
        model, velocity = momentum_step(model, _arrays(r["mean"]), velocity, lr=lr, beta=momentum)
        theirs = _arrays(r["model"])
        assert model.keys() == theirs.keys()
        for k in model:
            assert np.array_equal(model[k], theirs[k]), (k, np.abs(model[k] - theirs[k]).max())
