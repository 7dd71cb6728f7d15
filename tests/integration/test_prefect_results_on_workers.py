"""Tasks on a Dask cluster persist their results in the workspace, or in the shared store the Prefect server names.

A real Prefect server and a Dask scheduler with 2 workers (tests/integration/servers.py), the
workers with a HOME of their own, as on other hosts. First no result storage is configured: the
results go to <workspace>/prefect/storage (Prefect sends the flow run's settings with each task),
nothing to anyone's ~/.prefect. Then the platform sets the server's default result storage
(`prefect experimental result-storage set <block>`; here a local-file-system block standing in for an S3 one,
which needs s3fs on the workers): lmforge's workspace default must not override it, and the
results go there, as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.servers import dask_cluster, prefect_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLOW = """
from lmforge.flows.workspace_flow import workspace_flow   # lmforge.flows first: it sets Prefect's environment
from prefect import task
from prefect_dask import DaskTaskRunner
import sys

@task(persist_result=True)
def square(x: int) -> dict:
    return {"square": x * x}

@workspace_flow(name="probe-on-workers", task_runner=DaskTaskRunner(address=sys.argv[1]))
def probe(n: int) -> list:
    return [f.result() for f in square.map(list(range(n)))]

print("result", probe(int(sys.argv[2])))
"""

SET_SHARED = """
import sys
from prefect.client.orchestration import get_client
from prefect.filesystems import LocalFileSystem

block_id = LocalFileSystem(basepath=sys.argv[1]).save("shared-results", overwrite=True)
with get_client(sync_client=True) as client:
    client.update_server_default_result_storage(block_id)
"""


def _env(tmp: Path, api: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_", "MLFLOW_"))}
    return {**env, "HOME": str(tmp / "home"), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def _python(env: dict[str, str], cwd: Path, code: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _results(folder: Path) -> list:
    """The values persisted under `folder`: every file JSON (task records hold the value JSON-encoded)."""
    values = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "metadata" in data:
            assert data["metadata"]["serializer"]["type"] == "json", path
            data = json.loads(data["result"])
        values.append(data)
    return values


def test_tasks_on_dask_workers_persist_in_the_workspace_or_the_servers_shared_store(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    workers_home = tmp_path / "workers-home"
    with prefect_server(tmp_path) as api, dask_cluster(tmp_path, workers=2, env={"HOME": str(workers_home)}) as dask:
        env = _env(tmp_path, api)
        out = _python(env, project, FLOW, dask, "3")
        assert "result [{'square': 0}, {'square': 1}, {'square': 4}]" in out
        local = project / ".lmforge" / "prefect" / "storage"
        values = _results(local)
        assert all({"square": i * i} in values for i in range(3)), values
        assert not (tmp_path / "home" / ".prefect" / "storage").exists()
        assert not (workers_home / ".prefect" / "storage").exists()

        shared = tmp_path / "shared-store"
        _python(env, project, SET_SHARED, str(shared))
        before = {p for p in local.rglob("*") if p.is_file()}
        out = _python(env, project, FLOW, dask, "5")
        assert "{'square': 16}" in out
        values = _results(shared)
        assert {"square": 16} in values and {"square": 9} in values, values   # the new tasks' results went there
        assert {p for p in local.rglob("*") if p.is_file()} == before          # and none to the workspace
        assert not (workers_home / ".prefect" / "storage").exists()
