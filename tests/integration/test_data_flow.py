"""The data flow for real: Prefect tasks and cache, MLflow run, the dataset folder, the CLI."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from lmforge.components.config import load_config
from lmforge.components.data.manifest import verify_manifest
from lmforge.components.data.quarantine import raw_bytes, read_quarantine, write_quarantine
from lmforge.components.serving.records import read_records
from tests.conftest import REPO, TINY_CONFIG
from tests.unit.data.corpus import BAD_LINES, write_mixed_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _cfg(source: Path, *extra: str):
    return load_config(TINY_CONFIG, [f"data.source={json.dumps(str(source))}", *extra])


def test_second_run_is_served_from_the_cache_with_the_same_manifest(workspace, tiny_config):
    from lmforge.flows.data import data_flow

    first = data_flow(tiny_config)
    manifest_path = workspace.dataset_dir(first["dataset_version"]) / "manifest.json"
    manifest_bytes = manifest_path.read_bytes()
    second = data_flow(tiny_config)

    assert second["dataset_version"] == first["dataset_version"] == workspace.latest_dataset()
    assert manifest_path.read_bytes() == manifest_bytes and verify_manifest(json.loads(manifest_bytes))
    assert set(first["tasks"].values()) == {"Completed"}
    assert set(second["tasks"].values()) == {"Cached"} and len(second["tasks"]) == 5  # ingest, decide, tokenizer, records, finish

    s = first["summary"]
    assert s["docs_in"] == 400 == s["clean"] + s["quarantined"]
    assert s["records_read"] == 400 + s["sampled_out"]
    assert s["clean"] == s["train"] + s["validation"] + s["test"] + s["exact_duplicates"] + s["near_duplicates"]
    assert min(s["train"], s["validation"], s["test"]) > 0 and 300 < s["vocab_size"] <= 512

    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(workspace)
    run = MlflowClient().get_run(second["mlflow_run_id"])
    assert run.data.tags["dataset_version"] == first["dataset_version"]
    assert run.data.metrics["docs_in"] == 400


def test_planted_bad_records_reconcile_exactly_and_replay_after_a_fix(workspace, tmp_path):
    """Bad records of every kind and blank lines: each counted once, kept whole, and taken back once fixed."""
    from lmforge.flows.data import data_flow

    source = write_mixed_jsonl(tmp_path / "mixed.jsonl", 40)
    source.write_bytes(source.read_bytes().replace(b"\n", b"\n\n", 3) + b"   \n")  # 3 empty lines + 1 of spaces
    n_lines = source.read_bytes().count(b"\n")
    result = data_flow(_cfg(source, "data.runner=\"threads\"", "data.shard_mb=0.002"))
    s = result["summary"]
    expected = Counter(reason for _, reason in BAD_LINES) + Counter({"blank_line": 4})
    assert s["quarantined_by_reason"] == dict(expected)
    assert s["records_read"] == n_lines == s["docs_in"] == s["clean"] + s["quarantined"] and s["shards"] > 2
    d = workspace.dataset_dir(result["dataset_version"])
    entries = read_quarantine(d / "quarantine.jsonl")
    assert sorted(q.reason for q in entries) == sorted(expected.elements())
    lines = source.read_bytes().split(b"\n")
    for q in entries:  # each entry is the whole line, with where it came from
        assert q.source == "mixed.jsonl" and raw_bytes(q) == lines[q.line - 1].rstrip(b"\r")
    kept = [r.id for split in ("train", "validation", "test") for r in read_records(d / "records" / f"{split}.jsonl")]
    assert sorted(kept) == sorted(f"doc{i}" for i in range(40))
    assert json.loads((d / "report.json").read_text())["counts"] == json.loads((d / "manifest.json").read_text())["counts"]

    # a person fixes the records that can be fixed and drops the rest, then replays them
    fixes = {"invalid_json": {"id": "js", "text": "Now terminated. A fixed record about sockets and threads."},
             "invalid_utf8": None, "too_long": {"id": "long", "text": "word " * 50}}
    fixed = []
    for q in entries:
        if q.reason in ("invalid_json", "too_long"):
            fixed.append(replace(q, raw=json.dumps(fixes[q.reason]), raw_b64=None))
        elif q.reason == "invalid_utf8" and q.raw_b64 is not None:  # not UTF-8: kept as base64
            good = base64.b64decode(q.raw_b64).replace(b"\xc3\x28", b"\xc3\xa9")
            fixed.append(replace(q, raw=good.decode("utf-8"), raw_b64=None))
    fixed_file = tmp_path / "fixed.jsonl"
    write_quarantine(fixed_file, fixed)
    proc = _lmforge(workspace, ["data", "replay", str(fixed_file), "--config", str(TINY_CONFIG), "--set",
                                f"data.source={json.dumps(str(source))}", "--set", "data.runner=\"threads\"", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["replay"] == {"entries": 3, "still_quarantined": 0, "taken": 3}
    d2 = workspace.dataset_dir(out["dataset_version"])
    kept2 = {r.id for split in ("train", "validation", "test") for r in read_records(d2 / "records" / f"{split}.jsonl")}
    assert kept2 == {f"doc{i}" for i in range(40)} | {"js", "long", "u8"}
    s2 = out["summary"]
    assert s2["records_read"] == n_lines + 3 == s2["clean"] + s2["quarantined"] and s2["clean"] == 43


def _lmforge(workspace, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFORGE_HOME": str(workspace.root), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "COLUMNS": "200"}
    env.pop("PREFECT_HOME", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    lmforge = Path(sys.executable).parent / "lmforge"
    return subprocess.run([str(lmforge), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_change_to_component_code_reruns_the_steps_that_run_it(workspace, tmp_path, monkeypatch):
    from lmforge.components.data import clean
    from lmforge.flows.data import data_flow

    cfg = _cfg(write_mixed_jsonl(tmp_path / "m.jsonl", 40), "data.runner=\"threads\"")
    first = data_flow(cfg)
    assert set(data_flow(cfg)["tasks"].values()) == {"Cached"}

    original = clean.clean_text
    monkeypatch.setattr(clean, "clean_text", lambda text: original(text).replace("handle", "HANDLE"))
    changed = data_flow(cfg)
    assert changed["tasks"]["data-ingest-shard"] == "Completed"  # ingest runs clean_text: not served from the cache
    assert changed["dataset_version"] != first["dataset_version"]
    d = workspace.dataset_dir(changed["dataset_version"])
    assert "HANDLE" in (d / "records" / "train.jsonl").read_text()

    monkeypatch.setattr(clean, "clean_text", original)
    again = data_flow(cfg)
    assert again["dataset_version"] == first["dataset_version"] and again["tasks"]["data-ingest-shard"] == "Cached"

    # a cached step whose output was changed on disk is run again, not trusted
    for rows in (workspace.datasets / ".build").glob("ingest-*/rows.parquet"):
        rows.write_bytes(rows.read_bytes()[:-10] + b"0123456789")
    healed = data_flow(cfg)
    assert healed["dataset_version"] == first["dataset_version"]
    assert healed["tasks"]["data-ingest-shard"] == "Completed"


def test_two_worker_dask_cluster_gives_byte_identical_shards(workspace, tmp_path, monkeypatch):
    import os

    from lmforge.flows.data import data_flow

    for leaked in ("MALLOC_TRIM_THRESHOLD_", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONHASHSEED"):
        monkeypatch.delenv(leaked, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")     # the user's own value survives the cluster
    source = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    serial = data_flow(_cfg(source, "data.runner=\"threads\"", "data.workers=1", "data.shard_mb=0.002"))
    dask = data_flow(_cfg(source, "data.runner=\"dask\"", "data.workers=2", "data.shard_mb=0.002"))
    # distributed's Nanny wrote its worker settings into this process's environment; the data flow took them back,
    # so the ranks a later stage starts do not inherit them (MALLOC_TRIM_THRESHOLD_ halved training's tokens/s).
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert not {"MALLOC_TRIM_THRESHOLD_", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONHASHSEED"} & set(os.environ)
    a, b = (json.loads((workspace.dataset_dir(r["dataset_version"]) / "manifest.json").read_text()) for r in (serial, dask))
    assert a["hashes"] == b["hashes"] and a["counts"] == b["counts"]  # every part, shards included, byte for byte
    for split in ("train", "validation", "test"):
        assert (workspace.dataset_dir(serial["dataset_version"]) / "shards" / f"{split}.bin").read_bytes() == \
               (workspace.dataset_dir(dask["dataset_version"]) / "shards" / f"{split}.bin").read_bytes()


def test_cli_missing_source_is_one_line_and_writes_nothing(workspace):
    proc = _lmforge(workspace, ["run", "data", "--config", str(TINY_CONFIG), "--set", "data.source=/no/such/path"])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: data.source: /no/such/path does not exist"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert not workspace.datasets.exists() and workspace.latest_dataset() is None


def test_local_cluster_workers_run_without_malloc_trim_or_profiler(monkeypatch):
    """The stage's Dask workers: glibc's own trim threshold (not Dask's 64 KiB) and no stack-sampling profiler."""
    import dask.config
    from distributed import Client, LocalCluster

    from lmforge.flows.data import dask_environ_restored, dask_worker_settings, local_cluster_kwargs

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)

    def seen() -> tuple:
        return os.environ.get("MALLOC_TRIM_THRESHOLD_"), dask.config.get("distributed.worker.profile.enabled")

    with dask_environ_restored(), dask_worker_settings(), LocalCluster(**local_cluster_kwargs(1)) as cluster, \
            Client(cluster) as client:
        assert list(client.run(seen).values()) == [(None, False)]


