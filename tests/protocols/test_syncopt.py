"""The Sync-Opt step machine (pure): steps, refusals, faults, and an in-memory
federation of N agents that must match centralized gradient descent exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedagent.errors import CodecError
from fedagent.protocols import syncopt as S
from fedagent.protocols.codec import Envelope, Limits, decode, encode
from fedagent.protocols.messages import SyncGradient, SyncStep, SyncValidation, body_of

F32 = np.float32


def weights0() -> dict[str, np.ndarray]:
    return {
        "w": np.array([0.5, -0.25, 1.0], dtype=F32),
        "b": np.array([0.1], dtype=F32),
        "bn.count": np.array(0, dtype=np.int64),
    }  # a buffer: travels, has no gradient


PARAMS = ("w", "b")


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, dtype=F32), "b": np.array([value], dtype=F32)}


def machine(**kw) -> S.SyncOptMachine:
    return S.SyncOptMachine(S.SyncOptConfig(**{"steps": 3, "step_timeout": 10.0, **kw}), weights0(), PARAMS)


def sgd(weights, gradient, lr=0.1):
    out = dict(weights)
    for n, g in gradient.items():
        out[n] = (weights[n] - lr * g).astype(weights[n].dtype)
    return out


def gradient_event(sender, step, n=10, value=1.0, version=None, m=None, loss=1.0):
    return S.GradientReceived(sender, step, m.model_version if version is None else version, n, loss, grad(value))


# ---- one step -----------------------------------------------------------------------
def test_a_step_broadcasts_collects_aggregates_by_samples_and_applies():
    m = machine()
    start, wake = m.handle(S.Begin(("b-agent", "a-agent")), 0.0)
    assert isinstance(start, S.StartStep) and start.step == 1 and start.model_version == 0
    assert start.participants == ("a-agent", "b-agent") and start.weights is not None
    assert wake == S.RequestWakeup(10.0)
    assert m.handle(gradient_event("a-agent", 1, n=10, value=1.0, m=m, loss=2.0), 1.0) == []
    (apply,) = m.handle(gradient_event("b-agent", 1, n=30, value=5.0, m=m, loss=4.0), 2.0)
    assert isinstance(apply, S.ApplyGradient) and apply.step == 1 and apply.model_version == 0
    # (10·1 + 30·5) / 40 = 4
    np.testing.assert_allclose(apply.gradient["w"], 4.0)
    assert apply.gradient["w"].dtype == F32 and set(apply.gradient) == set(PARAMS)
    new = sgd(m.weights, apply.gradient)
    done, nxt, _ = m.handle(S.OptimizerApplied(1, new), 3.0)
    assert isinstance(done, S.StepDone) and done.model_version == 1 and not done.final
    assert done.loss == pytest.approx((10 * 2.0 + 30 * 4.0) / 40) and done.samples == 40
    assert done.participants == ("a-agent", "b-agent") and done.missing == ()
    expected = S.relative_change(new, weights0(), PARAMS)
    assert done.rel_change == pytest.approx(expected) and expected > 0
    assert isinstance(nxt, S.StartStep) and nxt.step == 2 and nxt.model_version == 1
    assert nxt.weights is new


def test_stops_after_max_steps():
    m = machine(steps=2)
    m.handle(S.Begin(("a",)), 0.0)
    cmds = []
    for step in (1, 2):
        (apply,) = m.handle(gradient_event("a", step, m=m), 0.0)
        cmds = m.handle(S.OptimizerApplied(step, sgd(m.weights, apply.gradient)), 0.0)
    done, fin = cmds
    assert done.final and isinstance(fin, S.Finished)
    assert fin.reason == "max steps" and fin.steps_done == 2 and fin.model_version == 2
    assert m.phase is S.Phase.DONE


def test_stops_when_the_relative_change_falls_below_tol():
    m = machine(steps=100, tol=1e-3)
    m.handle(S.Begin(("a",)), 0.0)
    (apply,) = m.handle(gradient_event("a", 1, m=m, value=1.0), 0.0)
    out = m.handle(S.OptimizerApplied(1, sgd(m.weights, apply.gradient)), 0.0)
    assert not out[0].final  # a big step: keep going
    (apply,) = m.handle(gradient_event("a", 2, m=m, value=1e-6), 0.0)
    done, fin = m.handle(S.OptimizerApplied(2, sgd(m.weights, apply.gradient)), 0.0)
    assert done.rel_change < 1e-3 and done.final and fin.reason == "converged"


def test_repeated_version_travels_without_weights():
    m = machine(on_fault="continue", min_gradients=2)
    m.handle(S.Begin(("a", "b", "c")), 0.0)
    m.handle(gradient_event("a", 1, m=m), 1.0)
    m.handle(S.AgentOffline("c"), 2.0)
    # b still online and silent: wait for the deadline.
    out = m.handle(S.Wakeup(), 10.0)
    repeated, start, _ = out
    assert isinstance(repeated, S.StepRepeated) and "missing b, c" in repeated.reason
    # The same version again, to a and b who hold it: only the version travels.
    assert start.step == 2 and start.model_version == 0 and start.participants == ("a",) and start.weights is None


# ---- refusals -----------------------------------------------------------------------
def test_late_duplicate_stale_and_unselected_gradients_are_refused_by_name():
    m = machine()
    m.handle(S.Begin(("a", "b")), 0.0)
    assert m.handle(gradient_event("a", 1, m=m), 1.0) == []
    (dup,) = m.handle(gradient_event("a", 1, m=m), 1.1)
    assert (dup.sender, dup.reason) == ("a", "duplicate")
    (old,) = m.handle(gradient_event("b", 1, m=m, version=7), 1.2)
    assert (old.sender, old.reason) == ("b", "stale")
    (future,) = m.handle(gradient_event("b", 5, m=m), 1.3)
    assert (future.sender, future.reason) == ("b", "stale")
    (eve,) = m.handle(gradient_event("eve", 1, m=m), 1.4)
    assert (eve.sender, eve.reason) == ("eve", "unselected")
    (apply,) = m.handle(gradient_event("b", 1, m=m), 1.5)
    # While the optimizer runs, a late gradient of that step is stale.
    (late,) = m.handle(gradient_event("b", 1, m=m), 1.6)
    assert late.reason == "stale"
    m.handle(S.OptimizerApplied(1, sgd(m.weights, apply.gradient)), 2.0)
    (late,) = m.handle(gradient_event("a", 1, m=m, version=0), 2.1)
    assert (late.sender, late.reason) == ("a", "stale")


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda g: {"w": g["w"]}, "names"),
        (lambda g: {**g, "bn.count": np.array(1)}, "names"),
        (lambda g: {**g, "w": np.zeros(4, F32)}, "shape"),
        (lambda g: {**g, "w": g["w"].astype(np.float64)}, "dtype"),
        (lambda g: {**g, "b": np.array([np.nan], F32)}, "non-finite"),
        (lambda g: {**g, "w": np.array([np.inf, 0, 0], F32)}, "non-finite"),
    ],
)
def test_malformed_gradients_never_reach_the_aggregate(mutate, reason):
    m = machine()
    m.handle(S.Begin(("a", "b")), 0.0)
    bad = S.GradientReceived("a", 1, 0, 10, 1.0, mutate(grad(100.0)))
    (r,) = m.handle(bad, 1.0)
    assert (r.sender, r.reason) == ("a", reason)
    # a may still send a good one; the aggregate is the good gradients only.
    m.handle(gradient_event("a", 1, m=m, value=1.0), 2.0)
    (apply,) = m.handle(gradient_event("b", 1, m=m, value=3.0), 3.0)
    np.testing.assert_allclose(apply.gradient["w"], 2.0)


def test_norm_bound_and_bad_loss():
    m = machine(max_norm=1.0)
    m.handle(S.Begin(("a",)), 0.0)
    (r,) = m.handle(gradient_event("a", 1, m=m, value=10.0), 1.0)
    assert r.reason == "norm"
    (r,) = m.handle(gradient_event("a", 1, m=m, value=0.1, loss=math.nan), 1.0)
    assert r.reason == "non-finite"


# ---- faults -------------------------------------------------------------------------
def test_continue_aggregates_without_a_vanished_agent_and_readmits_it():
    m = machine(steps=5, on_fault="continue")
    m.handle(S.Begin(("a", "b", "c")), 0.0)
    m.handle(gradient_event("a", 1, m=m, n=10, value=1.0), 1.0)
    m.handle(gradient_event("b", 1, m=m, n=10, value=3.0), 1.0)
    assert m.handle(S.Wakeup(), 5.0) == [S.RequestWakeup(10.0)]  # before the deadline: wait for c
    (apply,) = m.handle(S.AgentOffline("c"), 6.0)  # c is gone: no need to wait longer
    np.testing.assert_allclose(apply.gradient["w"], 2.0)
    done, start, _ = m.handle(S.OptimizerApplied(1, sgd(m.weights, apply.gradient)), 7.0)
    assert done.missing == ("c",) and done.participants == ("a", "b") and not m.exact
    assert start.participants == ("a", "b")
    # c restarts: it is back in the next step, and gets the full weights.
    m.handle(S.AgentOnline("c"), 8.0)
    m.handle(gradient_event("a", 2, m=m), 9.0)
    (apply,) = m.handle(gradient_event("b", 2, m=m), 9.0)
    _, start, _ = m.handle(S.OptimizerApplied(2, sgd(m.weights, apply.gradient)), 10.0)
    assert start.participants == ("a", "b", "c") and start.weights is not None


def test_continue_waits_for_a_silent_but_online_agent_until_the_deadline():
    m = machine(on_fault="continue")
    m.handle(S.Begin(("a", "b")), 0.0)
    m.handle(gradient_event("a", 1, m=m), 1.0)
    assert m.handle(S.Wakeup(), 9.9) == [S.RequestWakeup(10.0)]  # early: the deadline asked for again
    (apply,) = m.handle(S.Wakeup(), 10.0)
    assert isinstance(apply, S.ApplyGradient)


def test_an_earlier_steps_wakeup_re_requests_the_current_deadline():
    """Found by the slow agent-restart test: the daemon's one Timer keeps the soonest
    wake-up, so step 1's deadline fires during step 2 and step 2's own request was
    dropped. That early wake-up must ask for step 2's deadline again, or a participant
    that never answers stalls step 2 for ever."""
    m = machine(on_fault="continue")
    m.handle(S.Begin(("a", "b")), 0.0)  # step 1, deadline 10
    m.handle(gradient_event("a", 1, m=m), 1.0)
    (apply,) = m.handle(gradient_event("b", 1, m=m), 2.0)
    _done, start2, wake2 = m.handle(S.OptimizerApplied(1, sgd(m.weights, apply.gradient)), 3.0)
    assert isinstance(start2, S.StartStep) and wake2 == S.RequestWakeup(13.0)
    m.handle(gradient_event("a", 2, m=m), 4.0)  # b stays silent (online)
    assert m.handle(S.Wakeup(), 10.0) == [S.RequestWakeup(13.0)]  # step 1's wake-up
    (apply2,) = m.handle(S.Wakeup(), 13.0)
    assert isinstance(apply2, S.ApplyGradient) and apply2.step == 2


def test_abort_policy_waits_for_the_deadline_then_stops():
    m = machine(on_fault="abort")
    m.handle(S.Begin(("a", "b")), 0.0)
    m.handle(gradient_event("a", 1, m=m), 1.0)
    assert m.handle(S.AgentOffline("b"), 2.0) == []  # may reconnect: QoS 1 redelivers
    (ab,) = m.handle(S.Wakeup(), 10.0)
    assert isinstance(ab, S.Aborted) and "b" in ab.reason and m.phase is S.Phase.ABORTED
    assert m.model_version == 0
    (r,) = m.handle(gradient_event("b", 1, m=m), 11.0)
    assert r.reason == "stale"


def test_an_early_wakeup_re_arms_the_current_steps_deadline():
    """The daemon's timer keeps only the soonest wake-up: step 1's deadline replaces step
    2's request, fires while step 2 still waits, and must not be the last word on it."""
    m = machine(steps=5, on_fault="continue")
    m.handle(S.Begin(("a", "b")), 0.0)
    m.handle(gradient_event("a", 1, m=m), 1.0)
    (apply,) = m.handle(gradient_event("b", 1, m=m), 2.0)
    _, start2, wake2 = m.handle(S.OptimizerApplied(1, sgd(m.weights, apply.gradient)), 3.0)
    assert start2.step == 2 and wake2 == S.RequestWakeup(13.0)
    m.handle(gradient_event("a", 2, m=m), 4.0)
    # step 1's wake-up (due at 10) arrives first: step 2 waits for b and asks again
    assert m.handle(S.Wakeup(), 10.0) == [S.RequestWakeup(13.0)]
    (apply2,) = m.handle(S.Wakeup(), 13.0)
    assert isinstance(apply2, S.ApplyGradient) and apply2.step == 2


