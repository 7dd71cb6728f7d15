"""The stages and the end-to-end pipeline that chains them.

    lmforge run data            # one stage
    lmforge run all             # every stage that exists, in order, as subflows

Stages hand each other nothing but the workspace: each reads its inputs from the
workspace's pointers (the latest dataset, the latest training run, registry aliases)
and returns a small JSON-able summary. So any stage can be re-run on its own, and a
pipeline re-run after a failure finds the finished deterministic stages in Prefect's
persisted results (cached), and training continues from its last complete checkpoint.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from typing import Any

from prefect import flow
from prefect.states import Cancelled

from components.config import PipelineConfig, as_config
from flows.lateness import too_late

# name -> "module:flow"; a stage is present when its module is.
STAGES: dict[str, str] = {
    "data": "flows.data:data_flow",
    "features": "flows.features:features_flow",
    "train": "flows.train:train_flow",
    "evaluate": "flows.evaluate:evaluate_flow",
    "compress": "flows.compress:compress_flow",
    "deploy": "flows.deploy:deploy_flow",
    "monitor": "flows.monitor:monitor_flow",
}


def available_stages() -> list[str]:
    return [name for name, target in STAGES.items() if importlib.util.find_spec(target.split(":")[0]) is not None]


def stage_flow(name: str) -> Any:
    module, attr = STAGES[name].split(":")
    return getattr(importlib.import_module(module), attr)


@flow(name="pipeline", log_prints=True)
def pipeline_flow(cfg: PipelineConfig | str | None = None, resume: bool = False,
                  max_lateness_minutes: float | None = None) -> Any:
    """Run every available stage in order; return per-stage summaries and wall times.

    `resume` lets training continue from the last complete checkpoint of an interrupted run;
    the data stages resume through Prefect's cache.
    """
    reason = too_late(max_lateness_minutes)
    if reason:
        return Cancelled(message=reason)
    cfg = as_config(cfg)
    summary: dict[str, Any] = {"config": cfg.name, "stages": {}}
    for name in available_stages():
        start = time.perf_counter()
        kwargs = {"resume": resume} if name == "train" else {}
        result = stage_flow(name)(cfg, **kwargs)
        summary["stages"][name] = {"seconds": round(time.perf_counter() - start, 1), "result": result}
    summary["links"] = run_links()
    return summary


def run_links() -> dict[str, str]:
    """Where to look next: the Prefect flow run and the MLflow store."""
    from prefect.runtime import flow_run

    from components.tracking import tracking_uri
    from components.workspace import Workspace

    links = {"mlflow": f"{tracking_uri(Workspace.from_env())}  (open it: lmforge ui mlflow)"}
    run_id = flow_run.get_id()
    if run_id:
        links["prefect_flow_run"] = f"{flow_run.get_name()} ({run_id}; lmforge ui prefect -> Runs)"
    return links
