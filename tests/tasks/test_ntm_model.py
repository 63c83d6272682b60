"""ProdLDA / CombinedTM tasks: determinism of a step, vocabulary re-indexing, and the
centralized step equal to the sample-weighted mean of the nodes' gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedagent.errors import ConfigError
from fedagent.tasks.base import SyncTask, load_task
from fedagent.tasks.ntm import ProdLDA, centralized_step, federated_step, laplace_prior, node_gradient

torch.set_num_threads(1)

SMALL = {
    "corpus": "synthetic",
    "vocab_size": 120,
    "true_topics": 10,
    "shared_topics": 5,
    "docs": 40,
    "val_docs": 10,
    "doc_length": (20, 40),
    "n_topics": 6,
    "batch_size": 8,
    "hidden": 16,
    "shards": 5,
    "seed": 3,
}


def small_tasks(name: str = "prodlda", **extra):
    tasks = [load_task(name, {**SMALL, **extra, "shard": s}) for s in range(SMALL["shards"])]
    terms = sorted(set().union(*(t.term_counts() for t in tasks)))
    for t in tasks:
        t.set_vocabulary(terms)
    return tasks


def test_laplace_prior_of_dirichlet_one_is_standard_ctm_prior():
    mean, var = laplace_prior(50, 1.0)
    assert torch.allclose(mean, torch.zeros(50, dtype=torch.float64))
    assert torch.allclose(var, torch.full((50,), 1.0 - 1.0 / 50, dtype=torch.float64))


def test_builtin_names_build_sync_tasks():
    task = load_task("prodlda", {**SMALL, "shard": 1})
    assert isinstance(task, SyncTask)
    assert task.num_batches() == SMALL["docs"] // SMALL["batch_size"]
    with pytest.raises(ConfigError):
        load_task("prodlda", {**SMALL, "shard": 5})
    with pytest.raises(ConfigError):
        load_task("prodlda", {**SMALL, "bogus": 1})


def test_term_counts_and_set_vocabulary_reindex_without_losing_common_terms():
    task = load_task("prodlda", {**SMALL, "shard": 0})
    counts = task.term_counts()
    assert sum(counts.values()) == int(task.corpus.train.sum())
    keep = sorted(counts)[: len(counts) // 2]
    common = ["zzz-not-local"] + keep
    task.set_vocabulary(common)
    assert task.terms == common
    assert task.train.shape == (SMALL["docs"], len(common))
    assert task.train[:, 0].sum() == 0
    kept = task.train.sum(axis=0).A.ravel()
    for j, term in enumerate(keep, start=1):
        assert kept[j] == counts[term]
    model = task.build_model()
    assert model.vocab_size == len(common)


def test_step_loss_is_a_function_of_seed_shard_and_step():
    a, b = small_tasks(), small_tasks()
    model = a[0].build_model()
    l1, n1 = a[2].step_loss(model, 7)
    l2, n2 = b[2].step_loss(model, 7)
    assert n1 == n2 == SMALL["batch_size"]
    assert float(l1.detach()) == float(l2.detach())
    # Same documents, other noise: steps 0 and num_batches() are different epochs.
    assert float(a[2].step_loss(model, 0)[0].detach()) != float(a[2].step_loss(model, 1)[0].detach())
    assert float(a[2].step_loss(model, 7)[0].detach()) != float(a[3].step_loss(model, 7)[0].detach())
    # The global torch RNG plays no part.
    torch.manual_seed(999)
    assert float(a[2].step_loss(model, 7)[0]) == float(l1)


def test_noise_differs_between_steps_with_the_same_batch():
    task = small_tasks()[0]
    model = task.build_model()
    fixed = task.batch_indices(0)
    task.batch_indices = lambda step: fixed  # same documents at every step
    losses = [float(task.step_loss(model, s)[0]) for s in range(5)]
    assert len(set(losses)) == 5
    assert float(task.step_loss(model, 2)[0]) == losses[2]


def test_every_document_is_visited_across_an_epoch():
    task = small_tasks()[1]
    nb = task.num_batches()
    seen = np.concatenate([task.batch_indices(s) for s in range(nb)])
    assert len(seen) == len(set(seen.tolist())) == nb * task.batch_size


@pytest.mark.parametrize("name", ["prodlda", "combinedtm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_centralized_step_equals_weighted_mean_of_node_gradients(name, dtype):
    tasks = small_tasks(name)
    # Unequal batch sizes make the sample weighting matter.
    tasks[0].batch_size = 4
    model = tasks[0].build_model().to(dtype)
    results = [node_gradient(model, t, 3) for t in tasks]
    total = sum(n for _, n, _ in results)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    centralized_step(model, opt, tasks, 3)
    means = {pname: sum(g[pname] * n for g, n, _ in results) / total for pname in results[0][0]}
    # float32: summation order shows at the precision of the largest gradient entry
    tol = 1e-6 if dtype == torch.float64 else 1e-6 * max(float(np.abs(m).max()) for m in means.values())
    for pname, p in model.named_parameters():
        assert np.max(np.abs(p.grad.double().numpy() - means[pname])) <= tol, pname


def test_federated_and_centralized_training_agree_over_steps():
    tasks = small_tasks()
    central = tasks[0].build_model()
    fed = tasks[0].build_model()
    oc, of = tasks[0].make_optimizer(central.parameters()), tasks[0].make_optimizer(fed.parameters())
    for step in range(12):
        lc = centralized_step(central, oc, tasks, step)
        lf = federated_step(fed, of, tasks, step)
        assert abs(lc - lf) < 1e-4
    diff = max(float((a - b).abs().max()) for a, b in zip(central.parameters(), fed.parameters()))
    assert diff <= 1e-5
    moved = max(float((a - b).abs().max()) for a, b in zip(central.parameters(), tasks[0].build_model().parameters()))
    assert moved > 1e-3


def test_model_state_is_parameters_only_and_topics_are_distributions():
    task = small_tasks()[0]
    model = task.build_model()
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    tw = task.topic_word(model)
    assert tw.shape == (SMALL["n_topics"], len(task.terms))
    assert np.allclose(tw.sum(1), 1.0)
    tops = task.topics(model, 4)
    assert len(tops) == SMALL["n_topics"] and all(len(t) == 4 for t in tops)
    assert all(w in task.terms for t in tops for w in t)
    theta = task.infer_theta(model)
    assert theta.shape == (SMALL["val_docs"], SMALL["n_topics"])
    assert np.allclose(theta.sum(1), 1.0)


def test_local_fit_lowers_the_loss():
    task = small_tasks()[0]
    model = task.build_model()
    before = task.evaluate(model)["val_loss"]
    task.fit(model, epochs=15)
    assert task.evaluate(model)["val_loss"] < before


def test_optimizer_is_adam_with_prodlda_defaults():
    task = small_tasks()[0]
    opt = task.make_optimizer(ProdLDA(10, 3).parameters())
    assert isinstance(opt, torch.optim.Adam)
    assert opt.defaults["lr"] == 2e-3 and opt.defaults["betas"] == (0.99, 0.999)


@pytest.mark.parametrize("seed", range(6))
def test_float64_sync_opt_equals_centralized_for_any_seed(seed):
    """``dtype = "float64"``: 50 Adam steps of Sync-Opt (five per-node gradients, their
    sample-weighted mean) and of centralized training on the concatenated batches stay
    within the 1e-5 bound for every seed; in float32 some seeds end 7e-5 apart."""
    tasks = small_tasks(seed=seed, dtype="float64", hidden=8)
    central, fed = tasks[0].build_model(), tasks[0].build_model()
    assert all(p.dtype == torch.float64 for p in central.parameters())
    oc, of = tasks[0].make_optimizer(central.parameters()), tasks[0].make_optimizer(fed.parameters())
    for step in range(50):
        centralized_step(central, oc, tasks, step)
        federated_step(fed, of, tasks, step)
    diff = max(float((a - b).abs().max()) for a, b in zip(central.parameters(), fed.parameters()))
    moved = max(float((a - b).abs().max()) for a, b in zip(central.parameters(), tasks[0].build_model().parameters()))
    assert moved > 1e-2 and diff <= 1e-5, (diff, moved)
    assert diff <= 1e-9  # the margin float64 buys: summation order only


def test_dtype_option_is_checked():
    with pytest.raises(ConfigError, match="dtype"):
        load_task("prodlda", {**SMALL, "shard": 0, "dtype": "float16"})


def test_decoder_topics_are_what_the_loss_sees_and_softmax_beta_is_not():
    """Rescaling every column of beta leaves the training loss unchanged (the decoder
    BatchNorm undoes it, up to its eps), shifting a column too when theta sums to 1 (no
    dropout); the decoder's topics do not move, softmax(beta) does."""
    task = small_tasks(dtype="float64")[0]
    model = task.build_model()
    with torch.no_grad():
        model.beta.mul_(100.0)  # a spread well above the BatchNorm's eps, as training gives
    theta = task.infer_theta(model, "train")
    loss = task.step_loss(model, 0)[0].item()
    dec, soft = task.decoder_topic_word(model, theta), task.topic_word(model)
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(model.beta.shape[1], generator=gen, dtype=torch.float64) * 4 + 1
    shift = torch.randn(model.beta.shape[1], generator=gen, dtype=torch.float64) * 3
    with torch.no_grad():
        model.beta.mul_(scale)
    assert abs(task.step_loss(model, 0)[0].item() - loss) <= 1e-6 * abs(loss)
    with torch.no_grad():
        model.beta.add_(shift)
    assert np.abs(task.decoder_topic_word(model, theta) - dec).max() <= 1e-6
    assert np.abs(task.topic_word(model) - soft).max() > 1e-2
    assert np.allclose(dec.sum(1), 1.0)


def test_holdout_option_splits_each_node_75_25_the_same_way_every_time():
    full = load_task("prodlda", {**SMALL, "shard": 2})
    a = load_task("prodlda", {**SMALL, "shard": 2, "holdout": 0.25})
    b = load_task("prodlda", {**SMALL, "shard": 2, "holdout": 0.25})
    n = full.train.shape[0]
    assert a.train.shape[0] == n - round(n * 0.25) and a.val.shape[0] == round(n * 0.25)
    assert (a.train != b.train).nnz == 0 and (a.val != b.val).nnz == 0
    rows = {full.train[i].toarray().tobytes(): i for i in range(n)}
    kept = [rows[a.train[i].toarray().tobytes()] for i in range(a.train.shape[0])]
    held = [rows[a.val[i].toarray().tobytes()] for i in range(a.val.shape[0])]
    assert sorted(kept + held) == list(range(n))  # disjoint, and nothing lost
    other = load_task("prodlda", {**SMALL, "shard": 3, "holdout": 0.25})
    assert other.val.shape == a.val.shape
    for bad in (0.0, 1.0, 0.99):
        with pytest.raises(ConfigError):
            load_task("prodlda", {**SMALL, "shard": 2, "holdout": bad})
