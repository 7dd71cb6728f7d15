"""The custom layers a variant may hold, and how they are put back at load time.

    layer = LowRankLinear.from_linear(linear, rank=16)     # W ~ (U_r S_r) @ V_r^T
    apply_lowrank(model, {"model.layers.0.mlp.up_proj": 16})  # same shapes as a saved variant
    quantize_int8(model, skip=["lm_head"])                  # torch.ao dynamic int8 Linear layers
    linear_layers(model)                                     # name -> Linear or Conv1D (components/model/projections.py walks)

LowRankLinear, apply_lowrank and set_module live in components/serving/modelload.py, the loader
the server and the MLflow pyfunc carry, and are re-exported here. Only these structural
edits are ever applied when a variant is loaded, and each is driven by plain data (names
and ranks) in the variant's lmforge.json: loading never executes stored code or
unpickles anything.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lmforge.components.model.projections import is_projection, linearize, projections, require_projections, select
from lmforge.components.serving.modelload import LowRankLinear, apply_lowrank, set_module  # the loader's own layers

__all__ = ["LowRankLinear", "apply_lowrank", "count_params", "is_int8_linear", "linear_layers", "linear_weight_bytes",
           "quantize_int8", "require_linear", "select", "set_module", "weight_bytes"]


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear-like layer (nn.Linear and transformers' Conv1D), by name; components/model/projections.py is the one walk."""
    return {name: p.module for name, p in projections(model).items()}


def require_linear(model: nn.Module, model_dir: object) -> dict[str, nn.Module]:
    """The model's linear-like layers; a model with none cannot be compressed by any technique here."""
    return {name: p.module for name, p in require_projections(model, model_dir).items()}


def quantize_int8(model: nn.Module, *, skip: list[str] = ()) -> nn.Module:
    """Dynamic int8 quantization of every projection not named by a `skip` suffix and not tied to the input
    embedding (weights int8, activations quantized per batch at run time); Conv1D projections become their
    equivalent nn.Linear first, since torch's dynamic quantization knows nn.Linear only. Deterministic, so
    re-applying it to the same fp weights gives the same model."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    view = projections(model)
    names = [n for n, p in view.items() if not p.tied and not select({n: p}, list(skip))]
    linearize(model, skip=set(view) - set(names))
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
            w, b = m.weight(), m.bias()
            total += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    return total


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear-like (Linear, Conv1D and quantized Linear) weight matrices alone."""
    total = 0
    for m in model.modules():
        if is_projection(m):
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
            w, b = m.weight(), m.bias()
            n += w.numel() + (b.numel() if b is not None else 0)
    return n
