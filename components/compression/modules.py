"""The custom layers a variant may hold, and how they are put back at load time.

    layer = LowRankLinear.from_linear(linear, rank=16)     # W ~ (U_r S_r) @ V_r^T
    apply_lowrank(model, {"model.layers.0.mlp.up_proj": 16})  # same shapes as a saved variant
    quantize_int8(model, skip=["lm_head"])                  # torch.ao dynamic int8 Linear layers

LowRankLinear, apply_lowrank and set_module live in components/modelload.py, the loader
the server and the MLflow pyfunc carry, and are re-exported here. Only these structural
edits are ever applied when a variant is loaded, and each is driven by plain data (names
and ranks) in the variant's lmforge.json: loading never executes stored code or
unpickles anything.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lmforge.components.errors import UserError
from lmforge.components.modelload import LowRankLinear, apply_lowrank, set_module  # the loader's own layers

__all__ = ["LowRankLinear", "apply_lowrank", "count_params", "is_int8_linear", "linear_layers", "linear_weight_bytes",
           "quantize_int8", "require_linear", "select", "set_module", "weight_bytes"]


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def require_linear(model: nn.Module, model_dir: object) -> dict[str, nn.Linear]:
    """The model's Linear layers; a model with none cannot be compressed by any technique here."""
    layers = linear_layers(model)
    if not layers:
        raise UserError("compression model", model_dir, "has no Linear layers",
                        "Compress a transformer language model (e.g. the training stage's export)")
    return layers


def select(layers: dict[str, nn.Linear], suffixes: list[str]) -> dict[str, nn.Linear]:
    return {n: m for n, m in layers.items() if any(n == s or n.endswith("." + s) for s in suffixes)}


def quantize_int8(model: nn.Module, *, skip: list[str] = ()) -> nn.Module:
    """Dynamic int8 quantization of every Linear not named by a `skip` suffix (weights int8, activations
    quantized per batch at run time); deterministic, so re-applying it to the same fp weights gives the same model."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    names = [n for n in linear_layers(model) if not any(n == s or n.endswith("." + s) for s in skip)]
    with warnings.catch_warnings():
        # torch.ao eager quantization is deprecated in favour of torchao, which is not installed here.
        warnings.simplefilter("ignore")
        return quantize_dynamic(model.float(), {n: default_dynamic_qconfig for n in names}, dtype=torch.qint8)


def is_int8_linear(module: nn.Module) -> bool:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return isinstance(module, DynamicLinear)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held in memory, counting packed int8 Linear weights at their real size."""
    total = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for m in model.modules():
        if is_int8_linear(m):
            w, b = m._weight_bias()
            total += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    return total


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the Linear (and quantized Linear) weight matrices alone."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif is_int8_linear(m):
            w = m.weight()
            total += w.numel() * w.element_size()
    return total


def count_params(model: nn.Module) -> int:
    """Parameters, with tied tensors counted once and packed int8 weights counted as elements."""
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    for m in model.modules():
        if is_int8_linear(m):
            w, b = m._weight_bias()
            n += w.numel() + (b.numel() if b is not None else 0)
    return n
