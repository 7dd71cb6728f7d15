"""The stages and the end-to-end pipeline that chains them.

    lmforge run data            # one stage: stage_flow("data")
    lmforge run all             # every stage, in order, as subflows: pipeline_flow

pipeline_flow calls each stage's flow in turn, in the order of components/stages.py's
STAGES. Compress runs after the gate, and is skipped when the gate declined this run's
model (the champion, compressed when it was promoted, has not changed).
The drift loop's retraining (data with the new domain through deploy) is flows/retrain.py.

Stages hand each other nothing but the workspace: each reads its inputs from the
workspace's pointers (the latest dataset, the latest training run, registry aliases)
and returns a small JSON-able summary. So any stage can be re-run on its own, and a
pipeline re-run after a failure finds the finished deterministic stages in Prefect's
persisted results (cached), and training continues from its last complete checkpoint.

The stage flows are imported where they are called, not with this module: importing all
seven takes seconds, and `lmforge run <stage>` imports only its own.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from typing import Any

from prefect.states import Cancelled

from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.registry.gate import production_alias
from lmforge.components.stages import FLOWS, STAGES
from lmforge.components.workspace import Workspace
from lmforge.flows.lateness import too_late
from lmforge.flows.workspace_flow import workspace_flow


def stage_flow(name: str) -> Any:
    """The flow of one stage (a name in STAGES), from the stage table; only that stage's module is imported."""
    if name not in FLOWS:
        raise KeyError(f"{name!r} is not a stage (the stages: {', '.join(STAGES)})")
    module, function = FLOWS[name].split(":")
    return getattr(importlib.import_module(module), function)


@workspace_flow(name="pipeline", log_prints=True)
def pipeline_flow(cfg: PipelineConfig | str | None = None, resume: bool = False,
                  max_lateness_minutes: float | None = None) -> Any:
    """Run every stage in order; return per-stage summaries and wall times.

    A re-run after an interruption resumes: the data stages come from Prefect's cache, and
    training continues from its last complete checkpoint when the newest run stopped before
    exporting with this same training config and dataset (`resume` forces it).
    """
    reason = too_late(max_lateness_minutes)
    if reason:
        return Cancelled(message=reason)
    cfg = as_config(cfg)
    stages: dict[str, Any] = {}

    def run(name: str, flow: Callable[..., Any], **kwargs: Any) -> None:
        """Run one stage's flow, or skip it with the reason (no model to start from, the champion unchanged); record it."""
        start = time.perf_counter()
        missing = missing_model(Workspace.from_env(), cfg, name) or unchanged_champion(stages, name)
        result = {"summary": missing} if missing else flow(cfg, **kwargs)
        stages[name] = {"seconds": round(time.perf_counter() - start, 1), "result": result}

    for name in STAGES:   # compress runs after the gate; skipped when it declined this run's model (unchanged_champion)
        resumed = {"resume": resume or interrupted_run(Workspace.from_env(), cfg) is not None} if name == "train" else {}
        run(name, stage_flow(name), **resumed)
    return {"config": cfg.name, "stages": stages, "links": run_links()}


def interrupted_run(ws: Workspace, cfg: PipelineConfig) -> str | None:
    """The newest training run if it stopped before exporting, on this config and dataset, with a complete checkpoint."""
    from lmforge.components.training.checkpoint import complete_checkpoints
    from lmforge.components.workspace import EXPORT_MARKER, RUN_FILE

    newest = ws.latest_run(exported=False)
    if newest is None:
        return None
    run_dir = ws.run_dir(newest)
    if (run_dir / EXPORT_MARKER).exists():
        return None
    info = json.loads((run_dir / RUN_FILE).read_text())
    if info.get("config_hash") != config_hash(cfg.training) or info.get("dataset_version") != ws.latest_dataset():
        return None
    return run_dir.name if complete_checkpoints(run_dir / "checkpoints") else None


def missing_model(ws: Workspace, cfg: PipelineConfig, stage: str) -> str | None:
    """Why a stage that starts from a registry alias has nothing to start from (the gate promoted no model yet)."""
    alias = {"compress": cfg.compression.source_alias, "deploy": cfg.deploy.alias,
             "monitor": production_alias(cfg.deploy.name)}.get(stage)
    if alias is None:
        return None
    from lmforge.components.registry.aliases import current

    if current(ws, cfg.registry.model_name, alias) is not None:
        return None
    if stage == "monitor":   # monitoring compares the served version's traffic with its own reference
        return (f"skipped: no {cfg.registry.model_name}@{alias} yet (nothing serves on deployment "
                f"{cfg.deploy.name!r}: its deploy stage sets it)")
    return (f"skipped: no {cfg.registry.model_name}@{alias} in the registry yet "
            f"(the evaluate stage promotes a model only when it passes the gate)")


def unchanged_champion(done: dict[str, Any], stage: str) -> str | None:
    """Why compress has nothing new to do: this run's gate declined, so the champion (already compressed) is unchanged."""
    if stage != "compress":
        return None
    decision = ((done.get("evaluate") or {}).get("result") or {}).get("decision")
    if not isinstance(decision, dict) or decision.get("promote", True):
        return None
    return (f"skipped: the gate declined v{decision.get('candidate_version')}, so champion "
            f"v{decision.get('champion_version')} is unchanged (compress it on demand: lmforge run compress)")


def run_links() -> dict[str, str]:
    """Where to look next: the Prefect flow run and the MLflow store."""
    from prefect.runtime import flow_run

    from lmforge.components.tracking import shown_uri, tracking_uri

    links = {"mlflow": f"{shown_uri(tracking_uri(Workspace.from_env()))}  (open it: lmforge ui mlflow)"}
    run_id = flow_run.get_id()
    if run_id:
        links["prefect_flow_run"] = f"{flow_run.get_name()} ({run_id}; lmforge ui prefect -> Runs)"
    return links
