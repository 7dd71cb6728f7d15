"""`lmforge plan`: per-device memory of each training strategy, and the cheapest that fits.

    lmforge plan --model 7b --devices 8 --memory-gb 80            # 112 GB model state for DDP, 14 GB inference
    lmforge plan --model demo --devices 2 --memory-gb 8 --seq-len 128 --micro-batch 8
    lmforge plan --model 1b --devices 4 --memory-gb 24 --tp 2 --json

--model is a preset of [training.model] (tiny, demo, 125m, 1b) or a size (7b, 13b, 350m, 1.3e9).
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from lmforge.cli.output import emit_json
from lmforge.components.sections.training import PRESETS, ModelConfig
from lmforge.components.training.model import param_count
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
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Per-device memory (weights, gradients, optimizer, activations) per strategy; recommends the cheapest that fits."""
    precision = Precision(precision).value
    if model.lower() in PRESETS:
        cfg = ModelConfig(preset=model.lower())
        s = cfg.sizes()
        params = float(param_count(cfg, vocab_size=vocab))
        shape = {"hidden_size": s["hidden_size"], "num_layers": s["num_layers"], "num_heads": s["num_heads"], "vocab_size": vocab}
    else:
        params = parse_size(model)
        shape = shape_for(model, params)
    result = make_plan(PlanInput(params=params, devices=devices, memory_gb=memory_gb, precision=precision, seq_len=seq_len,
                                 micro_batch=micro_batch, activation_checkpointing=activation_checkpointing, pp=pp, tp=tp,
                                 label=model, **shape))
    if as_json:
        emit_json(result.to_dict())
        return
    table = Table(title=f"{model}: {params / 1e9:.3g}B params on {devices} x {memory_gb:g} GB, {precision}, "
                        f"seq {seq_len} x micro-batch {micro_batch}, pp {pp} x tp {tp} x dp {result.dp}")
    table.caption = "GB per device; host = offloaded to CPU memory per device"
    for col in ("strategy", "weights", "grads", "optim", "states", "activ", "total", "host", "fits"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in result.rows:
        table.add_row(r.strategy.replace("+offload_optimizer", "+off_opt").replace("+offload_param", "+off_par"),
                      *(f"{v:.2f}" for v in (r.params_gb, r.grads_gb, r.optimizer_gb, r.model_states_gb,
                                             r.activations_gb, r.total_gb, r.host_gb)),
                      "[green]yes[/green]" if r.fits else "[red]no[/red]")
    console.print(table)
    console.print(f"inference (bf16 weights, 2 bytes/param): {result.inference_gb:.2f} GB in total, "
                  f"{result.inference_gb / (pp * tp):.2f} GB per device over pp x tp = {pp * tp}")
    if result.recommended:
        console.print(f"recommended: [bold]{result.recommended}[/bold] (the first that fits, in order of communication cost)")
    else:
        console.print("[red]nothing fits[/red]: add devices, use --tp/--pp, --activation-checkpointing or a smaller micro-batch")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
