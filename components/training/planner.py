"""Per-device memory of each training strategy, from the ZeRO paper's formulas, and the cheapest that fits.

    plan = make_plan(PlanInput(params=7e9, devices=8, memory_gb=80, precision="bf16"))
    plan.rows[0].model_states_gb     # DDP: 16 bytes/param = 112 GB for 7B
    plan.inference_gb                # bf16 inference: 2 bytes/param = 14 GB
    plan.recommended                 # the first strategy, in order of communication cost, that fits

Model states per device for Psi parameters over N data-parallel devices (Rajbhandari et al.,
2020, with mixed-precision Adam: 2 bytes of bf16 weights, 2 of bf16 gradients, K = 12 of fp32
master weights + two moments; fp32 training is 4 + 4 + 8 under DDP, and 4 + 4 + 12 under ZeRO,
because DeepSpeed's ZeRO optimizers keep their own fp32 master partition even when the
weights are fp32 already):

    DDP    (P + G + K) Psi          = 16 Psi
    ZeRO-1  P + G + K Psi / N       = 4 Psi + 12 Psi / N
    ZeRO-2  P + (G + K) Psi / N     = 2 Psi + 14 Psi / N
    ZeRO-3  (P + G + K) Psi / N     = 16 Psi / N

Optimizer offload moves the K part to host memory; parameter offload (ZeRO-3) moves P too.
ZeRO-Infinity's NVMe tier (zero3+nvme_optimizer+nvme_param) moves K Psi / N to swap files, and the
parameter partition too, P Psi / N (lmforge sets max_in_cpu = 0, components/training/nvme.py: DeepSpeed's
default would keep the first 1e9 elements a device in host memory). Host memory holds DeepSpeed's swap
buffers: 5 parameter buffers as large as the largest parameter (the embedding, V h) and 4 fp32
optimizer buffers as large as the largest sub-group partition, min(1e8, Psi / N) (lmforge's
sub_group_size). DeepSpeed swaps no tensor under 1 MiB: a small model's small tensors stay in host memory.

LoRA (`trainable` = the adapters' parameter count T): the frozen base keeps only its weights
(P Psi, partitioned under ZeRO-3), and gradients and optimizer states exist for the adapters
alone: G T and K T, partitioned as above. The adapters' own weights are counted with the base.
Activations per decoder layer (Korthikanti et al., 2022): s b h (34 + 5 a s / h) bytes at 16
bits, or 2 s b h with activation checkpointing (plus one layer recomputed), plus the logits.
Over tp tensor ranks s b h (10 + 24 / tp + 5 a s / (h tp)): the norms' and residuals' inputs stay
whole on each rank (dividing all 34 by tp, as before, undercounted them), and so do the logits.
Only the strategies a layout can run are planned: ddp and zero1 with pipeline stages, no zero3 with tp.
Pipeline and tensor parallelism divide the model first, but not evenly (`params_per_rank`): the
decoder layers' projections split over tp and the layers over pp, while the embedding, the
head (untied, as every pipeline or tensor-parallel layout requires) and the norms stay whole
on their stage, so the heaviest rank (the last stage: head and final norm, or the first:
the embedding) holds ceil(L / pp) x (block / tp + norms) + V h (+ h). The even split Psi / (pp x tp)
missed the replicated tables: on the tiny preset at 4 layers, pp 2 x tp 2, it predicted 57.5K
parameters a rank where each holds 74.0K. AutoTP alone (pp = 1) also shards the head.

Mixture of Experts (`expert_params` = E, the experts' share of Psi, over `ep` expert-parallel
ranks): the dense part (Psi - E) is replicated and ZeRO-partitioned over the dp ranks as above;
each rank holds E / ep of the experts, whose ZeRO partitions span the dp / ep ranks that hold
the same experts (DeepSpeed's expert-data-parallel group). ZeRO-3 is left out: DeepSpeed's MoE
layer refuses it. `active_params` is what one token computes with (top_k experts per layer),
the N of 6N FLOPs per token.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.components.errors import UserError

GB = 1e9  # decimal, as in the paper's and the rule of thumb's "112 GB for 7B"

# Known Llama shapes, so that activations use the real hidden size and depth.
KNOWN_SHAPES: dict[str, dict[str, int]] = {
    "7b": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "vocab_size": 32000},
    "13b": {"hidden_size": 5120, "num_layers": 40, "num_heads": 40, "vocab_size": 32000},
    "70b": {"hidden_size": 8192, "num_layers": 80, "num_heads": 64, "vocab_size": 32000},
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2+offload_optimizer", "zero3+offload_optimizer+offload_param",
              "zero3+nvme_optimizer+nvme_param")
# DeepSpeed's NVMe swap buffers in host memory (runtime/swap_tensor): offload_param's buffer_count (lmforge sizes each to
# the largest parameter, components/training/nvme.py) and offload_optimizer's buffer_count of fp32 buffers as large
# as the largest optimizer sub-group partition (zero_optimization.sub_group_size: 1e8 elements with nvme, as
# components/training/strategies.py sets it; DeepSpeed's default of 1e9 would keep 16 GB of buffers per device).
NVME_PARAM_BUFFERS, NVME_OPTIMIZER_BUFFERS, SUB_GROUP_SIZE, PARAM_BUFFER_MAX = 5, 4, 1e8, 1e8
MAX_IN_CPU = 0  # offload_param.max_in_cpu as components/training/nvme.py sets it: parameter elements kept in host memory


@dataclass(frozen=True)
class PlanInput:
    params: float
    devices: int
    memory_gb: float
    precision: str = "bf16"
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    vocab_size: int = 32000
    seq_len: int = 2048
    micro_batch: int = 1
    activation_checkpointing: bool = False
    pp: int = 1
    tp: int = 1
    label: str = ""
    trainable: float | None = None   # LoRA: the adapters' parameters; None = every parameter trains
    expert_params: float = 0.0       # MoE: the experts' parameters (all of them, part of `params`); 0 = dense
    ep: int = 1                      # MoE: expert-parallel degree
    active_params: float | None = None   # MoE: parameters one token uses; None = params


@dataclass(frozen=True)
class PlanRow:
    strategy: str
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    host_gb: float
    fits: bool
    nvme_gb: float = 0.0   # ZeRO-Infinity: bytes per device in swap files (params and optimizer states)

    @property
    def model_states_gb(self) -> float:
        return self.params_gb + self.grads_gb + self.optimizer_gb

    @property
    def total_gb(self) -> float:
        return self.model_states_gb + self.activations_gb


@dataclass(frozen=True)
class Plan:
    input: PlanInput
    dp: int
    rows: list[PlanRow] = field(default_factory=list)
    inference_gb: float = 0.0
    recommended: str | None = None
    params_per_device: float = 0.0   # parameters a device holds (before ZeRO-3 partitions them): experts / ep
    active_params: float = 0.0       # parameters one token computes with

    def to_dict(self) -> dict[str, Any]:
        return {"input": asdict(self.input), "dp": self.dp, "inference_gb": self.inference_gb,
                "recommended": self.recommended, "params_per_device": self.params_per_device,
                "active_params": self.active_params,
                "rows": [{**asdict(r), "model_states_gb": r.model_states_gb, "total_gb": r.total_gb} for r in self.rows]}


def bytes_per_param(precision: str, *, zero: bool = False) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter for Adam."""
    if precision in ("bf16", "fp16"):
        return (2, 2, 12)
    return (4, 4, 12) if zero else (4, 4, 8)