def test_resume_never_reuses_a_step_number():
    m = S.SyncOptMachine(S.SyncOptConfig(steps=10), weights0(), PARAMS, model_version=4, steps_done=4, last_step=6)
    start, _ = m.handle(S.Begin(("a",)), 0.0)
    assert start.step == 7 and start.model_version == 4


def test_config_refuses_impossible_settings():
    for kw in (
        {"steps": 0},
        {"tol": -1},
        {"tol": math.nan},
        {"step_timeout": 0},
        {"on_fault": "retry"},
        {"aggregation": "median"},
        {"max_norm": 0.0},
        {"min_gradients": 0},
    ):
        with pytest.raises(ValueError):
            S.SyncOptConfig(**kw)


# ---- an in-memory federation --------------------------------------------------------
class LinearAgent:
    """Least squares on private data; the mini-batch of step e is fixed by (seed, e)."""

    def __init__(self, name: str, seed: int, n: int, batch: int) -> None:
        rng = np.random.default_rng(seed)
        self.name, self.batch, self.seed = name, batch, seed
        self.x = rng.normal(size=(n, 3)).astype(F32)
        self.y = (self.x @ np.array([1.0, -2.0, 0.5], F32) + 0.3 + rng.normal(scale=0.1, size=n)).astype(F32)
        self.weights: dict[str, np.ndarray] | None = None

    def indices(self, step: int) -> np.ndarray:
        return np.random.default_rng((self.seed, step)).choice(len(self.x), self.batch, replace=False)

    def gradient(self, w, step):
        idx = self.indices(step)
        x, y = self.x[idx].astype(np.float64), self.y[idx].astype(np.float64)
        r = x @ w["w"].astype(np.float64) + w["b"].astype(np.float64)[0] - y
        g = {"w": (2 * x.T @ r / len(idx)).astype(F32), "b": np.array([2 * r.mean()], F32)}
        return g, len(idx), float((r**2).mean())

    def on_step(self, cmd: S.StartStep, m: S.SyncOptMachine) -> S.GradientReceived | None:
        if self.name not in cmd.participants:
            return None
        if cmd.weights is not None:
            self.weights = cmd.weights
        assert self.weights is not None
        g, n, loss = self.gradient(self.weights, cmd.step)
        return S.GradientReceived(self.name, cmd.step, cmd.model_version, n, loss, g)


