"""LoRA: fine-tune low-rank adapters with peft on a slice of the training data, then merge them.

    out = lora_variant(model_dir, out / "lora", LoraConfig(r=8, steps=30), tuner=tuner)

Only the adapters train (W stays frozen); `merge_and_unload` then folds B @ A * alpha/r
into each W, so the result has exactly the parent's architecture and size, loads with a
plain `from_pretrained`, and costs nothing extra at inference. It is the cheap way to
adapt a (compressed) model to a data slice; the parameters do not shrink. Targets are
components/model/projections.py's projections (Linear or GPT-2's Conv1D; `targets = []` means every one
inside the decoder blocks); a head tied to the embedding gets no adapter. The default
targets, Llama's `q_proj`/`v_proj`, on a model that has no projection by those names (GPT-2's
`c_attn`, GPT-NeoX's `query_key_value`, Phi-3's fused `qkv_proj`) mean `[]`, and the recipe
says so (`targets_applied`); targets a user names are never replaced.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from lmforge.components.compression.finetune import Finetuner
from lmforge.components.compression.variant import load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.model.adapters import adapter_targets, add_adapters, target_suffixes
from lmforge.components.model.projections import Chosen
from lmforge.components.sections.compression import LoraConfig


def check_lora(model: nn.Module, cfg: LoraConfig, model_dir: object) -> Chosen:
    """The projections that get adapters, or a UserError when the config cannot apply to this model."""
    return adapter_targets(model, r=cfg.r, targets=cfg.targets, field="compression.lora.targets", where=model_dir)


def lora_variant(model_dir: Path, out_dir: Path, cfg: LoraConfig, *, tuner: Finetuner | None, seed: int = 0) -> Path:
    model, parent = load_parent(model_dir)
    chosen = check_lora(model, cfg, model_dir)  # before peft wraps the projections
    applied = target_suffixes(model, cfg.targets)
    peft_model = add_adapters(model, chosen, r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, seed=seed)
    if tuner is None:
        raise UserError("compression.lora", "enabled", "needs training data but none was given",
                        "Run the data stage first, or disable [compression.lora]")
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    losses = tuner.run(peft_model, steps=cfg.steps, data_fraction=cfg.data_fraction)
    merged = peft_model.merge_and_unload()
    recipe = {**cfg.model_dump(mode="json"), "adapter_params": trainable, "skipped": chosen.skipped,
              "losses": losses}
    if applied != list(cfg.targets):
        recipe["targets_applied"] = (f"{applied}: every projection in the decoder blocks, since the default "
                                     f"{cfg.targets} name no projection of this {model.config.model_type} model")
    return save_variant(merged, out_dir, parent_dir=parent, technique="lora-merged", recipe=recipe)
