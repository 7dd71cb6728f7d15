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

The embedded store admits one process at a time (the engine locks each shard's WAL while it is
loaded, and says so only with a bare exception), so lmforge holds it only for an operation or a
bounded session, never for the life of a process:

    with store_session(client):                 # one hold around a batch of calls; a no-op for a server
        client.query_points(...); client.query_points(...)

Every call on `EdgeCollections` outside a session opens the store, does its work and releases it.
Holding means an exclusive lock on <ws>/qdrant/.lock, with the holder's pid, command and start
time written beside it (<ws>/qdrant/.holder.json, atomically); a process that finds the lock held
polls for `vectors.lock_wait_s` and then raises `StoreBusy`, a UserError naming that holder.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shlex
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import IO, Any

import numpy as np

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.serving.records import Record
from lmforge.components.vectors.embed import Embedder, make_embedder
from lmforge.components.vectors.near_dups import Neighbours, semantic_near_duplicates
from lmforge.components.workspace import Workspace

SPLITS = ("train", "validation", "test")
_NS = uuid.UUID("5f1d3c2e-7a4b-4c1d-9e8f-6a5b4c3d2e1f")
_CLIENTS: dict[str, Any] = {}
LOCK = ".lock"                         # held (flock) by the one process using the embedded store
HOLDER = ".holder.json"                # beside it: that process's pid, command and start time
POLL_S = 0.1                           # how often a waiting process tries the lock again
_HELD: list[ExitStack] = []            # open stores_held() blocks, innermost last
FULL_SCAN_KB = 10_000                  # Qdrant's default: a segment under ~10 MB of vectors is searched exactly
INDEXING_KB = 1                        # build the HNSW graph for every optimised segment, however small


def point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NS, doc_id))


class StoreBusy(UserError):
    """The embedded store stayed held by another process for the whole wait; the message names that process."""


def _holder_text(root: Path) -> str:
    """Who holds the store, from the record its holder wrote beside the lock."""
    try:
        h = json.loads((root / HOLDER).read_text())
        return f"pid {h['pid']} ({h['command']}) since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return (f"a process that left no {HOLDER} (an older lmforge, or another program: "
                f"`fuser {root / LOCK}` names it)")


