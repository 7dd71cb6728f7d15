"""Semantic near-duplicates: pairs of kept documents whose embeddings are nearly the same, found by the vector index.

    report = semantic_near_duplicates(ids, vectors, splits, neighbours, threshold=0.95, max_pairs=50)
    report["pairs"], report["cross_split_pairs"]

The data stage's MinHash dedup already dropped lexical near-duplicates, so every pair found
here among the kept documents is one MinHash missed (a rewording, a re-ordered docstring).
A pair across splits is a possible leak between train and validation/test, so it is counted
separately.

The search is the index's own: every document's vector is a query for its nearest
neighbours at or above the threshold (`neighbours`, in batches; index.py answers it with the
engine's HNSW search). A query that comes back full (its neighbourhood may hold more) is
asked again for twice as many, so a mass of near-identical documents is counted whole. Each
pair is found from both of its ends, which covers an approximate search missing one of them.
`similar_pairs_exact` is the all-pairs reference the tests compare with.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Neighbours = Callable[[np.ndarray, int, float], list[list[tuple[int, float]]]]
"""neighbours(queries, limit, threshold): for each query row, up to `limit` (row, cosine) of the indexed
vectors with cosine >= threshold, closest first; rows number the vectors as `semantic_near_duplicates` got them."""

QUERY_BATCH = 256


def similar_pairs(vectors: np.ndarray, threshold: float, neighbours: Neighbours, *, k: int = 16,
                  batch: int = QUERY_BATCH) -> Iterator[tuple[int, int, float]]:
    """(i, j, cosine) with i < j and cosine >= threshold, each pair once, from the index's neighbour search."""
    n = len(vectors)
    seen: set[tuple[int, int]] = set()
    for lo in range(0, n, batch):
        pending, limit = list(range(lo, min(lo + batch, n))), k + 1   # + 1: a point is its own nearest neighbour
        while pending:
            full = []
            for i, hits in zip(pending, neighbours(vectors[pending], limit, threshold)):
                for j, cos in hits:
                    pair = (i, j) if i < j else (j, i)
                    if i != j and pair not in seen:
                        seen.add(pair)
                        yield pair[0], pair[1], cos
                if len(hits) >= limit:
                    full.append(i)
            pending, limit = full, limit * 2


def similar_pairs_exact(vectors: np.ndarray, threshold: float, *, block: int = 2048) -> Iterator[tuple[int, int, float]]:
    """Every (i, j, cosine) with i < j and cosine >= threshold, by all pairs; rows must be L2-normalised."""
    n = len(vectors)
    for start in range(0, n, block):
        sims = vectors[start:start + block] @ vectors.T
        rows, cols = np.nonzero(sims >= threshold)
        for r, c in zip(rows.tolist(), cols.tolist()):
            if start + r < c:
                yield start + r, c, float(sims[r, c])


def semantic_near_duplicates(ids: list[str], vectors: np.ndarray, splits: list[str], neighbours: Neighbours, *,
                             threshold: float, max_pairs: int) -> dict[str, Any]:
    """Count every pair at or above `threshold` (and those across splits); list the `max_pairs` closest."""
    assert len(ids) == len(vectors) == len(splits)
    found = cross = 0
    top: list[tuple[float, int, int]] = []  # a min-heap of the closest pairs seen so far
    for i, j, cos in similar_pairs(np.asarray(vectors, dtype=np.float32), threshold, neighbours):
        found += 1
        cross += splits[i] != splits[j]
        if len(top) < max_pairs:
            heapq.heappush(top, (cos, i, j))
        elif max_pairs and cos > top[0][0]:
            heapq.heapreplace(top, (cos, i, j))
    listed = [{"a": {"id": ids[i], "split": splits[i]}, "b": {"id": ids[j], "split": splits[j]},
               "cosine": round(min(cos, 1.0), 4)} for cos, i, j in sorted(top, reverse=True)]
    return {"threshold": threshold, "documents": len(ids), "pairs_found": found,
            "cross_split_pairs": cross, "pairs": listed}
