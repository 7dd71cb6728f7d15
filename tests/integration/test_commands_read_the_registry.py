"""With MLFLOW_TRACKING_URI naming an MLflow server, status, the run summary, gc and `ui mlflow` read that server.

The workspace has no store of its own here: everything registered lives on a real `mlflow server`
(tests/integration/servers.py) on loopback, as it does when many workspaces share one registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from lmforge.components.registry.claim import claim_name
from tests.integration.servers import mlflow_server

pytestmark = [pytest.mark.integration]

MODEL = "shared-lm"
ON_SERVER_TAG, ON_SERVER_RUN, UNREFERENCED = "aaaaaaaaaaaa", "cccccccccccc", "bbbbbbbbbbbb"


def _dataset(ws, version: str) -> None:
    d = ws.dataset_dir(version)
    (d / "records").mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"version": version, "counts": {}}))
    (d / "records" / "train.jsonl").write_text('{"id": "a", "text": "x"}\n')


def _register_on(url: str) -> None:
    """Two versions on the server: v1 names its dataset in a `dataset` tag, v2 only in its run's params."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url, registry_uri=url)
    exp = client.create_experiment("evaluation")
    client.create_registered_model(MODEL)
    for dataset, tags in ((ON_SERVER_TAG, {"dataset": ON_SERVER_TAG}), (ON_SERVER_RUN, {})):
        run = client.create_run(exp)
        client.log_param(run.info.run_id, "dataset_version", dataset)
        client.set_terminated(run.info.run_id)
        client.create_model_version(MODEL, source=f"runs:/{run.info.run_id}/model", run_id=run.info.run_id, tags=tags)
    client.set_registered_model_alias(MODEL, "champion", "2")
    client.set_registered_model_alias(MODEL, "challenger", "1")
    client.create_registered_model(claim_name(MODEL))   # an alias move in flight: not a model to list


def _lmforge(ws, url: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFORGE_HOME": str(ws.root), "MLFLOW_TRACKING_URI": url, "COLUMNS": "200", **extra}
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], cwd=ws.root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_status_summary_gc_and_ui_read_the_server(workspace, tmp_path, monkeypatch):
    ws = workspace
    for v in (ON_SERVER_TAG, ON_SERVER_RUN, UNREFERENCED):
        _dataset(ws, v)
    with mlflow_server(tmp_path / "srv") as url:
        _register_on(url)

        status = _lmforge(ws, url, "status", "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        out = json.loads(status.stdout)
        assert url in out["registry"] and "MLflow server" in out["registry"]
        (model,) = out["registered_models"]
        assert model["model"] == MODEL
        assert model["aliases"] == {"champion": "2", "challenger": "1"}
        assert model["versions"] == [{"version": "2", "aliases": ["champion"]}, {"version": "1", "aliases": ["challenger"]}]
        human = _lmforge(ws, url, "status")
        assert human.returncode == 0 and "champion -> v2" in human.stdout and f"MLflow server {url}" in human.stdout

        from lmforge.cli.summary import print_run_summary

        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        console = Console(record=True, width=200)
        print_run_summary({"stages": {}}, console, ws=ws, model_name=MODEL)
        assert f"model {MODEL} in MLflow server {url} (MLFLOW_TRACKING_URI): challenger -> v1, champion -> v2" \
            in console.export_text()

        ui = _lmforge(ws, url, "ui", "mlflow")
        assert ui.returncode == 0 and f"MLflow UI: {url}/#/models" in ui.stdout, ui.stdout + ui.stderr

        gc = _lmforge(ws, url, "gc", "--json")
        assert gc.returncode == 0, gc.stderr[-3000:]
        result = json.loads(gc.stdout)
        assert result["keep"] == {ON_SERVER_TAG: [f"registered model {MODEL}/1"],
                                  ON_SERVER_RUN: [f"registered model {MODEL}/2"]}
        assert result["datasets"] == [str(ws.dataset_dir(UNREFERENCED))]
        assert ws.dataset_dir(ON_SERVER_TAG).is_dir() and ws.dataset_dir(ON_SERVER_RUN).is_dir()
        assert not ws.dataset_dir(UNREFERENCED).exists()
        assert not ws.mlflow_db.exists()   # no command opened (and so created) the workspace's own store

    # The server is gone: gc says which registry it could not read, and removes nothing.
    _dataset(ws, UNREFERENCED)
    down = _lmforge(ws, url, "gc", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    assert down.returncode == 2, down.stderr[-3000:]
    assert f"registry: MLflow server {url} (MLFLOW_TRACKING_URI) could not be read" in " ".join(down.stderr.split())
    assert ws.dataset_dir(UNREFERENCED).is_dir()
