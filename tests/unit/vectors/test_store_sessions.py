"""The embedded store is held for a call or a bounded session, never for a process's life: another process gets it
after, waits for it up to vectors.lock_wait_s, and then fails with an error naming the holder; RAG never skips it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from lmforge.components.evaluation import evaluate_model_dir
from lmforge.components.evaluation.rag import build_rag
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.edge import HOLDER, EdgeCollections, StoreBusy, stores_held
from lmforge.components.vectors.index import close_clients, index_dataset
from tests.integration.evalreg_support import make_eval_dataset
from tests.unit.features.fakedata import make_dataset

HASHING = VectorsConfig(embedder="hashing", hash_dim=32)


@pytest.fixture
def ws(workspace):
    yield workspace
    close_clients()


def child(code: str) -> subprocess.Popen:
    """A Python process running `code` (with EdgeCollections, Path and time imported), once it has printed 'ready'."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; from pathlib import Path; "
                             "from lmforge.components.vectors.edge import EdgeCollections; " + code],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def indexed(ws) -> str:
    version, _ = make_dataset(ws)
    name = index_dataset(ws, version, HASHING)["collection"]
    close_clients()
    return name


def test_another_process_gets_the_store_after_a_call_while_the_first_lives_on(ws):
    name = indexed(ws)
    first = child(f"s = EdgeCollections(Path({str(ws.qdrant)!r})); n = s.count({name!r}).count; "   # s lives on
                  "print('ready', flush=True); time.sleep(60)")
    try:
        store = EdgeCollections(ws.qdrant, wait_s=0)   # no waiting: the first let go when its call returned
        assert store.count(name).count == 42
    finally:
        stop(first)


def test_a_held_store_is_waited_for_then_an_error_names_the_holder(ws):
    name = indexed(ws)
    holder = child(f"s = EdgeCollections(Path({str(ws.qdrant)!r})).session(); s.__enter__(); "
                   "print('ready', flush=True); time.sleep(60)")
    try:
        start = time.monotonic()
        with pytest.raises(StoreBusy) as err:
            EdgeCollections(ws.qdrant, wait_s=1.0).count(name)
        waited = time.monotonic() - start
        assert 1.0 <= waited < 3.0
        message = str(err.value)
        assert f"pid {holder.pid} (" in message and f"{sys.executable} -c " in message and "since 20" in message
        assert "vectors.lock_wait_s" in message and "vectors.url" in message
    finally:
        stop(holder)
    assert EdgeCollections(ws.qdrant, wait_s=5).count(name).count == 42   # the lock went with the process


def test_a_waiting_process_gets_the_store_when_the_holder_lets_go(ws):
    name = indexed(ws)
    holder = child(f"s = EdgeCollections(Path({str(ws.qdrant)!r})).session(); s.__enter__(); "
                   "print('ready', flush=True); time.sleep(1.0); s.__exit__(None, None, None); time.sleep(60)")
    try:
        start = time.monotonic()
        assert EdgeCollections(ws.qdrant, wait_s=30).count(name).count == 42
        assert time.monotonic() - start >= 0.5
    finally:
        stop(holder)


def test_the_holder_record_is_there_while_held_and_gone_after(tmp_path):
    store = EdgeCollections(tmp_path / "q")
    with store.session():
        record = json.loads((tmp_path / "q" / HOLDER).read_text())
        assert record["pid"] == os.getpid() and record["since"].startswith("20")
        assert record["command"] == shlex.join(sys.orig_argv)[:300]   # this process's command line, as run
        assert sorted(p.name for p in (tmp_path / "q").iterdir()) == [".holder.json", ".lock"]   # no temporary left
    assert not (tmp_path / "q" / HOLDER).exists()


def counted_loads(monkeypatch) -> list[str]:
    """The paths the engine loads shards from, one entry per load."""
    import qdrant_edge

    loads: list[str] = []
    real = qdrant_edge.EdgeShard.load
    monkeypatch.setattr(qdrant_edge.EdgeShard, "load", lambda path, *a: loads.append(path) or real(path, *a))
    return loads


