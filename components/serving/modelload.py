"""Load any lmforge model folder as the model it is: plain export, cast, int8 or low-rank.

    model = load_model(folder)               # eval mode, in the stored dtype (fp32 for a plain export)
    tok = load_tokenizer(folder)             # pad = eos when the tokenizer has none
    save_int8(quantized_model, folder)       # int8 weights + per-tensor scales in model.safetensors

`lmforge.json` (written by components/compression/variant.py) says how: `load.kind` is
- `hf` (or no lmforge.json): `from_pretrained`, in `load.dtype` (fp32 by default);
- `int8`: model.safetensors holds each quantized Linear as `<name>.weight` (int8, out x in,
  also for a layer that was a transposed Conv1D in the parent), `<name>.weight_scale` (fp32)
  and `<name>.bias`; the loader rebuilds torch's dynamic int8 Linear from exactly those,
  so the reloaded model is the one that was measured. The
  other tensors (embeddings, norms) are stored in bf16 when that is exact (a bf16
  parent), else fp32, and loaded as fp32;
- `lowrank`: model.safetensors holds the factors; `LowRankLinear` goes in at the
  recorded ranks (in place of a Linear or a Conv1D) and the factors load strictly.
For `int8` and `lowrank`, config.json carries `model_type = lmforge_int8 / lmforge_lowrank`,
so a plain `from_pretrained` fails loudly instead of filling the weights it cannot read
with random ones; the real type is `load.base_model_type`.

Safetensors only, no stored code runs. Imports torch, transformers, safetensors and the
standard library only: the server, the pyfunc and lmforge load a folder the same way.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

META = "lmforge.json"
WEIGHTS = "model.safetensors"
MARKED_TYPES = {"int8": "lmforge_int8", "lowrank": "lmforge_lowrank"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = ".weight_scale"


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


def cache_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config: what a token's KV cache holds, per layer, K and V each."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv, head_dim


def read_meta(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / META
    return json.loads(path.read_text()) if path.is_file() else {}


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def projection_dims(module: nn.Module) -> tuple[int, int] | None:
    """(out_features, in_features) of a linear-like layer, None for anything else.

    Two kinds compute y = x W^T + b: `nn.Linear` (weight out x in) and transformers' `Conv1D`
    (GPT-2's projections: the same map with the weight stored transposed, in x out).
    """
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        return module.nf, module.nx
    return None


def apply_lowrank(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """Swap the named linear-like layers (Linear or Conv1D) for (untrained) LowRankLinear of the given ranks, in place."""
    for name, rank in ranks.items():
        linear = model.get_submodule(name)
        dims = projection_dims(linear)
        assert dims is not None, f"{name} is {type(linear).__name__}, not Linear or Conv1D"
        layer = LowRankLinear(dims[1], dims[0], rank, getattr(linear, "bias", None) is not None)
        set_module(model, name, layer.to(linear.weight.dtype))
    return model


def int8_layers(model: nn.Module) -> dict[str, nn.Module]:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, DynamicLinear)}


def int8_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that store a dynamically quantized model: int8 weights and scales, the rest as is."""
    layers = int8_layers(model)
    out: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        w, b = layer.weight(), layer.bias()
        if w.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric) or w.q_zero_point() != 0:
            raise ValueError(f"{name}: only symmetric per-tensor int8 weights are stored (got {w.qscheme()})")
        out[f"{name}.weight"] = w.int_repr().contiguous()
        out[f"{name}{SCALE}"] = torch.tensor([w.q_scale()], dtype=torch.float32)
        if b is not None:
            out[f"{name}.bias"] = b.detach().float().contiguous()
    inside = tuple(f"{n}." for n in layers)
    seen: set[int] = set()  # tied tensors (embeddings and an unquantized lm_head) are stored once
    for name, t in model.state_dict().items():
        if name.startswith(inside) or not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        t = t.detach()
        if t.dtype == torch.float32 and torch.equal(t.to(torch.bfloat16).float(), t):
            t = t.to(torch.bfloat16)  # a bf16 parent's values, exactly: half the bytes, loaded back as fp32
        out[name] = t.contiguous()
    return out


def save_int8(model: nn.Module, folder: str | Path) -> None:
    """Write model.safetensors and a marked config.json for a model holding dynamic int8 Linear layers."""
    from safetensors.torch import save_file

    folder = Path(folder)
    assert int8_layers(model), "the model holds no int8 Linear layer"
    config = model.config.to_dict()
    (folder / "config.json").write_text(json.dumps({**config, "model_type": MARKED_TYPES["int8"]}, indent=2))
    save_file(int8_tensors(model), str(folder / WEIGHTS), metadata={"format": "pt", "lmforge": "int8"})
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _base_config(folder: Path, load: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text())
    marked = raw.pop("model_type")
    if marked != MARKED_TYPES[load["kind"]]:
        raise ValueError(f"{folder / 'config.json'}: model_type is {marked!r}, expected {MARKED_TYPES[load['kind']]!r} "
                         f"for a {load['kind']} variant; rebuild the variant")
    return AutoConfig.for_model(load["base_model_type"], **raw)


