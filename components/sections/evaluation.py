"""The [evaluation] table: held-out metrics, generation and latency."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class EvaluationConfig(Section):
    """BPC, perplexity, ROUGE, BLEU, latency."""

    seed: int = 0
    max_examples: int = Field(64, ge=1, description="generation examples scored from the test split")
