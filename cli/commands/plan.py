"""`lmforge plan`: per-device memory of each training strategy, and the cheapest that fits.

    lmforge plan --model 7b --devices 8 --memory-gb 80            # 112 GB model state for DDP, 14 GB inference
    lmforge plan --model demo --devices 2 --memory-gb 8 --seq-len 128 --micro-batch 8
    lmforge plan --model 1b --devices 4 --memory-gb 24 --tp 2 --json
    lmforge plan --model 7b --devices 1 --memory-gb 24 --lora-r 16          # LoRA: a frozen base plus adapter states
    lmforge plan --model /models/qwen2-0.5b --devices 2 --memory-gb 16 --lora-r 8   # a base folder: its own config.json
    lmforge plan --model demo --devices 4 --memory-gb 8 --experts 8 --top-k 2 --ep 4   # MoE: experts spread over 4 ranks

--model is a preset of [training.model] (tiny, demo, 125m, 1b), a size (7b, 13b, 350m, 1.3e9), or
a Hugging Face model folder (its config.json gives the parameters and the shape, and with
--lora-r the exact adapter size on training.lora's default targets). For a size or a preset,
--lora-r counts adapters on q_proj and v_proj as square hidden x hidden maps: 4 r hidden per layer.
--experts (a preset only, as [training.model.moe] builds it) counts every expert in the model
and top_k of them in the active parameters; --ep divides the experts' states over the ranks.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from lmforge.cli.output import emit_json
from lmforge.components.errors import UserError
from lmforge.components.sections.training import PRESETS, ModelConfig
from lmforge.components.training.planner import PlanInput, make_plan, parse_size, shape_for

console = Console()


class Precision(str, enum.Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def plan(
    model: Annotated[str, typer.Option("--model", "-m", help="preset (tiny, demo, 125m, 1b) or size (7b, 1.3e9)")] = "7b",
    devices: Annotated[int, typer.Option(help="GPUs (or CPU ranks) in the job", min=1)] = 8,
    memory_gb: Annotated[float, typer.Option("--memory-gb", help="memory per device, GB", min=0.1)] = 80.0,
    precision: Annotated[Precision, typer.Option(help="training precision of weights and activations")] = Precision.bf16,
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="tokens per sequence")] = 2048,
    micro_batch: Annotated[int, typer.Option("--micro-batch", min=1, help="sequences per device per step")] = 1,
    vocab: Annotated[int, typer.Option(help="vocabulary size, for presets and the logits", min=2)] = 32000,
    activation_checkpointing: Annotated[bool, typer.Option(
        "--activation-checkpointing", help="recompute activations in the backward pass (keeps one per layer)")] = False,
    pp: Annotated[int, typer.Option(help="pipeline stages", min=1)] = 1,
    tp: Annotated[int, typer.Option(help="tensor-parallel degree", min=1)] = 1,
    lora_r: Annotated[int, typer.Option("--lora-r", min=0, help="LoRA rank: only adapters train (0 = full)")] = 0,
    experts: Annotated[int, typer.Option("--experts", min=0, help="MoE experts per sparse layer (a preset; 0 = dense)")] = 0,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="MoE: experts each token uses")] = 1,
    ep: Annotated[int, typer.Option("--ep", min=1, help="MoE: expert-parallel degree")] = 1,
    expert_size: Annotated[int | None, typer.Option("--expert-size", min=8,
                                                    help="MoE: each expert's MLP width; unset = the preset's")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Per-device memory (weights, gradients, optimizer, activations) per strategy; recommends the cheapest that fits."""
    from lmforge.components.training.model import expert_param_count, param_count  # imports torch: only when planning

    precision = Precision(precision).value
    trainable: float | None = None
    moe: dict[str, float] = {}
    if experts and model.lower() not in PRESETS:
        raise UserError("--experts", experts, f"needs a preset (tiny, demo, 125m, 1b), and --model is {model}",
                        "Use --model <preset>, as [training.model.moe] builds experts into a preset")
    if Path(model, "config.json").is_file():
        params, shape, trainable = base_size(Path(model), lora_r)
    elif model.lower() in PRESETS:
        cfg = ModelConfig(preset=model.lower(), moe=moe_section(experts, top_k, expert_size))
        s = cfg.sizes()
        params = float(param_count(cfg, vocab_size=vocab))
        if experts:
            moe = {"expert_params": float(expert_param_count(cfg)), "ep": ep,
                   "active_params": float(param_count(cfg, vocab_size=vocab, active=True))}
        shape = {"hidden_size": s["hidden_size"], "num_layers": s["num_layers"], "num_heads": s["num_heads"], "vocab_size": vocab}
    else:
        params = parse_size(model)
        shape = shape_for(model, params)
    if lora_r and trainable is None:
        trainable = 4.0 * lora_r * shape["hidden_size"] * shape["num_layers"]
    result = make_plan(PlanInput(params=params, devices=devices, memory_gb=memory_gb, precision=precision, seq_len=seq_len,
                                 micro_batch=micro_batch, activation_checkpointing=activation_checkpointing, pp=pp, tp=tp,
                                 label=model, trainable=trainable, **moe, **shape))
    if as_json:
        emit_json(result.to_dict())
        return
    lora = f", LoRA r={lora_r}: {trainable / 1e6:.3g}M trainable" if trainable is not None else ""
    table = Table(title=f"{model}: {params / 1e9:.3g}B params{lora} on {devices} x {memory_gb:g} GB, {precision}, "
                        f"seq {seq_len} x micro-batch {micro_batch}, pp {pp} x tp {tp} x dp {result.dp}")
    table.caption = ("GB per device; host = offloaded to CPU memory per device (with nvme: DeepSpeed's swap buffers); "
                     "nvme = in ZeRO-Infinity's swap files per device")
    for col in ("strategy", "weights", "grads", "optim", "states", "activ", "total", "host", "nvme", "fits"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in result.rows:
        table.add_row(r.strategy.replace("+offload_optimizer", "+off_opt").replace("+offload_param", "+off_par")
                      .replace("_optimizer", "_opt").replace("_param", "_par"),
                      *(f"{v:.2f}" for v in (r.params_gb, r.grads_gb, r.optimizer_gb, r.model_states_gb,
                                             r.activations_gb, r.total_gb, r.host_gb, r.nvme_gb)),
                      "[green]yes[/green]" if r.fits else "[red]no[/red]")
    console.print(table)
    if experts:
        console.print(f"MoE: {experts} experts, top-{top_k}, ep {ep}: {result.params_per_device / 1e6:.3g}M params held per "
                      f"device (experts / ep), {result.active_params / 1e6:.3g}M active per token; ZeRO-3 left out "
                      f"(DeepSpeed's MoE layer refuses it)")
    console.print(f"inference (bf16 weights, 2 bytes/param): {result.inference_gb:.2f} GB in total, "
                  f"{2 * result.params_per_device / 1e9:.2f} GB on the heaviest device (pp {pp} x tp {tp})")
    if result.recommended:
        console.print(f"recommended: [bold]{result.recommended}[/bold] (the first that fits, in order of communication cost)")
    else:
        console.print("[red]nothing fits[/red]: add devices, use --tp/--pp, --activation-checkpointing or a smaller micro-batch")


def moe_section(experts: int, top_k: int, expert_size: int | None) -> Any:
    """[training.model.moe] for the flags, its own checks applied (a bad combination is a usage error)."""
    from pydantic import ValidationError

    from lmforge.components.sections.training import MoeConfig

    try:
        return MoeConfig(num_experts=experts, top_k=top_k, expert_size=expert_size)
    except ValidationError as e:
        raise UserError("--experts/--top-k", f"{experts}/{top_k}", e.errors()[0]["msg"].removeprefix("Value error, "),
                        "Change --experts or --top-k") from None


def base_size(folder: Path, lora_r: int) -> tuple[float, dict[str, int], float | None]:
    """(parameters, shape, adapter parameters or None) of a Hugging Face model folder, from its config.json alone
    (the model is built on the meta device: no weights are read)."""
    from transformers import AutoConfig

    from lmforge.components.model.adapters import adapter_targets
    from lmforge.components.sections.training import LoraTrainingConfig
    from lmforge.components.training.lora_training import FIELD, adapter_params
    from lmforge.components.training.model import meta_model

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    model = meta_model(config)
    params = float(sum(p.numel() for p in model.parameters()))
    text = config.get_text_config()
    shape = {"hidden_size": text.hidden_size, "num_layers": text.num_hidden_layers, "num_heads": text.num_attention_heads,
             "vocab_size": text.vocab_size}
    if not lora_r:
        return params, shape, None
    targets = LoraTrainingConfig().target_modules  # training.lora's default targets
    return params, shape, float(adapter_params(adapter_targets(model, r=lora_r, targets=targets, field=FIELD, where=folder),
                                               lora_r))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
