"""Semantic near-duplicates: pairs of kept documents whose embeddings are nearly the same.

    report = semantic_near_duplicates(ids, vectors, splits, threshold=0.95, max_pairs=50)
    report["pairs"], report["cross_split_pairs"]

The data stage's MinHash dedup already dropped lexical near-duplicates, so every pair found
here among the kept documents is one MinHash missed (a rewording, a re-ordered docstring).
A pair across splits is a possible leak between train and validation/test, so it is counted
separately. Candidates come from random-hyperplane LSH (SimHash): each vector gets
`bands` x `rows` sign bits, and two vectors that agree on every bit of some band are
compared; only those pairs get an exact cosine. With rows = 8 and bands = 16, a pair at
cosine 0.95 (angle 18 degrees, 0.9 agreement per bit) is a candidate with probability
1 - (1 - 0.9^8)^16 > 0.9999; the work grows with the number of candidates, not n^2.
`similar_pairs_exact` is the all-pairs reference the tests compare with.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import numpy as np

LSH_SEED = 0


def similar_pairs(vectors: np.ndarray, threshold: float, *, bands: int = 16, rows: int = 8,
                  max_bucket: int = 2048) -> Iterator[tuple[int, int, float]]:
    """(i, j, cosine) with i < j and cosine >= threshold, from SimHash LSH candidates; rows L2-normalised.

    A bucket larger than `max_bucket` (a mass of near-identical vectors) is compared in blocks as well.
    """
    n, dim = vectors.shape
    if n < 2:
        return
    planes = np.random.default_rng(LSH_SEED).standard_normal((dim, bands * rows)).astype(np.float32)
    bits = np.empty((n, bands * rows), dtype=bool)
    for lo in range(0, n, 8192):  # in blocks: never an n x dim float64 temporary
        bits[lo:lo + 8192] = vectors[lo:lo + 8192] @ planes > 0
    weights = (1 << np.arange(rows, dtype=np.uint64)).astype(np.uint64)
    seen: set[tuple[int, int]] = set()
    for band in range(bands):
        keys = bits[:, band * rows:(band + 1) * rows].astype(np.uint64) @ weights
        order = np.argsort(keys, kind="stable")
        bounds = np.flatnonzero(np.diff(keys[order])) + 1
        for group in np.split(order, bounds):
            if len(group) < 2:
                continue
            others = np.sort(group)
            for lo in range(0, len(others), max_bucket):
                block = others[lo:lo + max_bucket]
                sims = vectors[block] @ vectors[others].T
                r, c = np.nonzero(sims >= threshold)
                for a, b in zip(r.tolist(), c.tolist()):
                    i, j = int(block[a]), int(others[b])
                    if i < j and (i, j) not in seen:
                        seen.add((i, j))
                        yield i, j, float(sims[a, b])


def similar_pairs_exact(vectors: np.ndarray, threshold: float, *, block: int = 2048) -> Iterator[tuple[int, int, float]]:
    """Every (i, j, cosine) with i < j and cosine >= threshold, by all pairs; rows must be L2-normalised."""
    n = len(vectors)
    for start in range(0, n, block):
        sims = vectors[start:start + block] @ vectors.T
        rows, cols = np.nonzero(sims >= threshold)
        for r, c in zip(rows.tolist(), cols.tolist()):
            if start + r < c:
                yield start + r, c, float(sims[r, c])


def semantic_near_duplicates(ids: list[str], vectors: np.ndarray, splits: list[str], *, threshold: float,
                             max_pairs: int) -> dict[str, Any]:
    """Count every pair at or above `threshold` (and those across splits); list the `max_pairs` closest."""
    assert len(ids) == len(vectors) == len(splits)
    found = cross = 0
    top: list[tuple[float, int, int]] = []  # a min-heap of the closest pairs seen so far
    for i, j, cos in similar_pairs(np.asarray(vectors, dtype=np.float32), threshold):
        found += 1
        cross += splits[i] != splits[j]
        if len(top) < max_pairs:
            heapq.heappush(top, (cos, i, j))
        elif max_pairs and cos > top[0][0]:
            heapq.heapreplace(top, (cos, i, j))
    listed = [{"a": {"id": ids[i], "split": splits[i]}, "b": {"id": ids[j], "split": splits[j]},
               "cosine": round(cos, 4)} for cos, i, j in sorted(top, reverse=True)]
    return {"threshold": threshold, "documents": len(ids), "pairs_found": found,
            "cross_split_pairs": cross, "pairs": listed}
