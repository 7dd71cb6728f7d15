"""Every linear-like projection of a causal LM, found by what the modules are, not by their names.

    view = projections(model)                    # name -> Projection, in module order
    view["transformer.h.0.attn.c_attn"].weight   # (out, in) for Linear and GPT-2's Conv1D alike
    prefix, blocks = decoder_blocks(model)       # "model.layers", the decoder's ModuleList
    chosen = choose_targets(model, [], key="compression.prune.targets", model_dir=d)
    chosen.targets, chosen.skipped               # [] = every projection inside the decoder blocks
    converted = linearize(model)                 # Conv1D -> the equivalent nn.Linear, in place

A projection computes y = x W^T + b: an `nn.Linear`, or transformers' `Conv1D` (GPT-2), which
stores W transposed (in x out). `Projection.weight` is always the (out, in) view, so a
technique reads and writes one layout. A projection whose weight is the input embedding's
(a tied LM head: Qwen2-0.5B, GPT-2) is marked `tied`: compressing it alone would untie it, so
techniques skip it and record why. The decoder blocks are the longest `nn.ModuleList` of
one block class inside `model.base_model` (Llama's `model.layers`, GPT-2's `transformer.h`,
GPT-NeoX's `gpt_neox.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lmforge.components.errors import UserError
from lmforge.components.serving.modelload import projection_dims, set_module

__all__ = ["TIED", "Chosen", "Projection", "as_linear", "choose_targets", "decoder_blocks", "is_projection",
           "linearize", "projections", "require_projections", "select"]


@dataclass(frozen=True)
class Projection:
    name: str
    module: nn.Module
    out_features: int
    in_features: int
    transposed: bool  # weight stored in x out (Conv1D)
    block: int | None  # index of the decoder block it sits in; None outside them (e.g. the LM head)
    tied: bool  # its weight is the input embedding's

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) weight: a view, so writes through it reach the module."""
        w = self.module.weight
        return w.t() if self.transposed else w


def is_projection(module: nn.Module) -> bool:
    return projection_dims(module) is not None


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(full name, ModuleList) of the decoder's blocks: the longest ModuleList of one block class inside
    `model.base_model`; None when the model has none (then every projection is outside the blocks)."""
    base = getattr(model, "base_model", model)
    inside = {id(m) for m in base.modules()}
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if (isinstance(m, nn.ModuleList) and id(m) in inside and len(m)
                and len({type(b) for b in m}) == 1 and (best is None or len(m) > len(best[1]))):
            best = (name, m)
    return best


def _input_embedding(model: nn.Module) -> torch.Tensor | None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return getattr(emb, "weight", None)


def projections(model: nn.Module) -> dict[str, Projection]:
    """Every Linear and Conv1D of `model`, with its (out, in) size, its decoder block and whether it is tied."""
    found = decoder_blocks(model)
    block_of: dict[int, int] = {}
    if found is not None:
        for i, b in enumerate(found[1]):
            block_of.update({id(m): i for m in b.modules()})
    emb = _input_embedding(model)
    out: dict[str, Projection] = {}
    for name, m in model.named_modules():
        dims = projection_dims(m)
        if dims is None:
            continue
        out[name] = Projection(name, m, dims[0], dims[1], transposed=not isinstance(m, nn.Linear),
                               block=block_of.get(id(m)), tied=emb is not None and m.weight is emb)
    return out


def require_projections(model: nn.Module, model_dir: object) -> dict[str, Projection]:
    """The model's projections; a model with none cannot be compressed by any technique here."""
    view = projections(model)
    if not view:
        raise UserError("compression model", model_dir, "has no Linear layers",
                        "Compress a transformer language model (e.g. the training stage's export)")
    return view


def select(layers: dict, suffixes: list[str]) -> dict:
    """The entries whose name is, or ends with ".<suffix>", one of `suffixes`."""
    return {n: m for n, m in layers.items() if any(n == s or n.endswith("." + s) for s in suffixes)}


TIED = "tied to the input embedding: compressing it alone would untie it from the embedding"


@dataclass
class Chosen:
    targets: dict[str, Projection]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it is left as it is


def choose_targets(model: nn.Module, suffixes: list[str], *, key: str, model_dir: object) -> Chosen:
    """The projections a technique works on: those named by `suffixes`, or with `[]` every projection
    inside the decoder blocks. Tied projections are never targets; they and the block projections the
    suffixes leave out are recorded in `skipped` with the reason, so a partial match is never silent."""
    view = require_projections(model, model_dir)
    in_blocks = {n: p for n, p in view.items() if p.block is not None}
    named = select(view, suffixes) if suffixes else in_blocks
    if not named:
        own = sorted({n.rsplit(".", 1)[-1] for n in in_blocks or view})
        fix = f"Name module suffixes this model has ({', '.join(own)})"
        if in_blocks:
            fix += ", or set it to [] for every projection in the decoder blocks"
        raise UserError(key, suffixes, "match no Linear layer of the model" if suffixes
                        else "means every projection in the decoder blocks, and this model has no decoder blocks", fix)
    skipped = {n: TIED for n, p in named.items() if p.tied}
    skipped.update({n: f"not named in {key}" for n in in_blocks if n not in named})
    return Chosen({n: p for n, p in named.items() if not p.tied}, skipped)


def as_linear(conv: nn.Module) -> nn.Linear:
    """The nn.Linear computing exactly what a Conv1D computes (its weight transposed)."""
    out_features, in_features = projection_dims(conv)
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None, dtype=conv.weight.dtype,
                       device=conv.weight.device)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


def linearize(model: nn.Module, *, skip: set[str] = frozenset()) -> list[str]:
    """Replace every Conv1D projection (except those in `skip`) by its equivalent nn.Linear, in place, for code
    that knows nn.Linear only (torch's dynamic quantization); returns the names converted."""
    converted = [p.name for p in projections(model).values() if p.transposed and p.name not in skip]
    for name in converted:
        set_module(model, name, as_linear(model.get_submodule(name)))
    return converted
