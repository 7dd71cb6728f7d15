"""The monitor stage: profile the request log against the training reference, decide, report, retrain on drift.

    lmforge run monitor                         # the served version's traffic against its own reference
    monitor_flow(load_config("configs/demo.toml"))   # {"decision", "report", "summary", ...}

The reference is the served version's own (the deployment's serving alias, `production` or
`production-<deploy.name>`: its dataset, its tokenizer), and only that version's rows of the
request log are read. The dataset is this workspace's, or the copy that travelled with the
version in the registry (components/registry/travel.py) when another workspace trained it.
Monitoring decides (monitoring/), this flow acts: on "drift: retrain", outside the
cool-down and when no retrain holds the lock, it starts retraining, the lifecycle of
flows/retrain.py: the `monitoring.training_deployment` (retrain/on-demand) with
`run_deployment` when a Prefect server is configured (PREFECT_API_URL), or
flows.retrain.retrain_flow directly in the embedded default. Every trigger is recorded in
<workspace>/monitoring/triggers.jsonl; the report and its summary go to
<workspace>/monitoring/reports/<time>/ and to the MLflow experiment `monitoring`.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.states import Cancelled

from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.errors import UserError
from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.components.serving.records import read_records
from lmforge.components.serving.requestlog import RequestLog
from lmforge.components.serving.task import Task
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace, atomic_write_text, sha256_tree
from lmforge.flows import prefect_env
from lmforge.flows.lateness import too_late
from lmforge.flows.workspace_flow import workspace_flow
from lmforge.monitoring.assess import Assessment, assess
from lmforge.monitoring.profiles import build_reference, load_reference, reference_rows, save_reference
from lmforge.monitoring.report import write_report
from lmforge.monitoring.served import Served, served_model, served_rare_ids, serving_featurizer
from lmforge.monitoring.trigger import STARTED, plan_trigger, read_triggers, record_trigger

# The options that change the reference profile (the calibration has its own key).
REFERENCE_KEYS = ("reference_split", "reference_max_rows", "seed")


def reference_folder(ws: Workspace, served: Served, cfg: MonitoringConfig, rare_min_count: int) -> Path:
    key = config_hash(MonitoringConfig(**{k: getattr(cfg, k) for k in REFERENCE_KEYS}))
    tok = sha256_tree(served.model_dir)[:8]
    return ws.monitoring / "reference" / f"{served.dataset_version}-{tok}-{key}-rare{rare_min_count}"


@task(name="monitor-reference", cache_policy=INPUTS + TASK_SOURCE, persist_result=True,
      retries=1, retry_delay_seconds=2)
def reference_task(ws_root: str, served: Served, cfg: MonitoringConfig, rare_min_count: int) -> str:
    """Build and save the reference profile of the served version (its dataset, its tokenizer; once per version)."""
    ws = Workspace(Path(ws_root))
    folder = reference_folder(ws, served, cfg, rare_min_count)
    if (folder / "reference.json").is_file():
        return str(folder)
    version = served.dataset_version
    records = served.records / f"{cfg.reference_split}.jsonl"
    if not records.is_file():
        raise UserError("monitoring.reference_split", cfg.reference_split, f"has no records in {served.records}",
                        "Re-run the data stage (lmforge run data) or choose another split")
    kind = Task.load(served.model_dir)   # the served model's task says what a prompt of this dataset is
    held_out = [(r.module, ex[0]) for r in read_records(records) if (ex := kind.example(r)) is not None]
    prompts = [kind.prompt_as_text(p) for _, p in held_out]
    shards = served.travelled or ws.training_shards(version)
    rare_ids = served_rare_ids(ws, served, rare_min_count)
    featurize = serving_featurizer(served.model_dir, rare_ids)   # the served model's tokenizer, as serving uses
    rows = reference_rows(prompts, featurize, [m for m, _ in held_out])
    if len(rows) < 2 * 10:
        raise UserError("monitoring.reference_split", cfg.reference_split,
                        f"has only {len(rows)} prompts in dataset {version}", "Use a larger dataset or another split")
    ref = build_reference(rows, cfg)
    meta = {"dataset_version": version, "split": cfg.reference_split, "prompts": len(prompts), "task": kind.kind,
            "rare_token_min_count": rare_min_count, "rare_ids": len(rare_ids), "shards": str(shards),
            "served_version": served.version, "dataset_source": served.source, "model_sha256": sha256_tree(served.model_dir),
            "created_at": datetime.now(timezone.utc).isoformat(),
            "options": {k: getattr(cfg, k) for k in REFERENCE_KEYS}}
    save_reference(folder, ref, meta)
    with start_run(Workspace(Path(ws_root)), "monitoring", run_name=f"reference-{version[:8]}"):
        import mlflow

        mlflow.set_tags({"stage": "monitor", "kind": "reference", "dataset_version": version,
                         "served_version": served.version})
        mlflow.log_params({"split": cfg.reference_split, "rare_token_min_count": rare_min_count, **meta["options"]})
        mlflow.log_metrics({"reference_rows": len(ref.rows), "reference_modules": int(ref.rows["module"].nunique())})
        mlflow.log_artifacts(str(folder), artifact_path="reference")
    return str(folder)


@task(name="monitor-assess", persist_result=False)
def assess_task(ws_root: str, ref_folder: str, cfg: MonitoringConfig, now: datetime, model: str,
                version: str) -> Assessment:
    """Drift of `model` version `version`'s request-log rows (no other version's) against its reference."""
    ws = Workspace(Path(ws_root))
    ref = load_reference(Path(ref_folder))
    return assess(ref, Path(ref_folder), RequestLog(ws.requests), cfg, now=now, model=model, version=version,
                  windows_folder=ws.monitoring / "windows" / f"{model}-v{version}")


def start_retraining(cfg: PipelineConfig, reason: str) -> dict[str, Any]:
    """Start the retrain deployment on a Prefect server, or flows.retrain.retrain_flow here in the embedded default.

    Retraining is the lifecycle (data with the new domain, train, evaluate and gate, compress,
    deploy: flows/retrain.py). A retrain that is already running (its lock is held) is not
    started again: {"started": False, "busy": "..."}.
    """
    from prefect.settings import PREFECT_API_URL

    from lmforge.flows.retrain import BUSY, retrain_busy, retrain_flow

    busy = retrain_busy(Workspace.from_env())
    if busy:
        return {"started": False, "busy": busy}
    name = cfg.monitoring.training_deployment
    api_url = PREFECT_API_URL.value()   # the environment's, or a `temporary_settings` override
    if api_url and not prefect_env.is_temporary(api_url):   # a command's temporary server holds no deployments
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        try:
            run = run_deployment(name=name, parameters={"cfg": cfg.model_dump(mode="json"), "reason": reason},
                                 timeout=0, tags=["lmforge", "trigger:drift"])
        except ObjectNotFound:
            raise UserError("monitoring.training_deployment", name,
                            f"is not a deployment on the Prefect server at {api_url}",
                            "Register the deployments (lmforge prefect deploy) or set training_deployment") from None
        return {"started": True, "via": "deployment", "deployment": name, "flow_run_id": str(run.id),
                "flow_run_name": run.name}
    result = retrain_flow(cfg, reason=reason)
    if result["outcome"] == BUSY:   # another process took the lock between the check and the flow
        return {"started": False, "busy": result["reason"]}
    return {"started": True, "via": "flow", "flow": "retrain", "result": result}


def _summary(cfg: PipelineConfig, version: str, ref_meta: dict[str, Any], a: Assessment, trigger: dict[str, Any],
             now: datetime) -> dict[str, Any]:
    m = cfg.monitoring
    return {
        "created_at": now.isoformat(), "decision": trigger["decision"], "window": a.window,
        "drift": a.result.to_dict(), "tests": dict(m.columns),
        "calibration": a.calibration.to_dict() if a.calibration else None,
        "log": {"requests_read": a.requests_read, "corrupt_lines_skipped": a.corrupt_lines,
                "window_minutes": m.window_minutes, "decision_windows": m.decision_windows},
        "reference": {"dataset_version": version, "served_version": ref_meta.get("served_version"),
                      "dataset_source": ref_meta.get("dataset_source", "workspace"),
                      "split": m.reference_split, "rows": ref_meta["rows"], "modules": ref_meta["modules"]},
        "trigger": trigger,
    }


def _log_mlflow(ws: Workspace, summary: dict[str, Any], report_dir: Path) -> str:
    with start_run(ws, "monitoring", run_name=f"monitor-{summary['created_at'][:16]}") as run:
        import mlflow

        drift = summary["drift"]
        mlflow.set_tags({"stage": "monitor", "decision": summary["decision"],
                         "action": summary["trigger"]["action"],
                         "dataset_version": summary["reference"]["dataset_version"]})
        metrics = {"rows": drift["rows"], "corrupt_lines_skipped": summary["log"]["corrupt_lines_skipped"],
                   "drifted_columns": len(drift["drifted"]), "drift": float(drift["status"] == "drift")}
        if summary["calibration"]:
            metrics["aa_false_alarm_rate"] = summary["calibration"]["false_alarm_rate"]
        for column, c in drift["columns"].items():
            if c["score"] is not None:
                metrics[f"score.{column}"] = c["score"]
            if c["threshold"] is not None:
                metrics[f"threshold.{column}"] = c["threshold"]
        mlflow.log_metrics(metrics)
        mlflow.log_artifacts(str(report_dir), artifact_path="drift_report")
        return run.info.run_id


def served_reference(ws: Workspace, served: Served, cfg: PipelineConfig) -> tuple[str, dict[str, Any]]:
    """The served version's reference profile (cached; rebuilt when its folder was removed since) and its meta."""
    ref_folder = reference_task(str(ws.root), served, cfg.monitoring, cfg.deploy.rare_token_min_count)
    if not (Path(ref_folder) / "reference.json").is_file():  # a cached result whose folder was removed since
        ref_folder = reference_task.with_options(refresh_cache=True)(str(ws.root), served, cfg.monitoring,
                                                                     cfg.deploy.rare_token_min_count)
    return ref_folder, json.loads((Path(ref_folder) / "reference.json").read_text())


