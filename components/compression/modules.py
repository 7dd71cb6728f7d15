"""The custom layers a variant may hold, and how they are put back at load time.

    layer = LowRankLinear.from_linear(linear, rank=16)     # W ~ (U_r S_r) @ V_r^T
    apply_lowrank(model, {"model.layers.0.mlp.up_proj": 16})  # same shapes as a saved variant
    quantize_int8(model, skip=["lm_head"])                  # torch.ao dynamic int8 Linear layers

Only these structural edits are ever applied when a variant is loaded, and each is
driven by plain data (names and ranks) in the variant's lmforge.json: loading never
executes stored code or unpickles anything.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lmforge.components.errors import UserError


class LowRankLinear(nn.Module):
    """y = up(down(x)): a rank-r factorisation of an out x in Linear (bias kept on `up`)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int,
                    svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> "LowRankLinear":
        """The best rank-`rank` approximation of `linear` in Frobenius and spectral norm (Eckart-Young);
        `svd` = torch.linalg.svd(W.float(), full_matrices=False) when the caller already has it."""
        u, s, vh = svd if svd is not None else torch.linalg.svd(linear.weight.detach().float(), full_matrices=False)
        layer = cls(linear.in_features, linear.out_features, rank, linear.bias is not None)
        root = s[:rank].sqrt()
        # Splitting sqrt(s) between the factors keeps both factors' scales alike (better in low precision).
        layer.down.weight.data.copy_((root[:, None] * vh[:rank]).to(linear.weight.dtype))
        layer.up.weight.data.copy_((u[:, :rank] * root[None, :]).to(linear.weight.dtype))
        if linear.bias is not None:
            layer.up.bias.data.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


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


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_lowrank(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """Swap the named Linear layers for (untrained) LowRankLinear of the given ranks, in place."""
    for name, rank in ranks.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, not Linear"
        layer = LowRankLinear(linear.in_features, linear.out_features, rank, linear.bias is not None)
        set_module(model, name, layer.to(linear.weight.dtype))
    return model


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
