"""Qdrant local mode: idempotent rebuild, stale points removed, dimension mismatch and a held folder are user errors."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from lmforge.components.errors import UserError
from lmforge.components.retrieval import format_context, retrieve
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.index import close_clients, index_dataset, qdrant_client
from lmforge.components.vectors.near_dups import semantic_near_duplicates
from tests.unit.features.fakedata import make_dataset

NO_FEAST = FeaturesConfig(enabled=False)


@pytest.fixture
def ws(workspace):
    yield workspace
    close_clients()


def test_rebuild_is_idempotent_and_drops_stale_points(ws):
    version, records = make_dataset(ws)
    cfg = VectorsConfig(hash_dim=128, batch_size=7)
    first = index_dataset(ws, version, cfg)
    assert first["points"] == sum(len(r) for r in records.values()) and first["created"]
    again = index_dataset(ws, version, cfg)
    assert (again["points"], again["created"], again["deleted_stale"]) == (first["points"], False, 0)
    # The dataset loses a test record: re-indexing removes its point.
    path = ws.dataset_dir(version) / "records" / "test.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    third = index_dataset(ws, version, cfg)
    assert (third["points"], third["deleted_stale"]) == (first["points"] - 1, 1)
    # Writes went through WAL (qdrant-client internals still as expected), and they are on disk.
    assert first["local_wal"] and third["local_wal"]
    close_clients()
    assert qdrant_client(ws, cfg).count(third["collection"], exact=True).count == third["points"]


def test_dimension_mismatch_is_an_error_not_a_recreate(ws):
    version, _ = make_dataset(ws)
    index_dataset(ws, version, VectorsConfig(hash_dim=128))
    with pytest.raises(UserError, match="size 128.*makes 64"):
        index_dataset(ws, version, VectorsConfig(hash_dim=64))
    client = qdrant_client(ws, VectorsConfig())
    assert client.get_collection(f"lmforge_{version}_hashing").config.params.vectors.size == 128


def test_folder_held_by_another_process_is_a_user_error(ws):
    ws.qdrant.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from qdrant_client import QdrantClient; "
                               f"c = QdrantClient(path={str(ws.qdrant)!r}); print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(UserError) as err:
            qdrant_client(ws, VectorsConfig())
        assert str(ws.qdrant) in str(err.value) and "vectors.url" in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    deadline = time.monotonic() + 10
    while True:  # the lock goes with the process
        try:
            qdrant_client(ws, VectorsConfig())
            break
        except UserError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


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


def test_semantic_near_duplicates_counts_pairs_and_cross_split():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 32)).astype(np.float32)
    base[5] = base[0] + 0.01 * rng.normal(size=32)   # a near twin of 0, in another split
    base[4] = base[1] + 0.01 * rng.normal(size=32)   # a near twin of 1, same split
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    splits = ["train", "train", "train", "validation", "train", "test"]
    ids = [f"d{i}" for i in range(6)]
    report = semantic_near_duplicates(ids, base, splits, threshold=0.99, max_pairs=1)
    assert (report["pairs_found"], report["cross_split_pairs"]) == (2, 1)
    assert len(report["pairs"]) == 1 and report["pairs"][0]["cosine"] >= 0.99
    brute = {(i, j) for i in range(6) for j in range(i + 1, 6) if base[i] @ base[j] >= 0.99}
    assert brute == {(0, 5), (1, 4)}
