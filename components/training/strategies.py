"""The DeepSpeed config of a run, built by separate, ordered, gated functions (torchtitan style).

    layout = check_layout(cfg.training, vocab_size=4096, world_size=2)
    ds = deepspeed_config(cfg.training, layout, device="cuda")   # a JSON-able dict for deepspeed.initialize

Order: base recipe -> apply_autocast -> apply_zero -> apply_offload -> apply_pipeline -> apply_tensor_parallel
-> apply_activation_checkpointing -> apply_fused_optimizer (CUDA only). Each function returns a new dict and leaves it unchanged
when its feature is off, so a layout reads as the list of what was applied (`applied(ds)`).
"""

from __future__ import annotations

import copy
from typing import Any

from lmforge.components.sections.training import ParallelConfig, TrainingConfig
from lmforge.components.training.layout import Layout

APPLIED = "lmforge_applied"  # a key DeepSpeed ignores; lists the gates that fired, for the run's record


def base_config(cfg: TrainingConfig, layout: Layout) -> dict[str, Any]:
    """Batch arithmetic, AdamW, warmup + cosine LR, clipping and precision."""
    ds: dict[str, Any] = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro,
        "gradient_accumulation_steps": layout.accum,
        "steps_per_print": 10 ** 9,  # lmforge logs its own metrics; DeepSpeed's throughput lines only add noise
        "wall_clock_breakdown": False,
        # torch's AdamW: DeepSpeed's FusedAdam is a JIT-built op, a long first build on CPU for no gain here.
        "optimizer": {"type": "AdamW", "params": {"lr": layout.lr, "betas": list(cfg.betas), "eps": 1e-8,
                                                   "weight_decay": cfg.weight_decay, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": cfg.max_steps, "warmup_num_steps": cfg.warmup_steps, "warmup_type": "linear",
            "warmup_min_ratio": 0.0, "cos_min_ratio": cfg.min_lr_ratio}},
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": layout.bf16},
        "zero_optimization": {"stage": 0},
        APPLIED: ["base"],
    }
    return ds


def _with(ds: dict[str, Any], name: str) -> dict[str, Any]:
    out = copy.deepcopy(ds)
    out[APPLIED] = [*ds[APPLIED], name]
    return out


