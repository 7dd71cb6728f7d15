"""Which variants a [compression] table asks for, a check of all of them up front, and building one.

    names = plan(cfg.compression)                      # ["int8", "bf16", "prune", "channels", ...]
    names, skipped = preflight(parent_dir, cfg.compression, shard_dir=shards)   # every bad input, before any work
    path = build_variant("lowrank", parent_dir, out_root / "lowrank", cfg.compression, shard_dir=shards)

The pre-flight check loads the parent once and runs every enabled technique's own check
(layers to target, ranks a layer allows, a student smaller than its teacher, data for
the fine-tunes), so a bad value fails in seconds instead of after the first variants
were built and evaluated. A technique that does not apply to the parent's architecture at all
(channel pruning of a model without gated MLPs, e.g. GPT-2, GPT-NeoX, Phi-3's fused
gate_up_proj) is not an error of the config: it is left out of the plan, with the reason.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.components.compression.distill import distill_variant, student_config
from lmforge.components.compression.finetune import Finetuner
from lmforge.components.compression.lora import check_lora, lora_variant
from lmforge.components.compression.lowrank import check_lowrank, lowrank_variant
from lmforge.components.compression.modules import require_linear
from lmforge.components.compression.prune import (
    check_channels,
    check_prune,
    gated_mlps,
    need_tuner,
    prune_channels_variant,
    prune_variant,
)
from lmforge.components.compression.quantize import cast_variant, quantize_int8_variant
from lmforge.components.compression.variant import load_parent
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import CompressionConfig

TECHNIQUES = {"int8": "quantize-int8", "bf16": "cast-bf16", "fp16": "cast-fp16", "prune": "prune-unstructured",
              "channels": "prune-channels", "distill": "distill", "lowrank": "lowrank-svd", "lora": "lora-merged"}


def plan(cfg: CompressionConfig) -> list[str]:
    """The variant names to build, in a fixed order."""
    names: list[str] = []
    if cfg.quantize.enabled:
        names += ["int8"] if cfg.quantize.int8 else []
        names += [c for c in ("bf16", "fp16") if c in cfg.quantize.casts]
    names += ["prune"] if cfg.prune.enabled else []
    names += ["channels"] if cfg.channels.enabled else []
    names += ["distill"] if cfg.distill.enabled else []
    names += ["lowrank"] if cfg.lowrank.enabled else []
    names += ["lora"] if cfg.lora.enabled else []
    return names


def needs_data(cfg: CompressionConfig) -> bool:
    names = plan(cfg)
    return ("distill" in names or "lora" in names or ("prune" in names and cfg.prune.recovery_steps > 0)
            or ("channels" in names and cfg.channels.recovery_steps > 0))


def tuner_for(cfg: CompressionConfig, shard_dir: Path | None) -> Finetuner | None:
    return Finetuner(cfg.finetune, shard_dir=shard_dir, seed=cfg.seed) if shard_dir is not None else None


def preflight(parent_dir: Path, cfg: CompressionConfig, *,
              shard_dir: Path | None) -> tuple[list[str], dict[str, str]]:
    """Raise the first UserError any enabled technique would raise on this parent; return the plan and
    {variant: why it is not built} for the enabled techniques this architecture does not have the parts for."""
    names = plan(cfg)
    model, _ = load_parent(parent_dir)
    require_linear(model, parent_dir)
    skipped = inapplicable(model, names)
    names = [n for n in names if n not in skipped]
    tuner = tuner_for(cfg, shard_dir) if needs_data(cfg) else None
    if "prune" in names:
        check_prune(model, cfg.prune, parent_dir)
        need_tuner("compression.prune.recovery_steps", cfg.prune.recovery_steps, tuner)
    if "channels" in names:
        check_channels(model, parent_dir)
        need_tuner("compression.channels.recovery_steps", cfg.channels.recovery_steps, tuner)
    if "distill" in names:
        student_config(model.config, cfg.distill)
        need_tuner("compression.distill.steps", cfg.distill.steps, tuner)
    if "lowrank" in names:
        check_lowrank(model, cfg.lowrank, parent_dir)
    if "lora" in names:
        check_lora(model, cfg.lora, parent_dir)
        need_tuner("compression.lora.steps", cfg.lora.steps, tuner)
    return names, skipped


def inapplicable(model: object, names: list[str]) -> dict[str, str]:
    """The planned variants whose technique needs a part this model does not have, and why (by structure)."""
    out: dict[str, str] = {}
    if "channels" in names and not gated_mlps(model):  # type: ignore[arg-type]
        kind = getattr(getattr(model, "config", None), "model_type", "this model")
        out["channels"] = (f"not built: channel pruning needs gated MLPs (gate_proj/up_proj/down_proj) and the "
                           f"parent ({kind}) has none")
    return out


def build_variant(name: str, parent_dir: Path, out_dir: Path, cfg: CompressionConfig, *,
                  shard_dir: Path | None = None) -> Path:
    """Build the named variant of `parent_dir` into `out_dir` (replaced atomically)."""
    tuner = tuner_for(cfg, shard_dir) if needs_data(cfg) else None
    if name == "int8":
        return quantize_int8_variant(parent_dir, out_dir, cfg.quantize)
    if name in ("bf16", "fp16"):
        return cast_variant(parent_dir, out_dir, name)
    if name == "prune":
        return prune_variant(parent_dir, out_dir, cfg.prune, tuner=tuner)
    if name == "channels":
        return prune_channels_variant(parent_dir, out_dir, cfg.channels, tuner=tuner)
    if name == "distill":
        return distill_variant(parent_dir, out_dir, cfg.distill, tuner=tuner, seed=cfg.seed)
    if name == "lowrank":
        return lowrank_variant(parent_dir, out_dir, cfg.lowrank)
    if name == "lora":
        return lora_variant(parent_dir, out_dir, cfg.lora, tuner=tuner, seed=cfg.seed)
    raise UserError("compression variant", name, "is not a variant this stage builds", f"Choose one of {', '.join(TECHNIQUES)}")
