"""Secure aggregation over Mosquitto with real processes: the masks cancel, drop-outs
before and after masking are survived, and the coordinator only ever holds masked
vectors (its history journals every update-bearing message it received)."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import torch
from netfed import assert_only_masked_vectors, coordinator_in, history, secure_running, wait_for

from fedagent.local.federation import BATCH, LR, SEED, Federation
from fedagent.protocols.secagg import SecAggParams, flatten
from fedagent.tasks.base import get_weights, load_task, set_weights


def expected_mean_delta(fed: Federation, who: list[int], epochs: int, params: SecAggParams) -> tuple[np.ndarray, float]:
    """What plain sample-weighted FedAvg of these agents' round-1 updates gives (each
    weighted, clipped update as the protocol defines it), and the stated bound."""
    torch.set_num_threads(1)
    w0 = get_weights(load_task("digits", {"seed": SEED}).build_model())
    _, base = flatten(w0)
    samples, deltas = {}, {}
    for i in range(fed.n):
        task = load_task("digits", fed.shard_options(i))
        samples[i] = task.num_samples()
        if i in who:
            model = task.build_model()
            set_weights(model, w0)
            task.fit(model, epochs=epochs, lr=LR, batch_size=BATCH, seed=1)
            deltas[i] = flatten(get_weights(model))[1] - base
    # W: the largest sample count among the selected agents, at most weight_cap (2 by
    # default) × their lower median
    counts = sorted(samples.values())
    top = min(counts[-1], math.floor(2 * counts[(len(counts) - 1) // 2]))
    ratios = {i: min(samples[i], top) / top for i in who}
    total = sum(np.clip(ratios[i] * deltas[i], -params.clip, params.clip) for i in who)
    weight_sum = sum(ratios.values())
    return base + total / weight_sum, params.error_bound(weight_sum, len(who))


def final_flat(fed: Federation) -> np.ndarray:
    weights, _ = fed.final_weights()
    return flatten(weights)[1]


def test_masks_cancel_over_mosquitto(tmp_path):
    epochs = 20
    with secure_running(tmp_path, agents=3, rounds=1, alpha=0.3, rounds_options={"local_epochs": epochs}) as (fed, _):
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "the secure round", fed)
        assert done["completed_rounds"] == 1
        lines = history(fed)
        got = final_flat(fed)
    (rnd,) = [ln for ln in lines if ln.get("event") == "round"]
    # Every agent's masked input, or, on a machine so loaded that one agent trains more
    # than twice as long as the others, the inputs of the agents that were in when the
    # round stopped waiting (the server's quiet close): the masks cancel either way, the
    # late agent's through the others' shares of its key.
    assert set(rnd["participants"]) <= set(fed.agent_ids) and len(rnd["participants"]) >= 2
    who = [fed.agent_ids.index(a) for a in rnd["participants"]]
    assert_only_masked_vectors(lines, 20)
    want, bound = expected_mean_delta(fed, who, epochs, SecAggParams())
    err = np.abs(got - want).max()
    assert err <= bound + 2e-7, (err, bound)  # (+ float32 rounding of the stored model)
    assert rnd["secure"]["error_bound"] == bound


def test_agents_killed_before_and_after_masking(tmp_path):
    """agent-1 is killed after sharing its keys, before its masked input; agent-2 right
    after its masked input, before it could give any shares. agent-5 is held
    (SIGSTOP) meanwhile, so the unmasking stage cannot start before agent-2 is gone."""
    epochs = 150  # a few seconds of training: room to act between the stages
    with secure_running(
        tmp_path, agents=5, rounds=1, alpha=0.3, round_timeout=180.0, rounds_options={"local_epochs": epochs}
    ) as (fed, _):

        def stage(name: str):
            s = fed.status("coordinator")
            return (
                s
                if s and isinstance(s.get("secure_aggregation"), dict) and s["secure_aggregation"]["stage"] == name
                else None
            )

        wait_for(lambda: stage("inputs"), 120, "keys and shares exchanged", fed)
        sent = {ln["sender"] for ln in history(fed) if ln.get("kind") == "secagg_masked"}
        assert not sent & {"agent-1", "agent-2", "agent-5"}, "trained too fast for this test"
        fed.stop(fed.proc("agent-1"), signal.SIGKILL)
        fed.procs.remove(fed.proc("agent-1"))
        slow = fed.proc("agent-5")
        os.kill(slow.popen.pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: any(ln.get("kind") == "secagg_masked" and ln["sender"] == "agent-2" for ln in history(fed)),
                120,
                "agent-2's masked input",
                fed,
            )
            fed.stop(fed.proc("agent-2"), signal.SIGKILL)
            fed.procs.remove(fed.proc("agent-2"))
        finally:
            os.kill(slow.popen.pid, signal.SIGCONT)
        done = wait_for(lambda: coordinator_in(fed, "done"), 180, "the secure round", fed)
        assert done["completed_rounds"] == 1
        lines = history(fed)
        got = final_flat(fed)
    (rnd,) = [ln for ln in lines if ln.get("event") == "round"]
    assert rnd["participants"] == ["agent-2", "agent-3", "agent-4", "agent-5"]
    assert rnd["secure"]["dropped_before_input"] == ["agent-1"]
    reveals = {ln["sender"] for ln in lines if ln.get("kind") == "secagg_reveal"}
    assert "agent-2" not in reveals and reveals <= {"agent-3", "agent-4", "agent-5"}
    assert_only_masked_vectors(lines, 20)
    want, bound = expected_mean_delta(fed, [1, 2, 3, 4], epochs, SecAggParams())
    err = np.abs(got - want).max()
    assert err <= bound + 2e-7, (err, bound)  # (+ float32 rounding of the stored model)


def test_keys_come_ahead_after_the_first_round_over_mosquitto(tmp_path):
    """Three secure rounds: the first has a key stage; the agents advertise the next
    round's keys with their masked inputs, so rounds 2 and 3 have none."""
    with secure_running(tmp_path, agents=3, rounds=3, alpha=0.3) as (fed, _):
        done = wait_for(lambda: coordinator_in(fed, "done"), 240, "three secure rounds", fed)
        assert done["completed_rounds"] == 3
        lines = history(fed)
    rounds = [ln for ln in lines if ln.get("event") == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r["secure"]["keys_ahead"] for r in rounds] == [False, True, True]
    assert all(r["participants"] == fed.agent_ids for r in rounds)
    received = [ln for ln in lines if ln.get("event") == "received"]
    assert {ln["round"] for ln in received if ln["kind"] == "secagg_keys"} == {1}
    assert {ln["round"] for ln in received if ln["kind"] == "secagg_shares"} == {1, 2, 3}
    assert_only_masked_vectors(lines, 20)
