"""Persisted Prefect results go to <workspace>/prefect/storage, as JSON, whichever Prefect the run reports to.

Prefect's own default is $PREFECT_HOME/storage, ~/.prefect/storage unless PREFECT_HOME is set.
(`lmforge run data` against a user's Prefect server, on Dask workers, is checked the same way in
test_prefect_user_settings.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmforge.components.workspace import Workspace
from lmforge.flows.prefect_env import apply, choose

pytestmark = [pytest.mark.integration]


def test_every_mode_puts_results_in_the_workspace_unless_the_user_chose_a_storage(tmp_path):
    ws = Workspace(tmp_path / "ws")
    home = tmp_path / "home"
    (home / ".prefect").mkdir(parents=True)
    base = {"HOME": str(home)}
    for env in ({}, {"PREFECT_API_URL": "http://127.0.0.1:1/api"}, {"PREFECT_HOME": str(tmp_path / "mine")}):
        mode = choose(ws, {**base, **env})
        assert mode.results == ws.prefect / "storage", mode
        applied: dict[str, str] = {**base, **env}
        apply(mode, applied)
        assert applied["PREFECT_LOCAL_STORAGE_PATH"] == str(ws.prefect / "storage")

    for chosen in ({"PREFECT_LOCAL_STORAGE_PATH": "/shared/results"},
                   {"PREFECT_RESULTS_LOCAL_STORAGE_PATH": "/shared/results"},
                   {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": "s3-bucket/results"}):
        mode = choose(ws, {**base, "PREFECT_API_URL": "http://127.0.0.1:1/api", **chosen})
        applied = {**base, **chosen}
        apply(mode, applied)
        assert mode.results is None and applied.get("PREFECT_LOCAL_STORAGE_PATH") == chosen.get("PREFECT_LOCAL_STORAGE_PATH")

    # a storage block the active profile names is the user's choice too
    (home / ".prefect" / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:1/api"\n'
        'PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK = "s3-bucket/results"\n')
    mode = choose(ws, base)
    assert mode.kind == "profile" and mode.results is None and mode.env == {}


def test_a_flow_with_its_own_prefect_home_persists_its_results_in_the_workspace(tmp_path):
    cwd = tmp_path / "project"
    cwd.mkdir()
    user_home = tmp_path / "prefect-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_"))}
    env.update(HOME=str(tmp_path / "home"), PREFECT_HOME=str(user_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    script = ("from lmforge.flows.workspace_flow import workspace_flow\n"   # lmforge.flows first, as documented
              "from prefect import task\n"
              "@task(persist_result=True)\n"
              "def double(x: int) -> dict:\n"
              "    return {'doubled': 2 * x}\n"
              "@workspace_flow(name='probe-results')\n"
              "def probe(x: int) -> dict:\n"
              "    return double(x)\n"
              "print('result', probe(21))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "result {'doubled': 42}" in r.stdout

    stored = [p for p in (cwd / ".lmforge" / "prefect" / "storage").rglob("*") if p.is_file()]
    assert stored, "no persisted result in the workspace"
    # every file is JSON, none a pickle: a task's result record (metadata + the value, JSON-serialized), or a
    # flow's result (the value alone: its metadata lives on the API's flow run)
    files = [json.loads(p.read_text()) for p in stored]
    records = [f for f in files if isinstance(f, dict) and "metadata" in f]
    assert records and {rec["metadata"]["serializer"]["type"] for rec in records} == {"json"}
    assert [json.loads(rec["result"]) for rec in records] == [{"doubled": 42}]
    assert {"doubled": 42} in [f for f in files if f not in records]
    assert not (user_home / "storage").exists() or not any((user_home / "storage").iterdir())
    assert not (tmp_path / "home" / ".prefect").exists()