def run_federation(agents, steps, lr=0.05, drop_at=None):
    m = S.SyncOptMachine(S.SyncOptConfig(steps=steps, step_timeout=5), weights0(), PARAMS)
    pending = m.handle(S.Begin(tuple(a.name for a in agents)), 0.0)
    now, log = 0.0, []
    while pending:
        cmd = pending.pop(0)
        if isinstance(cmd, S.StartStep):
            for a in agents:
                if drop_at is not None and cmd.step == drop_at and a.name == agents[-1].name:
                    pending += m.handle(S.AgentOffline(a.name), now)
                    continue
                ev = a.on_step(cmd, m)
                if ev is not None:
                    pending += m.handle(ev, now)
        elif isinstance(cmd, S.ApplyGradient):
            pending += m.handle(S.OptimizerApplied(cmd.step, sgd(m.weights, cmd.gradient, lr)), now)
        elif isinstance(cmd, (S.StepDone, S.Finished)):
            log.append(cmd)
        now += 0.01
    return m, log


def centralized(agents, steps, lr=0.05):
    w = weights0()
    for e in range(1, steps + 1):
        xs = np.concatenate([a.x[a.indices(e)] for a in agents]).astype(np.float64)
        ys = np.concatenate([a.y[a.indices(e)] for a in agents]).astype(np.float64)
        r = xs @ w["w"].astype(np.float64) + w["b"].astype(np.float64)[0] - ys
        g = {"w": (2 * xs.T @ r / len(ys)).astype(F32), "b": np.array([2 * r.mean()], F32)}
        w = sgd(w, g, lr)
    return w