def act_on(ws: Workspace, cfg: PipelineConfig, a: Assessment, now: datetime) -> dict[str, Any]:
    """The trigger's plan for this assessment, carried out (a retrain started on drift outside the cool-down) and
    recorded unless there was nothing to do; returns the trigger record."""
    plan = plan_trigger(a.result.status, history=read_triggers(ws.monitoring), cfg=cfg.monitoring, now=now)
    trigger: dict[str, Any] = plan.to_record(window=a.window, drifted=a.result.drifted, started=False)
    if plan.action == STARTED:
        try:
            trigger.update(start_retraining(cfg, reason=f"{plan.decision}: {a.result.reason}"))
            if trigger.get("busy"):
                trigger["action"] = "busy"   # not a start: the cool-down does not count it
        except Exception as e:
            trigger.update(started=False, error=f"{type(e).__name__}: {e}")
            record_trigger(ws.monitoring, trigger)
            raise
    if plan.action != "none":
        record_trigger(ws.monitoring, trigger)
    return trigger


@workspace_flow(name="monitor", log_prints=True)
def monitor_flow(cfg: PipelineConfig | str | None = None, max_lateness_minutes: float | None = None,
                 now: datetime | None = None) -> Any:
    """Profiles, drift, report; on drift outside the cool-down, retraining. Returns {"decision", "report", "summary"}."""
    reason = too_late(max_lateness_minutes)
    if reason:
        return Cancelled(message=reason)
    cfg = as_config(cfg)
    m = cfg.monitoring
    ws = Workspace.from_env().ensure()
    if not m.enabled:
        return {"decision": None, "report": None, "summary": "monitoring disabled (monitoring.enabled=false)"}
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise UserError("now", now, "has no time zone", "Pass a timezone-aware datetime (UTC)")
    served = served_model(ws, cfg)
    version = served.dataset_version

    ref_folder, ref_meta = served_reference(ws, served, cfg)
    a = assess_task(str(ws.root), ref_folder, m, now, cfg.deploy.model_name, served.version)
    trigger = act_on(ws, cfg, a, now)
    summary = _summary(cfg, version, ref_meta, a, trigger, now)
    report_dir = ws.monitoring / "reports" / now.strftime("%Y%m%dT%H%M%S")
    paths = write_report(report_dir, summary, reference=load_reference(Path(ref_folder)).view, current=a.current,
                         over_time=a.over_time)
    run_id = _log_mlflow(ws, summary, report_dir)
    atomic_write_text(ws.monitoring / "reports" / "LATEST", report_dir.name + "\n")

    brief = {"decision": summary["decision"], "rows": a.result.rows, "drifted": a.result.drifted,
             "action": trigger["action"], "corrupt_lines_skipped": a.corrupt_lines,
             "false_alarm_rate": a.calibration.false_alarm_rate if a.calibration else None}
    print(f"monitor: {summary['decision']} ({a.result.reason}); trigger: {trigger['action']}; report {paths['html']}")
    return {"decision": summary["decision"], "report": paths["html"], "summary": brief, "reason": a.result.reason,
            "trigger": {k: v for k, v in trigger.items() if k != "result"}, "retrain": trigger.get("result"),
            "mlflow_run_id": run_id,
            "dataset_version": version, "dataset_source": served.source, "served_version": served.version}
