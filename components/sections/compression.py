"""The [compression] table: quantization, pruning, distillation, low-rank, LoRA."""

from __future__ import annotations

from ._base import Section


class CompressionConfig(Section):
    """Which variants to build from the champion, and the quality tolerance."""

    enabled: bool = True
