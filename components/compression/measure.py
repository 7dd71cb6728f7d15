"""Evaluate a variant folder as the evaluation stage does, and add its size.

    metrics = evaluate_variant(variant_dir, ws.dataset_dir(v), cfg.evaluation)
    metrics["bpc"], metrics["rougeL"], metrics["tokens_per_s"], metrics["weight_bytes"]

This runs the evaluation stage's measurements (bits_per_character, the shared generation
path, score_texts and the latency summary, on the same seeded sample of the split) on the
model `load_variant` rebuilds (int8 as int8, low-rank with its factors: the loader
Triton and the pyfunc run), and adds its size: params, bytes on disk, bytes of weights
in memory. The parent is measured with this too, so every row of the trade-off
table comes from the same code on the same machine within minutes.

BPC is scored on the GPU when there is one, except for a model whose kernels are CPU-only
(int8: `quantized::linear_dynamic`), which stays on the CPU; `device`, `device_reason` and
`device_fallback` (the model's kernels overrode the GPU) say which and why
(accelerator.runnable_device decides). Generation (tok/s, TTFT) runs on the CPU.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from lmforge.components.compression.variant import load_variant, variant_stats
from lmforge.components.errors import UserError
from lmforge.components.evaluation.bpc import bits_per_character
from lmforge.components.evaluation.evaluate_model import read_split, sample_records, task_examples
from lmforge.components.evaluation.latency import summarize
from lmforge.components.evaluation.text_metrics import score_texts
from lmforge.components.evaluation.timed_generation import generate
from lmforge.components.runtime.accelerator import runnable_device
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.serving.modelload import load_tokenizer
from lmforge.components.serving.task import Task


def evaluate_variant(model_dir: Path, dataset_dir: Path, cfg: EvaluationConfig) -> dict[str, Any]:
    """The metrics (floats) plus `device` ("cuda" / "cpu"), `device_reason` and `device_fallback`: where BPC
    was scored and why."""
    import torch

    started = time.perf_counter()
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        model = load_variant(Path(model_dir))
        tokenizer = load_tokenizer(model_dir)
        heldout = read_split(dataset_dir, cfg.split)
        if not heldout:
            raise UserError("dataset", dataset_dir, f"has an empty {cfg.split} split", "Use more documents (data.max_docs)")
        start_id = tokenizer.eos_token_id
        context = cfg.context_length or int(getattr(model.config, "max_position_embeddings", 512))
        rng = random.Random(cfg.seed)
        texts = [r.text for r in sample_records(heldout, cfg.bpc_max_docs, rng)]
        where = runnable_device(model)
        b = bits_per_character(model, tokenizer, texts, start_id=start_id, context_length=context,
                               batch_size=cfg.bpc_batch_size, device=where.device)
        task = Task.load(model_dir)   # the parent's, carried on in the variant's lmforge.json
        examples = task_examples(heldout, task, cfg.max_examples, rng)
        gens, wall = generate(model, tokenizer, [p for _, p, _ in examples], task,
                              max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                              max_prompt_tokens=max(1, context - cfg.max_new_tokens), temperature=cfg.temperature,
                              seed=cfg.seed)
        scores = score_texts([task.scored(g.text) for g in gens], [ref for _, _, ref in examples])
        latency = summarize([g.timing for g in gens], wall_s=wall)
        stats = variant_stats(Path(model_dir), model)
    finally:
        torch.set_num_threads(old_threads)
    return {"bpc": b.bpc, "perplexity": b.perplexity, **scores.metrics(), **latency,
            **{k: float(v) for k, v in stats.items()}, "eval_seconds": round(time.perf_counter() - started, 2),
            "device": str(where.device), "device_reason": where.reason, "device_fallback": where.fallback}