def model_state_bytes(params: float, *, strategy: str, dp: int, precision: str,
                      trainable: float | None = None) -> dict[str, float]:
    """Device and host bytes of weights, gradients and optimizer states for one strategy (per device).
    With `trainable` (LoRA) only that many parameters have gradients and optimizer states."""
    stage = 0 if strategy.startswith("ddp") else int(strategy[4])
    pb, gb, kb = bytes_per_param(precision, zero=stage > 0)
    learnt = params if trainable is None else trainable
    p, g, k = pb * params, gb * learnt, kb * learnt
    out = {"params": p / dp if stage >= 3 else p, "grads": g / dp if stage >= 2 else g,
           "optimizer": k / dp if stage >= 1 else k, "host": 0.0}
    if "offload_optimizer" in strategy:
        out["host"] += out["optimizer"]
        out["optimizer"] = 0.0
    if "offload_param" in strategy:
        out["host"] += out["params"]
        out["params"] = 0.0
    if "nvme" in strategy:  # ZeRO-Infinity: the optimizer states and the parameters (past max_in_cpu) go to swap files
        out["nvme"] = out["optimizer"] if "nvme_optimizer" in strategy else 0.0
        out["optimizer"] = 0.0 if "nvme_optimizer" in strategy else out["optimizer"]
        if "nvme_param" in strategy:
            swapped = max(0.0, out["params"] - MAX_IN_CPU * pb)
            out["nvme"] += swapped
            out["host"] = out["params"] - swapped
            out["params"] = 0.0
    return out


