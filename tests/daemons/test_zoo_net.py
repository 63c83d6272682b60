"""The zoo (tests/zoo.py: a ResNet with BatchNorm, a Transformer encoder with tied
weights, an LSTM, bfloat16 and float16 layers and buffers, frozen layers beside a
non-persistent buffer) trained through the real daemons with the default settings, on
the digits data split non-IID between two agents. For each run:

* the federated model beats every agent's local-only model (same data, same epochs);
* nothing is NaN, and every buffer that is non-negative on the agents (a running
  variance, a running mean of ReLU outputs, a counter) is non-negative in the global model;
* the exported state_dict (``fedagent export``) loads into the model with ``strict=True``,
  every tensor in the model's own dtype, and an agent's copy is the coordinator's;
* FedAvg equals :func:`zoo.reference_fedavg`, FedAvg as the docs state it written out on
  its own in numpy, to a relative L2 distance of 1e-6 per tensor (measured: equal to the
  bit; with two agents no sum depends on the order the updates arrive in), also under
  secure aggregation (the reference quantises as the agents do; the masks cancel).

Every change runs ``every`` (all of them, smaller, in one model: one federation checks
every kind of tensor) 2 rounds under FedAvg, FedBN (``local_norm``, with ``fedagent export
--site``), gossip and secure aggregation; ``-m slow`` runs each model on its own, 4 rounds,
under each of them (FedBN: the ResNet).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zoo
from click.testing import CliRunner
from netfed import coordinator_in, history, running, secure_running, wait_for

from fedagent.cli import main
from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED, Federation
from fedagent.storage import checkpoint

AGENTS = 2
ROUNDS = 4  # -m slow; every change runs the model with every kind of tensor, 2 rounds
CI_ROUNDS = 2
CI_PERIODS = 30
ALPHA = 0.1
TOLERANCE = 1e-6
SECURE_CLIP = 8.0
GOSSIP = {
    "periods": 30,
    "period_steps": 10,
    "lr": LR,
    "batch_size": BATCH,
    "seed": SEED,
    "period_seconds": 0.1,
    "send_timeout": 5.0,
    "eval_every": 10,
}


# A federation, then the same training in process twice (the reference and local-only):
# about 40 s a model on an idle 2-core machine, several times that on a loaded one.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(autouse=True)
def zoo_on_the_path(monkeypatch) -> Iterator[None]:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons train (torch_threads = 1)
    yield
    torch.set_num_threads(threads)


def tasks(name: str) -> list[zoo.ZooTask]:
    return [
        zoo.make({"model": name, "shard": i, "shards": AGENTS, "alpha": ALPHA, "seed": SEED}) for i in range(AGENTS)
    ]


def accuracy(name: str, weights: dict[str, np.ndarray]) -> float:
    task = zoo.make({"model": name, "seed": SEED})
    model = task.build_model()
    zoo.load(model, weights)
    return task.evaluate(model)["accuracy"]


def local_only(name: str, *, epochs: int = 0, steps: int = 0) -> list[float]:
    """Each agent's accuracy trained alone, ``epochs`` epochs (FedAvg's baseline) or
    ``steps`` mini-batches with gossip's cosine schedule."""
    out = []
    for task in tasks(name):
        model = task.build_model()
        for e in range(epochs):
            task.fit(model, epochs=1, lr=LR, batch_size=BATCH, seed=e + 1)
        for done in range(0, steps, GOSSIP["period_steps"]):
            lr = LR * 0.5 * (1 + math.cos(math.pi * done / steps))
            task.fit_steps(model, steps=GOSSIP["period_steps"], lr=lr, batch_size=BATCH, seed=done + 1)
        out.append(task.evaluate(model)["accuracy"])
    return out


def check_model(name: str, weights: dict[str, np.ndarray], path: Path, slack: float = 0.0) -> None:
    """No NaN, buffers that should not be negative are not (below zero by at most
    ``slack``: secure aggregation's quantisation bound), and ``path`` (the exported
    checkpoint) loads strictly into the model with every dtype the model's."""
    assert all(np.isfinite(v).all() for v in weights.values() if v.dtype.kind == "f")
    model = zoo.make({"model": name, "seed": SEED}).build_model()
    params = dict(model.named_parameters(remove_duplicate=False))
    for k, v in weights.items():
        if k not in params and (k.endswith(("running_var", "act_mean", "feature_scale", "steps"))):
            assert (v >= -slack).all(), (k, v.min())
        if k.endswith("running_var"):
            assert (v > -slack).all(), (k, v.min())
    out = path.parent / f"{path.stem}.pt"
    result = CliRunner().invoke(main, ["export", str(out), "--checkpoint", str(path)])
    assert result.exit_code == 0, result.output
    assert "parameters:" in result.output and "buffers:" in result.output
    state = torch.load(out, weights_only=True)
    model.load_state_dict(state, strict=True)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in model.state_dict().items()}


