"""The [registry] table: MLflow model name and promotion gates."""

from __future__ import annotations

from pydantic import Field

from ._base import Name, Section


class BenchmarkRule(Section):
    """One benchmark the gate holds: the candidate may not fall below the champion (or, for a first fine-tune, its
    base) on `task`'s `metric` by more than `margin` plus `stderrs` standard errors of the difference."""

    task: str = Field(min_length=1, description="a task in evaluation.benchmarks.tasks")
    metric: str = Field("acc", min_length=1, description="the harness metric (acc, acc_norm, exact_match, ...)")
    margin: float = Field(0.0, ge=0.0, description="how far below the reference the candidate may fall, in the "
                                                   "metric's units, beyond the standard-error allowance")
    stderrs: float = Field(2.0, ge=0.0, le=10.0,
                           description="standard errors of the difference (sqrt(se_candidate^2 + se_reference^2)) "
                                       "forgiven as noise; 0 = compare the means only")
    higher_is_better: bool = Field(True, description="false for a metric where lower is better (e.g. perplexity)")


class RegistryConfig(Section):
    """MLflow model registry with aliases, gated promotion and an audit trail.

    A candidate replaces the champion when its BPC is lower by at least `bpc_margin` and its
    ROUGE-L is not lower by more than `rougeL_tolerance`. With no champion, it must beat the
    unigram baseline's BPC on the same held-out text by `baseline_margin`. Each of `gate_benchmarks` must
    then hold too (against the champion, or the base a first fine-tune started from).
    """

    model_name: Name = Field("lmforge-lm", description="registered model name; also its folder in the registry cache")
    bpc_margin: float = Field(0.01, ge=0.0, le=10.0, description="bits/char the candidate must gain over the champion")
    rougeL_tolerance: float = Field(0.02, ge=0.0, le=1.0, description="ROUGE-L F1 the candidate may lose against the champion")
    baseline_margin: float = Field(0.0, ge=0.0, le=10.0,
                                   description="bits/char the first model must gain over the unigram baseline")
    reevaluate_champion: bool = Field(True,
                                      description="re-score the champion when it was scored on another dataset version, so both "
                                                  "sides compare on the same text")
    register_retries: int = Field(12, ge=1, le=100, description="attempts for a registry write that hits a locked store")
    retry_backoff_s: float = Field(0.1, gt=0.0, le=10.0,
                                   description="first retry wait; doubles each attempt (with jitter), capped at 5 s")
    gate_benchmarks: list[BenchmarkRule] = Field(
        default_factory=list, description="benchmark scores a candidate may not regress (evaluation.benchmarks must "
                                          "run each rule's task); e.g. [{task = \"lmforge_heldout\", metric = \"acc\"}]")
