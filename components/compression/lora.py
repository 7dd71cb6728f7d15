"""LoRA: fine-tune low-rank adapters with peft on a slice of the training data, then merge them.

    out = lora_variant(model_dir, out / "lora", LoraConfig(r=8, steps=30), tuner=tuner)

Only the adapters train (W stays frozen); `merge_and_unload` then folds B @ A * alpha/r
into each W, so the result has exactly the parent's architecture and size, loads with a
plain `from_pretrained`, and costs nothing extra at inference. It is the cheap way to
adapt a (compressed) model to a data slice; the parameters do not shrink.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from lmforge.components.compression.finetune import Finetuner
from lmforge.components.compression.modules import require_linear, select
from lmforge.components.compression.variant import load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import LoraConfig


def check_lora(model: nn.Module, cfg: LoraConfig, model_dir: object) -> dict[str, nn.Linear]:
    """The layers that get adapters, or a UserError when the config cannot apply to this model."""
    targets = select(require_linear(model, model_dir), cfg.targets)
    if not targets:
        raise UserError("compression.lora.targets", cfg.targets, "match no Linear layer of the model",
                        "Name module suffixes such as q_proj or v_proj")
    too_big = {n: min(m.in_features, m.out_features) for n, m in targets.items() if cfg.r > min(m.in_features, m.out_features)}
    if too_big:
        name, limit = min(too_big.items(), key=lambda kv: kv[1])
        raise UserError("compression.lora.r", cfg.r, f"is larger than layer {name} allows ({limit})",
                        f"Use r of at most {limit}")
    return targets


def add_adapters(model: nn.Module, cfg: LoraConfig, model_dir: Path, *, seed: int = 0) -> nn.Module:
    """The peft model with adapters on the target modules (A random, B zero: outputs unchanged at first)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = check_lora(model, cfg, model_dir)
    torch.manual_seed(seed)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=sorted({n.rsplit(".", 1)[-1] for n in targets}), bias="none")
    return get_peft_model(model, peft_cfg)


def lora_variant(model_dir: Path, out_dir: Path, cfg: LoraConfig, *, tuner: Finetuner | None, seed: int = 0) -> Path:
    model, parent = load_parent(model_dir)
    peft_model = add_adapters(model, cfg, model_dir, seed=seed)
    if tuner is None:
        raise UserError("compression.lora", "enabled", "needs training data but none was given",
                        "Run the data stage first, or disable [compression.lora]")
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    losses = tuner.run(peft_model, steps=cfg.steps, data_fraction=cfg.data_fraction)
    merged = peft_model.merge_and_unload()
    recipe = {**cfg.model_dump(mode="json"), "adapter_params": trainable, "losses": losses}
    return save_variant(merged, out_dir, parent_dir=parent, technique="lora-merged", recipe=recipe)