def test_ten_agents_in_memory_equal_centralized_training_on_the_union_of_batches():
    agents = [LinearAgent(f"agent-{i}", seed=i, n=200, batch=8 + 3 * i) for i in range(10)]
    m, log = run_federation(agents, steps=40)
    assert isinstance(log[-1], S.Finished) and log[-1].steps_done == 40 and m.exact
    ref = centralized(agents, 40)
    for n in PARAMS:
        assert np.max(np.abs(m.weights[n] - ref[n])) <= 1e-6
    losses = [c.loss for c in log if isinstance(c, S.StepDone)]
    assert losses[-1] < losses[0] / 4  # it learnt something
    assert m.weights["bn.count"] == 0  # buffers travel untouched


def test_in_memory_fault_drops_one_agent_and_flags_the_run_inexact():
    agents = [LinearAgent(f"agent-{i}", seed=i, n=100, batch=10) for i in range(4)]
    m, log = run_federation(agents, steps=6, drop_at=3)
    dones = [c for c in log if isinstance(c, S.StepDone)]
    assert [d.missing for d in dones] == [(), (), ("agent-3",), (), (), ()]
    assert dones[3].participants == ("agent-0", "agent-1", "agent-2") and not m.exact


# ---- messages -----------------------------------------------------------------------
LIMITS = Limits()


def roundtrip(msg):
    env = Envelope(kind=msg.kind, federation="fed", sender="coord", round=1, seq=1, ts=1.0, body=msg.to_body())
    back = decode(encode(env), LIMITS)
    return body_of(back.kind, back.body, LIMITS)


