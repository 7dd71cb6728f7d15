"""The run summary's evaluate row names each benchmark score with its standard error (what `make demo` prints)."""

from lmforge.cli.summary import _evaluate


def test_the_evaluate_row_lists_benchmark_scores_with_their_standard_errors():
    base = {"decision": "promoted", "reason": "first model", "bpc": 1.9, "rougeL": 0.1, "bleu": 1.0}
    row = _evaluate({"version": "1", "summary": {**base, "bench.lmforge_heldout.acc": 0.2,
                                                 "bench.lmforge_heldout.acc_stderr": 0.0402}})
    assert row.endswith("BLEU 1.00; lmforge_heldout acc 0.200 ± 0.040"), row
    assert _evaluate({"version": "1", "summary": base}).endswith("BLEU 1.00")
