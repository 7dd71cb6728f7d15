"""A compressed variant on disk: a Hugging Face folder plus lmforge.json, and its loader.

    model = load_variant(dir)                # any variant (or a plain export), ready for inference
    model, tok_dir = load_parent(model_dir)  # fp32, for a technique to work on
    save_variant(model, out_dir, parent_dir=model_dir, technique="prune", recipe={...})
    stats = variant_stats(dir)               # params, bytes on disk, weight bytes in memory

lmforge.json records `technique`, `recipe` (the config section it was built with plus
what it decided, e.g. the rank of each layer), `load` (how to rebuild it) and `parent`
(the parent's folder and its own lmforge.json). `load` is one of (components/serving/modelload.py
reads it: the same loader runs in evaluation, in the MLflow pyfunc and in Triton):

- `hf`: `from_pretrained` is the whole story (pruned, distilled, merged-LoRA, cast).
- `int8`: the int8 weights and their scales are stored (modelload.save_int8), and the
  dynamic int8 Linear layers are rebuilt from them at load.
- `lowrank`: model.safetensors holds the factors, and config.json the dense
  architecture under `model_type = "lmforge_lowrank"`; the loader restores the
  recorded base model type, swaps in `LowRankLinear` at the recorded ranks, then loads
  the factors strictly.
For int8 and lowrank a plain `from_pretrained` fails loudly ("unrecognized model")
instead of filling the weights it cannot read with random ones.

Nothing is ever unpickled and no stored code runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.components.compression.modules import count_params, linear_weight_bytes, weight_bytes
from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import copy_tokenizer
from lmforge.components.serving.modelload import DTYPES, MARKED_TYPES, META, WEIGHTS, load_model, read_meta, save_int8
from lmforge.components.workspace import atomic_dir, atomic_write_json

__all__ = ["DTYPES", "META", "WEIGHTS", "disk_bytes", "load_parent", "load_variant", "read_meta", "save_variant",
           "variant_stats"]

def _check_model_dir(model_dir: Path) -> Path:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError("model folder", model_dir, "has no config.json",
                        "Point at a Hugging Face folder such as runs/<run>/export or a registry download")
    return model_dir


def load_variant(model_dir: Path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild the model a folder holds, in eval mode; `dtype` overrides the stored float dtype (not for int8)."""
    model_dir = _check_model_dir(model_dir)
    try:
        return load_model(model_dir, dtype=dtype)
    except ValueError as e:  # modelload names the file and the problem
        raise UserError("model folder", model_dir, f"cannot be loaded: {e}",
                        "Rebuild the variant with this version of lmforge (lmforge run compress)") from None


def load_parent(model_dir: Path) -> tuple[nn.Module, Path]:
    """The parent in fp32 (techniques work in full precision), and the folder its tokenizer is in."""
    model_dir = _check_model_dir(model_dir)
    kind = read_meta(model_dir).get("load", {"kind": "hf"})["kind"]
    if kind == "int8":
        raise UserError("compression parent", model_dir, "is an int8 variant",
                        "Compress the float model it was built from (its lmforge.json names it under parent)")
    return load_variant(model_dir, dtype=torch.float32), model_dir


def save_variant(model: nn.Module, out_dir: Path, *, parent_dir: Path, technique: str, recipe: dict[str, Any],
                 load: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write `model` (a transformers model, possibly holding LowRankLinear) as a variant folder, atomically."""
    from safetensors.torch import save_model

    load = load or {"kind": "hf", "dtype": _dtype_name(model)}
    parent_dir = Path(parent_dir)
    parent_meta = read_meta(parent_dir)
    with atomic_dir(Path(out_dir)) as tmp:
        if load["kind"] == "int8":
            load = {**load, "base_model_type": model.config.model_type}
            save_int8(model, tmp)
        elif load["kind"] == "lowrank":
            config = model.config.to_dict()
            load = {**load, "base_model_type": config["model_type"]}
            atomic_write_json(tmp / "config.json", {**config, "model_type": MARKED_TYPES["lowrank"]})
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            save_model(model, str(tmp / WEIGHTS))  # handles tied embeddings, unlike save_file
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(parent_dir, tmp)  # whatever files the parent's tokenizer has (a base's vocab.json, ...)
        meta = {
            "technique": technique,
            "recipe": recipe,
            "load": load,
            "parent": {"path": str(parent_dir), "meta": parent_meta},
            # The lineage a downstream stage reads without walking up the parents.
            "dataset_version": parent_meta.get("dataset_version"),
            "task": parent_meta.get("task"),  # how it renders, stops and scores: the parent's (components/serving/task.py)
            **(extra or {}),
        }
        atomic_write_json(tmp / META, meta)
    return Path(out_dir)


def _dtype_name(model: nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return {v: k for k, v in DTYPES.items()}[dtype]


def disk_bytes(model_dir: Path) -> int:
    """Bytes of the stored weights (safetensors files), the part that compression changes."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def variant_stats(model_dir: Path, model: nn.Module | None = None) -> dict[str, int]:
    model = model if model is not None else load_variant(model_dir)
    return {"params": count_params(model), "disk_bytes": disk_bytes(model_dir),
            "weight_bytes": weight_bytes(model), "linear_weight_bytes": linear_weight_bytes(model)}
