"""The gate's benchmark rules (registry.gate_benchmarks): a regression beyond margin + stderrs declines, naming the task."""

from __future__ import annotations

import pytest

from lmforge.components.config import validate_config
from lmforge.components.errors import UserError
from lmforge.components.registry.gate import BaseScore, decide
from lmforge.components.sections.registry import RegistryConfig

CHAMP = {"bpc": 2.0, "rougeL": 0.3, "bench.mc.acc": 0.80, "bench.mc.acc_stderr": 0.02, "bench.lm.ppl": 10.0}
BETTER_BPC = {"bpc": 1.9, "rougeL": 0.3}


def cfg(**rule) -> RegistryConfig:
    return RegistryConfig(gate_benchmarks=[{"task": "mc", **rule}])


@pytest.mark.parametrize("acc,stderr,promote", [
    (0.80, 0.02, True),     # level
    (0.75, 0.02, True),     # 0.05 down, within 2 * hypot(0.02, 0.02) = 0.0566
    (0.70, 0.02, False),    # 0.10 down: beyond the noise
    (0.70, 0.00, False),
])
def test_a_drop_beyond_the_standard_errors_declines_and_names_the_task(acc, stderr, promote):
    cand = {**BETTER_BPC, "bench.mc.acc": acc, "bench.mc.acc_stderr": stderr}
    ok, reason = decide(cand, CHAMP, cfg())
    assert ok is promote, reason
    assert "benchmark mc acc" in reason and (promote or "more than the allowed" in reason), reason


def test_margin_and_stderrs_widen_or_narrow_the_allowance():
    cand = {**BETTER_BPC, "bench.mc.acc": 0.70, "bench.mc.acc_stderr": 0.02}
    assert decide(cand, CHAMP, cfg(margin=0.05))[0]
    assert not decide({**cand, "bench.mc.acc": 0.79}, CHAMP, cfg(stderrs=0))[0]


def test_lower_is_better_metrics_compare_the_other_way():
    rule = {"metric": "ppl", "higher_is_better": False}
    champ = {**CHAMP, "bench.mc.ppl": 10.0}
    assert decide({**BETTER_BPC, "bench.mc.ppl": 9.0}, champ, cfg(**rule))[0]
    assert not decide({**BETTER_BPC, "bench.mc.ppl": 11.0}, champ, cfg(**rule))[0]


def test_bpc_still_decides_first_and_a_missing_score_is_said():
    assert "BPC" in decide({"bpc": 2.5, "bench.mc.acc": 0.9}, CHAMP, cfg())[1]
    ok, reason = decide(BETTER_BPC, CHAMP, cfg())
    assert not ok and "candidate has no score" in reason
    ok, reason = decide({**BETTER_BPC, "bench.mc.acc": 0.1}, {"bpc": 2.0}, cfg())
    assert ok and "has no score on it, not compared" in reason


def test_a_first_fine_tune_is_held_to_its_base_benchmarks():
    base = BaseScore(name="base", sha256="0" * 64, metrics={"bpc": 2.0, "bench.mc.acc": 0.9, "bench.mc.acc_stderr": 0.0})
    ok, reason = decide({**BETTER_BPC, "bench.mc.acc": 0.5, "bench.mc.acc_stderr": 0.0}, None, cfg(), base=base)
    assert not ok and "the base base" in reason


def test_a_rule_for_a_task_that_is_not_run_is_a_config_error():
    with pytest.raises(UserError, match="gate_benchmarks names mc"):
        validate_config({"registry": {"gate_benchmarks": [{"task": "mc"}]}})
    validate_config({"registry": {"gate_benchmarks": [{"task": "mc"}]}, "evaluation": {"benchmarks": {"tasks": ["mc"]}}})
