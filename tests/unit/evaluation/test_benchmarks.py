"""components/evaluation/benchmarks.py without a model: the results' flattening, the task lookup and its errors."""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.evaluation import benchmarks
from lmforge.components.sections.evaluation import BenchmarkConfig


def test_results_flatten_to_mlflow_names_with_their_standard_errors():
    results = {"mc": {"alias": "mc", "sample_len": 40, "acc,none": 0.5, "acc_stderr,none": 0.08,
                      "acc_norm,none": 0.25, "acc_norm_stderr,none": "N/A"},
               "gsm": {"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01}}
    assert benchmarks.flatten(results) == {"bench.mc.acc": 0.5, "bench.mc.acc_stderr": 0.08, "bench.mc.acc_norm": 0.25,
                                           "bench.gsm.exact_match.strict-match": 0.1,
                                           "bench.gsm.exact_match_stderr.strict-match": 0.01}


def test_the_shipped_task_is_found_without_indexing_the_harness_tasks():
    tm = benchmarks.task_manager(BenchmarkConfig(tasks=["lmforge_heldout"]))
    assert "lmforge_heldout" in tm.all_tasks and "boolq" not in tm.all_tasks


def test_an_unknown_task_and_a_missing_folder_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="include_path"):
        benchmarks.check_tasks(BenchmarkConfig(tasks=["x"], include_path=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="no_such_task_anywhere.*is not a task or group"):
        benchmarks.check_tasks(BenchmarkConfig(tasks=["no_such_task_anywhere"]))


def test_task_names_are_unique_and_not_empty():
    with pytest.raises(ValueError, match="named once"):
        BenchmarkConfig(tasks=["a", "a"])
