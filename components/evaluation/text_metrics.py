"""Scores of generated summaries against references: ROUGE-1/2/L F1, corpus BLEU, exact match.

    s = score_texts(["the cat sat"], ["the cat sat on the mat"])
    s.rouge1, s.rouge2, s.rougeL     # mean F1 over pairs, in [0, 1] (rouge-score, Porter stemmer)
    s.bleu                           # corpus BLEU in [0, 100] (sacrebleu defaults: 13a tokens, exp smoothing)
    s.exact_match                    # share of pairs equal after whitespace and case folding
    s.per_pair[0]["rougeL"]          # per-pair scores, for the report's worst and best examples
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TextScores:
    rouge1: float
    rouge2: float
    rougeL: float
    bleu: float
    exact_match: float
    per_pair: list[dict[str, float]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"rouge1": self.rouge1, "rouge2": self.rouge2, "rougeL": self.rougeL,
                "bleu": self.bleu, "exact_match": self.exact_match}


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def score_texts(predictions: Sequence[str], references: Sequence[str]) -> TextScores:
    import sacrebleu
    from rouge_score import rouge_scorer

    assert len(predictions) == len(references), "one prediction per reference"
    if not references:
        nan = float("nan")
        return TextScores(nan, nan, nan, nan, nan, [])
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    per_pair: list[dict[str, Any]] = []
    for pred, ref in zip(predictions, references):
        s = scorer.score(ref, pred)  # rouge-score's order is (target, prediction)
        per_pair.append({"rouge1": s["rouge1"].fmeasure, "rouge2": s["rouge2"].fmeasure, "rougeL": s["rougeL"].fmeasure,
                         "exact_match": float(normalize(pred) == normalize(ref))})
    n = len(per_pair)
    bleu = sacrebleu.corpus_bleu(list(predictions), [list(references)]).score
    return TextScores(
        rouge1=sum(p["rouge1"] for p in per_pair) / n,
        rouge2=sum(p["rouge2"] for p in per_pair) / n,
        rougeL=sum(p["rougeL"] for p in per_pair) / n,
        bleu=float(bleu),
        exact_match=sum(p["exact_match"] for p in per_pair) / n,
        per_pair=per_pair,
    )
