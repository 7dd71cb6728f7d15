"""What an evaluation records: the registered version's tags, the MLflow run, the printed lines and the summary.

    tags = registration_tags(result, meta, dataset_version=v, manifest=ws.manifest(v), evaluation=cfg.evaluation)
    log_evaluation(result, base, training_run=run, meta=meta, dataset_version=v, evaluation=cfg.evaluation)
    log_decision(result, decision, version="3", n=5, title="Evaluation of run-7 (model version 3)")
    result_lines(result, decision, eval_set, base, model="demo", version="3")    # what the flow prints
    evaluation_summary(result, decision, eval_set, base, version="3")          # the stage's summary

flows/evaluate.py calls these around its steps (score, register, gate); the report itself is report.py's.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from lmforge.components.config import config_hash
from lmforge.components.evaluation import benchmarks
from lmforge.components.evaluation.evaluate_model import EvalResult
from lmforge.components.evaluation.report import write_report
from lmforge.components.registry.gate import BaseScore, EvalSet
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.workspace import sha256_file

EVAL_SET_TAG = "eval_set_sha256"   # on the registering run: the hash of the set the version was scored on


def json_safe(obj: Any) -> Any:
    """NaN and infinities (e.g. TPOT when every answer was one token) become None: they are not JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def registration_tags(result: EvalResult, meta: dict[str, Any], *, dataset_version: str, manifest: Path,
                      evaluation: EvaluationConfig) -> dict[str, str]:
    """The registered version's tags: the dataset and its manifest hash, the evaluation's config and context, RAG,
    and for a fine-tune the base folder and content it started from."""
    tags = {"dataset_version": dataset_version, "dataset_manifest_hash": sha256_file(manifest),
            "evaluation_config_hash": config_hash(evaluation), "evaluation_context": str(result.info["context_length"]),
            "rag": result.rag.get("status", "off")}
    return {**tags, **{f"base_{k}": v for k, v in (meta.get("base") or {}).items()}}


def log_evaluation(result: EvalResult, base: BaseScore | None, *, training_run: str, meta: dict[str, Any],
                   dataset_version: str, evaluation: EvaluationConfig) -> None:
    """Into the active MLflow run: what was evaluated, the [evaluation] params, the finite metrics, the base's BPC."""
    import mlflow

    mlflow.set_tags({"training_run": training_run, "dataset_version": dataset_version,
                     "training_run_id": meta.get("mlflow_run_id", "")})
    mlflow.log_params({f"evaluation.{k}": v for k, v in evaluation.model_dump().items()})
    mlflow.log_metrics({k: v for k, v in result.metrics.items() if math.isfinite(v)})  # e.g. no TPOT: nothing to log
    if base is not None and base.metrics is not None and math.isfinite(base.metrics["bpc"]):
        mlflow.log_metric("base_bpc", base.metrics["bpc"])


def log_eval_set(bundle: dict[str, Any], split: str) -> None:
    """Into the active MLflow run: the hash of the set the version is scored on (travel.py logs the set with it)."""
    import mlflow

    mlflow.set_tags({EVAL_SET_TAG: bundle["eval_set_sha256"], "eval_set_split": split})


def log_decision(result: EvalResult, decision: dict[str, Any], *, version: str, n: int, title: str) -> None:
    """Into the active MLflow run: the registered version and the gate's outcome as tags, and under report/ the
    report (report.py), the decision and the harness's benchmark results."""
    import mlflow

    mlflow.set_tags({"registered_version": version, "decision": decision["outcome"]})
    with tempfile.TemporaryDirectory() as tmp:
        write_report(result, Path(tmp), n=n, title=title, decision=decision)
        (Path(tmp) / "decision.json").write_text(json.dumps(decision, indent=2))
        if result.info.get("benchmarks"):   # the harness's results JSON, as lm-eval writes it
            (Path(tmp) / "benchmarks.json").write_text(json.dumps(result.info["benchmarks"], indent=2))
        mlflow.log_artifacts(tmp, artifact_path="report")


def result_lines(result: EvalResult, decision: dict[str, Any], eval_set: EvalSet, base: BaseScore | None, *,
                 model: str, version: str) -> list[str]:
    """What the flow prints: the decision and the set that decided, the scores, the base's BPC, the benchmarks."""
    m, rag = result.metrics, result.rag
    lines = [f"model {model} v{version}: {decision['outcome'].upper()}: {decision['reason']}",
             f"  decided on {eval_set.label()}; {decision['champion_metrics_source']}",
             f"  BPC {m['bpc']:.4f} (unigram {m['unigram_bpc']:.4f}), ROUGE-L {m['rougeL']:.4f}, BLEU {m['bleu']:.2f}, "
             f"{m['tokens_per_s']:.1f} tokens/s; RAG {rag.get('status')}"
             + (f" (ROUGE-L {rag['delta']['rougeL']:+.4f})" if rag.get("status") == "ok" else f": {rag.get('reason', '')}")]
    if result.info.get("generation", "ok") != "ok":
        lines.append(f"  {result.info['generation']}")
    if base is not None and base.metrics is not None:
        lines.append(f"  base {base.name}: BPC {base.metrics['bpc']:.4f} on the same sample")
    if result.info.get("benchmarks"):
        table = benchmarks.table(result.info["benchmarks"])
        lines.append("  benchmarks (lm-evaluation-harness; report/benchmarks.json):\n"
                     + "\n".join("    " + line for line in table.splitlines()))
    return lines


def evaluation_summary(result: EvalResult, decision: dict[str, Any], eval_set: EvalSet, base: BaseScore | None, *,
                       version: str) -> dict[str, Any]:
    """The stage's summary: the version, the decision, the set, the rounded scores (and benchmarks, the base's BPC)."""
    m = result.metrics
    summary = {"version": version, "decision": decision["outcome"], "reason": decision["reason"],
               "eval_set": eval_set.sha256[:12],
               "bpc": round(m["bpc"], 4), "unigram_bpc": round(m["unigram_bpc"], 4), "rougeL": round(m["rougeL"], 4),
               "bleu": round(m["bleu"], 2), "tokens_per_s": round(m["tokens_per_s"], 1), "rag": result.rag.get("status")}
    if base is not None and base.metrics is not None:
        summary["base_bpc"] = round(base.metrics["bpc"], 4)
    summary.update({k: round(v, 4) for k, v in m.items() if k.startswith("bench.")})
    return summary
