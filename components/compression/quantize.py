"""Quantization: int8 dynamic quantization of Linear layers for CPU serving, and fp16/bf16 casts.

    int8_dir = quantize_int8_variant(model_dir, out / "int8", QuantizeConfig())
    bf16_dir = cast_variant(model_dir, out / "bf16", "bf16")
    model = load_variant(int8_dir)        # dynamic int8 Linear layers, rebuilt from the stored int8 weights

Dynamic int8 keeps int8 weights and quantizes activations per batch at run time, which
speeds up the Linear layers on CPU without calibration data. The folder stores what
the quantized model holds: each quantized Linear's int8 weight, its per-tensor scale and
its float bias, in model.safetensors (components/modelload.py `save_int8`); the loader
that Triton and the MLflow pyfunc carry rebuilds exactly those layers, so every
consumer runs the int8 model measured here. config.json is marked `lmforge_int8`, so a
plain `from_pretrained` refuses the folder instead of loading int8 numbers as floats.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.components.compression.modules import quantize_int8, require_linear, select
from lmforge.components.compression.variant import DTYPES, load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import QuantizeConfig


def quantize_int8_variant(model_dir: Path, out_dir: Path, cfg: QuantizeConfig) -> Path:
    model, parent = load_parent(model_dir)
    layers = require_linear(model, model_dir)
    skipped = select(layers, cfg.skip)
    if len(skipped) == len(layers):
        raise UserError("compression.quantize.skip", cfg.skip, "skips every Linear layer, so nothing is quantized",
                        "Name fewer modules in skip")
    recipe = {**cfg.model_dump(mode="json"), "quantized_layers": len(layers) - len(skipped), "scheme": "qint8 per-tensor dynamic"}
    quantized = quantize_int8(model, skip=list(cfg.skip))
    return save_variant(quantized, out_dir, parent_dir=parent, technique="quantize-int8", recipe=recipe,
                        load={"kind": "int8", "skip": list(cfg.skip)})


def cast_variant(model_dir: Path, out_dir: Path, dtype: str) -> Path:
    """The parent's weights cast to `dtype` ("bf16" or "fp16"), stored and loaded in that dtype."""
    if dtype not in ("bf16", "fp16"):
        raise UserError("compression.quantize.casts", dtype, "is not a cast this stage makes", "Use bf16 or fp16")
    model, parent = load_parent(model_dir)
    require_linear(model, model_dir)
    model = model.to(DTYPES[dtype])
    return save_variant(model, out_dir, parent_dir=parent, technique=f"cast-{dtype}", recipe={"dtype": dtype},
                        load={"kind": "hf", "dtype": dtype})