def test_a_session_loads_each_shard_once_and_a_bare_call_loads_it_for_itself(ws, monkeypatch):
    name = indexed(ws)
    loads = counted_loads(monkeypatch)
    store = EdgeCollections(ws.qdrant)
    for _ in range(3):
        store.query_points(name, query=[1.0] * 32, limit=2)
    assert len(loads) == 3
    with store.session():
        for _ in range(3):
            store.query_points(name, query=[1.0] * 32, limit=2)
    assert len(loads) == 4
    version, _ = make_dataset(ws, version="fakev2")
    index_dataset(ws, version, HASHING.model_copy(update={"batch_size": 5}))   # nine upsert batches, one hold
    assert len(loads) == 5


def test_rag_waits_for_a_held_store_and_then_fails_naming_the_holder_instead_of_skipping(ws):
    version = make_eval_dataset(ws, per_module=4)
    index_dataset(ws, version, HASHING)
    close_clients()
    holder = child(f"s = EdgeCollections(Path({str(ws.qdrant)!r})).session(); s.__enter__(); "
                   "print('ready', flush=True); time.sleep(60)")
    try:
        with pytest.raises(StoreBusy, match=f"pid {holder.pid} "):
            build_rag(ws, HASHING.model_copy(update={"lock_wait_s": 0.5}), FeaturesConfig(enabled=False), k=2,
                      dataset_version=version)
    finally:
        stop(holder)
    rag = build_rag(ws, HASHING, FeaturesConfig(enabled=False), k=2, dataset_version=version)
    assert rag.augment is not None and "def " in rag.augment('def f(x):\n    """')


def test_a_store_held_mid_evaluation_fails_the_evaluation_instead_of_skipping_rag(ws, tiny_model_dir):
    version = make_eval_dataset(ws, per_module=4)

    def augment(prompt: str) -> str:   # retrieval meets a store another process did not let go
        raise StoreBusy(str(ws.qdrant), None, "is held by pid 1 (lmforge run features)", "Let it finish")

    cfg = EvaluationConfig(max_examples=2, max_new_tokens=4, batch_size=2, bpc_max_docs=2)
    with pytest.raises(StoreBusy, match="pid 1"):
        evaluate_model_dir(tiny_model_dir, ws.dataset_dir(version), cfg, rag=augment)


def test_rag_holds_the_store_once_for_all_its_prompts(ws, tiny_model_dir, monkeypatch):
    version = make_eval_dataset(ws, per_module=4)
    index_dataset(ws, version, HASHING)
    close_clients()
    loads = counted_loads(monkeypatch)
    rag = build_rag(ws, HASHING, FeaturesConfig(enabled=False), k=2, dataset_version=version)
    cfg = EvaluationConfig(max_examples=4, max_new_tokens=4, batch_size=4, bpc_max_docs=2)
    result = evaluate_model_dir(tiny_model_dir, ws.dataset_dir(version), cfg, rag=rag)
    assert result.rag["status"] == "ok" and len(result.examples) == 4
    assert len(loads) == 2   # the probe's, then one for the four prompts (not one per prompt)
    assert not (ws.qdrant / HOLDER).exists()   # and released after
    with stores_held():
        store = EdgeCollections(ws.qdrant)
        store.count(rag_collection(ws, version))
        assert (ws.qdrant / HOLDER).exists()   # held between calls, until the block ends
    assert not (ws.qdrant / HOLDER).exists()


def rag_collection(ws, version: str) -> str:
    return next(p.name for p in ws.qdrant.iterdir() if version in p.name)


def test_another_thread_of_the_process_waits_its_turn_within_the_bound(tmp_path):
    import threading

    store = EdgeCollections(tmp_path / "q", wait_s=0.5)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store.session():
            holding.set()
            done.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        with pytest.raises(StoreBusy, match=f"another thread of this process \\(pid {os.getpid()}\\)"):
            with store.session():
                pass
    finally:
        done.set()
        thread.join(10)
    with store.session():   # its turn, once the other thread let go
        assert json.loads((tmp_path / "q" / HOLDER).read_text())["pid"] == os.getpid()