def test_records_are_written_while_the_tokenizer_trains(workspace, tmp_path, monkeypatch):
    """The records tasks need no tokenizer: one runs while it trains, so no core waits through the training."""
    import threading

    from lmforge.components.data import corpuswork, shardwork
    from lmforge.flows.data import data_flow

    written = threading.Event()
    finish_records, train_tokenizer = shardwork.finish_records, corpuswork.train_tokenizer

    def records(*args, **kwargs):
        ref = finish_records(*args, **kwargs)
        written.set()
        return ref

    def train(*args, **kwargs):
        assert written.wait(30), "no shard's records were written while the tokenizer trained"
        return train_tokenizer(*args, **kwargs)

    monkeypatch.setattr(shardwork, "finish_records", records)
    monkeypatch.setattr(corpuswork, "train_tokenizer", train)
    source = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    result = data_flow(_cfg(source, "data.runner=\"threads\"", "data.workers=2"))
    assert result["tasks"]["data-tokenizer"] == result["tasks"]["data-records-shard"] == "Completed"


def test_a_base_models_tokenizer_is_copied_and_the_records_still_run_beside_it(workspace, tmp_path, checkpoint):
    from lmforge.components.model.basemodel import tokenizer_hash
    from lmforge.flows.data import data_flow

    base = checkpoint("gpt2")
    source = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    result = data_flow(_cfg(source, f"training.model.init={json.dumps(str(base))}", "data.runner=\"threads\""))
    assert "data-tokenizer" not in result["tasks"]
    assert {result["tasks"][t] for t in ("data-base-tokenizer", "data-records-shard", "data-finish-shard")} == {"Completed"}
    manifest = json.loads((workspace.dataset_dir(result["dataset_version"]) / "manifest.json").read_text())
    assert manifest["tokenizer_hash"] == tokenizer_hash(base)
    s = result["summary"]
    assert s["train"] + s["validation"] + s["test"] == s["kept"] and sum(s["tokens"].values()) > 0
