"""The [registry] table: MLflow model name and promotion gates."""

from __future__ import annotations

from pydantic import Field

from ._base import Name, Section


class RegistryConfig(Section):
    """MLflow model registry with aliases, gated promotion and an audit trail.

    A candidate replaces the champion when its BPC is lower by at least `bpc_margin` and its
    ROUGE-L is not lower by more than `rougeL_tolerance`. With no champion, it must beat the
    unigram baseline's BPC on the same held-out text by `baseline_margin`.
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
