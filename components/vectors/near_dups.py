"""Semantic near-duplicates: pairs of kept documents whose embeddings are nearly the same.

    report = semantic_near_duplicates(ids, vectors, splits, threshold=0.95, max_pairs=50)
    report["pairs"], report["cross_split_pairs"]

The data stage's MinHash dedup already dropped lexical near-duplicates, so every pair found
here among the kept documents is one MinHash missed (a rewording, a re-ordered docstring).
A pair across splits is a possible leak between train and validation/test, so it is counted
separately. Exact: all pairs, by blocked matrix products over L2-normalised rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import numpy as np


def similar_pairs(vectors: np.ndarray, threshold: float, *, block: int = 2048) -> Iterator[tuple[int, int, float]]:
    """Every (i, j, cosine) with i < j and cosine >= threshold; rows must be L2-normalised."""
    n = len(vectors)
    for start in range(0, n, block):
        sims = vectors[start:start + block] @ vectors.T
        rows, cols = np.nonzero(sims >= threshold)
        for r, c in zip(rows.tolist(), cols.tolist()):
            if start + r < c:
                yield start + r, c, float(sims[r, c])


def semantic_near_duplicates(ids: list[str], vectors: np.ndarray, splits: list[str], *, threshold: float,
                             max_pairs: int, details: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
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
    details = details or {}
    listed = [{"a": {"id": ids[i], "split": splits[i], **details.get(ids[i], {})},
               "b": {"id": ids[j], "split": splits[j], **details.get(ids[j], {})},
               "cosine": round(cos, 4)} for cos, i, j in sorted(top, reverse=True)]
    return {"threshold": threshold, "documents": len(ids), "pairs_found": found,
            "cross_split_pairs": cross, "pairs": listed}
