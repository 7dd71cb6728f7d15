"""A consolidated Hugging Face folder from a DeepSpeed engine, whatever the strategy.

    state = gather_hf_state(engine, zero_stage=3, tp=1, pp=1)     # every rank calls; the full dict on rank 0
    if rank == 0:
        write_export(run_dir / "export", state, llama_cfg, tokenizer, meta={...})

ZeRO-3 partitions and AutoTP shards are gathered with the engine's
`_consolidated_16bit_state_dict` (a collective: every rank must call it; docs/architecture.md:
`save_16bit_model` and `module.state_dict()` hold only this rank's shard under AutoTP).
Pipeline stages send their weights, renamed to Hugging Face keys, to rank 0.
The folder is built under a temporary name and renamed into place.
"""

from __future__ import annotations

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


def write_export(out_dir: Path, state: dict[str, torch.Tensor], llama_cfg: Any, tokenizer: Any, *,
                 dtype: torch.dtype, meta: dict[str, Any]) -> Path:
    """LlamaForCausalLM weights as safetensors + config + generation config + tokenizer + lmforge.json."""
    from transformers import GenerationConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_cfg)
    state = {k: v.to(dtype) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (llama_cfg.tie_word_embeddings and k == "lm_head.weight")]
    assert not missing and not unexpected, f"export keys: missing {missing}, unexpected {unexpected}"
    if llama_cfg.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) stayed on meta; the saved file never holds them.
    model.config.dtype = dtype
    model.config.use_cache = True
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, max_new_tokens=64, do_sample=False)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "lmforge.json", meta)
    return out_dir