def _load_int8(folder: Path, load: dict[str, Any]) -> nn.Module:
    from safetensors.torch import load_file
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(folder / WEIGHTS))
    model = AutoModelForCausalLM.from_config(_base_config(folder, load), dtype=torch.float32)
    names = sorted(k[: -len(SCALE)] for k in tensors if k.endswith(SCALE))
    assert names, f"{folder / WEIGHTS} holds no int8 layer"
    inside = tuple(f"{n}." for n in names)
    quantized = {k: tensors.pop(k) for k in list(tensors) if k.startswith(inside)}
    # The float tensors first, into the plain model; torch.ao's layers have a state_dict format of their own.
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied weight (an lm_head sharing the input embedding) is stored once, under its other name.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in tensors if k in params}
    missing = [k for k in missing if not k.startswith(inside) and not (k in params and id(params[k]) in loaded)]
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao is deprecated in favour of torchao, which is not installed
        for name in names:
            bias = quantized.get(f"{name}.bias")
            weight = quantized[f"{name}.weight"]
            # The stored int8 weight is out x in whatever the float layer was (a GPT-2 Conv1D was made a Linear
            # before quantizing), so the shapes come from it, not from the placeholder the config builds.
            out_features, in_features = weight.shape
            layer = DynamicLinear(in_features, out_features, bias_=bias is not None, dtype=torch.qint8)
            scale = float(quantized[f"{name}{SCALE}"][0])
            # Requantizing the dequantized weights gives back the stored int8 values exactly (|w| <= 127, one scale).
            q = torch.quantize_per_tensor(weight.float() * scale, scale, 0, torch.qint8)
            layer.set_weight_bias(q, bias)
            set_module(model, name, layer)
    return model


def _load_lowrank(folder: Path, load: dict[str, Any]) -> nn.Module:
    from safetensors.torch import load_model as load_safetensors
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_base_config(folder, load), dtype=torch.float32)
    model = apply_lowrank(model, {k: int(v) for k, v in load["ranks"].items()})
    missing, unexpected = load_safetensors(model, str(folder / WEIGHTS), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def load_model(folder: str | Path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The model a folder holds, in eval mode; `dtype` overrides a float model's stored dtype (not int8)."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    load = read_meta(folder).get("load") or {"kind": "hf"}
    kind = load["kind"]
    if kind == "hf":
        model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, trust_remote_code=False,
                                                     dtype=dtype or DTYPES[load.get("dtype", "fp32")])
    elif kind == "int8":
        model = _load_int8(folder, load)
    elif kind == "lowrank":
        model = _load_lowrank(folder, load)
        model = model.to(dtype) if dtype is not None else model
    else:
        raise ValueError(f"{folder / META}: load.kind {kind!r} is not one this lmforge loads (hf, int8, lowrank); "
                         "rebuild the variant with this version of lmforge")
    return model.eval()


def load_tokenizer(folder: str | Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def cpu_only_kernels(model: Any) -> list[str]:
    """What in `model` has CPU kernels only, e.g. ["quantized::linear_dynamic"]; [] when it runs anywhere.

    Decided by what the modules are, not by trying: torch's quantized modules (torch.ao.nn.quantized,
    dynamic included, and their fused and sparse kin) dispatch to fbgemm/qnnpack, which exist for the
    CPU only; so do quantized packed params and quantized tensors held anywhere else. QAT, quantizable
    and reference modules compute in float and run anywhere. Here, in the module the Triton model
    repository carries, so that serving (deploy/processing.serving_device) and evaluation
    (components/accelerator.runnable_device) ask one function.
    """
    cpu_only = ("torch.ao.nn.quantized.", "torch.ao.nn.intrinsic.quantized.", "torch.ao.nn.sparse.quantized.",
                "torch.nn.quantized.", "torch.nn.intrinsic.quantized.")
    anywhere = ("torch.ao.nn.quantized.reference.", "torch.nn.quantized._reference.")
    found: list[str] = []

    def add(kernel: str) -> None:
        if kernel not in found:
            found.append(kernel)

    for module in model.modules():
        cls = type(module)
        path = cls.__module__ + "."
        if path.startswith(cpu_only) and not path.startswith(anywhere):
            if cls.__name__.endswith("PackedParams"):
                continue  # the weights of the quantized layer that holds them, named already
            if cls.__name__ == "Linear":
                add("quantized::linear_dynamic" if ".dynamic." in path else "quantized::linear")
            else:
                add(f"quantized {cls.__name__} ({cls.__module__})")
            continue
        for key, value in vars(module).items():  # packed params a custom module holds itself
            kind = value._type().qualified_name() if type(value).__name__ == "ScriptObject" else ""
            if ".quantized." in kind:
                add(f"quantized packed params ({cls.__name__}.{key}: {kind.rsplit('.', 1)[-1]})")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if getattr(tensor, "is_quantized", False):
            add(f"quantized {tensor.dtype} tensors ({name})")
    return found
