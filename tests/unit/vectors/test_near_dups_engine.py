"""The engine's neighbour search finds what all pairs find, on vectors with planted near-duplicates."""

import numpy as np
import pytest

from lmforge.components.vectors.edge import FULL_SCAN_KB
from lmforge.components.vectors.near_dups import similar_pairs, similar_pairs_exact
from tests.unit.vectors.engine_neighbours import engine_neighbours_of


def planted(rng: np.random.Generator, n: int = 3000, dups: int = 150, dim: int = 64) -> np.ndarray:
    base = rng.standard_normal((n, dim)).astype(np.float32)
    twins = base[:dups] + 0.12 * rng.standard_normal((dups, dim)).astype(np.float32)  # cosine ~0.99 to their originals
    v = np.concatenate([base, twins])
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# FULL_SCAN_KB: this small segment is searched exactly, as the engine does under ~10 MB; 1: through the HNSW graph.
@pytest.mark.parametrize("full_scan_kb", [FULL_SCAN_KB, 1], ids=["full-scan", "hnsw"])
def test_engine_pairs_equal_all_pairs_on_planted_near_duplicates(tmp_path, full_scan_kb):
    v = planted(np.random.default_rng(3))
    exact = {(i, j) for i, j, _ in similar_pairs_exact(v, 0.95)}
    with engine_neighbours_of(tmp_path, v, full_scan_kb=full_scan_kb) as neighbours:
        found = {(i, j) for i, j, _ in similar_pairs(v, 0.95, neighbours)}
    assert len(exact) >= 150 and found == exact


def test_a_mass_of_near_identical_vectors_is_counted_whole(tmp_path):
    """40 copies of one vector: 780 pairs, far more than one query's first `k` neighbours."""
    rng = np.random.default_rng(5)
    v = planted(rng, n=500, dups=0)
    v[:40] = v[0] + 0.001 * rng.standard_normal((40, v.shape[1])).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    exact = {(i, j) for i, j, _ in similar_pairs_exact(v, 0.95)}
    with engine_neighbours_of(tmp_path, v) as neighbours:
        found = {(i, j) for i, j, _ in similar_pairs(v, 0.95, neighbours, k=4)}
    assert len(exact) >= 40 * 39 // 2 and found == exact
