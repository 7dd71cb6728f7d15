"""LoRA training: adapters on the base's projections (components/model/adapters.py), checked before launch, merged at export.

    chosen = check_adapters(cfg, config)                 # before launch, on a meta-device model: a UserError, or the targets
    model = with_adapters(model, cfg)                     # on each rank, after the base loaded (ZeRO-3: partitioned)
    merged = merge_adapters(state, cfg, run_dir / "adapter")   # rank 0 at export: adapter saved, weights merged

Only the adapters require gradients, so only they reach DeepSpeed's optimizer: ZeRO-2/3 keep
gradients and Adam states for them alone, and a checkpoint saves them alone
(`exclude_frozen_parameters`); the frozen base is the init folder's, loaded again on resume.
At export the consolidated state (the base's weights under peft's `base_layer` names plus the
adapters) is loaded into a fresh peft model over the base, saved as the adapter (peft's own
`save_pretrained`: adapter_config.json + adapter_model.safetensors) and merged with
`merge_and_unload`, whose weights are what serving loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmforge.components.model.adapters import adapter_targets, add_adapters
from lmforge.components.model.projections import Chosen
from lmforge.components.sections.training import TrainingConfig

FIELD = "training.lora.target_modules"
ADAPTER_DIR = "adapter"  # in the run folder, and copied into the export for lineage


def _targets(model: torch.nn.Module, cfg: TrainingConfig) -> Chosen:
    return adapter_targets(model, r=cfg.lora.r, targets=cfg.lora.target_modules, field=FIELD, where=cfg.model.init)


def check_adapters(cfg: TrainingConfig, config: Any) -> Chosen:
    """The projections that will get adapters, found on the model built from `config` on the meta device (no weights)."""
    from lmforge.components.training.model import meta_model

    return _targets(meta_model(config), cfg)


def adapter_params(chosen: Chosen, r: int) -> int:
    """Parameters the adapters add: A (r x in) and B (out x r) per target."""
    return sum(r * (p.in_features + p.out_features) for p in chosen.targets.values())


def with_adapters(model: torch.nn.Module, cfg: TrainingConfig) -> Any:
    """The peft model over `model`, every rank drawing the same adapter weights from the run's seed."""
    chosen = _targets(model, cfg)
    return add_adapters(model, chosen, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, seed=cfg.seed)


def merge_adapters(state: dict[str, torch.Tensor], cfg: TrainingConfig, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The merged weights, in the base's own key names, from the engine's state; the adapter is saved to
    `adapter_dir` first (peft's save_pretrained), since merging folds the adapters into the base in place."""
    from transformers import AutoModelForCausalLM

    from lmforge.components.workspace import atomic_dir

    assert cfg.model.init is not None
    base = AutoModelForCausalLM.from_pretrained(cfg.model.init, use_safetensors=True, trust_remote_code=False,
                                                dtype=torch.float32)
    peft_model = with_adapters(base, cfg)
    missing, unexpected = peft_model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    # A frozen weight the engine left out (a head tied to the embedding is gathered once) is the base's already;
    # every trained adapter must be there.
    lost = [k for k in missing if "lora_" in k]
    assert not unexpected and not lost, f"adapter export keys: unexpected {unexpected}, missing {lost}"
    with atomic_dir(adapter_dir) as tmp:
        peft_model.save_pretrained(str(tmp), safe_serialization=True)
    return dict(peft_model.merge_and_unload().state_dict())
