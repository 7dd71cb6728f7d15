"""LoRA adapters on a causal LM's projections, through peft: which projections get one, and the wrapped model.

    chosen = adapter_targets(model, r=8, targets=["q_proj", "v_proj"], field="training.lora.target_modules", where=folder)
    peft_model = add_adapters(model, chosen, r=8, alpha=16, dropout=0.0, seed=0)

One piece of code for the compression stage's LoRA variant (components/compression/lora.py)
and LoRA training on the ranks (components/training/lora_training.py). Targets are
components/model/projections.py's projections (Linear or GPT-2's Conv1D); `[]` means every one
inside the decoder blocks, and a head tied to the embedding gets no adapter. The default
targets, Llama's `q_proj`/`v_proj`, on a model with no projection by those names (GPT-2's
`c_attn`, GPT-NeoX's `query_key_value`, Phi-3's fused `qkv_proj`) mean `[]`; targets a user
names are never replaced.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmforge.components.errors import UserError
from lmforge.components.model.projections import Chosen, choose_targets, projections, select
from lmforge.components.sections.compression import DEFAULT_LORA_TARGETS

DEFAULT_TARGETS = list(DEFAULT_LORA_TARGETS)  # compression.lora.targets' and training.lora.target_modules' default


def target_suffixes(model: nn.Module, targets: list[str]) -> list[str]:
    """`targets`, except that the default names on a model without them mean [] (every projection in the blocks)."""
    if list(targets) == DEFAULT_TARGETS and not select(projections(model), targets):
        return []
    return list(targets)


def adapter_targets(model: nn.Module, *, r: int, targets: list[str], field: str, where: object) -> Chosen:
    """The projections that get adapters, or a UserError naming `field` (or its section's `r`) when the config
    cannot apply to this model. Works on a model built on the meta device: only shapes and names are read."""
    chosen = choose_targets(model, target_suffixes(model, targets), key=field, model_dir=where)
    too_big = {n: min(p.in_features, p.out_features) for n, p in chosen.targets.items()
               if r > min(p.in_features, p.out_features)}
    if too_big:
        name, limit = min(too_big.items(), key=lambda kv: kv[1])
        raise UserError(field.rsplit(".", 1)[0] + ".r", r, f"is larger than layer {name} allows ({limit})",
                        f"Use r of at most {limit}")
    return chosen


def add_adapters(model: nn.Module, chosen: Chosen, *, r: int, alpha: float, dropout: float, seed: int = 0) -> Any:
    """The peft model with adapters on the chosen projections (A random from `seed`, B zero: outputs unchanged at
    first); every other parameter is frozen."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # Full module names (peft matches a name exactly or as a suffix after "."), so exactly the chosen projections
    # get adapters. peft reads a Conv1D's transposed weight right only with fan_in_fan_out=True.
    peft_cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(chosen.targets),
                          fan_in_fan_out=any(p.transposed for p in chosen.targets.values()), bias="none")
    return get_peft_model(model, peft_cfg)
