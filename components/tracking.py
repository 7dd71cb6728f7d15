"""MLflow against the workspace: the tracking store and the artifact root.

    mlflow = use_workspace(ws)                 # sqlite:///<ws>/mlflow.db, artifacts in <ws>/mlartifacts
    with start_run(ws, "data", run_name="data-3f2a") as run:
        mlflow.log_metric("docs_in", 100)

`MLFLOW_TRACKING_URI` in the environment wins, which is how a scaled-out deployment
points every stage at an MLflow server on PostgreSQL + S3 with no code change. Commands that
only read (status, the run summary, gc, `ui mlflow`) reach the same registry the runs go to:

    client = registry_client(ws)     # MlflowClient on it; None when there is none yet (no server, no store)
    registry_label(ws)               # "MLflow server http://10.0.0.5:5000 (MLFLOW_TRACKING_URI)"
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from lmforge.components.workspace import Workspace

# mlflow.set_tracking_uri() also exports MLFLOW_TRACKING_URI (for child processes), so the
# variable alone cannot tell a user's server URI from a workspace URI this process set.
_SET_HERE: set[str] = set()


def external_uri() -> str | None:
    """MLFLOW_TRACKING_URI when a user (not this module) set it."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    return uri if uri and uri not in _SET_HERE else None


def tracking_uri(ws: Workspace) -> str:
    return external_uri() or ws.mlflow_uri


def is_server(uri: str) -> bool:
    """A tracking URI that names an MLflow server (REST over http or https), not a store this process opens."""
    return uri.startswith(("http://", "https://"))


def shown_uri(uri: str) -> str:
    """The URI with any password replaced by ***, to print (a postgresql:// store URI may carry one)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not parts.password:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def registry_label(ws: Workspace) -> str:
    """Which registry the runs go to, in words: the workspace's store, or the one MLFLOW_TRACKING_URI names."""
    uri = tracking_uri(ws)
    if uri == ws.mlflow_uri:
        return f"workspace store {uri}"
    return f"{'MLflow server' if is_server(uri) else 'store'} {shown_uri(uri)} (MLFLOW_TRACKING_URI)"


def registry_client(ws: Workspace) -> Any:
    """An MlflowClient on the registry the runs go to; None when there is none yet.

    With MLFLOW_TRACKING_URI set that is its server or store, always. Otherwise it is the
    workspace's SQLite store, and a workspace that never logged anything has none: reading
    it must not create an empty one.
    """
    if external_uri() is None and not ws.mlflow_db.is_file():
        return None
    from mlflow import MlflowClient

    uri = tracking_uri(ws)   # named to the client, not set for the process: a read creates no workspace folder
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def use_workspace(ws: Workspace) -> Any:
    import mlflow

    ws.ensure()
    uri = tracking_uri(ws)
    if uri == ws.mlflow_uri:
        _SET_HERE.add(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return mlflow


def ensure_experiment(ws: Workspace, name: str) -> str:
    """The experiment's id, creating it with its artifacts under the workspace the first time."""
    mlflow = use_workspace(ws)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None if external_uri() not in (None, ws.mlflow_uri) else (ws.mlflow_artifacts / name).as_uri()
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
