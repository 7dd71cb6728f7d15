"""ROUGE, BLEU and exact match on fixed pairs: hand-computed values, and the libraries' own."""

from __future__ import annotations

import pytest
import sacrebleu
from rouge_score import rouge_scorer

from lmforge.components.evaluation.text_metrics import score_texts


def test_rouge_on_a_partial_match_equals_hand_computed_f1():
    s = score_texts(["the cat sat"], ["the cat sat on the mat"])
    # unigrams: P 3/3, R 3/6 -> F1 2/3; bigrams: P 2/2, R 2/5 -> F1 4/7; LCS 3 -> as unigrams
    assert s.rouge1 == pytest.approx(2 / 3)
    assert s.rouge2 == pytest.approx(4 / 7)
    assert s.rougeL == pytest.approx(2 / 3)
    assert s.exact_match == 0.0


def test_corpus_bleu_equals_hand_computed_value():
    s = score_texts(["the cat sat on the mat"], ["the cat sat on a mat"])
    # clipped n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty
    assert s.bleu == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-6)


PAIRS = [
    ("Return a new list of the items.", "Return a list of the items."),
    ("Serialize obj to a JSON formatted str.", "Serialize ``obj`` to a JSON formatted ``str``."),
    ("Open the file.", "Close the socket."),
    ("Return True if path is a dir.", "return true if  path is a dir."),
]


def test_scores_equal_sacrebleu_and_rouge_score_on_fixed_pairs():
    preds, refs = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    s = score_texts(preds, refs)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    ref_scores = [scorer.score(r, p) for p, r in PAIRS]
    for key in ("rouge1", "rouge2", "rougeL"):
        assert getattr(s, key) == pytest.approx(sum(x[key].fmeasure for x in ref_scores) / len(PAIRS))
    assert s.bleu == pytest.approx(sacrebleu.corpus_bleu(preds, [refs]).score)
    assert s.exact_match == pytest.approx(1 / 4)  # the last pair differs only in case and spaces
    assert [p["exact_match"] for p in s.per_pair] == [0.0, 0.0, 0.0, 1.0]
