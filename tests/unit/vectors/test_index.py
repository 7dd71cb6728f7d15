"""The embedded Qdrant engine: idempotent rebuild, stale points removed, an HNSW index on disk that survives a reopen,
dimension mismatch and a shard held by another program are user errors (a store held by lmforge: test_store_sessions.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.edge import EdgeCollections
from lmforge.components.vectors.embed import make_embedder
from lmforge.components.vectors.index import (
    close_clients,
    collection_name,
    index_dataset,
    qdrant_client,
    vector_size,
)
from lmforge.components.vectors.near_dups import semantic_near_duplicates
from lmforge.components.vectors.retrieval import format_context, retrieve
from tests.unit.features.fakedata import make_dataset
from tests.unit.vectors.engine_neighbours import engine_neighbours_of

NO_FEAST = FeaturesConfig(enabled=False)


@pytest.fixture
def ws(workspace):
    yield workspace
    close_clients()


def test_rebuild_is_idempotent_and_drops_stale_points(ws):
    version, records = make_dataset(ws)
    cfg = VectorsConfig(embedder="hashing", hash_dim=128, batch_size=7)
    first = index_dataset(ws, version, cfg)
    assert first["points"] == sum(len(r) for r in records.values()) and first["created"]
    again = index_dataset(ws, version, cfg)
    assert (again["points"], again["created"], again["deleted_stale"]) == (first["points"], False, 0)
    # The dataset loses a test record: re-indexing removes its point.
    path = ws.dataset_dir(version) / "records" / "test.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    third = index_dataset(ws, version, cfg)
    assert (third["points"], third["deleted_stale"]) == (first["points"] - 1, 1)
    # The writes are on disk: a fresh store, after this one let go, counts the same.
    assert first["engine"] == third["engine"] == "qdrant-edge"
    close_clients()
    assert qdrant_client(ws, cfg).count(third["collection"], exact=True).count == third["points"]


def test_dimension_mismatch_is_an_error_not_a_recreate(ws):
    version, _ = make_dataset(ws)
    index_dataset(ws, version, VectorsConfig(embedder="hashing", hash_dim=128))
    with pytest.raises(UserError, match="size 128.*makes 64"):
        index_dataset(ws, version, VectorsConfig(embedder="hashing", hash_dim=64))
    client = qdrant_client(ws, VectorsConfig())
    assert vector_size(client, f"lmforge_{version}_hashing") == 128


def test_retrieve_returns_k_training_examples_only(ws):
    version, records = make_dataset(ws, n_train=20, n_val=10, n_test=10)
    index_dataset(ws, version, VectorsConfig())
    train_ids = {r.id for r in records["train"]}
    # The prompt is a test document's own signature: its exact twin must still not come back.
    for rec in records["test"][:4] + records["validation"][:2]:
        got = retrieve(rec.signature, 5, ws=ws, vectors=VectorsConfig(), features=NO_FEAST)
        assert len(got) == 5 and {g.id for g in got} <= train_ids
        assert [g.score for g in got] == sorted((g.score for g in got), reverse=True)
    context = format_context(got[:2], "def f(x):\n    \"\"\"")
    assert context.startswith(got[0].text.rstrip("\n")) and context.endswith("def f(x):\n    \"\"\"")


def test_retrieve_without_a_collection_says_to_run_the_stage(ws):
    version, _ = make_dataset(ws)
    with pytest.raises(UserError, match="lmforge run features"):
        retrieve("def f()", 3, ws=ws, vectors=VectorsConfig(), features=NO_FEAST, dataset_version=version)


def test_semantic_near_duplicates_counts_pairs_and_cross_split(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 32)).astype(np.float32)
    base[5] = base[0] + 0.01 * rng.normal(size=32)   # a near twin of 0, in another split
    base[4] = base[1] + 0.01 * rng.normal(size=32)   # a near twin of 1, same split
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    splits = ["train", "train", "train", "validation", "train", "test"]
    ids = [f"d{i}" for i in range(6)]
    with engine_neighbours_of(tmp_path, base) as neighbours:
        report = semantic_near_duplicates(ids, base, splits, neighbours, threshold=0.99, max_pairs=1)
    assert (report["pairs_found"], report["cross_split_pairs"]) == (2, 1)
    assert len(report["pairs"]) == 1 and report["pairs"][0]["cosine"] >= 0.99
    brute = {(i, j) for i in range(6) for j in range(i + 1, 6) if base[i] @ base[j] >= 0.99}
    assert brute == {(0, 5), (1, 4)}


def test_the_index_is_an_hnsw_shard_on_disk_that_answers_the_same_after_a_reopen(ws):
    version, records = make_dataset(ws, n_train=40, n_val=8, n_test=8)
    cfg = VectorsConfig(embedder="hashing", hash_dim=64)
    report = index_dataset(ws, version, cfg)
    name = collection_name(cfg, version, make_embedder(cfg))
    shard = ws.qdrant / name
    # The engine's own files: a segment with an HNSW graph (built by the optimiser), and the write-ahead log.
    graphs = list(shard.glob("segments/*/vector_index/graph.bin"))
    assert graphs and (shard / "wal").is_dir() and report["engine"] == "qdrant-edge"
    queries = make_embedder(cfg).embed([r.text for r in records["test"][:5]]).tolist()
    before = [[(p.id, round(p.score, 5)) for p in qdrant_client(ws, cfg).query_points(name, query=q, limit=5).points]
              for q in queries]
    close_clients()
    after = [[(p.id, round(p.score, 5)) for p in qdrant_client(ws, cfg).query_points(name, query=q, limit=5).points]
             for q in queries]
    assert after == before and all(len(hits) == 5 for hits in after)
    # A query is the nearest neighbour of itself: the test document's own point comes first.
    assert all(hits[0][1] > 0.999 for hits in after)


def test_a_shard_held_by_another_program_is_a_user_error_with_the_engines_words(ws):
    """The engine's own lock on a shard's WAL, met when something other than lmforge holds the shard: the engine
    says so only with a bare exception, so its message is passed on, not matched."""
    version, _ = make_dataset(ws)
    cfg = VectorsConfig(embedder="hashing", hash_dim=32)
    name = index_dataset(ws, version, cfg)["collection"]
    close_clients()
    holder = subprocess.Popen([sys.executable, "-c", "import time, qdrant_edge; "
                               f"s = qdrant_edge.EdgeShard.load({str(ws.qdrant / name)!r}); print('ready', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(UserError, match="cannot be opened by the engine") as err:
            qdrant_client(ws, cfg).count(name)
        assert str(ws.qdrant / name) in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert qdrant_client(ws, cfg).count(name).count > 0   # the failed load left the store released


def test_a_collection_appears_whole_or_not_at_all(tmp_path):
    (tmp_path / "q" / ".new-c-999999").mkdir(parents=True)   # what a writer killed mid-create leaves
    store = EdgeCollections(tmp_path / "q")
    try:
        from qdrant_client import models

        store.create_collection("c", vectors_config=models.VectorParams(size=8, distance=models.Distance.COSINE))
        assert store.collection_exists("c") and [c.name for c in store.get_collections().collections] == ["c"]
        assert not list((tmp_path / "q").glob(".new-*"))   # built aside, then renamed into place
        assert store.delete_collection("c") and not store.collection_exists("c")
        assert not [p for p in (tmp_path / "q").iterdir() if p.name != ".lock"]   # and no holder record: released
    finally:
        store.close()
