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

import tempfile
from pathlib import Path
from typing import Any

from prefect import task

from lmforge.components.compression.build import TECHNIQUES, build_variant, needs_data, preflight
from lmforge.components.compression.measure import evaluate_variant
from lmforge.components.compression.tradeoff import choose_compressed, tradeoff_chart, tradeoff_markdown, tradeoff_rows
from lmforge.components.compression.variant import read_meta
from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.errors import UserError
from lmforge.components.registry import current, download_model, register_model, resolve_version, set_alias, version_tags
from lmforge.components.registry.verify import verify_servable
from lmforge.components.sections.compression import CompressionConfig
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace, atomic_write_json, atomic_write_text
from lmforge.deploy.server import serve_venv
from lmforge.flows.workspace_flow import workspace_flow

ALIAS = "compressed"


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


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers among `metrics` that MLflow can log (a bool, such as device_fallback, is a tag, not a metric)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


@workspace_flow(name="compress", log_prints=True)
def compress_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    """Build, measure and register every enabled variant of the parent; move `compressed`."""
    cfg = as_config(cfg)
    c = cfg.compression
    if not c.enabled:
        return {"summary": "compression disabled ([compression] enabled = false)", "compressed": None}
    ws = Workspace.from_env().ensure()
    model_name = cfg.registry.model_name
    parent_version, parent_dir, parent_tags = parent_task(model_name, c.source_alias)
    dataset_version = read_meta(Path(parent_dir)).get("dataset_version") or parent_tags.get("dataset_version") \
        or ws.latest_dataset()
    if dataset_version is None or not ws.dataset_dir(dataset_version).is_dir():
        raise UserError("dataset", dataset_version or ws.datasets, "of the parent model is not in the workspace",
                        "Run the data stage first: lmforge run data")
    shard_dir = str(ws.training_shards(dataset_version)) if needs_data(c) else None
    names, skipped = preflight_task(parent_dir, c, shard_dir)
    eval_cfg = variant_eval_config(cfg)
    dataset_dir = str(ws.dataset_dir(dataset_version))
    out_root = ws.root / "compression" / f"v{parent_version}"

    parent_metrics = evaluate_task.with_options(name="compress-evaluate-parent")(parent_dir, dataset_dir, eval_cfg)
    variants: dict[str, dict[str, float]] = {}
    versions: dict[str, str] = {}
    rejected: dict[str, str] = dict(skipped)   # techniques this architecture has no parts for: never built
    serve_python = str(serve_venv() / "bin" / "python") if cfg.deploy.enabled else None
    with start_run(ws, "compression", run_name=f"compress-v{parent_version}") as mlrun:
        import mlflow

        mlflow.set_tags({"parent_version": parent_version, "parent_alias": c.source_alias,
                         "dataset_version": dataset_version, "compression_config_hash": config_hash(c)})
        mlflow.log_params({"variants": ",".join(names), "max_bpc_increase": c.max_bpc_increase,
                           "max_rouge_l_drop": c.max_rouge_l_drop, "parent_version": parent_version})
        mlflow.log_metrics({f"parent.{k}": v for k, v in _finite(parent_metrics).items()})
        for name, reason in skipped.items():
            mlflow.set_tag(f"{name}.not_registered", reason[:500])
            print(f"{name}: not registered: {reason}")
        for name in names:
            path = build_task.with_options(name=f"compress-build-{name}")(name, parent_dir, str(out_root / name), c, shard_dir)
            metrics = evaluate_task.with_options(name=f"compress-evaluate-{name}")(path, dataset_dir, eval_cfg)
            problem = verify_task.with_options(name=f"compress-verify-{name}")(path, serve_python)
            if problem:
                rejected[name] = problem
                mlflow.set_tag(f"{name}.not_registered", problem[:500])
                print(f"{name}: not registered: {problem}")
                continue
            variants[name] = metrics
            mlflow.log_metrics({f"{name}.{k}": v for k, v in _finite(metrics).items()})
            tags = {"variant": name, "technique": TECHNIQUES[name], "run_name": f"compress-v{parent_version}-{name}",
                    "dataset_version": dataset_version, "compression_config_hash": config_hash(c),
                    # a fine-tuned parent's base lineage: a variant names the base its parent started from
                    **{k: v for k, v in parent_tags.items() if k.startswith("base_")}}
            versions[name] = register_task.with_options(name=f"compress-register-{name}")(
                path, cfg, _finite(metrics), tags, parent_version)
            print(f"{name}: registered {model_name} v{versions[name]} (parent v{parent_version}), "
                  f"BPC {metrics['bpc']:.4f} on {metrics['device']} ({metrics['device_reason']}), "
                  f"{metrics['tokens_per_s']:.1f} tokens/s")

        rows = tradeoff_rows(parent_metrics, variants, c, techniques=TECHNIQUES)
        for r in rows:
            r["version"] = parent_version if r["variant"] == "parent" else versions[r["variant"]]
        pick, why = choose_compressed(rows)
        chosen = versions[pick] if pick else None
        if chosen is not None:
            set_alias(ws, model_name, ALIAS, chosen, reason=why)
        elif current(ws, model_name, ALIAS) is not None:
            set_alias(ws, model_name, ALIAS, None, reason=f"parent v{parent_version}: {why}")
        table = tradeoff_markdown(rows) + "".join(f"\n\n{n}: not registered: {reason}" for n, reason in rejected.items())
        with tempfile.TemporaryDirectory() as tmp:
            atomic_write_text(Path(tmp) / "tradeoff.md", f"# Compression of {model_name} v{parent_version}\n\n{table}\n\n"
                              f"Policy: {why}\n")
            atomic_write_json(Path(tmp) / "tradeoff.json", {"rows": rows, "compressed": chosen, "policy": why,
                                                              "not_registered": rejected})
            tradeoff_chart(rows, Path(tmp) / "tradeoff.png", title=f"{model_name} v{parent_version}: compression trade-off")
            mlflow.log_artifacts(tmp, artifact_path="tradeoff")
        mlflow.set_tags({"compressed_version": chosen or "none", "policy": why[:500]})
        run_id = mlrun.info.run_id

    print(f"Compression of {model_name} v{parent_version} on dataset {dataset_version}:\n{table}")
    print(f"{ALIAS}: " + (f"v{chosen} ({pick}): {why}" if chosen else f"none: {why}"))
    return {"summary": rows, "compressed": chosen, "compressed_variant": pick, "policy": why,
            "parent_version": parent_version, "versions": versions, "not_registered": rejected,
            "mlflow_run_id": run_id}
