"""The [registry] table: MLflow model name and promotion gates."""

from __future__ import annotations

from ._base import Section


class RegistryConfig(Section):
    """MLflow model registry with aliases and gated promotion."""

    model_name: str = "lmforge-lm"
