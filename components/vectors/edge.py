"""Qdrant's embedded engine (qdrant-edge-py) behind QdrantClient's calls, and the one process at a time that holds it.

    client = EdgeCollections(ws.qdrant, wait_s=120)   # components/vectors/index.py's qdrant_client makes it
    client.upsert(...); client.query_points(...)      # qdrant-client's own model types in and out

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
from pathlib import Path
from typing import IO, Any

from lmforge.components.errors import UserError

LOCK = ".lock"                         # held (flock) by the one process using the embedded store
HOLDER = ".holder.json"                # beside it: that process's pid, command and start time
POLL_S = 0.1                           # how often a waiting process tries the lock again
_HELD: list[ExitStack] = []            # open stores_held() blocks, innermost last
FULL_SCAN_KB = 10_000                  # Qdrant's default: a segment under ~10 MB of vectors is searched exactly
INDEXING_KB = 1                        # build the HNSW graph for every optimised segment, however small


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