def _write_holder(root: Path) -> None:
    """Say who holds the store: pid, command and start time, written whole (a temporary file renamed into place)."""
    record = {"pid": os.getpid(), "command": shlex.join(sys.orig_argv)[:300],
              "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = root / f".{HOLDER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, root / HOLDER)


def acquire_store(root: Path, wait_s: float) -> IO[str]:
    """The store's lock, polled for up to `wait_s` seconds; StoreBusy, naming the holder, when it stays held."""
    f: IO[str] = open(root / LOCK, "a")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                raise StoreBusy(str(root), None, f"is held by {_holder_text(root)}; waited {wait_s:g} s "
                                                 "(the embedded Qdrant engine admits one process at a time)",
                                "Let that process finish or stop it, raise vectors.lock_wait_s, or run a "
                                "Qdrant server and set vectors.url") from None
            time.sleep(POLL_S)
    _write_holder(root)
    return f


def release_store(root: Path, lock: IO[str]) -> None:
    """Remove the holder record, then the lock (in that order: the next holder's record is never removed)."""
    (root / HOLDER).unlink(missing_ok=True)
    lock.close()   # releases the flock


class EdgeCollections:
    """Collections in Qdrant's embedded engine, one shard each under `root`, with QdrantClient's calls.

    The methods lmforge calls on a QdrantClient (collection_exists, get_collections,
    create_collection, delete_collection, create_payload_index, upsert, scroll, delete, count,
    query_points, query_batch_points, close) take and return qdrant-client's own model types,
    so a caller cannot tell the two apart; `optimize`, `vector_size` and `session` are extra.

    Each call holds the store for itself unless a `session()` is open, which holds it (and the
    shards it loads) until it ends; `close()` ends one early. A new collection is created in a
    temporary folder and renamed into place, so a crash never leaves half a shard under its
    name, and a collection is a folder under its own name (lmforge's layout, not the engine's);
    each upsert or delete is one engine operation, written to the shard's WAL before it is
    applied (a crash replays or drops it whole).
    """

    def __init__(self, root: Path, *, m: int = 16, ef_construct: int = 100, hnsw_ef: int = 128,
                 full_scan_kb: int = FULL_SCAN_KB, wait_s: float = 120.0):
        self.root = Path(root)
        self.hnsw = (m, ef_construct, full_scan_kb)
        self.hnsw_ef = hnsw_ef
        self.wait_s = wait_s
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock: IO[str] | None = None
        self._depth = 0
        self._threads = threading.RLock()   # a flock is per open file: this process's threads take turns first
        self._shards: dict[str, Any] = {}

    @contextmanager
    def session(self) -> Iterator[EdgeCollections]:
        """Hold the store (waiting up to `wait_s` for another process) until the block ends; nested ones share it."""
        if not self._threads.acquire(timeout=self.wait_s):
            raise StoreBusy(str(self.root), None, f"is held by another thread of this process (pid {os.getpid()}); "
                                                  f"waited {self.wait_s:g} s", "Raise vectors.lock_wait_s")
        with self._threads:
            self._threads.release()   # held once, by the `with`
            if self._depth == 0:
                self._lock = acquire_store(self.root, self.wait_s)
                self._clear_leftovers()
                if _HELD:   # inside stores_held(): the store stays held until that block ends
                    self._depth += 1
                    _HELD[-1].callback(self._let_go)
            self._depth += 1
            try:
                yield self
            finally:
                self._let_go()

    def _let_go(self) -> None:
        with self._threads:
            if self._depth > 0:   # 0 already when close() ended the session early
                self._depth -= 1
                if self._depth == 0:
                    self.close()

    def _clear_leftovers(self) -> None:
        for left in [*self.root.glob(".new-*"), *self.root.glob(".deleted-*")]:   # a killed writer's; the lock is ours
            shutil.rmtree(left, ignore_errors=True)

    # ----- collections
    def collection_exists(self, name: str) -> bool:
        return not name.startswith(".") and (self.root / name).is_dir()

    def get_collections(self) -> Any:
        from qdrant_client import models

        names = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        return models.CollectionsResponse(collections=[models.CollectionDescription(name=n) for n in names])

    def vector_size(self, name: str) -> int | None:
        """The size of the collection's stored vectors (one point's, read through the engine); None when it is empty."""
        import qdrant_edge as qe

        with self.session():
            page, _ = self._shard(name).scroll(qe.ScrollRequest(limit=1, with_payload=False, with_vector=True))
        if not page:
            return None
        vector = page[0].vector
        return len(vector.get("", []) if isinstance(vector, dict) else vector)

    def create_collection(self, name: str, vectors_config: Any) -> bool:
        import qdrant_edge as qe

        m, ef_construct, full_scan_kb = self.hnsw
        config = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=vectors_config.size, distance=_distance(vectors_config.distance)),
            hnsw_config=qe.HnswIndexConfig(m=m, ef_construct=ef_construct, full_scan_threshold=full_scan_kb),
            optimizers=qe.EdgeOptimizersConfig(indexing_threshold=INDEXING_KB, default_segment_number=1))
        with self.session():
            tmp = self.root / f".new-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            qe.EdgeShard.create(str(tmp), config).close()
            os.rename(tmp, self.root / name)   # fails, rather than merges, if the name appeared meanwhile
        return True

    def delete_collection(self, name: str) -> bool:
        with self.session():
            if not self.collection_exists(name):
                return False
            shard = self._shards.pop(name, None)
            if shard is not None:
                shard.close()
            gone = self.root / f".deleted-{name}-{os.getpid()}"
            os.rename(self.root / name, gone)   # the collection disappears at once; the files go after
            shutil.rmtree(gone)
        return True

    def create_payload_index(self, name: str, field_name: str, field_schema: Any) -> None:
        import qdrant_edge as qe

        schema = getattr(qe.PayloadSchemaType, str(getattr(field_schema, "value", field_schema)).capitalize())
        with self.session():
            self._shard(name).update(qe.UpdateOperation.create_field_index(field_name, schema))

    def optimize(self, name: str) -> bool:
        """Let the engine merge segments and build the HNSW graph now; True if it changed anything."""
        with self.session():
            shard = self._shard(name)
            changed = shard.optimize()
            shard.flush()
        return changed

    # ----- points
    def upsert(self, collection_name: str, points: list[Any], wait: bool = True) -> None:
        import qdrant_edge as qe

        batch = [qe.Point(p.id, p.vector, p.payload) for p in points]
        with self.session():
            self._shard(collection_name).update(qe.UpdateOperation.upsert_points(batch))

    def delete(self, collection_name: str, points_selector: Any, wait: bool = True) -> None:
        import qdrant_edge as qe

        ids = [str(i) if isinstance(i, uuid.UUID) else i for i in points_selector.points]
        with self.session():
            self._shard(collection_name).update(qe.UpdateOperation.delete_points(ids))

    def scroll(self, collection_name: str, limit: int = 10, offset: Any = None, with_payload: bool = True,
               with_vectors: bool = False) -> tuple[list[Any], Any]:
        import qdrant_edge as qe
        from qdrant_client import models

        with self.session():
            page, after = self._shard(collection_name).scroll(
                qe.ScrollRequest(offset=offset, limit=limit, with_payload=with_payload, with_vector=with_vectors))
        records = [models.Record(id=_id(r.id), payload=r.payload, vector=r.vector) for r in page]
        return records, None if after is None else _id(after)

    def count(self, collection_name: str, exact: bool = True) -> Any:
        import qdrant_edge as qe
        from qdrant_client import models

        with self.session():
            return models.CountResult(count=self._shard(collection_name).count(qe.CountRequest(exact=exact)))

    def query_points(self, collection_name: str, query: Any, limit: int = 10, with_payload: bool = False,
                     query_filter: Any = None, score_threshold: float | None = None, search_params: Any = None) -> Any:
        from qdrant_client.http import models as rest

        request = rest.QueryRequest(query=query, limit=limit, with_payload=with_payload, filter=query_filter,
                                    score_threshold=score_threshold, params=search_params)
        return self.query_batch_points(collection_name, [request])[0]

    def query_batch_points(self, collection_name: str, requests: list[Any]) -> list[Any]:
        """qdrant-client QueryRequests (a dense vector query, limit, filter, threshold, hnsw_ef), run as one engine batch."""
        import qdrant_edge as qe
        from qdrant_client.http import models as rest

        batch = qe.QueryBatchRequest([_edge_request(r, self.hnsw_ef) for r in requests])
        with self.session():
            answers = self._shard(collection_name).query_batch(batch)
        return [rest.QueryResponse(points=[rest.ScoredPoint(id=_id(p.id), version=p.version, score=p.score,
                                                            payload=p.payload) for p in hits]) for hits in answers]

    def close(self) -> None:
        """Close the loaded shards and release the store (ending a session early)."""
        with self._threads:
            while self._shards:
                _, shard = self._shards.popitem()
                shard.close()
            if self._lock is not None:
                release_store(self.root, self._lock)
                self._lock = None
            self._depth = 0

    def _shard(self, name: str) -> Any:
        """The loaded shard `name`; called inside a session only."""
        import qdrant_edge as qe

        assert self._lock is not None, "a shard is loaded inside a session only"
        if name not in self._shards:
            if not self.collection_exists(name):
                raise UserError(f"Qdrant collection {name}", self.root / name, "does not exist",
                                "Index the dataset with these [vectors] settings: lmforge run features")
            try:
                self._shards[name] = qe.EdgeShard.load(str(self.root / name))
            except Exception as e:
                # The engine raises a bare Exception and documents no "locked" answer; lmforge's own
                # processes never meet its lock (they hold .lock first), so this is another program's
                # hold or a damaged shard: both are named with the engine's words, not guessed from them.
                raise UserError(f"Qdrant collection {name}", self.root / name, f"cannot be opened by the engine ({e})",
                                "If a program other than lmforge has this shard open, stop it; otherwise delete the "
                                "folder and run `lmforge run features` to rebuild it") from e
        return self._shards[name]


