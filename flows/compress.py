"""The compress stage: every enabled variant of the champion, evaluated, registered with lineage.

    lmforge run compress                        # prints the trade-off table; moves alias `compressed`
    compress_flow(load_config("configs/demo.toml"))   # {"summary": [rows], "compressed": "7" or None, ...}

Steps: download the parent (registry alias `compression.source_alias`, the champion by
default); check every enabled technique against it before any work; measure the parent;
then per variant: build (components/compression/), measure (same code as the parent),
load it through its MLflow pyfunc and through the serving runtime Triton runs
(components/registry/verify.py; the latter when deploy is enabled), and only if both
load it and agree token for token with lmforge, register it as a new version tagged
`parent_version`. A variant that fails is not registered; the reason is printed, tagged
on the MLflow run (`<variant>.not_registered`) and returned under `not_registered`. Finally the policy moves `compressed`
to the smallest variant within the quality tolerance, or removes it and says why none
qualifies. The MLflow experiment `compression` holds one run per stage run with every
variant's metrics, the registered models, the table (markdown, JSON) and the chart (PNG).
Nothing is cached: variants train, timings are measured anew, and the registry is state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from lmforge.components.compression.build import build_variant, needs_data, preflight
from lmforge.components.compression.measure import evaluate_variant
from lmforge.components.compression.record import (
    ALIAS,
    finite,
    log_refused,
    log_registered,
    log_start,
    log_tradeoff,
    result_lines,
    variant_tags,
    versioned_rows,
)
from lmforge.components.compression.tradeoff import choose_compressed
from lmforge.components.compression.variant import read_meta
from lmforge.components.config import PipelineConfig, as_config
from lmforge.components.errors import UserError
from lmforge.components.registry import current, download_model, register_model, resolve_version, set_alias, version_tags
from lmforge.components.registry.verify import verify_servable
from lmforge.components.sections.compression import CompressionConfig
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace
from lmforge.deploy.server import serve_venv
from lmforge.flows.workspace_flow import workspace_flow


def _retry_unless_user_error(task_: Any, task_run: Any, state: Any) -> bool:
    return not isinstance(state.result(raise_on_failure=False), UserError)


@task(name="compress-parent", retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_unless_user_error)
def parent_task(model_name: str, alias: str) -> tuple[str, str, dict[str, str]]:
    ws = Workspace.from_env()
    version = resolve_version(ws, model_name, alias)
    return version, str(download_model(ws, model_name, version)), version_tags(ws, model_name, version)


@task(name="compress-preflight")
def preflight_task(parent_dir: str, cfg: CompressionConfig, shard_dir: str | None) -> tuple[list[str], dict[str, str]]:
    return preflight(Path(parent_dir), cfg, shard_dir=Path(shard_dir) if shard_dir else None)


@task(name="compress-build")
def build_task(name: str, parent_dir: str, out_dir: str, cfg: CompressionConfig, shard_dir: str | None) -> str:
    return str(build_variant(name, Path(parent_dir), Path(out_dir), cfg, shard_dir=Path(shard_dir) if shard_dir else None))


@task(name="compress-evaluate", persist_result=False)
def evaluate_task(model_dir: str, dataset_dir: str, cfg: EvaluationConfig) -> dict[str, float]:
    return evaluate_variant(Path(model_dir), Path(dataset_dir), cfg)


@task(name="compress-verify", persist_result=False)
def verify_task(model_dir: str, serve_python: str | None) -> str | None:
    return verify_servable(Path(model_dir), serve_python=Path(serve_python) if serve_python else None)


@task(name="compress-register", retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_unless_user_error,
      persist_result=False)
def register_task(model_dir: str, cfg: PipelineConfig, metrics: dict[str, float], tags: dict[str, str],
                  parent_version: str) -> str:
    return register_model(Workspace.from_env(), cfg.registry, Path(model_dir), metrics=metrics, tags=tags,
                          parent_version=parent_version)


def variant_eval_config(cfg: PipelineConfig) -> EvaluationConfig:
    c = cfg.compression
    update = {k: v for k, v in {"max_examples": c.eval_max_examples, "bpc_max_docs": c.eval_bpc_docs}.items() if v is not None}
    return cfg.evaluation.model_copy(update=update)


@dataclass(frozen=True)
class Parent:
    """The model the variants are made from, and the dataset it was trained on (its records measure each variant)."""

    version: str
    dir: str
    tags: dict[str, str]
    dataset_version: str
    dataset_dir: str
    shard_dir: str | None      # the training shards, for the techniques that train (needs_data)
    out_root: Path             # <ws>/compression/v<version>/<variant>


def open_parent(ws: Workspace, cfg: PipelineConfig) -> Parent:
    """The parent (compression.source_alias, downloaded) and its dataset, which must be in this workspace."""
    version, folder, tags = parent_task(cfg.registry.model_name, cfg.compression.source_alias)
    dataset = ws.require_dataset(read_meta(Path(folder)).get("dataset_version") or tags.get("dataset_version"))
    shards = str(ws.training_shards(dataset)) if needs_data(cfg.compression) else None
    return Parent(version=version, dir=folder, tags=tags, dataset_version=dataset, dataset_dir=str(ws.dataset_dir(dataset)),
                  shard_dir=shards, out_root=ws.root / "compression" / f"v{version}")


def make_variant(name: str, parent: Parent, c: CompressionConfig, eval_cfg: EvaluationConfig,
                 serve_python: str | None) -> tuple[str, dict[str, float], str | None]:
    """Build, measure and verify one variant: its folder, its metrics, and why it must not be registered (or None)."""
    path = build_task.with_options(name=f"compress-build-{name}")(name, parent.dir, str(parent.out_root / name), c,
                                                                   parent.shard_dir)
    metrics = evaluate_task.with_options(name=f"compress-evaluate-{name}")(path, parent.dataset_dir, eval_cfg)
    return path, metrics, verify_task.with_options(name=f"compress-verify-{name}")(path, serve_python)


def register_variant(name: str, path: str, metrics: dict[str, float], parent: Parent, cfg: PipelineConfig) -> str:
    """A new version of the model, tagged with its technique and lineage (`parent_version`, the base's `base_*`)."""
    tags = variant_tags(name, cfg.compression, parent_version=parent.version, dataset_version=parent.dataset_version,
                        parent_tags=parent.tags)
    return register_task.with_options(name=f"compress-register-{name}")(path, cfg, finite(metrics), tags, parent.version)


def move_compressed(ws: Workspace, model_name: str, chosen: str | None, why: str, parent_version: str) -> None:
    """`compressed` to the chosen variant, or away (with the reason) when none qualifies."""
    if chosen is not None:
        set_alias(ws, model_name, ALIAS, chosen, reason=why)
    elif current(ws, model_name, ALIAS) is not None:
        set_alias(ws, model_name, ALIAS, None, reason=f"parent v{parent_version}: {why}")


@workspace_flow(name="compress", log_prints=True)
def compress_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    """Build, measure and register every enabled variant of the parent; move `compressed`."""
    cfg = as_config(cfg)
    c, model_name = cfg.compression, cfg.registry.model_name
    if not c.enabled:
        return {"summary": "compression disabled ([compression] enabled = false)", "compressed": None}
    ws = Workspace.from_env().ensure()
    parent = open_parent(ws, cfg)
    names, skipped = preflight_task(parent.dir, c, parent.shard_dir)
    eval_cfg = variant_eval_config(cfg)
    parent_metrics = evaluate_task.with_options(name="compress-evaluate-parent")(parent.dir, parent.dataset_dir, eval_cfg)
    variants: dict[str, dict[str, float]] = {}
    versions: dict[str, str] = {}
    rejected: dict[str, str] = dict(skipped)   # techniques this architecture has no parts for: never built
    serve_python = str(serve_venv() / "bin" / "python") if cfg.deploy.enabled else None
    with start_run(ws, "compression", run_name=f"compress-v{parent.version}") as mlrun:
        for line in log_start(c, parent_version=parent.version, dataset_version=parent.dataset_version, names=names,
                              parent_metrics=parent_metrics, skipped=skipped):
            print(line)
        for name in names:
            path, metrics, problem = make_variant(name, parent, c, eval_cfg, serve_python)
            if problem:
                rejected[name] = problem
                print(log_refused(name, problem))
                continue
            variants[name] = metrics
            versions[name] = register_variant(name, path, metrics, parent, cfg)
            print(log_registered(name, metrics, model=model_name, version=versions[name], parent_version=parent.version))
        rows = versioned_rows(parent_metrics, variants, versions, c, parent_version=parent.version)
        pick, why = choose_compressed(rows)
        chosen = versions[pick] if pick else None
        move_compressed(ws, model_name, chosen, why, parent.version)
        table = log_tradeoff(rows, rejected, chosen=chosen, why=why, model=model_name, parent_version=parent.version)
    print(*result_lines(table, model=model_name, parent_version=parent.version, dataset_version=parent.dataset_version,
                        chosen=chosen, pick=pick, why=why), sep="\n")
    return {"summary": rows, "compressed": chosen, "compressed_variant": pick, "policy": why,
            "parent_version": parent.version, "versions": versions, "not_registered": rejected,
            "mlflow_run_id": mlrun.info.run_id}
