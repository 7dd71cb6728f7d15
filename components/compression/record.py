"""What a compression run records: its MLflow run, the printed lines, each variant's tags and the summary.

    with start_run(ws, "compression", run_name=f"compress-v{parent}"):
        lines = log_start(c, parent_version="3", dataset_version=v, names=names, parent_metrics=m, skipped=skipped)
        line = log_refused("int8", "the pyfunc's text differs")          # tagged <variant>.not_registered
        tags = variant_tags("int8", c, parent_version="3", dataset_version=v, parent_tags=tags)
        line = log_registered("int8", metrics, model="demo", version="4", parent_version="3")
        table = log_tradeoff(rows, rejected, chosen="4", why=why, model="demo", parent_version="3")
    compression_summary(...)                                            # the stage's summary

flows/compress.py calls these around its steps (build, measure, verify, register, move `compressed`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lmforge.components.compression.build import TECHNIQUES
from lmforge.components.compression.tradeoff import tradeoff_chart, tradeoff_markdown, tradeoff_rows
from lmforge.components.config import config_hash
from lmforge.components.sections.compression import CompressionConfig
from lmforge.components.workspace import atomic_write_json, atomic_write_text

ALIAS = "compressed"


def finite(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers among `metrics` that MLflow can log (a bool, such as device_fallback, is a tag, not a metric)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def log_start(c: CompressionConfig, *, parent_version: str, dataset_version: str, names: list[str],
              parent_metrics: dict[str, Any], skipped: dict[str, str]) -> list[str]:
    """Into the active MLflow run: the parent, the settings, the parent's metrics and the techniques skipped before
    any work; returns the lines that say why each was skipped."""
    import mlflow

    mlflow.set_tags({"parent_version": parent_version, "parent_alias": c.source_alias,
                     "dataset_version": dataset_version, "compression_config_hash": config_hash(c)})
    mlflow.log_params({"variants": ",".join(names), "max_bpc_increase": c.max_bpc_increase,
                       "max_rouge_l_drop": c.max_rouge_l_drop, "parent_version": parent_version})
    mlflow.log_metrics({f"parent.{k}": v for k, v in finite(parent_metrics).items()})
    return [log_refused(name, reason) for name, reason in skipped.items()]


def log_refused(name: str, reason: str) -> str:
    """A variant not registered: tagged on the active MLflow run with its reason; returns the line to print."""
    import mlflow

    mlflow.set_tag(f"{name}.not_registered", reason[:500])
    return f"{name}: not registered: {reason}"


def variant_tags(name: str, c: CompressionConfig, *, parent_version: str, dataset_version: str,
                 parent_tags: dict[str, str]) -> dict[str, str]:
    """The registered variant's tags; a fine-tuned parent's base lineage (`base_*`) carries on to the variant."""
    return {"variant": name, "technique": TECHNIQUES[name], "run_name": f"compress-v{parent_version}-{name}",
            "dataset_version": dataset_version, "compression_config_hash": config_hash(c),
            **{k: v for k, v in parent_tags.items() if k.startswith("base_")}}


def log_registered(name: str, metrics: dict[str, Any], *, model: str, version: str, parent_version: str) -> str:
    """A registered variant's metrics into the active MLflow run (`<variant>.<metric>`); returns the line to print."""
    import mlflow

    mlflow.log_metrics({f"{name}.{k}": v for k, v in finite(metrics).items()})
    return (f"{name}: registered {model} v{version} (parent v{parent_version}), BPC {metrics['bpc']:.4f} on "
            f"{metrics['device']} ({metrics['device_reason']}), {metrics['tokens_per_s']:.1f} tokens/s")


def versioned_rows(parent_metrics: dict[str, Any], variants: dict[str, dict[str, Any]], versions: dict[str, str],
                   c: CompressionConfig, *, parent_version: str) -> list[dict[str, Any]]:
    """The trade-off table's rows (tradeoff.py), each with the registry version it is."""
    rows = tradeoff_rows(parent_metrics, variants, c, techniques=TECHNIQUES)
    for r in rows:
        r["version"] = parent_version if r["variant"] == "parent" else versions[r["variant"]]
    return rows


def log_tradeoff(rows: list[dict[str, Any]], rejected: dict[str, str], *, chosen: str | None, why: str, model: str,
                 parent_version: str) -> str:
    """Into the active MLflow run, under tradeoff/: the table (markdown, JSON) and the chart, and the policy's choice
    as tags; returns the table with the variants not registered."""
    import mlflow

    table = tradeoff_markdown(rows) + "".join(f"\n\n{n}: not registered: {reason}" for n, reason in rejected.items())
    with tempfile.TemporaryDirectory() as tmp:
        atomic_write_text(Path(tmp) / "tradeoff.md", f"# Compression of {model} v{parent_version}\n\n{table}\n\n"
                          f"Policy: {why}\n")
        atomic_write_json(Path(tmp) / "tradeoff.json", {"rows": rows, "compressed": chosen, "policy": why,
                                                          "not_registered": rejected})
        tradeoff_chart(rows, Path(tmp) / "tradeoff.png", title=f"{model} v{parent_version}: compression trade-off")
        mlflow.log_artifacts(tmp, artifact_path="tradeoff")
    mlflow.set_tags({"compressed_version": chosen or "none", "policy": why[:500]})
    return table


def result_lines(table: str, *, model: str, parent_version: str, dataset_version: str, chosen: str | None,
                 pick: str | None, why: str) -> list[str]:
    """What the flow prints at the end: the table and where `compressed` points now, and why."""
    return [f"Compression of {model} v{parent_version} on dataset {dataset_version}:\n{table}",
            f"{ALIAS}: " + (f"v{chosen} ({pick}): {why}" if chosen else f"none: {why}")]