def test_step_and_gradient_messages_roundtrip():
    st = roundtrip(SyncStep(3, 2, ("a", "b"), 30.0, "abc", weights0()))
    assert st.step == 3 and st.participants == ("a", "b") and st.vocab_digest == "abc"
    np.testing.assert_array_equal(st.weights["w"], weights0()["w"])
    assert roundtrip(SyncStep(3, 2, ("a",), 30.0, "")).weights is None
    g = roundtrip(SyncGradient(3, 2, 16, 1.5, grad(2.0)))
    assert (g.step, g.base_version, g.num_samples, g.loss) == (3, 2, 16, 1.5)
    np.testing.assert_array_equal(g.gradient["w"], grad(2.0)["w"])
    assert not roundtrip(SyncStep(3, 2, ("a",), 30.0, "")).validate
    assert roundtrip(SyncStep(4, 2, ("a",), 30.0, "", validate=True)).validate
    v = roundtrip(SyncValidation(4, 2, 181.5, 37))
    assert (v.step, v.base_version, v.loss, v.num_docs) == (4, 2, 181.5, 37)
    assert math.isinf(roundtrip(SyncValidation(4, 2, math.inf, 3)).loss)  # a diverged model may say so
    for patch in ({"num_docs": -1}, {"loss": "x"}, {"step": True}, {"validate": 1}):
        body = {**SyncValidation(4, 2, 1.0, 3).to_body(), **patch}
        with pytest.raises(CodecError):
            (SyncStep if "validate" in patch else SyncValidation).from_body(
                {**SyncStep(4, 2, ("a",), 30.0, "").to_body(), **patch} if "validate" in patch else body, LIMITS
            )


@pytest.mark.parametrize(
    "patch",
    [
        {"num_samples": 0},
        {"loss": float("nan")},
        {"step": -1},
        {"gradient": {"w": {"dtype": "object", "shape": [1], "data": b"x"}}},
        {"num_samples": True},
    ],
)
def test_bad_gradient_messages_are_codec_errors(patch):
    body = {**SyncGradient(1, 0, 4, 0.5, grad(1.0)).to_body(), **patch}
    with pytest.raises(CodecError):
        SyncGradient.from_body(body, LIMITS)


# ---- configuration ------------------------------------------------------------------
def test_syncopt_section_is_read_and_checked(tmp_path):
    from fedagent import config
    from fedagent.errors import ConfigError

    tls = config.TlsConfig(ca=tmp_path / "ca.crt", cert=tmp_path / "c.crt", key=tmp_path / "c.key")

    def load(section):
        p = tmp_path / "coordinator.toml"
        p.write_text(
            config.render(
                node_id="coord",
                federation="fed",
                tls=tls,
                state_dir=tmp_path,
                mode="syncopt",
                broker="mqtts://127.0.0.1:8883",
                syncopt=section,
            )
        )
        return config.load(p, "coordinator")

    cfg = load({"steps": 50, "tol": 1e-4, "expected_agents": 5, "min_count": 2, "max_size": 1000, "on_fault": "abort"})
    assert cfg.mode == "syncopt"
    m = cfg.syncopt.machine_config()
    assert (m.steps, m.tol, m.on_fault) == (50, 1e-4, "abort")
    v = cfg.syncopt.vocab_config()
    assert (v.expected_agents, v.min_count, v.max_size) == (5, 2, 1000)
    m = load({"patience": 5, "epoch_steps": 35, "delta": 0.1, "float64": True}).syncopt.machine_config()
    assert (m.patience, m.epoch_steps, m.delta, m.max_epochs, m.aggregation) == (5, 35, 0.1, 100, "ordered")
    for bad in (
        {"patience": 5},  # no epoch_steps
        {"max_epochs": 0},
        {"stepz": 3},
        {"on_fault": "retry"},
        {"steps": 0},
        {"expected_agents": 2, "min_agents": 3},
        {"aggregation": "median"},
        {"vocab_timeout": 0},
    ):
        with pytest.raises(ConfigError, match="syncopt"):
            load(bad)


def test_optimizer_state_survives_a_checkpoint(tmp_path):
    """Adam's moments go into the checkpoint as named tensors and come back: a resumed
    coordinator takes the same next step as one that never stopped."""
    import torch

    from fedagent.coordinator.syncopt import OPTIMIZER_PREFIX, load_optimizer_state, optimizer_state
    from fedagent.storage import checkpoint
    from fedagent.tasks.base import get_weights

    def model_and_opt():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softplus(), torch.nn.Linear(3, 1))
        return m, torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.99, 0.999))

    def step(m, opt, k):
        opt.zero_grad()
        x = torch.linspace(-1, 1, 8 * 4).reshape(8, 4) * (k + 1)
        m(x).pow(2).mean().backward()
        opt.step()

    m, opt = model_and_opt()
    for k in range(3):
        step(m, opt, k)
    arrays, scalars = optimizer_state(opt)
    assert arrays and all(k.startswith(OPTIMIZER_PREFIX) for k in arrays)
    checkpoint.save(tmp_path / "c.ckpt", {**get_weights(m), **arrays}, {"optimizer": scalars})
    saved, meta = checkpoint.load(tmp_path / "c.ckpt")

    m2, opt2 = model_and_opt()
    m2.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in saved.items() if not k.startswith(OPTIMIZER_PREFIX)}
    )
    load_optimizer_state(opt2, {k: v for k, v in saved.items() if k.startswith(OPTIMIZER_PREFIX)}, meta["optimizer"])
    step(m, opt, 3)
    step(m2, opt2, 3)
    for (n, a), b in zip(get_weights(m).items(), get_weights(m2).values()):
        assert np.array_equal(a, b), n


