"""A training run's bookkeeping: its folder and record, what it prints, logs to MLflow and returns as its summary.

    run = open_run(ws, cfg.training, config_name=cfg.name, resume=False, dataset_version=v)
    run.name, run.run_dir, run.dataset_version, run.note     # the note: a resume on its own, older dataset
    job_lines(job, task)                                       # task:, hardware: (precision and why), notes, base:
    log_start(job, cfg.training, resolved, manifest=ws.manifest(v), dataset_version=v, first=True)
    steps = log_end(run.run_dir, title=run.name, seconds=..., log_model=True)
    run_summary(job, cfg.training, steps, launched, dataset_version=v, name=run.name, resume=False)

flows/train.py calls these around its steps; the record (`<run>/run.json`, components/workspace.py RUN_FILE)
holds the run's name, dataset, config hash, creation time and MLflow run id, and is kept across resumes: the
export reads the MLflow run id from it (protocol.py export_meta).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.config import config_hash
from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.serving.task import Task
from lmforge.components.training.job import Job
from lmforge.components.training.strategies import applied
from lmforge.components.workspace import RUN_FILE, Workspace, atomic_write_json, sha256_file


@dataclass(frozen=True)
class RunStart:
    """The run folder a training run writes to, its record, and the dataset it trains on."""

    name: str
    run_dir: Path
    record: dict[str, Any]
    dataset_version: str
    note: str | None = None        # said when a resume keeps its own dataset over the latest

    def save(self, mlflow_run_id: str) -> dict[str, Any]:
        """Write the record with the MLflow run that tracks it (the export reads it from there)."""
        record = {**self.record, "mlflow_run_id": mlflow_run_id}
        atomic_write_json(self.run_dir / RUN_FILE, record)
        return record


def run_name(ws: Workspace, training: TrainingConfig, *, config_name: str, resume: bool) -> str:
    """training.run_name; else the newest started run to resume; else <config>-<UTC time>."""
    if training.run_name:
        return training.run_name
    if not resume:
        return f"{config_name}-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S')}"
    newest = ws.latest_run(exported=False)  # the newest started run, finished or not
    if newest is None:
        raise UserError("--resume", ws.runs, "holds no training run to resume", "Train without --resume to start fresh")
    return newest


def open_run(ws: Workspace, training: TrainingConfig, *, config_name: str, resume: bool,
             dataset_version: str) -> RunStart:
    """The run's folder, ready: a resume keeps its record and its own dataset; a fresh run starts from an empty one."""
    name = run_name(ws, training, config_name=config_name, resume=resume)
    run_dir = ws.run_dir(name)
    if resume:
        if not (run_dir / RUN_FILE).is_file():
            raise UserError("--resume", run_dir, "is not a training run", "Train without --resume to start fresh")
        record = json.loads((run_dir / RUN_FILE).read_text())
        own = record["dataset_version"]
        note = f"note: resuming {name} on its own dataset {own} (latest is {dataset_version})" \
            if own != dataset_version else None
        return RunStart(name=name, run_dir=run_dir, record=record, dataset_version=own, note=note)
    if run_dir.exists():
        # A fresh run under a reused name must not leave checkpoints a later --resume could mistake for its own.
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    record = {"run_name": name, "dataset_version": dataset_version, "config_hash": config_hash(training),
              "created_at": dt.datetime.now(dt.UTC).isoformat()}
    return RunStart(name=name, run_dir=run_dir, record=record, dataset_version=dataset_version)


def pinned_base(manifest: Path) -> str | None:
    """The registry version the data stage pinned for training.model.init (the manifest's source.base).

    A registry alias is not read again when training: the data stage resolved it once, so the weights are the
    version whose tokenizer made this dataset even if the alias has moved since (and a resume, on its own
    dataset, gets its own version back)."""
    return json.loads(manifest.read_text()).get("source", {}).get("base") if manifest.is_file() else None


