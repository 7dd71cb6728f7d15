"""Evaluation: BPC and perplexity, ROUGE/BLEU/exact match on generated summaries, latency, RAG, reports.

    from lmforge.components.evaluation import evaluate_model_dir
    result = evaluate_model_dir(model_dir, ws.dataset_dir(v), cfg.evaluation)

Modules: bpc.py, baseline.py (unigram), timed_generation.py, text_metrics.py, latency.py,
rag.py, evaluate_model.py (the entry point), report.py.
"""

from lmforge.components.evaluation.evaluate_model import EvalResult, Example, evaluate_model_dir

__all__ = ["EvalResult", "Example", "evaluate_model_dir"]
