"""Qdrant: one collection per dataset version, rebuilt idempotently, plus the semantic near-duplicate report.

    client = qdrant_client(ws, VectorsConfig())              # the embedded engine at <ws>/qdrant, or vectors.url
    report = index_dataset(ws, "3f2a9c1b7d0e", VectorsConfig())
    report["collection"], report["points"], report["near_duplicates"]["pairs_found"]

Without `vectors.url` the collections live in Qdrant's embedded engine (qdrant-edge-py: the
server's own segment, HNSW and WAL code, in process), one shard per collection at
<ws>/qdrant/<collection>/ (see `EdgeCollections`); with it, in a Qdrant server through
qdrant-client. Both answer the same QdrantClient calls, so every caller is the same for both.

Points are the dataset's kept documents (all splits), with payload id, module, qualname,
summary, split, signature and text; the point id is a UUID derived from the document id, so
re-indexing overwrites the same points, and points no longer in the dataset are deleted.
After the upserts the engine builds the HNSW index (`optimize`), and the near-duplicate
search asks it for every point's nearest neighbours (components/vectors/near_dups.py).
An existing collection with another vector size is an error, never silently recreated.

The embedded store and how one process at a time holds it: components/vectors/edge.py.
"""

from __future__ import annotations

import atexit
import json
import uuid
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.serving.records import Record
from lmforge.components.vectors.edge import EdgeCollections, store_session
from lmforge.components.vectors.embed import Embedder, make_embedder
from lmforge.components.vectors.near_dups import Neighbours, semantic_near_duplicates
from lmforge.components.workspace import Workspace

SPLITS = ("train", "validation", "test")
_NS = uuid.UUID("5f1d3c2e-7a4b-4c1d-9e8f-6a5b4c3d2e1f")
_CLIENTS: dict[str, Any] = {}


def point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NS, doc_id))


def qdrant_client(ws: Workspace, cfg: VectorsConfig) -> Any:
    """A QdrantClient for vectors.url, or the embedded engine's collections at <ws>/qdrant (one object per folder per
    process, holding the store only during its calls and sessions)."""
    key = cfg.url or str(ws.qdrant)
    if key in _CLIENTS:
        return _CLIENTS[key]
    if cfg.url:
        from qdrant_client import QdrantClient

        client: Any = QdrantClient(url=cfg.url, api_key=cfg.api_key, timeout=int(cfg.timeout_s))
    else:
        client = EdgeCollections(ws.qdrant, m=cfg.hnsw_m, ef_construct=cfg.hnsw_ef_construct, hnsw_ef=cfg.hnsw_ef,
                                 wait_s=cfg.lock_wait_s)
    _CLIENTS[key] = client
    return client


def close_clients() -> None:
    while _CLIENTS:
        _, client = _CLIENTS.popitem()
        client.close()


# Closing at interpreter exit ends a session left open (an exception past a caller that did not use `with`).
atexit.register(close_clients)


def collection_name(cfg: VectorsConfig, version: str, embedder: Embedder) -> str:
    return f"{cfg.collection_prefix}_{version}_{embedder.name}"


def vector_size(client: Any, name: str) -> int | None:
    """The vector size collection `name` was created with, on either store."""
    if isinstance(client, EdgeCollections):
        return client.vector_size(name)
    params = client.get_collection(name).config.params.vectors
    return params.size if hasattr(params, "size") else None


def ensure_collection(client: Any, name: str, embedder: Embedder, *, server: bool) -> bool:
    """Create `name` for `embedder` unless it exists; a size mismatch is a UserError. True when created."""
    from qdrant_client import models

    if client.collection_exists(name):
        size = vector_size(client, name)
        if size is not None and size != embedder.dim:   # None: an empty collection, nothing to mismatch
            where = "on the server (its DELETE /collections/" + name + ")" if server else "(its folder under <workspace>/qdrant/)"
            raise UserError(f"Qdrant collection {name}", None,
                            f"holds vectors of size {size}, but the {embedder.name} embedder makes {embedder.dim}",
                            f"Delete the collection {where} and run `lmforge run features` to rebuild it, or restore the "
                            "embedder settings it was built with (vectors.hash_dim, vectors.model_dir)")
        return False
    params = models.VectorParams(size=embedder.dim, distance=models.Distance.COSINE)
    if server:
        client.create_collection(name, vectors_config=params, metadata={"embedder": embedder.name, "dim": embedder.dim})
    else:
        client.create_collection(name, vectors_config=params)
    client.create_payload_index(name, "split", field_schema=models.PayloadSchemaType.KEYWORD)
    return True


def iter_records(ws: Workspace, version: str) -> Iterator[tuple[str, Record]]:
    """(split, record) for every kept document of the dataset, read a line at a time."""
    ds = ws.dataset_dir(version)
    paths = {split: ds / "records" / f"{split}.jsonl" for split in SPLITS}
    for split, path in paths.items():
        if not path.is_file():
            raise UserError("dataset", ds, f"has no records/{split}.jsonl", "Re-run the data stage: lmforge run data")
    for split, path in paths.items():
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield split, Record.from_dict(json.loads(line))


def upsert_points(client: Any, name: str, items: list[tuple[str, Record]], vectors: np.ndarray) -> None:
    from qdrant_client import models

    points = [models.PointStruct(id=point_id(r.id), vector=vectors[n].tolist(),
                                 payload={"id": r.id, "module": r.module, "qualname": r.qualname, "summary": r.summary,
                                          "split": split, "signature": r.signature, "text": r.text})
              for n, (split, r) in enumerate(items)]
    client.upsert(name, points=points, wait=True)


