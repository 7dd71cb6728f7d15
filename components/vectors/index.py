"""Qdrant: one collection per dataset version, rebuilt idempotently, plus the semantic near-duplicate report.

    client = qdrant_client(ws, VectorsConfig())              # local mode at <ws>/qdrant, or vectors.url
    report = index_dataset(ws, "3f2a9c1b7d0e", VectorsConfig())
    report["collection"], report["points"], report["near_duplicates"]["pairs_found"]

Points are the dataset's kept documents (all splits), with payload id, module, qualname,
summary, split, signature and text; the point id is a UUID derived from the document id, so
re-indexing overwrites the same points, and points no longer in the dataset are deleted.
An existing collection with another vector size is an error, never silently recreated.

Local mode allows one client per folder at a time; clients are therefore cached per
process (`close_clients()` releases them). A folder held by another process is a UserError.
"""

from __future__ import annotations

import atexit
import json
import sqlite3
import uuid
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.components.data.records import Record
from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.embed import Embedder, make_embedder
from lmforge.components.vectors.near_dups import semantic_near_duplicates
from lmforge.components.workspace import Workspace

SPLITS = ("train", "validation", "test")
_NS = uuid.UUID("5f1d3c2e-7a4b-4c1d-9e8f-6a5b4c3d2e1f")
_CLIENTS: dict[str, Any] = {}


def point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NS, doc_id))


def qdrant_client(ws: Workspace, cfg: VectorsConfig) -> Any:
    """A QdrantClient for vectors.url, or for local mode at <ws>/qdrant (one per folder per process)."""
    from qdrant_client import QdrantClient

    key = cfg.url or str(ws.qdrant)
    if key in _CLIENTS:
        return _CLIENTS[key]
    if cfg.url:
        client = QdrantClient(url=cfg.url, api_key=cfg.api_key, timeout=int(cfg.timeout_s))
    else:
        ws.qdrant.mkdir(parents=True, exist_ok=True)
        try:
            client = QdrantClient(path=str(ws.qdrant))
        except RuntimeError as e:
            if "already accessed" not in str(e):
                raise
            raise UserError(str(ws.qdrant), None, "is in use by another process (Qdrant local mode allows one at a time)",
                            "Stop that process (a running lmforge stage or server), "
                            "or run a Qdrant server and set vectors.url") from e
    _CLIENTS[key] = client
    return client


def close_clients() -> None:
    while _CLIENTS:
        _, client = _CLIENTS.popitem()
        client.close()


# Closing at interpreter exit, rather than in QdrantClient.__del__ during shutdown, releases the lock cleanly.
atexit.register(close_clients)


def tune_local_storage(client: Any) -> bool:
    """Let Qdrant local mode commit a point without a full fsync; False when the client is not local.

    Local mode stores every point in its own SQLite transaction: ~30 ms each with the default
    full sync on this machine's disk, over 10 minutes for the stdlib corpus. WAL with
    synchronous=NORMAL keeps every commit atomic and survives a crash of the process (a power
    cut may lose the last commits, and the index is rebuilt idempotently) at ~0.2 ms a commit.
    """
    collections = getattr(getattr(client, "_client", None), "collections", None)
    if not isinstance(collections, dict):
        return False
    for collection in collections.values():
        conn = getattr(getattr(collection, "storage", None), "storage", None)
        if isinstance(conn, sqlite3.Connection):
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
    return True


def collection_name(cfg: VectorsConfig, version: str, embedder: Embedder) -> str:
    return f"{cfg.collection_prefix}_{version}_{embedder.name}"


def ensure_collection(client: Any, name: str, embedder: Embedder, *, server: bool) -> bool:
    """Create `name` for `embedder` unless it exists; a size mismatch is a UserError. True when created."""
    from qdrant_client import models

    if client.collection_exists(name):
        params = client.get_collection(name).config.params.vectors
        size = params.size if hasattr(params, "size") else None
        if size != embedder.dim:
            raise UserError(f"Qdrant collection {name}", None,
                            f"holds vectors of size {size}, but the {embedder.name} embedder makes {embedder.dim}",
                            f"Delete the collection (client.delete_collection({name!r})) to rebuild it, or restore the "
                            "embedder settings it was built with (vectors.hash_dim, vectors.model_dir)")
        return False
    client.create_collection(name, vectors_config=models.VectorParams(size=embedder.dim, distance=models.Distance.COSINE),
                             metadata={"embedder": embedder.name, "dim": embedder.dim})
    if server:  # local mode scans payloads and warns that an index has no effect there
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


def index_dataset(ws: Workspace, version: str, cfg: VectorsConfig, *, embedder: Embedder | None = None) -> dict[str, Any]:
    """Embed and upsert the dataset's documents a batch at a time; then drop stale points and report near-duplicates.

    Only the vectors (n x dim float32), ids and splits are kept for the whole corpus, for the
    near-duplicate search; texts and payloads live one batch at a time.
    """
    from qdrant_client.http.exceptions import ResponseHandlingException

    embedder = embedder or make_embedder(cfg)
    client = qdrant_client(ws, cfg)
    name = collection_name(cfg, version, embedder)
    try:
        created = ensure_collection(client, name, embedder, server=cfg.url is not None)
    except ResponseHandlingException as e:   # qdrant-client's error when the server cannot be reached at all
        raise UserError("vectors.url", cfg.url, f"cannot be reached ({e})",
                        "Start the Qdrant server at that address (check host, port and api_key), "
                        "or remove vectors.url to index into the workspace in Qdrant's local mode") from e
    fast_writes = cfg.url is None and tune_local_storage(client)
    ids: list[str] = []
    splits: list[str] = []
    chunks: list[np.ndarray] = []
    records = iter_records(ws, version)
    while batch := list(islice(records, cfg.batch_size)):  # itertools.batched needs Python 3.12
        vectors = np.asarray(embedder.embed([r.text for _, r in batch]), dtype=np.float32)
        upsert_points(client, name, batch, vectors)
        ids += [r.id for _, r in batch]
        splits += [split for split, _ in batch]
        chunks.append(vectors)
    vectors = np.concatenate(chunks) if chunks else np.zeros((0, embedder.dim), dtype=np.float32)
    deleted = delete_stale(client, name, {point_id(i) for i in ids})
    points = client.count(name, exact=True).count
    assert points == len(set(ids)), f"{name} holds {points} points for {len(ids)} documents"
    dups = semantic_near_duplicates(ids, vectors, splits, threshold=cfg.near_dup_threshold, max_pairs=cfg.max_reported_pairs)
    listed = {side["id"] for pair in dups["pairs"] for side in (pair["a"], pair["b"])}
    details = {r.id: {"module": r.module, "qualname": r.qualname, "summary": r.summary}
               for _, r in iter_records(ws, version) if r.id in listed} if listed else {}
    for pair in dups["pairs"]:
        for side in (pair["a"], pair["b"]):
            side.update(details.get(side["id"], {}))
    return {"collection": name, "location": cfg.url or str(Path(ws.qdrant)), "embedder": embedder.name,
            "dim": embedder.dim, "points": points, "created": created, "deleted_stale": deleted, "local_wal": fast_writes,
            "near_duplicates": dups}
