"""prefect.yaml end to end: a loopback Prefect server, `prefect deploy --all`, the plain prefect CLI,
and one deployment run executed by a process worker to Completed. Always stops everything."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from components.workspace import Workspace
from flows import prefect_local
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
EXPECTED = {
    "pipeline/nightly": "0 2 * * *",
    "monitor/hourly": "0 * * * *",
    "compress/after-training": None,
    "data/on-demand": None,
    "train/on-demand": None,
}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def prefect(ws: Workspace, api_url: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([prefect_local.prefect_bin(), *args], cwd=REPO, env=prefect_local.server_env(ws, api_url),
                          capture_output=True, text=True, timeout=timeout)


def test_deploy_list_and_run_through_a_worker(tmp_path, monkeypatch):
    ws = Workspace(tmp_path / "ws").ensure()
    monkeypatch.setenv("LMFORGE_HOME", str(ws.root))
    info = prefect_local.start_server(ws, port=free_port())
    try:
        prefect_local.deploy_all(ws, info.api_url)

        listed = prefect(ws, info.api_url, "deployment", "ls")
        assert listed.returncode == 0, listed.stderr
        for name, cron in EXPECTED.items():
            assert name in listed.stdout, f"{name} missing from:\n{listed.stdout}"
            if cron:
                inspected = prefect(ws, info.api_url, "deployment", "inspect", name)
                assert f"'cron': '{cron}'" in inspected.stdout, inspected.stdout[-2000:]

        prefect_local.start_worker(ws, info.api_url)
        run = prefect(ws, info.api_url, "deployment", "run", "data/on-demand",
                      "--param", f"cfg={REPO / 'configs' / 'tiny.toml'}", "--watch", "--watch-timeout", "480",
                      timeout=540)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-3000:]
        assert re.search(r"finished in state .*Completed", out), out[-3000:]
        assert ws.latest_dataset() is not None, "the worker's run did not write a dataset into the workspace"
    finally:
        stopped = prefect_local.stop_all(ws)
        assert "server" in stopped
    assert prefect_local.active_server(ws) is None
