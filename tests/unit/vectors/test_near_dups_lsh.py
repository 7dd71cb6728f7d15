"""SimHash LSH near-duplicates find what all pairs find, on vectors with planted near-duplicates."""

import numpy as np

from lmforge.components.vectors.near_dups import similar_pairs, similar_pairs_exact


def test_lsh_pairs_equal_all_pairs_on_planted_near_duplicates():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3000, 64)).astype(np.float32)
    dups = base[:150] + 0.12 * rng.standard_normal((150, 64)).astype(np.float32)  # cosine ~0.99 to their originals
    v = np.concatenate([base, dups])
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    exact = {(i, j) for i, j, _ in similar_pairs_exact(v, 0.95)}
    lsh = {(i, j) for i, j, _ in similar_pairs(v, 0.95)}
    assert len(exact) >= 150 and lsh == exact
