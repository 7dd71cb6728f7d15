"""The train stage: the latest dataset's training shards to an exported Hugging Face model.

    lmforge run train                                   # configs/demo.toml: ZeRO-2 on 2 CPU ranks or every GPU, precision auto
    lmforge run train --resume                          # continue the newest run from its last complete checkpoint
    lmforge run train --set training.parallel.strategy=zero3 --set training.max_steps=50
    train_flow(cfg) -> {"run": name, "export": path, "summary": {...}}

One MLflow run per training run in experiment `training` (a resume continues it): the
resolved config, the generated DeepSpeed config, the dataset manifest hash, the base folder
and its content hash when training.model.init is set (also in the export's lmforge.json; for a
registry reference also the reference and the version the dataset pinned), per-step metrics from
rank 0's events (loss, lr, tokens/s, MFU, per-rank memory, and the MoE, pipeline-bubble and
parameter-server fields: components/training/report.py, step_metrics, names them all), with a
parameter-server strategy the artifact ps_stats.json, the loss curve and the exported folder. Training
never caches and never retries: a failed launch names the rank and its last lines.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmforge.components.basesource import resolve_base
from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.errors import UserError
from lmforge.components.runtime.resources import source_commit
from lmforge.components.taskdata import dataset_task
from lmforge.components.tracking import start_run
from lmforge.components.training.job import Job, prepare_job
from lmforge.components.training.launcher import launch
from lmforge.components.training.report import loss_curve_png, read_steps, step_metrics
from lmforge.components.training.strategies import applied
from lmforge.components.workspace import RUN_FILE, Workspace, atomic_write_json, sha256_file
from lmforge.flows import quiet
from lmforge.flows.workspace_flow import workspace_flow

console = Console(stderr=True)


def _pick_run(ws: Workspace, cfg: PipelineConfig, resume: bool) -> str:
    if cfg.training.run_name:
        return cfg.training.run_name
    if not resume:
        return f"{cfg.name}-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S')}"
    newest = ws.latest_run(exported=False)  # the newest started run, finished or not
    if newest is None:
        raise UserError("--resume", ws.runs, "holds no training run to resume", "Train without --resume to start fresh")
    return newest


def _flat(prefix: str, obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj
    return out


@task(name="train-launch", retries=0, cache_policy=NO_CACHE, persist_result=False)
def launch_task(job: Job, mlflow_run_id: str, start_step: int, max_steps: int) -> dict[str, Any]:
    """Run the deepspeed launcher; stream ranks; drive a progress bar and MLflow metrics from rank 0's steps."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient()
    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console) as bar:
        tid = bar.add_task("train", total=max_steps, completed=start_step, info="starting ranks")

        def on_event(ev: dict[str, Any]) -> None:
            bar.update(tid, completed=ev["step"],
                       info=f"loss {ev['loss']:.3f}  {ev['tokens_per_s']:.0f} tok/s  MFU {ev['mfu']:.1%}")
            ts = int(dt.datetime.now().timestamp() * 1000)
            client.log_batch(mlflow_run_id, metrics=[Metric(k, float(v), ts, ev["step"]) for k, v in step_metrics(ev).items()])

        def on_line(rank: int, line: str) -> None:
            # The ranks' own chatter shows under `lmforge -v`; quiet, the progress bar speaks for them
            # (a failure still quotes the failing rank's last lines, and every rank keeps its log).
            if line.strip() and quiet.verbose():
                bar.console.print(f"[dim]{'[launcher]' if rank < 0 else f'[rank{rank}]'}[/dim] {line}",
                                  markup=True, highlight=False, soft_wrap=True)

        result = launch(job.launch, on_line=on_line, on_event=on_event)
    return {"seconds": result.seconds, "backend": result.backend, "steps_logged": len(result.events)}


