"""The [features] table: the Feast feature store and training-set selection."""

from __future__ import annotations

from ._base import Section


class FeaturesConfig(Section):
    """Feast apply, materialise, point-in-time training-set selection."""

    enabled: bool = True
