"""What an evaluation records (components/evaluation/record.py): the registered version's tags, the MLflow run,
the printed lines and the stage's summary."""

from __future__ import annotations

import json
import math

from lmforge.components.evaluation import record
from lmforge.components.evaluation.evaluate_model import EvalResult, Example
from lmforge.components.registry.gate import BaseScore, EvalSet
from lmforge.components.sections.evaluation import EvaluationConfig

METRICS = {"bpc": 2.5, "unigram_bpc": 4.0, "rougeL": 0.25, "bleu": 7.123, "tokens_per_s": 50.04, "tpot_ms": math.nan,
           "bench.arc.acc": 0.31234}
EVAL_SET = EvalSet(sha256="f" * 64, split="test", dataset_version="v1", logged_with="v3", how="no champion yet")
DECISION = {"outcome": "promoted", "reason": "no champion yet", "champion_metrics_source": "no champion yet"}


def result() -> EvalResult:
    example = Example(id="a", prompt="def f():", reference="Do f.", prediction="Do f.", rougeL=1.0, rouge1=1.0, tokens=3)
    return EvalResult(metrics=dict(METRICS), examples=[example], rag={"status": "off", "reason": "disabled"},
                      info={"context_length": 128})


def test_json_safe_turns_nan_into_none():
    assert record.json_safe({"a": [math.nan, 1.0], "b": math.inf}) == {"a": [None, 1.0], "b": None}


def test_registration_tags_name_the_dataset_the_context_and_the_base(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    tags = record.registration_tags(result(), {"base": {"path": "/b", "sha256": "abc"}}, dataset_version="v1",
                                    manifest=manifest, evaluation=EvaluationConfig())
    assert tags["dataset_version"] == "v1" and len(tags["dataset_manifest_hash"]) == 64
    assert tags["evaluation_context"] == "128" and tags["rag"] == "off"
    assert tags["base_path"] == "/b" and tags["base_sha256"] == "abc"


def test_the_lines_and_the_summary():
    base = BaseScore(name="base", sha256="abc", metrics={"bpc": 2.75})
    lines = record.result_lines(result(), DECISION, EVAL_SET, base, model="demo", version="3")
    assert lines[0] == "model demo v3: PROMOTED: no champion yet"
    assert lines[1].startswith("  decided on evaluation set test ffffffffffff")
    assert lines[2] == "  BPC 2.5000 (unigram 4.0000), ROUGE-L 0.2500, BLEU 7.12, 50.0 tokens/s; RAG off: disabled"
    assert lines[3] == "  base base: BPC 2.7500 on the same sample"
    summary = record.evaluation_summary(result(), DECISION, EVAL_SET, base, version="3")
    assert summary["eval_set"] == "f" * 12 and summary["bleu"] == 7.12 and summary["base_bpc"] == 2.75
    assert summary["bench.arc.acc"] == 0.3123 and summary["decision"] == "promoted"


def test_the_run_logs_the_metrics_the_eval_set_and_the_report(workspace):
    from mlflow import MlflowClient

    from lmforge.components.tracking import start_run
    from lmforge.components.workspace import Workspace

    ws = Workspace.from_env().ensure()
    with start_run(ws, "evaluation", run_name="eval-r1") as run:
        record.log_evaluation(result(), BaseScore(name="b", sha256="x", metrics={"bpc": 3.0}), training_run="r1",
                              meta={"mlflow_run_id": "t1"}, dataset_version="v1", evaluation=EvaluationConfig())
        record.log_eval_set({"eval_set_sha256": "f" * 64}, "test")
        record.log_decision(result(), DECISION, version="3", n=1, title="Evaluation of r1 (model version 3)")
    got = MlflowClient().get_run(run.info.run_id).data
    assert got.tags["training_run_id"] == "t1" and got.tags[record.EVAL_SET_TAG] == "f" * 64
    assert got.tags["registered_version"] == "3" and got.tags["decision"] == "promoted"
    assert got.metrics["bpc"] == 2.5 and "tpot_ms" not in got.metrics and got.metrics["base_bpc"] == 3.0
    assert got.params["evaluation.split"] == EvaluationConfig().split
    report = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/decision.json"} <= report
    local = MlflowClient().download_artifacts(run.info.run_id, "report/decision.json", str(ws.root))
    assert json.loads(open(local).read())["outcome"] == "promoted"