def nvme_host_bytes(inp: "PlanInput", *, dp: int, params: float) -> float:
    """Host memory the NVMe tier still needs per device: DeepSpeed's swap buffers (see NVME_PARAM_BUFFERS)."""
    pb = bytes_per_param(inp.precision, zero=True)[0]
    largest = min(PARAM_BUFFER_MAX, inp.vocab_size * inp.hidden_size)  # the embedding, a Llama's largest parameter
    learnt = params if inp.trainable is None else inp.trainable
    kept = min(MAX_IN_CPU, params / dp)  # ZeRO-3's parameter partition up to max_in_cpu stays in host memory
    return kept * pb + NVME_PARAM_BUFFERS * largest * pb + NVME_OPTIMIZER_BUFFERS * min(SUB_GROUP_SIZE, learnt / dp) * 4


def activation_bytes(inp: PlanInput) -> float:
    s, b, h, a, layers, t = inp.seq_len, inp.micro_batch, inp.hidden_size, inp.num_heads, inp.num_layers, inp.tp
    # Korthikanti et al.'s tensor-parallel count (their Table 2, no sequence parallelism): the 10 s b h of the norms'
    # and residuals' inputs and the dropout masks stay whole on every tensor rank; only the rest divides by t.
    full = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    per_layer = 2 * s * b * h if inp.activation_checkpointing else full  # a checkpoint keeps the layer's whole input
    recompute = full if inp.activation_checkpointing else 0.0
    # 1F1B keeps up to pp micro-batches in flight on the first stage, each holding layers/pp layers' worth.
    layers_held = layers / inp.pp * min(inp.pp, layers)
    # bf16 logits, fp32 copy for the loss, fp32 gradient: whole on every rank, whose head is replicated (pipeline)
    # or gathers its output (AutoTP).
    logits = s * b * inp.vocab_size * (2 + 4 + 4)
    return per_layer * layers_held + recompute + logits


def _check_experts(inp: PlanInput, dp: int) -> None:
    if inp.ep > 1 and not inp.expert_params:
        raise UserError("--ep", inp.ep, "spreads experts over devices, and the model has none", "Add --experts N, or drop --ep")
    if not inp.expert_params:
        return
    if inp.pp > 1 or inp.tp > 1 or inp.trainable is not None:
        raise UserError("--experts", inp.expert_params, "MoE trains data- and expert-parallel, from scratch, in lmforge",
                        "Drop --pp, --tp and --lora-r with --experts")
    if dp % inp.ep:
        raise UserError("--ep", inp.ep, f"must divide the data-parallel devices ({dp})", f"Use a divisor of {dp}")


