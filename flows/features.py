"""The features stage: Feast apply, materialise, training-set selection; Qdrant index and near-duplicates.

    lmforge run features                       # on the latest dataset
    features_flow(load_config("configs/demo.toml"))   # or a TOML path, as Prefect deployments pass it

Reads the latest dataset; writes <dataset>/selected/ (the shards training reads),
the counts into the dataset's report.json, the Feast registry and online store under
<workspace>/features, and one Qdrant collection per dataset version.

Nothing here is cached: every task writes into a store (registry, online store, Qdrant,
the dataset folder), and a cache hit would skip that write. All of them are idempotent,
so a re-run converges to the same state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import task

from lmforge.components.config import PipelineConfig, as_config
from lmforge.components.errors import UserError
from lmforge.components.features.offline import publish_offline
from lmforge.components.features.selection import clear_selection, select_training_set, update_report
from lmforge.components.features.store import apply_repo, materialize
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.tracking import start_run
from lmforge.components.vectors.embed import make_embedder
from lmforge.components.vectors.index import close_clients, index_dataset
from lmforge.components.workspace import Workspace
from lmforge.flows.workspace_flow import workspace_flow


def _retry_unless_user_error(task_: Any, task_run: Any, state: Any) -> bool:
    """Retry I/O hiccups; a UserError (bad config, missing dataset, held folder) fails at once."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # the failure cannot be read back: retrying is the safe default
        return True
    return not isinstance(error, UserError)


_io = {"retries": 2, "retry_delay_seconds": 3, "retry_condition_fn": _retry_unless_user_error}


@task(name="feast-apply", **_io)
def apply_task(ws: Workspace, cfg: FeaturesConfig, version: str) -> dict[str, Any]:
    published = publish_offline(ws, version)
    return {**apply_repo(ws, cfg), "offline": published}


@task(name="feast-materialize", **_io)
def materialize_task(ws: Workspace, cfg: FeaturesConfig, since: str | None) -> dict[str, Any]:
    return materialize(ws, cfg, since=datetime.fromisoformat(since) if since else None)


@task(name="feast-select")
def select_task(ws: Workspace, cfg: FeaturesConfig, version: str) -> dict[str, Any]:
    return select_training_set(ws, version, cfg)


@task(name="qdrant-index", **_io)
def index_task(ws: Workspace, cfg: VectorsConfig, version: str) -> dict[str, Any]:
    embedder = make_embedder(cfg)   # named in the report, the summary and MLflow: MiniLM, or hashing and why
    try:
        report = index_dataset(ws, version, cfg, embedder=embedder)
    finally:
        close_clients()  # release the local-mode folder lock for other processes
    report["embedder_source"] = embedder.source
    update_report(ws.dataset_dir(version), "semantic_near_duplicates", {**report["near_duplicates"],
                                                                       "collection": report["collection"],
                                                                       "embedder": report["embedder"],
                                                                       "embedder_source": embedder.source,
                                                                       "dim": report["dim"]})
    return report


@workspace_flow(name="features", log_prints=True)
def features_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    """Apply, materialise and select (Feast); index and report near-duplicates (Qdrant); on the latest dataset."""
    cfg = as_config(cfg)
    ws = Workspace.from_env()
    version = ws.require_dataset()
    result: dict[str, Any] = {"dataset_version": version}
    summary = {"selected": None, "rejected": None, "missing_features": None, "indexed": None, "semantic_near_dups": None}
    if cfg.features.enabled:
        result["apply"] = apply_task(ws, cfg.features, version)
        result["materialize"] = materialize_task(ws, cfg.features, result["apply"]["offline"]["min_event"])
        selection = select_task(ws, cfg.features, version)
        result["selection"] = {k: v for k, v in selection.items() if k != "shards"}
        summary.update(selected=selection["selected"], rejected=selection["rejected"],
                       missing_features=selection["missing_features"])
    elif clear_selection(ws, version):
        print("features disabled: removed the previous selection; training reads the whole train split")
    if cfg.vectors.enabled:
        index = index_task(ws, cfg.vectors, version)
        dups = index["near_duplicates"]
        result["index"] = {k: v for k, v in index.items() if k != "near_duplicates"}
        summary.update(indexed=index["points"], semantic_near_dups=dups["pairs_found"], embedder=index["embedder"])
        print(f"features: embedded with {index['embedder_source']} into {index['collection']}")
    result["summary"] = summary
    _log(ws, version, summary, result.get("index"))
    print(f"features: {summary}")
    return result


def _log(ws: Workspace, version: str, summary: dict[str, Any], index: dict[str, Any] | None) -> None:
    with start_run(ws, "data", run_name=f"features-{version[:8]}"):
        import mlflow

        mlflow.set_tags({"stage": "features", "dataset_version": version})
        if index is not None:   # which embedder made the collection's vectors
            mlflow.set_tags({"embedder": index["embedder"], "qdrant_collection": index["collection"]})
            mlflow.log_params({"vectors.embedder": index["embedder"], "vectors.embedder_source": index["embedder_source"],
                               "vectors.dim": index["dim"]})
        mlflow.log_metrics({k: float(v) for k, v in summary.items() if isinstance(v, (int, float))})
        for name in ("report.json", "selected/selection.json"):
            path = ws.dataset_dir(version) / name
            if path.is_file():
                mlflow.log_artifact(str(path), artifact_path="features")
