"""Plain vectors in the embedded Qdrant engine, for the near-duplicate tests.

    with engine_neighbours_of(tmp_path, vectors) as neighbours:
        report = semantic_near_duplicates(ids, vectors, splits, neighbours, threshold=0.95, max_pairs=10)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lmforge.components.vectors.edge import FULL_SCAN_KB, EdgeCollections
from lmforge.components.vectors.index import engine_neighbours
from lmforge.components.vectors.near_dups import Neighbours


@contextmanager
def engine_neighbours_of(root: Path, vectors: np.ndarray, *, full_scan_kb: int = FULL_SCAN_KB,
                         hnsw_ef: int = 64) -> Iterator[Neighbours]:
    """An engine shard holding `vectors` (point id = row), optimised (HNSW built); its neighbour search."""
    from qdrant_client import models

    store = EdgeCollections(root / "engine", full_scan_kb=full_scan_kb, hnsw_ef=hnsw_ef)
    try:
        store.create_collection("v", vectors_config=models.VectorParams(size=vectors.shape[1], distance=models.Distance.COSINE))
        for lo in range(0, len(vectors), 1000):
            rows = range(lo, min(lo + 1000, len(vectors)))
            store.upsert("v", [models.PointStruct(id=i, vector=vectors[i].tolist()) for i in rows])
        store.optimize("v")
        yield engine_neighbours(store, "v", {str(i): i for i in range(len(vectors))}, hnsw_ef=hnsw_ef)
    finally:
        store.close()
