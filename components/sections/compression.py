"""The [compression] table: quantization, pruning, distillation, low-rank, LoRA.

    [compression]
    max_bpc_increase = 0.05              # the policy: a variant qualifies within +5% BPC ...
    max_rouge_l_drop = 0.05              # ... and at most 0.05 ROUGE-L below its parent
    [compression.quantize]
    int8 = true
    casts = ["bf16"]
    [compression.lowrank]
    mode = "budget"
    param_budget = 0.5

Each technique has its own sub-table with an `enabled` flag; a technique function takes
only its own sub-table. `finetune` is the short recovery/adaptation loop that pruning,
distillation and LoRA share (a technique's own `steps` says how long it runs).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Name, Section


class FinetuneConfig(Section):
    """The short training loop shared by recovery fine-tunes, distillation and LoRA."""

    seq_len: int = Field(128, ge=8, le=8192, description="tokens per training window")
    batch_size: int = Field(8, ge=1, description="windows per step")
    lr: float = Field(3e-4, gt=0, lt=1, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, lt=1, description="AdamW weight decay")
    threads: int = Field(0, ge=0, description="torch CPU threads while training (0 = leave torch's default)")
    bf16: bool | None = Field(None,
                              description="bf16 autocast; unset = only where bf16 is faster (CUDA with bf16, or a CPU whose "
                                          "measured bf16 matmul beats fp32)")


class QuantizeConfig(Section):
    """int8 dynamic quantization of Linear layers for CPU serving, and fp16/bf16 casts."""

    enabled: bool = True
    int8: bool = Field(True,
                       description="build the int8 dynamic variant (torch.ao quantize_dynamic; stored as int8 weights + scales)")
    casts: list[Literal["bf16", "fp16"]] = Field(["bf16"], description="half-precision casts to build, one variant each")
    skip: list[str] = Field([], description="module-name suffixes kept in float (e.g. 'lm_head')")


class PruneConfig(Section):
    """Unstructured magnitude pruning of every Linear weight to one target sparsity."""

    enabled: bool = True
    sparsity: float = Field(0.5, ge=0, lt=1, description="fraction of weights set to zero, in [0, 1)")
    scope: Literal["global", "layer"] = Field("global", description="rank magnitudes across all layers or within each")
    targets: list[str] = Field([], description="module-name suffixes to prune; [] = every linear projection "
                               "(nn.Linear, GPT-2's Conv1D) inside the decoder blocks, never a tied head")
    recovery_steps: int = Field(0, ge=0, description="masked fine-tune steps after pruning (0 = none)")


class ChannelPruneConfig(Section):
    """Structured pruning of MLP channels: the matrices shrink and intermediate_size follows."""

    enabled: bool = True
    keep: float = Field(0.5, gt=0, le=1, description="fraction of MLP channels kept (same in every layer)")
    recovery_steps: int = Field(0, ge=0, description="fine-tune steps after pruning (0 = none)")


class DistillConfig(Section):
    """A smaller student trained on the teacher's soft targets (temperature-scaled KL + CE)."""

    enabled: bool = True
    num_layers: int | None = Field(None, ge=1, description="student layers (None = half the teacher's, at least 1)")
    hidden_size: int | None = Field(None, ge=8, description="student width (None = the teacher's; narrower starts from scratch)")
    temperature: float = Field(2.0, gt=0, description="softmax temperature of the soft targets")
    alpha: float = Field(0.5, ge=0, le=1, description="weight of the KL term; 1 - alpha weighs the CE on the data")
    steps: int = Field(50, ge=1, description="distillation steps")


class LowRankConfig(Section):
    """Truncated SVD of Linear layers: W ~ U_r S_r V_r^T, stored as two smaller Linear layers."""

    enabled: bool = True
    mode: Literal["energy", "budget", "rank"] = Field("budget", description="how each layer's rank is chosen")
    energy: float = Field(0.9, gt=0, le=1, description="mode=energy: keep the smallest rank retaining this share of sum(s^2)")
    param_budget: float = Field(0.5, gt=0, lt=1, description="mode=budget: target Linear parameters / original")
    rank: int = Field(16, ge=1, description="mode=rank: the same rank for every target layer")
    targets: list[str] = Field([], description="module-name suffixes to factorise; [] = every linear projection "
                               "(nn.Linear, GPT-2's Conv1D) inside the decoder blocks, never a tied head")


# Llama's attention query and value projections, as in the LoRA paper; components/model/adapters.py reads this
# default on a model without them as every projection in the decoder blocks.
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")


class LoraConfig(Section):
    """Fine-tune LoRA adapters with peft on a slice of the training data, then merge them."""

    enabled: bool = True
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="adapter scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="adapter dropout")
    targets: list[str] = Field(list(DEFAULT_LORA_TARGETS), description="module-name suffixes that get adapters")
    data_fraction: float = Field(0.25, gt=0, le=1, description="leading share of the train tokens used")
    steps: int = Field(30, ge=1, description="fine-tune steps")


class CompressionConfig(Section):
    """Which variants to build from the champion, and the quality tolerance of the policy."""

    enabled: bool = True
    seed: int = 0
    source_alias: Name = Field("champion", description="registry alias (or version number) of the parent model")
    max_bpc_increase: float = Field(0.05, ge=0, description="policy: largest relative BPC increase vs the parent (0.05 = +5%)")
    max_rouge_l_drop: float = Field(0.05, ge=0, le=1, description="policy: largest absolute ROUGE-L drop vs the parent")
    eval_max_examples: int | None = Field(None, ge=1,
                                          description="generation examples per variant; unset = [evaluation] max_examples")
    eval_bpc_docs: int | None = Field(None, ge=1,
                                      description="held-out documents for BPC per variant; unset = [evaluation] bpc_max_docs")
    finetune: FinetuneConfig = FinetuneConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    prune: PruneConfig = PruneConfig()
    channels: ChannelPruneConfig = ChannelPruneConfig()
    distill: DistillConfig = DistillConfig()
    lowrank: LowRankConfig = LowRankConfig()
    lora: LoraConfig = LoraConfig()
