"""A consolidated Hugging Face folder from a DeepSpeed engine, whatever the strategy.

    state = gather_hf_state(engine, zero_stage=3, tp=1, pp=1)     # every rank calls; the full dict on rank 0
    if rank == 0:
        write_export(run_dir / "export", state, config, tokenizer, dtype=torch.bfloat16, meta={...})
        write_export(..., tokenizer_dir=dataset / "tokenizer")   # a base's tokenizer files, copied as they are

The folder is built from the trained model's transformers config (model.py model_config): a
preset's LlamaConfig or the base's own config.json, so a fine-tuned GPT-2 exports as GPT-2.

ZeRO-3 partitions and AutoTP shards are gathered with the engine's
`_consolidated_16bit_state_dict` (a collective: every rank must call it; docs/architecture.md:
`save_16bit_model` and `module.state_dict()` hold only this rank's shard under AutoTP).
Pipeline stages send their weights, renamed to Hugging Face keys, to rank 0; with tensor parallelism inside
the stages, each stage first joins its tensor shards within its tensor group (pipeline_model.stage_hf_state).
The folder is built under a temporary name and renamed into place.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from lmforge.components.workspace import atomic_dir, atomic_write_json


def gather_hf_state(engine: Any, *, zero_stage: int, tp: int, pp: int) -> dict[str, torch.Tensor] | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    if pp > 1:
        from lmforge.components.training.pipeline_model import stage_hf_state

        parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(stage_hf_state(engine.module), parts, dst=0)
        if rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged
    if zero_stage == 3 or tp > 1:
        state = engine._consolidated_16bit_state_dict()
        return {k: v.detach().cpu() for k, v in state.items()} if rank == 0 else None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()} if rank == 0 else None


def write_export(out_dir: Path, state: dict[str, torch.Tensor], config: Any, tokenizer: Any, *,
                 dtype: torch.dtype, meta: dict[str, Any], tokenizer_dir: Path | None = None,
                 extra: dict[str, Path] | None = None) -> Path:
    """Weights as safetensors + config + generation config + tokenizer + lmforge.json, for any causal-LM config.

    With `tokenizer_dir` its tokenizer files are copied byte for byte (a base's tokenizer stays the
    base's); without it the tokenizer is saved with save_pretrained. `extra` folders are copied in under
    their names (a LoRA run's `adapter/`).
    """
    from transformers import GenerationConfig

    from lmforge.components.training.model import meta_model

    model = meta_model(config)
    state = {k: v.to(dtype) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # a tied head is one tensor with the embedding, whichever name the state dict used
    # Every parameter must now hold a trained tensor: one still on meta was in no key the engine gave.
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing and not unexpected, f"export keys: missing {missing}, unexpected {unexpected}"
    # Non-persistent buffers (rotary inv_freq) stayed on meta; the saved file never holds them.
    model.config.dtype = dtype
    model.config.use_cache = True
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, max_new_tokens=64, do_sample=False)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer_dir is None:
            tokenizer.save_pretrained(tmp)
        else:
            from lmforge.components.model.basemodel import copy_tokenizer

            copy_tokenizer(Path(tokenizer_dir), tmp)
        for name, folder in (extra or {}).items():
            shutil.copytree(folder, tmp / name)
        atomic_write_json(tmp / "lmforge.json", meta)
    return out_dir
