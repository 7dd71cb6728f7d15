"""Quantization: int8 dynamic quantization of linear-like layers for CPU serving, and fp16/bf16 casts.

    int8_dir = quantize_int8_variant(model_dir, out / "int8", QuantizeConfig())
    bf16_dir = cast_variant(model_dir, out / "bf16", "bf16")
    model = load_variant(int8_dir)        # dynamic int8 Linear layers, rebuilt from the stored int8 weights

Dynamic int8 keeps int8 weights and quantizes activations per batch at run time, which
speeds up the Linear layers on CPU without calibration data. torch quantizes nn.Linear
only, so GPT-2's Conv1D projections first become the equivalent nn.Linear (the weight
transposed), and the logits on a few tokens are checked unchanged before quantizing. A
head tied to the input embedding stays in float with the embedding (recipe `skipped`
says so). The folder stores what the quantized model holds: each quantized Linear's int8
weight, its per-tensor scale and its float bias, in model.safetensors
(components/serving/modelload.py `save_int8`); the loader that Triton and the MLflow pyfunc carry
rebuilds exactly those layers, so every consumer runs the int8 model measured here.
config.json is marked `lmforge_int8`, so a plain `from_pretrained` refuses the folder
instead of loading int8 numbers as floats.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmforge.components.compression.modules import quantize_int8, require_linear
from lmforge.components.compression.variant import DTYPES, load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.model.projections import TIED, linearize, projections, select
from lmforge.components.sections.compression import QuantizeConfig

CONVERSION_ATOL = 1e-5


def quantize_int8_variant(model_dir: Path, out_dir: Path, cfg: QuantizeConfig) -> Path:
    model, parent = load_parent(model_dir)
    require_linear(model, model_dir)
    view = projections(model)
    skipped = {n: f"named in compression.quantize.skip {cfg.skip}" for n in select(view, cfg.skip)}
    skipped.update({n: TIED for n, p in view.items() if p.tied})
    if len(skipped) == len(view):
        raise UserError("compression.quantize.skip", cfg.skip, "skips every Linear layer, so nothing is quantized",
                        "Name fewer modules in skip")
    converted, diff = linearize_checked(model, skip=set(skipped))
    recipe = {**cfg.model_dump(mode="json"), "quantized_layers": len(view) - len(skipped), "scheme": "qint8 per-tensor dynamic",
              "skipped": skipped, "conv1d_to_linear": {"layers": len(converted), "max_abs_logit_diff": diff}}
    quantized = quantize_int8(model, skip=list(cfg.skip))
    return save_variant(quantized, out_dir, parent_dir=parent, technique="quantize-int8", recipe=recipe,
                        load={"kind": "int8", "skip": list(cfg.skip)})


def linearize_checked(model: nn.Module, *, skip: set[str]) -> tuple[list[str], float]:
    """Turn the Conv1D projections into nn.Linear (linearize) and prove on a few tokens that the logits did not
    move (within CONVERSION_ATOL) before anything is quantized; returns the names and the largest difference."""
    if not any(p.transposed and n not in skip for n, p in projections(model).items()):
        return [], 0.0
    ids = (torch.arange(8) % int(model.config.vocab_size)).unsqueeze(0)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()
        converted = linearize(model, skip=skip)
        after = model(input_ids=ids).logits.float()
    model.train(was_training)
    diff = float((before - after).abs().max())
    if diff > CONVERSION_ATOL:  # a bug in as_linear, not a user's problem
        raise AssertionError(f"Conv1D -> Linear changed the logits by {diff} (> {CONVERSION_ATOL}) in {converted[:3]}")
    return converted, diff


def cast_variant(model_dir: Path, out_dir: Path, dtype: str) -> Path:
    """The parent's weights cast to `dtype` ("bf16" or "fp16"), stored and loaded in that dtype."""
    if dtype not in ("bf16", "fp16"):
        raise UserError("compression.quantize.casts", dtype, "is not a cast this stage makes", "Use bf16 or fp16")
    model, parent = load_parent(model_dir)
    require_linear(model, model_dir)
    model = model.to(DTYPES[dtype])
    return save_variant(model, out_dir, parent_dir=parent, technique=f"cast-{dtype}", recipe={"dtype": dtype},
                        load={"kind": "hf", "dtype": dtype})

