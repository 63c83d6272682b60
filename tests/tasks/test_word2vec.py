"""The word2vec task: SGNS pieces checked exactly, the task on a small Wikipedia slice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedagent.agent.gossip import resolve_exchange
from fedagent.errors import ConfigError
from fedagent.tasks.base import get_weights, load_task, set_weights
from fedagent.tasks.word2vec import SkipGram, Vocabulary, sgns_update, skipgram_pairs

pytestmark = pytest.mark.usefixtures("text_cache_one_thread")


def test_hand_written_gradients_equal_autograd():
    torch.manual_seed(0)
    model = SkipGram(12, 5).double()
    with torch.no_grad():
        model.out_embed.weight.normal_()
        model.in_embed.weight.normal_()
    centers = torch.tensor([0, 3, 3, 7, 11])
    contexts = torch.tensor([1, 4, 1, 7, 2])
    noise = torch.tensor([[2, 5], [1, 4], [9, 9], [0, 7], [3, 3]])  # repeats and a masked hit
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = model.pair_losses(centers, contexts, noise)
    losses.sum().backward()
    expected = {
        "in_embed.weight": before["in_embed.weight"] - 0.1 * model.in_embed.weight.grad,
        "out_embed.weight": before["out_embed.weight"] - 0.1 * model.out_embed.weight.grad,
    }
    got = sgns_update(model.in_embed.weight.data, model.out_embed.weight.data, centers, contexts, noise, 0.1)
    torch.testing.assert_close(got, losses.detach())
    for k, v in expected.items():
        torch.testing.assert_close(model.state_dict()[k], v)


def test_pairs_stay_in_their_document_and_window():
    docs = [np.array([0, 1, 2, 3]), np.array([4, 5])]
    rng = np.random.default_rng(0)
    c, x = skipgram_pairs(docs, np.ones(6), 1, rng)
    assert sorted(zip(c.tolist(), x.tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2), (4, 5), (5, 4)]
    c, x = skipgram_pairs(docs, np.ones(6), 3, rng)
    doc = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    assert all(doc[a] == doc[b] and a != b for a, b in zip(c.tolist(), x.tolist()))
    # keep probability 0 for word 1: it never appears in a pair
    keep = np.ones(6)
    keep[1] = 0.0
    c, x = skipgram_pairs(docs, keep, 2, rng)
    assert 1 not in set(c.tolist()) | set(x.tolist())


def test_subsampling_and_noise_distribution_follow_word2vec():
    v = Vocabulary(["the", "war", "rare"], [9000, 900, 100])
    keep = v.keep_probabilities(1e-2)
    f = np.array([0.9, 0.09, 0.01])
    assert keep == pytest.approx([(np.sqrt(90) + 1) / 90, (np.sqrt(9) + 1) / 9, 1.0])
    assert keep == pytest.approx(np.minimum(1, (np.sqrt(f / 1e-2) + 1) * 1e-2 / f))
    assert keep[0] < keep[1] < keep[2] == 1.0
    table = v.noise_table(0.75, size=100_000).numpy()
    p = np.array([9000, 900, 100]) ** 0.75
    assert np.bincount(table, minlength=3) / len(table) == pytest.approx(p / p.sum(), abs=1e-4)


def test_vocabulary_file_round_trip_and_bad_files(tmp_path):
    v = Vocabulary(["a", "b"], [3, 1])
    v.write(tmp_path / "v.tsv")
    again = Vocabulary.read(tmp_path / "v.tsv")
    assert again.terms == ("a", "b") and again.counts.tolist() == [3, 1]
    (tmp_path / "bad.tsv").write_text("a 3\n")
    with pytest.raises(ConfigError):
        Vocabulary.read(tmp_path / "bad.tsv")
    with pytest.raises(ConfigError):
        Vocabulary(["a", "a"], [1, 1])


SLICE = {"limit": 6, "shards": 2, "split": "random", "min_count": 3, "dim": 16, "seed": 0}


def test_task_on_a_slice_shares_vocabulary_trains_and_averages():
    a = load_task("word2vec", {**SLICE, "shard": 0})
    b = load_task("word2vec", {**SLICE, "shard": 1})
    assert a.vocab.terms == b.vocab.terms  # one common vocabulary
    assert set(a.term_counts()) != set(b.term_counts())  # different local data
    ma, mb = a.build_model(), b.build_model()
    names = list(get_weights(ma))
    assert names == ["in_embed.weight", "out_embed.weight"]
    assert resolve_exchange(("in_embed.*",), names) == ("in_embed.weight",)  # thesis "half"
    for k in names:
        assert np.array_equal(get_weights(ma)[k], get_weights(mb)[k])  # same seeded start
    first = a.fit_steps(ma, steps=5, lr=0.1, batch_size=256, seed=1)["loss"]
    a.fit_steps(ma, steps=100, lr=0.1, batch_size=256, seed=2)
    later = a.fit_steps(ma, steps=5, lr=0.1, batch_size=256, seed=3)["loss"]
    assert later < first - 0.3
    b.fit(mb, epochs=1, lr=0.025, batch_size=256, seed=1)
    wa, wb = get_weights(ma), get_weights(mb)
    avg = {k: (wa[k] + wb[k]) / 2 for k in wa}
    set_weights(mb, avg)
    assert np.allclose(get_weights(mb)["out_embed.weight"], avg["out_embed.weight"])
    metrics = a.evaluate(ma)
    assert 0 < metrics["wordsim353_coverage"] < 1
    a.options["analogies"] = True
    assert 0 < a.evaluate(ma)["analogy_coverage"] < 1
    assert {"wordsim353_rho", "simlex999_rho", "simlex999_coverage"} <= set(metrics)


def test_task_refuses_bad_options():
    with pytest.raises(ConfigError):
        load_task("word2vec", {"limit": 3, "dimension": 3})
    with pytest.raises(ConfigError):
        load_task("word2vec", {"limit": 3, "shards": 2, "shard": 2})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_centralized_word2vec_on_wikipedia_beats_a_random_model():
    """All 105 articles (~236 k tokens after stop words), 5 epochs of word2vec defaults.
    Measured: wordsim353 rho 0.227 (242 of 353 pairs covered) against 0.066 for the
    untrained model; gensim's skip-gram with the same settings gets 0.192."""
    from fedagent.tasks.word2vec import train_centralized

    task = load_task("word2vec", {})
    untrained = task.evaluate(task.build_model())["wordsim353_rho"]
    model = task.build_model()
    steps = int(5 * task.pairs_per_epoch() / 1024)
    train_centralized(task, model, steps=steps, lr=0.025, batch_size=1024, seed=1)
    trained = task.evaluate(model)
    assert trained["wordsim353_coverage"] > 0.6
    assert trained["wordsim353_rho"] > untrained + 0.1, (trained, untrained)