def apply_autocast(ds: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """bf16 as torch.autocast over fp32 weights (DeepSpeed's torch_autocast) instead of bf16 weights with an fp32
    master copy: no flatten/copy between the two each step, and the numerics of a plain autocast loop."""
    if not layout.autocast:
        return ds
    out = _with(ds, "autocast")
    out["bf16"] = {"enabled": False}
    out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return out


def apply_zero(ds: dict[str, Any], par: ParallelConfig) -> dict[str, Any]:
    """ZeRO stage 1/2/3: partition optimizer states, then gradients, then parameters."""
    if par.zero_stage == 0:
        return ds
    out = _with(ds, f"zero{par.zero_stage}")
    zero: dict[str, Any] = {"stage": par.zero_stage, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    if par.zero_stage == 3:
        # Export needs the full 16-bit weights gathered on rank 0 at save time.
        zero.update({"stage3_gather_16bit_weights_on_model_save": True, "stage3_param_persistence_threshold": 1e4,
                     "stage3_prefetch_bucket_size": 5e7})
    out["zero_optimization"] = zero
    return out


# DeepSpeed's "aio" section for the NVMe tier on a CPU host: its defaults (runtime/swap_tensor/constants.py) but one
# I/O thread per request, since each rank already has only cores / ranks of the machine's cores.
AIO_CPU = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
           "overlap_events": True, "use_gds": False}


def apply_offload(ds: dict[str, Any], par: ParallelConfig) -> dict[str, Any]:
    """Optimizer states (stepped by DeepSpeedCPUAdam) and, under ZeRO-3, parameters in host memory ("cpu") or in swap
    files under nvme_path ("nvme", ZeRO-Infinity, read and written by DeepSpeed's async_io op on libaio).

    DeepSpeed swaps no tensor under 1 MiB: those partitions stay in host memory. components/training/nvme.py gives
    each run its own subfolder of nvme_path before launch and, for the parameters, sets what keeps them in the swap
    files between uses (max_in_cpu 0, no reuse distance, swap buffers sized to the model): DeepSpeed's defaults
    would keep a model under 1e9 parameter elements a rank in host memory, only the optimizer swapping."""
    if not (par.offload_optimizer or par.offload_param):
        return ds
    out = _with(ds, "offload_nvme" if "nvme" in (par.offload_optimizer, par.offload_param) else "offload")
    zero = out["zero_optimization"]
    if par.offload_optimizer:
        del out["optimizer"]["params"]["torch_adam"]  # the host optimizer is DeepSpeedCPUAdam
        zero["offload_optimizer"] = {"device": str(par.offload_optimizer), "pin_memory": False}
        if par.offload_optimizer == "nvme":
            zero["offload_optimizer"].update(nvme_path=par.nvme_path, buffer_count=4)  # param, grad, 2 Adam moments
            # The swapper keeps buffer_count fp32 buffers of the largest sub-group in host memory: DeepSpeed's 1e9
            # elements would be 16 GB of them (components/training/planner.py counts them).
            zero["sub_group_size"] = int(1e8)
    if par.offload_param:
        zero["offload_param"] = {"device": str(par.offload_param), "pin_memory": False}
        if par.offload_param == "nvme":
            zero["offload_param"].update(nvme_path=par.nvme_path, buffer_count=5)
    if "nvme" in (par.offload_optimizer, par.offload_param):
        out["aio"] = dict(AIO_CPU)
    return out


def apply_pipeline(ds: dict[str, Any], par: ParallelConfig, layout: Layout) -> dict[str, Any]:
    """deepspeed.pipe: stages and partition method (read by the rank when it builds the PipelineModule)."""
    if layout.pp == 1:
        return ds
    out = _with(ds, "pipeline")
    out["pipeline"] = {"stages": layout.pp, "partition": par.pipeline.partition, "micro_batches": layout.accum,
                       "activation_checkpoint_interval": 0}
    return out


def apply_tensor_parallel(ds: dict[str, Any], par: ParallelConfig, layout: Layout) -> dict[str, Any]:
    """DeepSpeed AutoTP: the linear layers sharded over `autotp_size` ranks.

    With pipeline stages the pipeline shards its own decoder blocks over the grid's tensor group
    (pipeline_model.py): no AutoTP section, the degree goes in the pipeline section the rank reads,
    and the batch stays micro x accum x dp, which the pipeline engine checks against the grid's
    data-parallel size (deepspeed.initialize takes the PipelineModule's grid as the mpu)."""
    if layout.tp == 1:
        return ds
    if layout.pp > 1:
        out = _with(ds, "pipeline_tensor_parallel")
        out["pipeline"]["tensor_parallel"] = layout.tp
        return out
    out = _with(ds, "tensor_parallel")
    out["tensor_parallel"] = {"autotp_size": layout.tp}
    # deepspeed.initialize checks the batch against the whole world before AutoTP forms its
    # groups, as if every rank were data-parallel; the ranks of one TP group share each batch.
    out["train_batch_size"] = layout.micro * layout.accum * layout.dp * layout.tp
    return out


def apply_activation_checkpointing(ds: dict[str, Any], cfg: TrainingConfig, layout: Layout) -> dict[str, Any]:
    """Recompute each decoder layer in backward (the rank applies it to the model or the pipeline)."""
    if not cfg.activation_checkpointing:
        return ds
    out = _with(ds, "activation_checkpointing")
    if layout.pp > 1:
        out["pipeline"]["activation_checkpoint_interval"] = 1
    out["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return out


def apply_fused_optimizer(ds: dict[str, Any], device: str) -> dict[str, Any]:
    """On CUDA, torch's AdamW with fused=True (one kernel for all parameters); not for the host optimizer of offload."""
    if device != "cuda" or not ds["optimizer"]["params"].get("torch_adam"):
        return ds
    out = _with(ds, "fused_adamw")
    out["optimizer"]["params"]["fused"] = True
    return out


def apply_universal_load(ds: dict[str, Any], universal: bool) -> dict[str, Any]:
    """An elastic resume (components/training/universal.py): the engine loads the checkpoint's universal form,
    one file per parameter and state, sliced for this world. Applied by job.py, which alone knows about resume."""
    if not universal:
        return ds
    out = _with(ds, "universal_load")
    out["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
    return out


def deepspeed_config(cfg: TrainingConfig, layout: Layout, *, device: str = "cpu") -> dict[str, Any]:
    ds = base_config(cfg, layout)
    ds = apply_autocast(ds, layout)
    ds = apply_zero(ds, cfg.parallel)
    ds = apply_offload(ds, cfg.parallel)
    ds = apply_pipeline(ds, cfg.parallel, layout)
    ds = apply_tensor_parallel(ds, cfg.parallel, layout)
    ds = apply_activation_checkpointing(ds, cfg, layout)
    ds = apply_fused_optimizer(ds, device)
    return ds


def applied(ds: dict[str, Any]) -> list[str]:
    return list(ds.get(APPLIED, []))


def for_deepspeed(ds: dict[str, Any]) -> dict[str, Any]:
    """The config as handed to deepspeed.initialize: lmforge's own bookkeeping removed."""
    return {k: v for k, v in ds.items() if k != APPLIED}
