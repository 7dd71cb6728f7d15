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
parameter-server fields: components/training/step_metrics.py, step_metrics, names them all), with a
parameter-server strategy the artifact ps_stats.json, the loss curve and the exported folder. Training
never caches and never retries: a failed launch names the rank and its last lines.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmforge.components.config import PipelineConfig, as_config
from lmforge.components.data.taskdata import dataset_task
from lmforge.components.registry.basesource import resolve_base
from lmforge.components.tracking import start_run
from lmforge.components.training.job import Job, prepare_job
from lmforge.components.training.launcher import launch
from lmforge.components.training.run import job_lines, log_end, log_start, open_run, pinned_base, run_summary
from lmforge.components.training.step_metrics import step_metrics
from lmforge.components.workspace import Workspace
from lmforge.flows import quiet
from lmforge.flows.workspace_flow import workspace_flow

console = Console(stderr=True)


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
    tc = cfg.training
    ws = Workspace.from_env().ensure()
    run = open_run(ws, tc, config_name=cfg.name, resume=resume, dataset_version=ws.require_dataset())
    version, manifest = run.dataset_version, ws.manifest(run.dataset_version)
    if run.note:
        console.print(run.note)
    task = dataset_task(cfg.task, ws.dataset_dir(version))
    base = resolve_base(ws, tc.model.init, pinned=pinned_base(manifest)) if tc.model.init is not None else None
    # Checked before any MLflow run opens, so a bad layout or a missing checkpoint leaves no trace but its message.
    job = prepare_job(tc, shards=ws.training_shards(version), tokenizer=ws.dataset_dir(version) / "tokenizer",
                      run_dir=run.run_dir, resume=resume, base=base, task=task,
                      meta={"run_name": run.name, "dataset_version": version})
    for line in job_lines(job, task):
        console.print(line)
    mlflow_run = {"run_id": run.record["mlflow_run_id"]} if resume else {"run_name": run.name}
    with start_run(ws, "training", **mlflow_run) as tracked:
        record = run.save(tracked.info.run_id)  # the export records which MLflow run made it (from this record)
        log_start(job, tc, cfg.model_dump(mode="json"), manifest=manifest, dataset_version=version)
        launched = launch_task(job, tracked.info.run_id, job.start_step, tc.max_steps)
        steps = log_end(run.run_dir, title=run.name, seconds=launched["seconds"], log_model=tc.log_model_artifact)
    summary = run_summary(job, tc, steps, launched, name=run.name, dataset_version=version, resume=resume)
    return {"run": run.name, "export": str(run.run_dir / "export"), "mlflow_run_id": record["mlflow_run_id"],
            "summary": summary}