# ---- early stopping on a validation loss (gFedNTM Sec. 4.1, the CTM package's rule) ----
def test_patience_stop_keeps_the_best_epoch_and_stops_after_patience_bad_epochs():
    rule = S.PatienceStop(patience=2, max_epochs=100)
    improved = [rule.observe(x) for x in (5.0, 4.0, 4.0, 4.5, 3.9, 4.1, 4.2)]
    # an equal loss counts as an improvement (delta = 0: loss <= best - delta)
    assert improved == [True, True, True, False, True, False, False]
    assert rule.stopped and rule.epochs == 7 and rule.best_epoch == 4 and rule.best == 3.9
    with pytest.raises(RuntimeError):
        rule.observe(1.0)


def test_patience_stop_delta_max_epochs_and_non_finite_losses():
    rule = S.PatienceStop(patience=3, delta=0.5, max_epochs=100)
    assert [rule.observe(x) for x in (10.0, 9.6, 9.4)] == [True, False, True]
    rule = S.PatienceStop(patience=5, max_epochs=3)
    for x in (3.0, 2.0, 1.0):
        assert not rule.stopped
        rule.observe(x)
    assert rule.stopped and rule.best_epoch == 2  # the cap ends an improving run
    rule = S.PatienceStop(patience=2)
    assert rule.observe(math.nan) is False and rule.best_epoch == -1
    assert rule.observe(math.inf) is False and rule.stopped
    with pytest.raises(ValueError):
        S.PatienceStop(patience=0)
    with pytest.raises(ValueError):
        S.PatienceStop(delta=-1.0)


def test_pooled_validation_loss_is_the_sample_weighted_mean_of_the_nodes_losses():
    assert S.pooled_validation_loss({"a": (2.0, 100), "b": (4.0, 300)}) == pytest.approx(3.5)
    assert S.pooled_validation_loss({"a": (2.0, 100), "b": (math.nan, 0)}) == pytest.approx(2.0)
    assert S.pooled_validation_loss({"a": (2.0, 100), "b": (math.nan, 5)}) == math.inf
    for bad in ({}, {"a": (1.0, 0)}, {"a": (1.0, -3), "b": (1.0, 10)}):
        with pytest.raises(ValueError):
            S.pooled_validation_loss(bad)


# ---- arrival order does not change the aggregate ("ordered") ------------------------
def f64_grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=3) * 10.0 ** rng.integers(-8, 8, size=3), "b": rng.normal(size=1)}


def test_ordered_aggregate_is_the_in_process_sum_whatever_the_arrival_order():
    order = ("a", "b", "c", "d", "e")
    ref = {"w": np.zeros(3), "b": np.zeros(1)}
    grads = {a: (f64_grads(i), 8 + i) for i, a in enumerate(order)}
    # what an in-process Sync-Opt step computes (fedagent.tasks.ntm.federated_step)
    total = sum(n for _, n in grads.values())
    expected = {k: sum(g[k] * n for g, n in grads.values()) / total for k in ref}
    results = []
    for perm in (order, order[::-1], ("c", "a", "e", "b", "d")):
        acc = S.OrderedWeightedMean(ref, order)
        for a in perm:
            acc.add(a, *grads[a])
        results.append(acc.result())
    for r in results:
        for k in ref:
            assert np.array_equal(r[k], expected[k]) and r[k].dtype == np.float64
    # the streaming mean's last bits depend on the order (why "ordered" exists)
    streamed = []
    for perm in (order, order[::-1], ("c", "a", "e", "b", "d")):
        acc2 = S.SampleWeightedMean(ref)
        for a in perm:
            acc2.add(a, *grads[a])
        streamed.append(acc2.result())
    assert any(not np.array_equal(s["w"], expected["w"]) for s in streamed)


def test_ordered_aggregate_skips_the_missing_and_refuses_strangers():
    ref = {"w": np.zeros(3, dtype=F32), "b": np.zeros(1, dtype=F32)}
    acc = S.OrderedWeightedMean(ref, ("a", "b", "c"))
    acc.add("c", grad(3.0), 10)  # held until a and b are in or known missing
    acc.add("a", grad(1.0), 30)
    with pytest.raises(ValueError):
        acc.add("a", grad(1.0), 30)
    with pytest.raises(ValueError):
        acc.add("z", grad(1.0), 30)
    out = acc.result()  # b never came
    np.testing.assert_allclose(out["w"], (30 * 1.0 + 10 * 3.0) / 40)
    assert out["w"].dtype == F32 and acc.count == 2


