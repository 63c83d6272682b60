"""Server momentum through the daemons: the coordinator (real processes, Mosquitto, mutual
TLS) keeps the velocity in a file beside its model checkpoint, and after a kill -9 the restarted
coordinator goes on with it: every round after the restart is the momentum step from the
checkpointed model and velocity, replayed here from the agents' own training."""

from __future__ import annotations

import json
import signal

import numpy as np
import torch
from netfed import coordinator_in, running, wait_for

from fedagent.coordinator.velocity import load
from fedagent.local.federation import BATCH, LOCAL_EPOCHS, LR, SEED, Federation
from fedagent.storage import checkpoint
from fedagent.tasks.base import get_weights, load_task, set_weights

BETA = 0.9
ROUNDS = 6


def ckpt_path(fed: Federation):
    return fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "global.ckpt"


def split(fed: Federation, *, only: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """The checkpointed model, the velocity that goes with it and its model version. The
    checkpoint holds the model only; ``only``: that version's velocity file is the only
    one (after a kill the previous version's, or the next one's, may be there too)."""
    saved, meta = checkpoint.load(ckpt_path(fed))
    version = meta["model_version"]
    assert not any(k.startswith(checkpoint.OPTIMIZER_PREFIX) for k in saved)
    files = sorted(p.name for p in ckpt_path(fed).parent.glob("velocity-*.bin"))
    mine = f"velocity-{version}.bin"
    assert files == [mine] if only else mine in files, files
    return saved, load(ckpt_path(fed).parent / mine, saved, version), version


def replay(fed: Federation, x: dict, v: dict, rounds: list[dict]) -> tuple[dict, dict]:
    """FedAvgM over the aggregated ``rounds`` (history lines): each participant trains the
    global model as its agent does (round number as the seed), the sample-weighted mean
    is the aggregate, then v = β·v + (mean − x), x = x + v (float64)."""
    torch.set_num_threads(1)
    tasks = {aid: load_task("digits", fed.shard_options(i)) for i, aid in enumerate(fed.agent_ids)}
    x = {k: a.astype(np.float64) for k, a in x.items()}
    v = {k: a.astype(np.float64) for k, a in v.items()}
    for rec in rounds:
        mean = {k: np.zeros_like(a) for k, a in x.items()}
        for aid, w in rec["agg_weights"].items():
            task = tasks[aid]
            model = task.build_model()
            set_weights(model, {k: a.astype(np.float32) for k, a in x.items()})
            task.fit(model, epochs=LOCAL_EPOCHS, lr=LR, batch_size=BATCH, seed=rec["round"])
            for k, a in get_weights(model).items():
                mean[k] += w * a.astype(np.float64)
        for k in x:
            v[k] = BETA * v.get(k, 0.0) + (mean[k] - x[k])
            x[k] = x[k] + v[k]
    return x, v


def configure(fed: Federation) -> None:
    # Uncompressed updates (the default is int8 for streamed updates): the replay below
    # then trains and averages exactly what the agents sent.
    fed.write_coordinator(
        "digits",
        {"seed": SEED},
        {
            "rounds": ROUNDS,
            "min_agents": fed.n,
            "expected_agents": fed.n,
            "min_updates": fed.n,
            "round_timeout": 60,
            "local_epochs": LOCAL_EPOCHS,
            "lr": LR,
            "batch_size": BATCH,
            "seed": SEED,
            "server_momentum": BETA,
        },
        transfer={"compression": "none"},
    )


def test_velocity_survives_a_coordinator_kill(tmp_path):
    with running(
        tmp_path, configure=configure, agents=2, rounds=ROUNDS, alpha=0.5, round_timeout=60, agent_broker_by_mdns=False
    ) as fed:
        wait_for(lambda: (fed.status("coordinator") or {}).get("completed_rounds", 0) >= 2, 120, "two rounds", fed)
        old = fed.proc("coordinator")
        fed.stop(old, signal.SIGKILL)  # kill -9: what is on disk now is all the restarted one has
        fed.procs.remove(old)
        x_k, v_k, k = split(fed, only=False)
        assert k >= 2 and sorted(v_k) == sorted(x_k)  # every (floating) tensor has its velocity
        assert all(np.abs(a).max() > 0 for a in v_k.values())
        fed.spawn("coordinator")
        done = wait_for(lambda: coordinator_in(fed, "done"), 180, "the restarted coordinator to finish", fed)
        assert done["completed_rounds"] == ROUNDS and done["model_version"] == ROUNDS
        assert done["server_step"] == {"lr": 1.0, "momentum": BETA, "default": False}
        hist = ckpt_path(fed).parent / "history.jsonl"
        after = [
            r
            for r in (json.loads(line) for line in hist.read_text().splitlines())
            if r["event"] == "round" and r["model_version"] > k
        ]
        assert [r["model_version"] for r in after] == list(range(k + 1, ROUNDS + 1))
        x_n, v_n, version = split(fed, only=True)
        assert version == ROUNDS
        want_x, want_v = replay(fed, x_k, v_k, after)
        for name in x_n:
            np.testing.assert_allclose(x_n[name], want_x[name], rtol=1e-4, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(v_n[name], want_v[name], rtol=1e-4, atol=1e-5, err_msg=name)
        # A restart that had lost the velocity would have made another model: the
        # comparison above tells the two apart.
        lost_x, _ = replay(fed, x_k, {}, after)
        assert max(float(np.abs(lost_x[n] - want_x[n]).max()) for n in want_x) > 1e-2
