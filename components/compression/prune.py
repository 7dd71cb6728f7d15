"""Pruning: unstructured magnitude pruning to a target sparsity, and structured MLP-channel pruning.

    pruned = prune_variant(model_dir, out / "prune", PruneConfig(sparsity=0.5), tuner=tuner)
    slim = prune_channels_variant(model_dir, out / "channels", ChannelPruneConfig(keep=0.5))

Unstructured pruning works on the projections components/model/projections.py finds (Linear or Conv1D;
`targets = []` means every one inside the decoder blocks; a head tied to the embedding is
never pruned) with torch.nn.utils.prune (L1 magnitude, global or per layer): the
mask stays attached during the optional recovery fine-tune, so pruned weights stay zero
while the survivors adapt, and is then made permanent (`prune.remove`). The matrices keep
their shapes; the zeros pay off only with a sparse kernel or compression on disk.

Channel pruning drops whole intermediate channels of each gated MLP (a row of gate_proj
and up_proj and the matching column of down_proj), ranked by the product of their norms,
so the matrices really shrink and `intermediate_size` in config.json follows; the folder
loads with a plain `from_pretrained`. It needs the gated gate/up/down MLP (Llama, Qwen2,
Mistral); other MLPs (GPT-2, GPT-NeoX, Phi-3's fused gate_up_proj) are refused up front.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import prune

from lmforge.components.compression.finetune import Finetuner
from lmforge.components.compression.modules import require_linear
from lmforge.components.compression.variant import load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.model.projections import Chosen, choose_targets
from lmforge.components.sections.compression import ChannelPruneConfig, PruneConfig


def check_prune(model: nn.Module, cfg: PruneConfig, model_dir: object) -> Chosen:
    return choose_targets(model, cfg.targets, key="compression.prune.targets", model_dir=model_dir)


def prune_variant(model_dir: Path, out_dir: Path, cfg: PruneConfig, *, tuner: Finetuner | None = None) -> Path:
    if not 0 <= cfg.sparsity < 1:  # a section built with model_construct skips pydantic's check
        raise UserError("compression.prune.sparsity", cfg.sparsity, "is outside [0, 1)", "Choose e.g. 0.5")
    need_tuner("compression.prune.recovery_steps", cfg.recovery_steps, tuner)
    model, parent = load_parent(model_dir)
    chosen = check_prune(model, cfg, model_dir)
    targets = {n: p.module for n, p in chosen.targets.items()}
    params = [(m, "weight") for m in targets.values()]  # a Conv1D's transposed weight prunes alike: magnitudes
    if cfg.scope == "global":
        prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=cfg.sparsity)
    else:
        for m, name in params:
            prune.l1_unstructured(m, name, amount=cfg.sparsity)
    losses = tuner.run(model, steps=cfg.recovery_steps) if tuner and cfg.recovery_steps else []
    for m, name in params:
        prune.remove(m, name)
    recipe = {**cfg.model_dump(mode="json"), "achieved_sparsity": sparsity(targets.values()),
              "pruned_layers": len(targets), "skipped": chosen.skipped, "recovery_losses": losses}
    return save_variant(model, out_dir, parent_dir=parent, technique="prune-unstructured", recipe=recipe)


def sparsity(layers) -> float:
    zeros = total = 0
    for m in layers:
        zeros += int((m.weight == 0).sum())
        total += m.weight.numel()
    return zeros / total


def gated_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """The MLP blocks with gate_proj/up_proj/down_proj (Llama, Mistral, Qwen and the like)."""
    return {n: m for n, m in model.named_modules()
            if all(isinstance(getattr(m, k, None), nn.Linear) for k in ("gate_proj", "up_proj", "down_proj"))}


def channel_scores(mlp: nn.Module) -> torch.Tensor:
    """One score per intermediate channel: how much that channel can contribute to the block's output."""
    g = mlp.gate_proj.weight.detach().float().norm(dim=1)
    u = mlp.up_proj.weight.detach().float().norm(dim=1)
    d = mlp.down_proj.weight.detach().float().norm(dim=0)
    return g * u * d


def _sliced(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    w = linear.weight.detach().index_select(dim, index)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, dtype=w.dtype)
    out.weight.data.copy_(w)
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.detach().index_select(0, index) if dim == 0 else linear.bias.detach())
    return out


def check_channels(model: nn.Module, model_dir: object) -> dict[str, nn.Module]:
    require_linear(model, model_dir)
    mlps = gated_mlps(model)
    if not mlps:
        raise UserError("compression model", model_dir, "has no gated MLP (gate_proj/up_proj/down_proj) to prune",
                        "Disable [compression.channels] for this architecture")
    return mlps


def prune_channels_variant(model_dir: Path, out_dir: Path, cfg: ChannelPruneConfig, *,
                           tuner: Finetuner | None = None) -> Path:
    need_tuner("compression.channels.recovery_steps", cfg.recovery_steps, tuner)
    model, parent = load_parent(model_dir)
    mlps = check_channels(model, model_dir)
    width = {m.gate_proj.out_features for m in mlps.values()}
    assert len(width) == 1, f"MLP widths differ across layers: {width}"
    before = width.pop()
    keep_n = max(1, round(cfg.keep * before))
    for mlp in mlps.values():
        index = channel_scores(mlp).topk(keep_n).indices.sort().values
        mlp.gate_proj = _sliced(mlp.gate_proj, index, 0)
        mlp.up_proj = _sliced(mlp.up_proj, index, 0)
        mlp.down_proj = _sliced(mlp.down_proj, index, 1)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = keep_n
    model.config.intermediate_size = keep_n
    losses = tuner.run(model, steps=cfg.recovery_steps) if tuner and cfg.recovery_steps else []
    recipe = {**cfg.model_dump(mode="json"), "intermediate_size": [before, keep_n], "recovery_losses": losses}
    return save_variant(model, out_dir, parent_dir=parent, technique="prune-channels", recipe=recipe)


def need_tuner(key: str, steps: int, tuner: Finetuner | None) -> None:
    if steps and tuner is None:
        raise UserError(key, steps, "asks for a fine-tune but no training data was given",
                        "Run the data stage first, or set it to 0")
