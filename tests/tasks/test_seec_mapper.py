"""SEEC's vector-space mapper learns a map between two independently built spaces."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedagent.tasks.seec import map_vectors, train_mapper
from fedagent.tasks.text_metrics import normalize_rows, sim_k


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_mapper_recovers_a_linear_change_of_space_with_other_dimensions():
    rng = np.random.default_rng(0)
    public = rng.normal(size=(400, 12))
    site_i = public @ rng.normal(size=(12, 16))  # site i: 16-d vectors
    site_j = public @ rng.normal(size=(12, 10))  # site j: 10-d, another basis
    train, test = slice(0, 300), slice(300, 400)
    mapper = train_mapper(site_i[train], site_j[train], hidden=128, lr=1e-3, epochs=60, seed=0)
    mapped = map_vectors(mapper, site_i[test])
    assert mapped.shape == (100, 10)
    cos = np.sum(normalize_rows(mapped) * normalize_rows(site_j[test]), axis=1)
    assert np.mean(cos) > 0.9
    # Search in j's space with i's mapped queries finds j's own neighbours...
    mapped_overlap = sim_k(site_j[test], mapped, k=5)
    # ...far better than sending i's vectors unmapped (cut to j's size).
    unmapped_overlap = sim_k(site_j[test], site_i[test][:, :10], k=5)
    assert mapped_overlap > 0.6 and mapped_overlap > unmapped_overlap + 0.3, (mapped_overlap, unmapped_overlap)


def test_mapper_refuses_mismatched_rows():
    with pytest.raises(ValueError):
        train_mapper(np.zeros((3, 2)), np.zeros((4, 2)))


def test_mapper_trains_and_maps_read_only_vectors_without_a_warning():
    # A peer's public vectors are read-only views of the received message's buffer.
    rng = np.random.default_rng(1)
    source = np.frombuffer(rng.normal(size=(20, 4)).astype(np.float32).tobytes(), dtype=np.float32).reshape(20, 4)
    target = np.frombuffer(rng.normal(size=(20, 3)).astype(np.float32).tobytes(), dtype=np.float32).reshape(20, 3)
    assert not source.flags.writeable and not target.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mapper = train_mapper(source, target, hidden=8, epochs=2, seed=0)
        assert map_vectors(mapper, source).shape == (20, 3)
