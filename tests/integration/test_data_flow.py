"""The data flow for real: Prefect tasks and cache, MLflow run, the dataset folder, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.components.config import load_config
from lmforge.components.data.manifest import verify_manifest
from lmforge.components.data.quarantine import read_quarantine
from lmforge.components.data.records import read_records
from tests.conftest import REPO, TINY_CONFIG
from tests.unit.data.corpus import BAD_LINES, write_mixed_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def task_states(flow_run_id, names: set[str], timeout: float = 30.0) -> dict[str, str]:
    """Task run name prefix -> state name, read back from the Prefect API (task runs arrive asynchronously)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        states = {r.name.rsplit("-", 1)[0]: r.state.name for r in runs if r.state is not None}
        if names <= set(states) or time.monotonic() > deadline:
            return {n: s for n, s in states.items() if n in names}
        time.sleep(0.5)


def test_second_run_is_served_from_the_cache_with_the_same_manifest(workspace, tiny_config):
    from lmforge.flows.data import data_flow

    first_state = data_flow(tiny_config, return_state=True)
    first = first_state.result()
    manifest_path = workspace.dataset_dir(first["dataset_version"]) / "manifest.json"
    manifest_bytes = manifest_path.read_bytes()
    second_state = data_flow(tiny_config, return_state=True)
    second = second_state.result()

    assert second["dataset_version"] == first["dataset_version"] == workspace.latest_dataset()
    assert manifest_path.read_bytes() == manifest_bytes and verify_manifest(json.loads(manifest_bytes))
    assert set(first["tasks"].values()) == {"Completed"}
    assert set(second["tasks"].values()) == {"Cached"}
    from_api = task_states(second_state.state_details.flow_run_id, set(second["tasks"]))
    assert from_api == dict.fromkeys(second["tasks"], "Cached") and len(from_api) == 7

    s = first["summary"]
    assert s["docs_in"] == 400 == s["clean"] + s["quarantined"]
    assert s["clean"] == s["train"] + s["validation"] + s["test"] + s["exact_duplicates"] + s["near_duplicates"]
    assert min(s["train"], s["validation"], s["test"]) > 0 and 300 < s["vocab_size"] <= 512

    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(workspace)
    run = MlflowClient().get_run(second["mlflow_run_id"])
    assert run.data.tags["dataset_version"] == first["dataset_version"]
    assert run.data.metrics["docs_in"] == 400


def test_mixed_corpus_runs_to_completion_with_every_bad_record_quarantined(workspace, tmp_path):
    from lmforge.flows.data import data_flow

    source = write_mixed_jsonl(tmp_path / "mixed.jsonl", 40)
    cfg = load_config(TINY_CONFIG, [f"data.source={json.dumps(str(source))}"])
    result = data_flow(cfg)
    s = result["summary"]
    expected: dict[str, int] = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert s["quarantined_by_reason"] == expected
    assert s["docs_in"] == 40 + len(BAD_LINES) == s["clean"] + s["quarantined"]
    d = workspace.dataset_dir(result["dataset_version"])
    assert sorted(q.reason for q in read_quarantine(d / "quarantine.jsonl")) == sorted(r for _, r in BAD_LINES)
    kept = [r.id for split in ("train", "validation", "test") for r in read_records(d / "records" / f"{split}.jsonl")]
    assert sorted(kept) == sorted(f"doc{i}" for i in range(40))
    assert json.loads((d / "report.json").read_text())["counts"] == json.loads((d / "manifest.json").read_text())["counts"]


def test_cli_missing_source_is_one_line_and_writes_nothing(workspace):
    env = {**os.environ, "LMFORGE_HOME": str(workspace.root), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "COLUMNS": "200"}
    env.pop("PREFECT_HOME", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    lmforge = Path(sys.executable).parent / "lmforge"
    proc = subprocess.run([str(lmforge), "run", "data", "--config", str(TINY_CONFIG), "--set", "data.source=/no/such/path"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: data.source: /no/such/path does not exist"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert not workspace.datasets.exists() and workspace.latest_dataset() is None
