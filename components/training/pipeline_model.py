"""A Llama-style decoder as a deepspeed.pipe.PipelineModule: embedding, decoder blocks, norm + head.

    pipe = build_pipeline(model, stages=2, partition="type:DecoderBlock")     # the loss is lm_loss, on the last stage
    pipe = build_pipeline(model, stages=2, partition="type:DecoderBlock", tensor_parallel=2)  # dp x pp x tp
    loss = engine.train_batch(iter(micro_batches))          # 1F1B over the micro-batches
    hf_state = stage_hf_state(pipe)                          # this stage's weights under HF names (TP shards joined)

Only hidden states travel between stages, so each decoder block carries its own rotary
embedding and builds the position ids itself; attention is SDPA with `is_causal`, so no
mask crosses a stage boundary. The blocks reuse the modules of a built model (lmforge's
Llama, or a base of any architecture `unsplittable` accepts), so a pipeline run starts from
exactly the weights of the other strategies.

With `tensor_parallel` > 1 the ranks form DeepSpeed's PipeModelDataParallelTopology (world =
pp x dp x tp) and each decoder block's projections are sharded over the grid's tensor (slice)
group with DeepSpeed's own AutoTP training layers, in Megatron's layout: q/k/v and gate/up
column-parallel (LinearLayer: identity forward, gradient all-reduce backward), o and down
row-parallel (LinearAllreduce: output all-reduce forward). Every rank builds the full model from
the same seed and keeps its slice, so the sharded model computes what the whole one does. HF
attention reshapes with -1 heads, so a shard of q/k/v runs heads/tp and kv_heads/tp heads with
the same grouping. The embedding, the norms and the head stay replicated. Gradient clipping
needs each gradient counted once in the norm: DeepSpeed counts parameters marked model-parallel
on every rank and the rest only on tensor rank 0 (ZeRO, bf16) or only on rank 0 of the whole
pp x tp group (the fp32 clip, runtime/utils.py clip_grad_norm_, which so missed every later
stage's weights even without tp), so the sharded weights carry DeepSpeed's mark and the
replicated ones are marked on tensor rank 0 (`mark_for_grad_norm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EmbedBlock(nn.Module):
    hf_prefix = "model."

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderBlock(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.hf_prefix = f"model.layers.{index}."

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        cos_sin = self.rotary(hidden, positions)
        out = self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {self.hf_prefix + k: v for k, v in self.layer.state_dict().items()}


class NormHeadBlock(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {"model.norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}


def _embed_state(block: EmbedBlock) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": block.embed_tokens.weight}


EmbedBlock.hf_state = _embed_state  # type: ignore[attr-defined]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, in fp32 whatever the compute precision."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


LLAMA_STYLE = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


def unsplittable(model: Any, *, seq_len: int) -> str | None:
    """Why the pipeline cannot split `model` (None when it can), by what the model is made of.

    The stages below take a Llama-style decoder: `model.embed_tokens`, a ModuleList `model.layers`
    of blocks called with rotary `position_embeddings`, `model.norm`, the model's own
    `model.rotary_emb` and an `lm_head` of its own (Llama, Mistral, Qwen2, Phi-3 are built so;
    GPT-2 and GPT-NeoX are not). A head tied to the embedding would sit on two stages, and a
    sliding window shorter than seq_len needs a mask, which no stage boundary carries.
    """
    missing = [name for name in LLAMA_STYLE if not _has(model, name)]
    if missing:
        return (f"it is not a Llama-style decoder (it has no {', '.join(missing)}); the pipeline splits models made of "
                f"{', '.join(LLAMA_STYLE)}, such as Llama, Mistral, Qwen2 and Phi-3")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        return "its output head is tied to the input embedding, and a pipeline puts those on different stages"
    window = getattr(model.config, "sliding_window", None)
    if window and window < seq_len and getattr(model.config, "use_sliding_window", True):
        return f"its attention is windowed ({window} tokens, shorter than seq_len {seq_len}), which needs a mask"
    return None


def _has(model: Any, dotted: str) -> bool:
    try:
        model.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def pipeline_layers(model: Any) -> list[nn.Module]:
    inner = model.model
    rotary = type(inner.rotary_emb)  # the architecture's own rotary embedding, one per block (buffers only)
    blocks: list[nn.Module] = [EmbedBlock(inner.embed_tokens)]
    blocks += [DecoderBlock(layer, rotary(config=model.config), i) for i, layer in enumerate(inner.layers)]
    blocks.append(NormHeadBlock(inner.norm, model.lm_head))
    return blocks


def build_pipeline(model: Any, *, stages: int, partition: str, activation_checkpoint_interval: int = 0,
                   tensor_parallel: int = 1) -> Any:
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = dist.get_world_size()
    assert world % (stages * tensor_parallel) == 0, (world, stages, tensor_parallel)  # check_layout refused it before
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor_parallel,
                                             num_dp=world // (stages * tensor_parallel))
    # Only the decoder blocks are recomputed: DeepSpeed's default (reentrant) checkpoint of the embedding, whose input
    # ids need no gradient, returns an output without one, and the backward failed ("element 0 of tensors does not
    # require grad").
    pipe = PipelineModule(layers=pipeline_layers(model), topology=topology, partition_method=partition,
                          loss_fn=lm_loss, activation_checkpoint_interval=activation_checkpoint_interval,
                          checkpointable_layers=[DecoderBlock.__name__])
    if tensor_parallel > 1:
        shard_decoder_blocks(pipe, model.config)
    mark_for_grad_norm(pipe)
    return pipe


# Megatron's split of a Llama-style block: these projections' output features are sharded (column
# parallel), those' input features (row parallel, whose partial outputs are summed by an all-reduce).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
TP_ATTR = "lmforge_tp_group"  # on the PipelineModule: the tensor group its blocks are sharded over


def tp_unshardable(layer: nn.Module) -> str | None:
    """Why a decoder layer's projections cannot take the column/row split (None when they can):
    its nn.Linear modules must be exactly the seven of a Llama-style block, under self_attn and mlp."""
    linears = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    expected = {f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
    if linears != expected:
        return (f"its decoder layer's projections are {', '.join(sorted(linears)) or 'not nn.Linear'}, not the separate "
                f"{', '.join(sorted(expected))} the tensor-parallel split shards")
    return None


def shard_decoder_blocks(pipe: Any, config: Any) -> None:
    """Replace this stage's decoder-block projections by DeepSpeed's AutoTP training layers over the grid's
    tensor group; each rank keeps its slice of the full weights it was built with."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    set_autotp_mode(training=True)  # DeepSpeed's layers freeze their weights unless in training mode
    group, tp = pipe._grid.get_slice_parallel_group(), pipe._grid.get_slice_parallel_world_size()
    meta = AutoTPMeta.from_model_config(config)
    for block in pipe.forward_funcs:
        if not isinstance(block, DecoderBlock):
            continue
        why = tp_unshardable(block.layer)
        assert why is None, why  # layout.py refused such a model before launch
        for parent_name, parent in (("self_attn", block.layer.self_attn), ("mlp", block.layer.mlp)):
            for name in COLUMN_PARALLEL + ROW_PARALLEL:
                full = getattr(parent, name, None)
                if full is None:
                    continue
                shape = tuple(full.weight.shape)
                cls = LinearLayer if name in COLUMN_PARALLEL else LinearAllreduce
                sharded = cls(full, group, name=f"{block.hf_prefix}{parent_name}.{name}", tp_meta=meta)
                dim = 0 if name in COLUMN_PARALLEL else 1
                assert sharded.weight.shape[dim] * tp == shape[dim], (name, shape, tuple(sharded.weight.shape))
                setattr(parent, name, sharded)
    setattr(pipe, TP_ATTR, group)


