"""MLflow against the workspace: the tracking store and the artifact root.

    mlflow = use_workspace(ws)                 # sqlite:///<ws>/mlflow.db, artifacts in <ws>/mlartifacts
    with start_run(ws, "data", run_name="data-3f2a") as run:
        mlflow.log_metric("docs_in", 100)

`MLFLOW_TRACKING_URI` in the environment wins, which is how a scaled-out deployment
points every stage at an MLflow server on PostgreSQL + S3 with no code change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from components.workspace import Workspace


def tracking_uri(ws: Workspace) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or ws.mlflow_uri


def use_workspace(ws: Workspace) -> Any:
    import mlflow

    ws.ensure()
    mlflow.set_tracking_uri(tracking_uri(ws))
    mlflow.set_registry_uri(tracking_uri(ws))
    return mlflow


def ensure_experiment(ws: Workspace, name: str) -> str:
    """The experiment's id, creating it with its artifacts under the workspace the first time."""
    mlflow = use_workspace(ws)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None if os.environ.get("MLFLOW_TRACKING_URI") else (ws.mlflow_artifacts / name).as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # another process created it between the lookup and here
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def start_run(ws: Workspace, experiment: str, **kwargs: Any) -> Iterator[Any]:
    mlflow = use_workspace(ws)
    exp_id = ensure_experiment(ws, experiment)
    with mlflow.start_run(experiment_id=exp_id, **kwargs) as run:
        yield run