def assert_equal_to_reference(fed: dict[str, np.ndarray], ref: dict[str, np.ndarray], tolerance: float) -> None:
    assert fed.keys() == ref.keys()
    for k in ref:
        a, b = fed[k].astype(np.float64), ref[k].astype(np.float64)
        distance = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert distance <= tolerance, (k, distance)


def fedavg(
    tmp_path: Path, name: str, *, rounds: int = ROUNDS, secure: bool = False, **options: object
) -> dict[str, object]:
    """A FedAvg federation of the zoo model ``name``, ``rounds`` rounds: the final global
    model, the path of the coordinator's checkpoint and of agent-1's."""
    kw = {
        "agents": AGENTS,
        "rounds": rounds,
        "alpha": ALPHA,
        "task": "zoo:make",
        "task_options": {"model": name, "alpha": ALPHA},
        "agent_broker_by_mdns": False,
    }
    if secure:
        # A clip range that holds every coordinate of these models' updates (a running
        # mean of activations moves by more than the default ±1 in a round).
        options = {"local_epochs": LOCAL_EPOCHS, "secure_clip": SECURE_CLIP, **options}
        ctx = secure_running(tmp_path, rounds_options=options, **kw)
    else:
        ctx = running(tmp_path, rounds_options=options, **kw)
    with ctx as started:
        fed: Federation = started[0] if secure else started  # type: ignore[index]
        done = wait_for(lambda: coordinator_in(fed, "done"), 300, "the federation to finish", fed)
        assert done["completed_rounds"] == rounds and not done["refused_agents"]
        assert all(math.isfinite(v) for v in done["metrics"].values())
        weights, _ = fed.final_weights()
        bound = max((r.get("secure") or {}).get("error_bound", 0.0) for r in history(fed) if r["event"] == "round")
        home = fed.work / "state" / "agent-1" / "agent" / fed.fed
        wait_for(lambda: (fed.status("agent-1") or {}).get("model_version") == rounds, 60, "agent-1's model", fed)
        return {
            "rounds": rounds,
            "weights": weights,
            "coordinator": fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "global.ckpt",
            "agent": home / "global.ckpt",
            "local_layers": home / "local_layers.ckpt",
            "config": fed.config_path("agent-1"),
            "error_bound": bound,
        }


def check_fedavg(name: str, run: dict[str, object], **reference: object) -> None:
    weights = run["weights"]
    assert isinstance(weights, dict)
    # Under secure aggregation a buffer is the global value plus the masked sum's mean
    # step: off by up to its quantisation bound (docs/tasks.md), so a value near zero can
    # come out below it by as much.
    check_model(name, weights, Path(str(run["coordinator"])), float(run.get("error_bound", 0.0)))
    loaded = checkpoint.load(Path(str(run["agent"])))
    assert loaded is not None
    for k, v in weights.items():  # what agent-1 holds is the global model, to the bit
        np.testing.assert_array_equal(loaded[0][k], v)
    rounds = int(str(run["rounds"]))
    federated = accuracy(name, weights)
    alone = local_only(name, epochs=rounds * LOCAL_EPOCHS)
    assert federated > max(alone), (federated, alone)
    ref = zoo.reference_fedavg(tasks(name), rounds, epochs=LOCAL_EPOCHS, lr=LR, batch_size=BATCH, **reference)
    assert_equal_to_reference(weights, ref, TOLERANCE)


# ---- every change: the model with every kind of tensor, 2 rounds --------------------
def test_fedavg_trains_a_model_with_every_kind_of_tensor(tmp_path: Path) -> None:
    check_fedavg("every", fedavg(tmp_path, "every", rounds=CI_ROUNDS))


def test_fedbn_keeps_normalisation_layers_on_the_agents(tmp_path: Path) -> None:
    fedbn(tmp_path, "every", CI_ROUNDS)


def test_gossip_trains_a_model_with_every_kind_of_tensor(tmp_path: Path) -> None:
    gossip(tmp_path, "every", periods=CI_PERIODS)


def test_secure_aggregation_trains_a_model_with_every_kind_of_tensor(tmp_path: Path) -> None:
    check_fedavg("every", fedavg(tmp_path, "every", rounds=CI_ROUNDS, secure=True), secure=SECURE_CLIP)