def test_machine_with_ordered_aggregation_folds_in_participant_order():
    m = machine(aggregation="ordered")
    m.handle(S.Begin(("b", "a")), 0.0)
    assert m.handle(gradient_event("b", 1, n=30, value=5.0, m=m), 1.0) == []
    (apply,) = m.handle(gradient_event("a", 1, n=10, value=1.0, m=m), 2.0)
    np.testing.assert_allclose(apply.gradient["w"], 4.0)
    assert apply.gradient["w"].dtype == F32


# ---- early stopping inside the machine -------------------------------------------------
def stopping_machine(**kw) -> S.SyncOptMachine:
    cfg = {"steps": 100, "step_timeout": 10.0, "patience": 2, "epoch_steps": 2, **kw}
    return S.SyncOptMachine(S.SyncOptConfig(**cfg), weights0(), PARAMS)


def run_epochs(m: S.SyncOptMachine, agents: tuple[str, ...], val_losses: list[float]):
    """Drive ``m``: every step gets a gradient from every agent; the k-th validation gets
    val_losses[k] from every agent. Returns every command."""
    seen: list = []
    pending = m.handle(S.Begin(agents), 0.0)
    losses = iter(val_losses)
    while pending:
        cmd = pending.pop(0)
        seen.append(cmd)
        if isinstance(cmd, S.StartStep):
            for a in cmd.participants:
                pending += m.handle(gradient_event(a, cmd.step, m=m), 0.0)
        elif isinstance(cmd, S.ApplyGradient):
            pending += m.handle(S.OptimizerApplied(cmd.step, sgd(m.weights, cmd.gradient)), 0.0)
        elif isinstance(cmd, S.StartValidation):
            loss = next(losses)
            for a in cmd.participants:
                pending += m.handle(S.ValidationReceived(a, cmd.step, cmd.model_version, loss, 5), 0.0)
    return seen


def test_the_machine_validates_every_epoch_and_stops_on_patience_with_the_best_model():
    m = stopping_machine()
    seen = run_epochs(m, ("a", "b"), [3.0, 2.0, 2.5, 2.6])
    epochs = [c for c in seen if isinstance(c, S.EpochDone)]
    assert [(e.epoch, e.model_version, e.loss, e.improved, e.best_epoch) for e in epochs] == [
        (1, 2, 3.0, True, 1),
        (2, 4, 2.0, True, 2),
        (3, 6, 2.5, False, 2),
        (4, 8, 2.6, False, 2),
    ]
    assert [e.final for e in epochs] == [False, False, False, True] and epochs[-1].documents == 10
    fin = seen[-1]
    assert isinstance(fin, S.Finished) and fin.reason == "early stopped" and fin.steps_done == 8
    # the kept model is the best epoch's (after 4 steps), not the last one
    assert fin.model_version == 4 and fin.weights is m.best_weights and m.model_version == 8
    # every validation follows exactly two steps and carries the new weights; the step after
    # a validation sends only the version (every participant holds it)
    kinds = [type(c).__name__ for c in seen if isinstance(c, (S.StartStep, S.StartValidation))]
    assert kinds == ["StartStep", "StartStep", "StartValidation"] * 4
    vals = [c for c in seen if isinstance(c, S.StartValidation)]
    assert all(v.weights is not None for v in vals)
    after = [seen[i + 2] for i, c in enumerate(seen) if isinstance(c, S.StartValidation) and i + 2 < len(seen)]
    assert all(isinstance(c, S.StartStep) and c.weights is None for c in after if isinstance(c, S.StartStep))
    assert len({c.step for c in seen if isinstance(c, (S.StartStep, S.StartValidation))}) == 12  # never reused
    assert m.status()["best_epoch"] == 2 and m.status()["epochs"] == 4


def test_max_epochs_and_max_steps_end_an_improving_run_with_its_best_model():
    m = stopping_machine(max_epochs=3)
    seen = run_epochs(m, ("a",), [3.0, 2.0, 1.0])
    assert seen[-1].reason == "max epochs" and seen[-1].model_version == 6
    m = stopping_machine(steps=5)
    seen = run_epochs(m, ("a",), [3.0, 2.0])
    # step 5 ends mid-epoch: the model kept is the best validated one (after 4 steps)
    assert isinstance(seen[-1], S.Finished) and seen[-1].reason == "max steps"
    assert seen[-1].model_version == 4 and seen[-1].steps_done == 5