def delete_stale(client: Any, name: str, keep: set[str]) -> int:
    """Delete points whose id is not in `keep`; returns how many."""
    from qdrant_client import models

    stale, offset = [], None
    while True:
        page, offset = client.scroll(name, limit=10_000, offset=offset, with_payload=False, with_vectors=False)
        stale += [p.id for p in page if str(p.id) not in keep]
        if offset is None:
            break
    if stale:
        client.delete(name, points_selector=models.PointIdsList(points=stale), wait=True)
    return len(stale)


def engine_neighbours(client: Any, name: str, rows: dict[str, int], *, hnsw_ef: int) -> Neighbours:
    """The near-duplicate search's `neighbours`, answered by the engine's batch query: point ids become row numbers."""
    from qdrant_client import models

    def neighbours(queries: np.ndarray, limit: int, threshold: float) -> list[list[tuple[int, float]]]:
        requests = [models.QueryRequest(query=q.tolist(), limit=limit, score_threshold=threshold,
                                        params=models.SearchParams(hnsw_ef=max(hnsw_ef, limit)))
                    for q in queries]
        answers = client.query_batch_points(name, requests=requests)
        return [[(rows[str(p.id)], float(p.score)) for p in a.points if str(p.id) in rows] for a in answers]

    return neighbours


def embed_dataset(ws: Workspace, version: str, embedder: Embedder, batch_size: int) -> tuple[list[str], list[str], np.ndarray]:
    """(ids, splits, vectors) of every kept document, embedded `batch_size` texts at a time; texts are not kept."""
    ids: list[str] = []
    splits: list[str] = []
    chunks: list[np.ndarray] = []
    records = iter_records(ws, version)
    while batch := list(islice(records, batch_size)):  # itertools.batched needs Python 3.12
        chunks.append(np.asarray(embedder.embed([r.text for _, r in batch]), dtype=np.float32))
        ids += [r.id for _, r in batch]
        splits += [split for split, _ in batch]
    return ids, splits, np.concatenate(chunks) if chunks else np.zeros((0, embedder.dim), dtype=np.float32)


def _ensure(client: Any, name: str, embedder: Embedder, cfg: VectorsConfig) -> bool:
    from qdrant_client.http.exceptions import ResponseHandlingException

    try:
        return ensure_collection(client, name, embedder, server=cfg.url is not None)
    except ResponseHandlingException as e:   # qdrant-client's error when the server cannot be reached at all
        raise UserError("vectors.url", cfg.url, f"cannot be reached ({e})",
                        "Start the Qdrant server at that address (check host, port and api_key), "
                        "or remove vectors.url to index into the workspace with the embedded engine") from e


def _near_duplicates(ws: Workspace, version: str, client: Any, name: str, cfg: VectorsConfig, ids: list[str],
                     splits: list[str], vectors: np.ndarray) -> dict[str, Any]:
    rows = {point_id(i): n for n, i in enumerate(ids)}
    dups = semantic_near_duplicates(ids, vectors, splits, engine_neighbours(client, name, rows, hnsw_ef=cfg.hnsw_ef),
                                    threshold=cfg.near_dup_threshold, max_pairs=cfg.max_reported_pairs)
    listed = {side["id"] for pair in dups["pairs"] for side in (pair["a"], pair["b"])}
    details = {r.id: {"module": r.module, "qualname": r.qualname, "summary": r.summary}
               for _, r in iter_records(ws, version) if r.id in listed} if listed else {}
    for pair in dups["pairs"]:
        for side in (pair["a"], pair["b"]):
            side.update(details.get(side["id"], {}))
    return dups


def index_dataset(ws: Workspace, version: str, cfg: VectorsConfig, *, embedder: Embedder | None = None) -> dict[str, Any]:
    """Embed the dataset's documents; then, in one hold of the store, upsert them a batch at a time, drop stale
    points, build the index and report near-duplicates.

    The embedding (the slow part) runs before the store is held, so another process waits only
    for the engine's work; within the hold no reader sees a half-written collection. Only the
    vectors (n x dim float32), ids and splits are kept for the whole corpus, as the
    near-duplicate search's queries; texts and payloads live one batch at a time.
    """
    embedder = embedder or make_embedder(cfg)
    client = qdrant_client(ws, cfg)
    name = collection_name(cfg, version, embedder)
    ids, splits, vectors = embed_dataset(ws, version, embedder, cfg.batch_size)
    with store_session(client):
        created = _ensure(client, name, embedder, cfg)
        records = iter_records(ws, version)
        for lo in range(0, len(ids), cfg.batch_size):
            batch = list(islice(records, cfg.batch_size))
            upsert_points(client, name, batch, vectors[lo:lo + len(batch)])
        deleted = delete_stale(client, name, {point_id(i) for i in ids})
        if isinstance(client, EdgeCollections):
            client.optimize(name)   # a server builds its HNSW in the background; the embedded engine does it here
        points = client.count(name, exact=True).count
        assert points == len(set(ids)), f"{name} holds {points} points for {len(ids)} documents"
        dups = _near_duplicates(ws, version, client, name, cfg, ids, splits, vectors)
    return {"collection": name, "location": cfg.url or str(Path(ws.qdrant)), "embedder": embedder.name,
            "dim": embedder.dim, "points": points, "created": created, "deleted_stale": deleted,
            "engine": "qdrant-server" if cfg.url else "qdrant-edge", "near_duplicates": dups}