def job_lines(job: Job, task: Task) -> list[str]:
    """What the flow prints before launch: the task, the hardware (precision and why), the job's notes, the base."""
    lines = [f"task: {task.kind}" + (f", stop at {list(task.stop_strings)}" if task.stop_strings else ""),
             f"hardware: {job.hardware.summary()}", *job.notes]
    if job.base is not None:
        pinned = f"{job.base.ref} = version {job.base.version} at " if job.base.ref else ""
        lines.append(f"base: {pinned}{job.base.path} ({job.base.architecture}, sha256 {job.base.sha256[:12]})")
    return lines


def flat(prefix: str, obj: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """A nested dict as dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj
    return out


def run_params(training: TrainingConfig) -> dict[str, str]:
    """The [training] section as MLflow params (dotted keys, values cut to MLflow's 500 characters)."""
    return {k: str(v)[:500] for k, v in flat("", training.model_dump(mode="json")).items()}


def run_tags(job: Job, training: TrainingConfig, *, dataset_version: str, manifest: Path) -> dict[str, str]:
    """The run's MLflow tags: dataset and its manifest hash, strategy, layout, hardware, base lineage, commit."""
    meta = job.launch.request.meta
    return {"dataset_version": dataset_version, "dataset_manifest_sha256": sha256_file(manifest) if manifest.exists() else "",
            "strategy": training.parallel.strategy, "applied": ",".join(applied(job.ds_config)),
            "layout": json.dumps(job.layout.to_dict()), "git_commit": meta.get("git_commit") or "",
            **{f"hardware.{k}": str(v)[:500] for k, v in job.hardware.to_dict().items()},
            **{f"base.{k}": str(v)[:500] for k, v in meta.get("base", {}).items()}}


def log_start(job: Job, training: TrainingConfig, resolved: dict[str, Any], *, manifest: Path,
              dataset_version: str) -> None:
    """Into the active MLflow run: params and the resolved config on the first attempt, this attempt's DeepSpeed
    config, the tags."""
    import mlflow

    attempt = job.launch.request.attempt
    if attempt == 0:
        mlflow.log_params(run_params(training))
        mlflow.log_dict(resolved, "config/resolved_config.json")
    mlflow.log_dict(job.ds_config, f"config/deepspeed_config-{attempt}.json")
    mlflow.set_tags(run_tags(job, training, dataset_version=dataset_version, manifest=manifest))


def log_end(run_dir: Path, *, title: str, seconds: float, log_model: bool) -> list[dict[str, Any]]:
    """Into the active MLflow run: the loss curve, the parameter-server stats, the model (with log_model), the final
    metrics; returns rank 0's logged steps."""
    import mlflow

    from lmforge.components.training.step_metrics import loss_curve_png, read_steps

    steps = read_steps(run_dir)
    mlflow.log_artifact(str(loss_curve_png(steps, run_dir / "loss_curve.png", title=title)))
    if (run_dir / "ps_stats.json").is_file():  # the parameter-server family's final staleness histogram and bytes
        mlflow.log_artifact(str(run_dir / "ps_stats.json"))
    if log_model:
        mlflow.log_artifacts(str(run_dir / "export"), "model")
    mlflow.log_metrics({"final_loss": steps[-1]["loss"], "train_seconds": seconds})
    return steps


def run_summary(job: Job, training: TrainingConfig, steps: list[dict[str, Any]], launched: dict[str, Any], *,
                name: str, dataset_version: str, resume: bool) -> dict[str, Any]:
    """The stage's summary: the losses, the throughput of the last five steps, where and how it ran."""
    first, last, tail = steps[0], steps[-1], steps[-5:]
    return {"run": name, "strategy": training.parallel.strategy, "applied": applied(job.ds_config),
            "dataset": dataset_version, "steps": last["step"], "resumed_from": job.start_step if resume else None,
            "first_loss": round(first["loss"], 4), "final_loss": round(last["loss"], 4),
            "tokens_per_s": round(sum(e["tokens_per_s"] for e in tail) / len(tail), 1),
            "mfu": round(sum(e["mfu"] for e in tail) / len(tail), 4),
            "seconds": round(launched["seconds"], 1), "backend": launched["backend"],
            "precision": job.hardware.precision.name, "objective": training.objective, "lora_r": training.lora.r}
