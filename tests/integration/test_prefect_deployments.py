"""prefect.yaml end to end: `prefect deploy --all` against a loopback Prefect server, the plain
prefect CLI listing the deployments and their schedules, and one deployment run executed by a
process worker to Completed. The worker is always stopped; the server fixture stops the server."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from lmforge.flows import prefect_local

REPO = Path(__file__).resolve().parents[2]
EXPECTED = {
    "pipeline/nightly": "0 2 * * *",
    "monitor/hourly": "0 * * * *",
    "compress/on-demand": None,
    "retrain/on-demand": None,
    "data/on-demand": None,
    "features/on-demand": None,
    "train/on-demand": None,
    "evaluate/on-demand": None,
    "deploy/on-demand": None,
}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def prefect(server, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([prefect_local.prefect_bin(), *args], cwd=REPO, env=prefect_local.server_env(server.ws, server.api_url),
                          capture_output=True, text=True, timeout=timeout)


def test_deploy_list_and_run_through_a_worker(prefect_server):
    prefect_local.deploy_all(prefect_server.ws, prefect_server.api_url)

    listed = prefect(prefect_server, "deployment", "ls")
    assert listed.returncode == 0, listed.stderr
    for name, cron in EXPECTED.items():
        assert name in listed.stdout, f"{name} missing from:\n{listed.stdout}"
        if cron:
            inspected = prefect(prefect_server, "deployment", "inspect", name)
            assert f"'cron': '{cron}'" in inspected.stdout, inspected.stdout[-2000:]

    # One retrain at a time: a second run of the drift loop's retrain is cancelled, not queued.
    retrain = prefect(prefect_server, "deployment", "inspect", "retrain/on-demand").stdout
    assert "'collision_strategy': 'CANCEL_NEW'" in retrain and "'limit': 1" in retrain, retrain[-2000:]
    # No deployment is triggered by training runs (the pipeline and the retrain flow chain compress explicitly).
    compress = prefect(prefect_server, "deployment", "inspect", "compress/on-demand").stdout
    assert "prefect.flow-run.Completed" not in compress, compress[-2000:]

    prefect_local.start_worker(prefect_server.ws, prefect_server.api_url)
    try:
        run = prefect(prefect_server, "deployment", "run", "data/on-demand",
                      "--param", f"cfg={REPO / 'configs' / 'tiny.toml'}", "--watch", "--watch-timeout", "480",
                      timeout=540)
    finally:
        assert prefect_local.stop_worker(prefect_server.ws), "the worker had died before the end of the test"
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert re.search(r"Flow run finished .*'Completed'", out), out[-3000:]
    assert prefect_server.ws.latest_dataset() is not None, "the worker's run wrote no dataset into its workspace"