@contextmanager
def stores_held() -> Iterator[None]:
    """Keep every embedded store that a call inside the block opens held (its shards loaded) until the block ends.

    For a loop of calls that cannot share a client (RAG's one retrieval per prompt): opening a
    shard costs the engine tens of milliseconds, a query a fraction of one.
    """
    _HELD.append(ExitStack())
    try:
        yield
    finally:
        _HELD.pop().close()


def store_session(client: Any) -> AbstractContextManager[Any]:
    """`client.session()` for the embedded store: one hold around a batch of calls; nothing for a Qdrant server."""
    return client.session() if isinstance(client, EdgeCollections) else nullcontext(client)


def _id(value: Any) -> Any:
    return str(value) if isinstance(value, uuid.UUID) else value


def _distance(distance: Any) -> Any:
    import qdrant_edge as qe

    return getattr(qe.Distance, str(getattr(distance, "value", distance)).capitalize())


def _edge_request(request: Any, default_ef: int) -> Any:
    """A qdrant-client QueryRequest for a dense vector as the engine's QueryRequest."""
    import qdrant_edge as qe

    if not isinstance(request.query, list):
        raise TypeError(f"the embedded Qdrant store answers dense-vector queries only, not {type(request.query).__name__}")
    params = request.params
    ef = params.hnsw_ef if params is not None and params.hnsw_ef else default_ef
    exact = bool(params is not None and params.exact)
    return qe.QueryRequest(limit=request.limit, query=qe.Query.Nearest(request.query),
                           with_payload=bool(request.with_payload), score_threshold=request.score_threshold,
                           filter=_edge_filter(request.filter), params=qe.SearchParams(hnsw_ef=ef, exact=exact))


def _edge_filter(flt: Any) -> Any:
    """A qdrant-client Filter of field matches (MatchValue / MatchAny, must / should / must_not) for the engine."""
    import qdrant_edge as qe
    from qdrant_client import models

    if flt is None:
        return None

    def condition(c: Any) -> Any:
        if isinstance(c, models.Filter):
            return _edge_filter(c)
        if isinstance(c, models.FieldCondition) and isinstance(c.match, models.MatchValue):
            return qe.FieldCondition(key=c.key, match=qe.MatchValue(c.match.value))
        if isinstance(c, models.FieldCondition) and isinstance(c.match, models.MatchAny):
            return qe.FieldCondition(key=c.key, match=qe.MatchAny(list(c.match.any)))
        raise TypeError(f"the embedded Qdrant store does not translate the filter condition {c!r}")

    def clauses(cs: Any) -> list[Any] | None:
        if cs is None:
            return None
        return [condition(c) for c in (cs if isinstance(cs, list) else [cs])]

    return qe.Filter(must=clauses(flt.must), should=clauses(flt.should), must_not=clauses(flt.must_not))


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