def test_validation_answers_are_checked_and_a_missing_one_is_a_fault():
    m = stopping_machine(on_fault="abort")
    m.handle(S.Begin(("a", "b")), 0.0)
    for step in (1, 2):
        m.handle(gradient_event("a", step, m=m), 0.0)
        (apply,) = m.handle(gradient_event("b", step, m=m), 0.0)
        out = m.handle(S.OptimizerApplied(step, sgd(m.weights, apply.gradient)), 0.0)
    start = out[1]
    assert isinstance(start, S.StartValidation) and start.step == 3 and start.epoch == 1
    assert m.phase is S.Phase.VALIDATING
    (g,) = m.handle(gradient_event("a", 3, m=m), 0.5)
    assert g.reason == "stale"  # a gradient is not a validation loss
    (old,) = m.handle(S.ValidationReceived("a", 3, 1, 2.0, 5), 0.5)
    assert old.reason == "stale"
    (neg,) = m.handle(S.ValidationReceived("a", 3, 2, 2.0, -1), 0.5)
    assert neg.reason == "weight"
    assert m.handle(S.ValidationReceived("a", 3, 2, 2.0, 5), 0.5) == []
    (dup,) = m.handle(S.ValidationReceived("a", 3, 2, 2.0, 5), 0.6)
    assert dup.reason == "duplicate"
    assert m.handle(S.Wakeup(), 5.0) == [S.RequestWakeup(10.0)]  # before the deadline: re-armed
    (aborted,) = m.handle(S.Wakeup(), 10.5)
    assert isinstance(aborted, S.Aborted) and "no validation loss from b" in aborted.reason

    m = stopping_machine(on_fault="continue")
    m.handle(S.Begin(("a", "b")), 0.0)
    for step in (1, 2):
        m.handle(gradient_event("a", step, m=m), 0.0)
        (apply,) = m.handle(gradient_event("b", step, m=m), 0.0)
        m.handle(S.OptimizerApplied(step, sgd(m.weights, apply.gradient)), 0.0)
    m.handle(S.ValidationReceived("a", 3, 2, 2.0, 5), 0.5)
    epoch, start, _ = m.handle(S.AgentOffline("b"), 1.0)
    assert isinstance(epoch, S.EpochDone) and epoch.missing == ("b",) and epoch.loss == 2.0
    assert isinstance(start, S.StartStep) and start.participants == ("a",) and not m.exact


def test_a_resumed_machine_validates_a_finished_epoch_first_and_keeps_its_best():
    rule = S.PatienceStop(patience=2, best=2.0, best_epoch=0, epochs=1, bad_epochs=0)
    best = {k: v + 1 if v.dtype.kind == "f" else v for k, v in weights0().items()}
    cfg = S.SyncOptConfig(steps=100, step_timeout=10.0, patience=2, epoch_steps=2)
    m = S.SyncOptMachine(
        cfg, weights0(), PARAMS, model_version=4, steps_done=4, last_step=9, stopper=rule, best=(2, best)
    )
    start, _ = m.handle(S.Begin(("a",)), 0.0)
    assert isinstance(start, S.StartValidation) and start.epoch == 2 and start.step == 10
    epoch, step, _ = m.handle(S.ValidationReceived("a", 10, 4, 2.5, 5), 0.0)
    assert not epoch.improved and epoch.best_epoch == 1 and isinstance(step, S.StartStep)
    assert m.stopper_state() == {"best": 2.0, "best_epoch": 0, "epochs": 2, "bad_epochs": 1, "stopped": False}
    done = S.SyncOptMachine(cfg, weights0(), PARAMS, steps_done=8, stopper=S.PatienceStop(patience=2, stopped=True))
    assert done.phase is S.Phase.DONE


def test_early_stopping_settings_are_checked():
    for kw in ({"patience": 2}, {"patience": -1}, {"epoch_steps": -1}, {"max_epochs": 0}, {"delta": -0.1}):
        with pytest.raises(ValueError):
            S.SyncOptConfig(**kw)
    assert S.SyncOptConfig(patience=5, epoch_steps=10).max_epochs == 100


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["weighted", "mean", "ordered"])
def test_reused_sum_buffers_change_no_bit_and_results_are_never_the_buffers(kind, dtype):
    """The aggregates a machine builds reuse one set of float64 buffers step after step:
    every step's result is bit for bit the one of an aggregate without buffers, and a
    later step does not overwrite an earlier step's result."""
    rng = np.random.default_rng(7)
    ref = {"w": np.zeros((4, 6), dtype=dtype), "b": np.zeros(6, dtype=dtype)}
    order = ("a", "b", "c")
    buffers = S.SumBuffers()
    kept = []
    for _ in range(4):
        grads = {a: {k: rng.standard_normal(v.shape).astype(dtype) for k, v in ref.items()} for a in order}
        sizes = {"a": 64, "b": 17, "c": 33}
        fresh = S.AGGREGATORS[kind](ref, order, None)
        pooled = S.AGGREGATORS[kind](ref, order, buffers)
        for a in ("b", "a", "c"):
            fresh.add(a, grads[a], sizes[a])
            pooled.add(a, grads[a], sizes[a])
        want, got = fresh.result(), pooled.result()
        for k in ref:
            assert got[k].dtype == dtype
            assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8))
        kept.append((got, {k: v.copy() for k, v in got.items()}))
    for got, copy in kept:
        for k in ref:
            assert np.array_equal(got[k], copy[k])