def mark_for_grad_norm(pipe: Any) -> None:
    """Count every gradient exactly once in DeepSpeed's global norm (and so in clipping).

    DeepSpeed sums squared gradient norms over the grid's model-parallel group (all stages and tensor
    ranks of one data-parallel replica), counting a parameter on a rank when it is marked model-parallel
    or when the rank is tensor rank 0 (ZeRO, bf16) or model-parallel rank 0 (the fp32 clip in
    runtime/utils.py clip_grad_norm_, which is rank 0 of the whole pp x tp group, not of the stage).
    Sharded weights are marked by DeepSpeed's layers; a replicated parameter is marked on tensor rank
    0 only, so the later stages' replicated weights count too and the tensor copies do not count tp times.
    """
    if pipe._grid.get_slice_parallel_rank() != 0:
        return
    for p in pipe.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            p.model_parallel = True


def split_dim(hf_key: str) -> int | None:
    """The dimension a Hugging Face weight is sharded along under the tensor-parallel split, None when replicated."""
    module, param = hf_key.rsplit(".", 2)[-2:]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and param == "weight":
        return 1  # a row-parallel bias is added once, after the all-reduce: replicated
    return None


def split_hf_state(state: dict[str, torch.Tensor], *, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Tensor rank `rank`'s slice of a full state dict (what shard_decoder_blocks leaves on that rank)."""
    return {k: (v if split_dim(k) is None else v.chunk(tp, dim=split_dim(k))[rank]) for k, v in state.items()}


def merge_hf_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state dict from every tensor rank's slice, in tensor-rank order: shards concatenated along
    their split dimension, replicated tensors taken from rank 0."""
    out = {}
    for k, v in shards[0].items():
        dim = split_dim(k)
        out[k] = v if dim is None else torch.cat([s[k] for s in shards], dim=dim)
    return out


def stage_hf_state(pipe: Any) -> dict[str, torch.Tensor]:
    """This stage's weights under Hugging Face names, on CPU; on a DeepSpeed PipelineModule, from the stage's first
    data-parallel replica and tensor rank only, {} from the others, which hold copies (so the export's gather moves
    one copy of each stage). Under tensor parallelism every rank of the stage's tensor group must call it: the
    shards are joined within the group."""
    out: dict[str, torch.Tensor] = {}
    for layer in pipe.forward_funcs:
        if hasattr(layer, "hf_state"):
            out.update({k: v.detach().cpu() for k, v in layer.hf_state().items()})
    group = getattr(pipe, TP_ATTR, None)
    if group is not None:
        import torch.distributed as dist

        shards: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shards, out, group=group)
        out = merge_hf_shards(shards)
    grid = getattr(pipe, "_grid", None)  # a DeepSpeed PipelineModule's; the torch schedules' chunks have none
    if grid is None or (grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0):
        return out
    return {}


class IdleClock:
    """How long this pipeline stage computed, and how long it spent outside the 1F1B schedule.

        clock = IdleClock.attach(engine)     # a deepspeed PipelineEngine
        t0 = time.perf_counter(); engine.train_batch(it)
        idle = clock.idle_fraction(time.perf_counter() - t0)

    The bubble of a stage is the part of its schedule in which it does no forward or
    backward work: 1 - (forward + backward) / (step time - optimizer and gradient reduction).
    Waits at the end of the step (a later stage finishing its last backward) count, which is
    why this does not time the send/receive instructions alone; a barrier of the pipeline's
    stages before the first end-of-batch instruction (ReduceTiedGrads) keeps them out of the
    optimizer step, whose clipping all-reduce across the stages would otherwise absorb them as
    "outside" time (1F1B then read about (p-1)/m x 3/4 at p = 2). rank.py bounds a logged step
    with a barrier before and after `train_batch`, so every stage's step spans the same
    schedule (as torch's schedules do in schedules.py); without it a stage's clock starts when
    its own previous optimizer step ends, and the waits the formula counts go partly unseen.

    On CUDA the clock waits for the device (torch.cuda.synchronize on the engine's device)
    before each reading: kernels run asynchronously, so without it an instruction's time would
    be the time to launch its kernels, and the compute would look near zero and the idle
    fraction near one. The syncs cost a little overlap between instructions; on the CPU,
    where every op is done when it returns, there is nothing to wait for and none is made.
    """

    def __init__(self) -> None:
        self.compute = 0.0
        self.outside = 0.0

    @classmethod
    def attach(cls, engine: Any) -> "IdleClock":
        import time

        from deepspeed.runtime.pipe import schedule

        clock = cls()
        device = torch.device(engine.device)

        def now() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the queued kernels finish first: see the docstring
            return time.perf_counter()

        compute = (schedule.ForwardPass, schedule.BackwardPass)
        outside = (schedule.OptimizerStep, schedule.ReduceGrads, schedule.ReduceTiedGrads)

        def timed(fn: Any, bucket: str, *, end_of_schedule: bool = False) -> Any:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                if end_of_schedule:
                    # The schedule ends when the last stage is done: a stage that finished early waits here, as
                    # idle. Without it the wait hid in the optimizer step's clipping all-reduce (across the stages),
                    # which is outside, and 1F1B read below (p-1)/m.
                    torch.distributed.barrier(group=self.grid.get_pipe_parallel_group())
                t0 = now()  # work queued before this instruction is not its time
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    setattr(clock, bucket, getattr(clock, bucket) + now() - t0)
            return run

        table = {}
        for k, v in type(engine)._INSTRUCTION_MAP.items():
            table[k] = (timed(v, "compute") if k in compute
                        else timed(v, "outside", end_of_schedule=k is schedule.ReduceTiedGrads) if k in outside else v)
        # An instance attribute shadows the class's instruction table for this engine only.
        engine._INSTRUCTION_MAP = table
        return clock

    def idle_fraction(self, step_seconds: float) -> float:
        schedule_s = max(step_seconds - self.outside, 1e-9)
        out = max(0.0, 1.0 - self.compute / schedule_s)
        self.compute = self.outside = 0.0
        return out
