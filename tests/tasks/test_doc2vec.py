"""The doc2vec (PV-DBOW) task: what is shared, what stays local, inference with a frozen head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedagent.tasks.base import get_weights, load_task
from fedagent.tasks.text_metrics import nearest


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SLICE = {"corpus": "newsgroups", "limit": 60, "holdout": 0.0, "dim": 24, "seed": 0}


def test_only_the_word_head_is_shared_and_sites_split_the_documents():
    a = load_task("doc2vec", {**SLICE, "shards": 2, "shard": 0})
    b = load_task("doc2vec", {**SLICE, "shards": 2, "shard": 1})
    assert a.vocab.terms == b.vocab.terms
    assert not set(a.titles) & set(b.titles)
    assert len(a.titles) + len(b.titles) == 60
    model = a.build_model()
    assert list(get_weights(model)) == ["out_embed.weight"]  # no document vectors in the model
    assert a.doc_vectors.shape == (len(a.titles), 24)


def test_training_then_inference_recovers_documents_with_the_head_frozen():
    task = load_task("doc2vec", {**SLICE, "limit": 40})
    model = task.build_model()
    for epoch in range(15):
        task.fit(model, epochs=1, lr=0.05, batch_size=128, seed=epoch)
    head = get_weights(model)["out_embed.weight"].copy()
    v1, loss1 = task.infer_vectors(model, task.tokens, seed=1, epochs=15, lr=0.05)
    v2, _ = task.infer_vectors(model, task.tokens, seed=2, epochs=15, lr=0.05)
    assert np.array_equal(get_weights(model)["out_embed.weight"], head)  # frozen
    again, _ = task.infer_vectors(model, task.tokens, seed=1, epochs=15, lr=0.05)
    assert np.array_equal(again, v1)  # deterministic
    # Two inferences of the same text from different random starts find each other:
    # the vector is a function of the shared head and the words, not of the start.
    hits = np.mean(nearest(v2, [], 1, query_vectors=v1)[:, 0] == np.arange(len(v1)))
    assert hits >= 0.8
    assert loss1 < 4.0  # below the untrained 6·log 2


def test_a_documents_vector_does_not_depend_on_the_documents_inferred_with_it():
    """What makes a live search equal to the in-process mapping: a document inferred
    alone, in another order or among other documents gets the same vector, and a query
    whose text is an indexed document's text gets that document's indexed vector."""
    task = load_task("doc2vec", {**SLICE, "limit": 30, "infer_epochs": 4})
    model = task.build_model()
    for epoch in range(5):
        task.fit(model, epochs=1, lr=0.05, batch_size=128, seed=epoch)
    index = task.embed_documents(model)
    docs = list(task.tokens)
    shuffled, _ = task.infer_vectors(model, docs[::-1][:12] + [["space", "shuttle", "orbit"]], seed=task.seed + 3)
    assert np.allclose(shuffled[:12][::-1], index[-12:], atol=1e-5)
    alone, _ = task.infer_vectors(model, [docs[7]], seed=task.seed + 3)
    assert np.allclose(alone[0], index[7], atol=1e-5)
    assert np.array_equal(task.embed_text(model, " ".join(docs[7])), index[7])
    other_seed, _ = task.infer_vectors(model, [docs[7]], seed=task.seed + 4)
    assert not np.allclose(other_seed[0], index[7], atol=1e-3)  # the seed still matters


def test_a_short_text_gets_more_passes_than_a_long_one():
    from fedagent.tasks.doc2vec import INFER_MAX_PASSES, INFER_MIN_PAIRS, infer_passes

    assert infer_passes(2, 10) == INFER_MAX_PASSES
    assert infer_passes(INFER_MIN_PAIRS // 20, 10) == 20
    assert infer_passes(50_000, 10) == 10
    assert infer_passes(50_000, 40) == 40


def test_evaluate_reports_knn_accuracy_on_the_holdout():
    task = load_task("doc2vec", {"corpus": "newsgroups", "limit": 50, "holdout": 0.2, "dim": 16, "infer_epochs": 3})
    assert len(task.test_tokens) == 10
    metrics = task.evaluate(task.build_model())
    assert 0.0 <= metrics["knn_accuracy"] <= 1.0
    assert metrics["infer_loss"] == pytest.approx(6 * np.log(2), abs=0.01)  # zero head: every score 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trained_doc2vec_separates_the_newsgroups():
    """Default options: 160 training and 40 held-out posts, d = 50. Measured: 5-NN
    accuracy 0.875 after 20 epochs against 0.525 untrained."""
    task = load_task("doc2vec", {})
    model = task.build_model()
    untrained = task.evaluate(model)["knn_accuracy"]
    for epoch in range(20):
        task.fit(model, epochs=1, lr=0.025 * (1 - epoch / 20) + 1e-4, batch_size=256, seed=epoch)
    trained = task.evaluate(model)["knn_accuracy"]
    assert trained >= 0.8 and trained >= untrained + 0.2, (trained, untrained)


def test_a_fedavg_agent_adopts_the_federations_counts_with_the_common_vocabulary():
    """The coordinator's vocabulary carries the merged counts; a FedAvg agent installs
    them, so its subsampling and noise words follow the whole corpus (as a centralized
    model's do) and not its own share of it."""
    import threading
    from types import SimpleNamespace

    from fedagent.agent.fedavg import FedAvgSession

    shards = [load_task("doc2vec", {**SLICE, "shards": 2, "shard": i}) for i in range(2)]
    whole = load_task("doc2vec", SLICE)  # built on the merge of both shards' offers
    terms = list(whole.vocab.terms)
    counts = [int(c) for c in whole.vocab.counts]
    session = SimpleNamespace(agent=SimpleNamespace(task=shards[0], thread_lock=threading.Lock(), model=None))
    FedAvgSession._set_vocabulary(session, terms, counts)  # type: ignore[arg-type]
    assert list(shards[0].vocab.terms) == terms
    assert np.array_equal(shards[0].noise.numpy(), whole.noise.numpy())
    assert np.array_equal(shards[0].keep, whole.keep)
    assert session.agent.model is not None and session.agent.model.out_embed.weight.shape[0] == len(terms)
    # the shard's own counts would give another noise distribution
    shards[1].set_vocabulary(terms)
    assert not np.array_equal(shards[1].noise.numpy(), whole.noise.numpy())