@workspace_flow(name="train", log_prints=True)
def train_flow(cfg: PipelineConfig | str | None = None, resume: bool = False) -> dict[str, Any]:
    cfg = as_config(cfg)
    ws = Workspace.from_env().ensure()
    version = ws.latest_dataset()
    if version is None:
        raise UserError("dataset", ws.datasets, "holds no complete dataset", "Run the data stage first: lmforge run data")
    name = _pick_run(ws, cfg, resume)
    run_dir = ws.run_dir(name)
    run_file = run_dir / RUN_FILE
    if resume and not run_file.is_file():
        raise UserError("--resume", run_dir, "is not a training run", "Train without --resume to start fresh")
    if not resume and run_dir.exists():
        # A fresh run under a reused name must not leave checkpoints a later --resume could mistake for its own.
        shutil.rmtree(run_dir)
    info = json.loads(run_file.read_text()) if resume else {
        "run_name": name, "dataset_version": version, "config_hash": config_hash(cfg.training),
        "created_at": dt.datetime.now(dt.UTC).isoformat()}
    if resume and info["dataset_version"] != version:
        console.print(f"note: resuming {name} on its own dataset {info['dataset_version']} (latest is {version})")
        version = info["dataset_version"]
    manifest = ws.dataset_dir(version) / "manifest.json"
    tc = cfg.training
    run_dir.mkdir(parents=True, exist_ok=True)
    # seq_len: the context the model was trained at; evaluation never scores positions beyond it.
    task = dataset_task(cfg.task, ws.dataset_dir(version))
    meta = {"dataset_version": version, "config_hash": config_hash(tc), "strategy": tc.parallel.strategy,
            "seq_len": tc.seq_len, "objective": tc.objective, "task": task.to_dict(),
            **({"lora": tc.lora.model_dump(mode="json")} if tc.lora.r else {}),
            "mlflow_run_id": info.get("mlflow_run_id"), "git_commit": source_commit(), "run_name": name}
    # A registry alias is not read again here: the data stage resolved it once and pinned the version in the
    # dataset's manifest (source.base), so the weights are the version whose tokenizer made this dataset, even
    # if the alias has moved since (and a resume, on its own dataset, gets its own version back).
    pin = json.loads(manifest.read_text()).get("source", {}).get("base") if manifest.exists() else None
    base = resolve_base(ws, tc.model.init, pinned=pin) if tc.model.init is not None else None
    # Checked before any MLflow run opens, so a bad layout or a missing checkpoint leaves no trace but its message.
    job = prepare_job(tc, shards=ws.training_shards(version), tokenizer=ws.dataset_dir(version) / "tokenizer",
                      run_dir=run_dir, resume=resume, meta=meta, base=base, task=task)
    console.print(f"task: {task.kind}" + (f", stop at {list(task.stop_strings)}" if task.stop_strings else ""))
    console.print(f"hardware: {job.hardware.summary()}")
    for note in job.notes:
        console.print(note)
    if job.base is not None:
        # Lineage: which folder, with which content, the run started from (hashed once, here).
        job = job.with_meta(base=job.base.lineage())
        pinned = f"{job.base.ref} = version {job.base.version} at " if job.base.ref else ""
        console.print(f"base: {pinned}{job.base.path} ({job.base.architecture}, sha256 {job.base.sha256[:12]})")
    run_kwargs = {"run_id": info["mlflow_run_id"]} if resume else {"run_name": name}
    with start_run(ws, "training", **run_kwargs) as run:
        import mlflow

        info["mlflow_run_id"] = run.info.run_id
        job = job.with_meta(mlflow_run_id=run.info.run_id)  # the export records which MLflow run made it
        atomic_write_json(run_file, info)
        attempt = job.launch.request.attempt
        if attempt == 0:
            mlflow.log_params({k: str(v)[:500] for k, v in _flat("", tc.model_dump(mode="json"), {}).items()})
            mlflow.log_dict(cfg.model_dump(mode="json"), "config/resolved_config.json")
        mlflow.log_dict(job.ds_config, f"config/deepspeed_config-{attempt}.json")
        manifest_sha = sha256_file(manifest) if manifest.exists() else ""
        mlflow.set_tags({"dataset_version": version, "dataset_manifest_sha256": manifest_sha,
                         "strategy": tc.parallel.strategy, "applied": ",".join(applied(job.ds_config)),
                         "layout": json.dumps(job.layout.to_dict()), "git_commit": meta["git_commit"] or "",
                         **{f"hardware.{k}": str(v)[:500] for k, v in job.hardware.to_dict().items()},
                         **{f"base.{k}": str(v)[:500] for k, v in (job.base.lineage() if job.base else {}).items()}})
        launched = launch_task(job, run.info.run_id, job.start_step, tc.max_steps)
        steps = read_steps(run_dir)
        curve = loss_curve_png(steps, run_dir / "loss_curve.png", title=name)
        mlflow.log_artifact(str(curve))
        if (run_dir / "ps_stats.json").is_file():  # the parameter-server family's final staleness histogram and bytes
            mlflow.log_artifact(str(run_dir / "ps_stats.json"))
        export = run_dir / "export"
        if tc.log_model_artifact:
            mlflow.log_artifacts(str(export), "model")
        first, last = steps[0], steps[-1]
        mlflow.log_metrics({"final_loss": last["loss"], "train_seconds": launched["seconds"]})
    summary = {"run": name, "strategy": tc.parallel.strategy, "applied": applied(job.ds_config), "dataset": version,
               "steps": last["step"], "resumed_from": job.start_step if resume else None,
               "first_loss": round(first["loss"], 4), "final_loss": round(last["loss"], 4),
               "tokens_per_s": round(sum(e["tokens_per_s"] for e in steps[-5:]) / min(5, len(steps)), 1),
               "mfu": round(sum(e["mfu"] for e in steps[-5:]) / min(5, len(steps)), 4),
               "seconds": round(launched["seconds"], 1), "backend": launched["backend"],
               "precision": job.hardware.precision.name, "objective": tc.objective, "lora_r": tc.lora.r}
    return {"run": name, "export": str(export), "mlflow_run_id": info["mlflow_run_id"], "summary": summary}