def fedbn(tmp_path: Path, name: str, rounds: int) -> None:
    """With local_norm the global model's normalisation layers stay as built (it is not
    meant to be used alone); each site's own model (the global model with its layers)
    beats its local-only model, and global model and layers equal the reference's; the
    site's own model, written by ``fedagent export --site``, loads strictly in plain torch."""
    run = fedavg(tmp_path, name, rounds=rounds, local_norm=True)
    weights = run["weights"]
    assert isinstance(weights, dict)
    built = zoo.make({"model": name, "seed": SEED}).build_model()
    initial = zoo.state(built)
    norm = zoo.norm_tensors(built)
    assert norm and all(np.array_equal(weights[k], initial[k]) for k in norm)  # never averaged
    check_model(name, weights, Path(str(run["coordinator"])))
    sites: list[dict[str, np.ndarray]] = []
    ref = zoo.reference_fedavg(
        tasks(name), rounds, epochs=LOCAL_EPOCHS, lr=LR, batch_size=BATCH, local_norm=True, sites=sites
    )
    assert_equal_to_reference(weights, ref, TOLERANCE)
    layers = checkpoint.load(Path(str(run["local_layers"])))
    assert layers is not None and set(layers[0]) == norm
    assert_equal_to_reference(layers[0], sites[0], TOLERANCE)  # agent-1's own layers
    variances = [k for k in norm if k.endswith("running_var")]
    assert variances and all((layers[0][k] > 0).all() for k in variances)
    alone = local_only(name, epochs=rounds * LOCAL_EPOCHS)
    own = [accuracy(name, {**weights, **site}) for site in sites]
    assert all(o > a for o, a in zip(own, alone, strict=True)), (own, alone)
    out = Path(str(run["agent"])).parent / "site.pt"
    result = CliRunner().invoke(main, ["export", str(out), "--site", "--config", str(run["config"])])
    assert result.exit_code == 0, result.output
    site = torch.load(out, weights_only=True)
    zoo.make({"model": name, "seed": SEED}).build_model().load_state_dict(site, strict=True)
    for k in variances:
        assert torch.equal(site[k], torch.from_numpy(layers[0][k]))


def gossip(tmp_path: Path, name: str, periods: int = int(GOSSIP["periods"])) -> None:
    with running(
        tmp_path,
        agents=AGENTS,
        rounds=1,
        alpha=ALPHA,
        mode="gossip",
        gossip={**GOSSIP, "periods": periods},
        task="zoo:make",
        task_options={"model": name, "alpha": ALPHA},
        agent_broker_by_mdns=False,
    ) as fed:

        def finished() -> dict | None:
            out = {a: fed.status(a) for a in fed.agent_ids}
            return out if all(s and s.get("round_state") == "finished" for s in out.values()) else None

        done = wait_for(finished, 300, "the gossip agents to finish", fed)
        assert all(s["gossip"]["merged"] > 0 and not s["refused_peers"] for s in done.values())
        alone = local_only(name, steps=periods * int(GOSSIP["period_steps"]))
        for aid in fed.agent_ids:
            loaded = checkpoint.load(fed.model_path(aid))
            assert loaded is not None
            check_model(name, loaded[0], fed.model_path(aid))
            # With the exchanges each agent made: a loaded machine delays models, and an
            # agent that merged few (or stale) ones is close to training alone.
            exchanges = {
                a: {k: s["gossip"].get(k) for k in ("merged", "received", "dropped", "lag_mean")}
                for a, s in done.items()
            }
            assert accuracy(name, loaded[0]) > max(alone), (aid, accuracy(name, loaded[0]), alone, exchanges)


# ---- -m slow: each model of the zoo on its own, 4 rounds -----------------------------
SINGLE = [n for n in zoo.MODELS if n != "every"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE)
def test_fedavg_trains_every_model_of_the_zoo(tmp_path: Path, name: str) -> None:
    check_fedavg(name, fedavg(tmp_path, name))


@pytest.mark.slow
def test_fedbn_keeps_the_resnets_normalisation_layers_on_the_agents(tmp_path: Path) -> None:
    fedbn(tmp_path, "resnet", ROUNDS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE)
def test_gossip_trains_every_model_of_the_zoo(tmp_path: Path, name: str) -> None:
    gossip(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE)
def test_secure_aggregation_trains_every_model_of_the_zoo(tmp_path: Path, name: str) -> None:
    check_fedavg(name, fedavg(tmp_path, name, secure=True), secure=SECURE_CLIP)
