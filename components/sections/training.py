"""The [training] table: model, recipe and parallel layout."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class TrainingConfig(Section):
    """A LlamaForCausalLM trained with DeepSpeed."""

    seed: int = 0
    num_ranks: int = Field(2, ge=1, description="local ranks for the deepspeed launcher")
