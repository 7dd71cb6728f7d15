"""The [features] table: the Feast feature store and training-set selection."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class FeaturesConfig(Section):
    """Feast apply, materialise, point-in-time training-set selection."""

    enabled: bool = Field(True, description="run the feature store stage; off = train on the whole train split")
    repo: str | None = Field(
        None, description="Feast feature repo folder (feature_store.yaml + definitions); unset = the project's feature_repo/")
    min_quality: float = Field(0.3, ge=0.0, le=1.0,
                               description="keep a training document when its quality_score is at least this")
    min_words: int = Field(0, ge=0, description="keep a training document when it has at least this many words")
    max_cluster_size: int | None = Field(
        None, ge=1, description="drop documents whose near-duplicate cluster was larger than this; unset = no limit")
