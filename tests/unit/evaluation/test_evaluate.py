"""evaluate_model_dir end to end on a tiny held-out set: the metrics, the report, RAG on/skipped."""

from __future__ import annotations

import json
import math

import pytest

from lmforge.components.evaluation import EvalResult, evaluate_model_dir
from lmforge.components.evaluation.rag import build_rag
from lmforge.components.evaluation.report import worst_and_best, write_report
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from tests.integration.evalreg_support import make_eval_dataset

KEYS = {"bpc", "perplexity", "rouge1", "rouge2", "rougeL", "bleu", "exact_match", "ttft_ms", "tpot_ms", "tokens_per_s",
        "unigram_bpc"}
CFG = EvaluationConfig(max_examples=6, max_new_tokens=8, batch_size=3, bpc_max_docs=10)


def test_metrics_examples_report_and_a_rag_run(workspace, tiny_model_dir, tmp_path):
    v = make_eval_dataset(workspace, per_module=8)
    seen = []

    def rag(prompt: str) -> str:  # a fixed context: checks the RAG path runs and is scored separately
        seen.append(prompt)
        return 'def add(a, b):\n    """Return a plus b."""\n' + prompt

    r = evaluate_model_dir(tiny_model_dir, workspace.dataset_dir(v), CFG, rag=rag)
    assert KEYS <= set(r.metrics)
    assert all(math.isfinite(r.metrics[k]) for k in KEYS - {"tpot_ms"})
    assert r.metrics["bpc"] > 0 and 0 <= r.metrics["rougeL"] <= 1 and 0 <= r.metrics["bleu"] <= 100
    assert len(r.examples) == 6 and len(seen) == 6 and r.info["bpc_docs"] == 10
    assert r.rag["status"] == "ok"
    assert r.rag["delta"]["rougeL"] == pytest.approx(r.rag["metrics"]["rougeL"] - r.metrics["rougeL"])
    assert EvalResult.from_dict(json.loads(json.dumps(r.to_dict()))).metrics == r.metrics

    paths = write_report(r, tmp_path / "report", n=2, title="t")
    md = paths["md"].read_text()
    assert "## Worst examples" in md and "## Best examples" in md and "with RAG" in md
    worst, best = worst_and_best(r.examples, 2)
    assert worst[0].rougeL <= worst[-1].rougeL <= best[-1].rougeL <= best[0].rougeL
    assert json.loads(paths["json"].read_text())["worst"] == [e.id for e in worst]
    assert paths["png"].stat().st_size > 1000


def test_rag_is_skipped_with_a_reason_when_no_store_is_built(workspace):
    rag = build_rag(workspace, VectorsConfig(), FeaturesConfig(), k=2, dataset_version="nope")
    assert rag.augment is None
    assert rag.reason


def test_missing_split_is_a_user_error(workspace, tiny_model_dir):
    from lmforge.components.errors import UserError

    with pytest.raises(UserError, match="records/test.jsonl"):
        evaluate_model_dir(tiny_model_dir, workspace.root / "no-dataset", CFG)