def moe_state_bytes(inp: PlanInput, *, strategy: str, dp: int) -> dict[str, float]:
    """Model states per device with experts: the dense part over dp, this device's E / ep experts over dp / ep."""
    dense = model_state_bytes(inp.params - inp.expert_params, strategy=strategy, dp=dp, precision=inp.precision)
    experts = model_state_bytes(inp.expert_params / inp.ep, strategy=strategy, dp=dp // inp.ep, precision=inp.precision)
    return {k: dense[k] + experts[k] for k in dense}


def params_per_rank(inp: PlanInput) -> float:
    """Parameters on the heaviest rank of a pp x tp layout, from the Llama shape (see the module docstring).
    A shape whose tables alone exceed `params` (a made-up size) falls back to the even split."""
    if inp.pp * inp.tp == 1:
        return inp.params
    h, layers = inp.hidden_size, inp.num_layers
    table = inp.vocab_size * h
    blocks = inp.params - 2 * table - h  # the embedding, the untied head and the final norm are not in a block
    if blocks <= 0:
        return inp.params / (inp.pp * inp.tp)
    norms = 2 * h  # each block's two RMSNorm weights stay whole on every tensor rank
    per_layer = (blocks / layers - norms) / inp.tp + norms
    if inp.pp == 1:  # AutoTP: the head is sharded too, the embedding is not
        return layers * per_layer + table + table / inp.tp + h
    return -(-layers // inp.pp) * per_layer + table + h


def make_plan(inp: PlanInput) -> Plan:
    if inp.devices % (inp.pp * inp.tp):
        raise UserError("--devices", inp.devices, f"is not divisible by pp x tp = {inp.pp * inp.tp}",
                        "Use a multiple of pp x tp devices")
    dp = inp.devices // (inp.pp * inp.tp)
    _check_experts(inp, dp)
    local = params_per_rank(inp)
    local_trainable = None if inp.trainable is None else inp.trainable / (inp.pp * inp.tp)
    act = activation_bytes(inp)
    rows = []
    for strategy in STRATEGIES:
        if inp.expert_params and strategy.startswith("zero3"):
            continue  # DeepSpeed's MoE layer refuses ZeRO-3
        if (inp.pp > 1 and strategy.startswith(("zero2", "zero3"))) or (inp.tp > 1 and strategy.startswith("zero3")):
            continue  # the layout rules (sections/training.py): a pipeline runs ddp or zero1, AutoTP ddp to zero2
        if inp.expert_params:
            st = moe_state_bytes(inp, strategy=strategy, dp=dp)
        else:
            st = model_state_bytes(local, strategy=strategy, dp=dp, precision=inp.precision, trainable=local_trainable)
        host = nvme_host_bytes(inp, dp=dp, params=local) if "nvme" in strategy else st["host"]
        row = PlanRow(strategy, st["params"] / GB, st["grads"] / GB, st["optimizer"] / GB, act / GB, host / GB,
                      fits=False, nvme_gb=st.get("nvme", 0.0) / GB)
        rows.append(PlanRow(**{**asdict(row), "fits": row.total_gb <= inp.memory_gb}))
    recommended = next((r.strategy for r in rows if r.fits), None)
    held = local - inp.expert_params + inp.expert_params / inp.ep
    active = inp.params if inp.active_params is None else inp.active_params
    return Plan(inp, dp, rows, inference_gb=2 * inp.params / GB, recommended=recommended, params_per_device=held,
                active_params=active)


def parse_size(text: str) -> float:
    """'7b', '125M', '1.3e9', '7000000000' -> parameters."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise UserError("--model", text, "is not a model size or preset",
                        "Write e.g. 7b, 125m, 1.3e9, or a preset: tiny, demo, 125m, 1b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale


def shape_for(text: str, params: float) -> dict[str, int]:
    """A Llama shape for the size: a known one, else hidden/layers = 128 (as in Llama-7B) and 128-wide heads."""
    if text.lower() in KNOWN_SHAPES:
        return KNOWN_SHAPES[text.lower()]
    hidden = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    return {"hidden_size": hidden, "num_layers": max(1, round(hidden / 128)), "num_heads": max(1, hidden // 128),
            "vocab_size": 32000}
