"""One rank's model and engine, built through one ordered chain of apply_* steps (components/training/rank.py).

    s = open_rank(request, rank=rank, world=world)   # the tokenizer, the batches and the model
    s = assemble(s)                                  # every step of APPLY in order, then the data-parallel coordinates
    s.engine, s.moe, s.dp_rank, s.dp_size

Each step applies one capability when the request asks for it and returns the state unchanged otherwise:

    apply_moe                        training.model.moe.num_experts: routing statistics, the auxiliary loss (moe.py)
    apply_lora                       training.lora.r > 0: adapters on the frozen base (lora_training.py)
    apply_torch_schedule             a pipeline on interleaved-1f1b, zero-bubble or dualpipev (schedules.py)
    apply_pipeline                   a pipeline on DeepSpeed's 1f1b: the model as stages (pipeline_model.py)
    apply_activation_checkpointing   training.activation_checkpointing without a pipeline (1f1b's stages take it from
                                     the DeepSpeed config; layout.py refuses it on torch's schedules)
    apply_deepspeed                  DeepSpeed's engine, unless torch's schedules built their own
    apply_moe_groups                 MoE: the expert groups DeepSpeed made are the ones the layout asked for
    apply_compile                    hardware.compile: engine.compile()

The order is the one the capabilities need: the adapters go onto the model before a pipeline cuts it into stages,
the engine's optimizer is given the parameters that train once every step that changes them has run, and the
MoE groups exist only once DeepSpeed's engine made them. Importing this module imports DeepSpeed and
transformers; rank.py imports it after reading the request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import deepspeed

from lmforge.components.training.batches import TokenWindows
from lmforge.components.training.layout import Layout
from lmforge.components.training.model import build_model, count_params, load_tokenizer
from lmforge.components.training.pipeline_model import build_pipeline
from lmforge.components.training.protocol import RankRequest
from lmforge.components.training.strategies import for_deepspeed


@dataclass(frozen=True)
class RankState:
    """What the apply_* steps build up on one rank; each step returns a new state (dataclasses.replace) or this one."""

    req: RankRequest
    rank: int
    world: int
    tokenizer: Any
    windows: Any                 # TokenWindows, or SftBatches for objective = "sft"
    model: Any                   # the Hugging Face model (with adapters after apply_lora)
    n_params: int                # counted before any adapter
    moe: Any = None              # MoeRun after apply_moe
    stages: Any = None           # DeepSpeed's 1f1b stages (a PipelineModule) after apply_pipeline
    engine: Any = None           # DeepSpeed's engine, or schedules.py's TorchPipelineEngine
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def cfg(self) -> Any:
        return self.req.training

    @property
    def layout(self) -> Layout:
        return self.req.layout

    @property
    def lora(self) -> bool:
        return self.cfg.lora.r > 0

    @property
    def torch_pp(self) -> bool:
        """A pipeline on torch.distributed.pipelining (every schedule but 1f1b), behind the same engine calls."""
        return self.layout.pp > 1 and self.cfg.parallel.pipeline.schedule != "1f1b"


def open_batches(req: RankRequest, tokenizer: Any) -> Any:
    """The run's batches: its SFT examples (sft.py, batched as decided before launch) or the token windows."""
    cfg = req.training
    if req.sft_batching is not None:
        from lmforge.components.training.sft import SFT_DIR, SftBatches

        return SftBatches.open(req.run_dir / SFT_DIR, seq_len=cfg.seq_len, seed=cfg.seed, batching=req.sft_batching,
                               pad_id=tokenizer.eos_token_id)
    return TokenWindows.open(req.shards, seq_len=cfg.seq_len, seed=cfg.seed)


def open_rank(req: RankRequest, *, rank: int, world: int) -> RankState:
    """The state before any apply_* step: the tokenizer, the batches and the model (partitioned as it is built under
    ZeRO-3 without a pipeline)."""
    cfg = req.training
    tokenizer = load_tokenizer(req.tokenizer)
    windows = open_batches(req, tokenizer)
    zero3 = req.layout.zero_stage == 3 and req.layout.pp == 1
    model = build_model(cfg.model, tokenizer, seq_len=cfg.seq_len, seed=cfg.seed,
                        zero3_config=for_deepspeed(req.ds_config) if zero3 else None)
    return RankState(req=req, rank=rank, world=world, tokenizer=tokenizer, windows=windows, model=model,
                     n_params=count_params(model))


def apply_moe(s: RankState) -> RankState:
    if not s.cfg.model.moe.num_experts:
        return s
    from lmforge.components.training.moe import MoeRun

    return replace(s, moe=MoeRun.attach(s.model, s.cfg.model.moe, ep_size=s.cfg.parallel.expert_parallel, rank=s.rank))


def apply_lora(s: RankState) -> RankState:
    if not s.lora:
        return s
    from lmforge.components.training.lora_training import with_adapters

    return replace(s, model=with_adapters(s.model, s.cfg))  # the base frozen; only the adapters reach the optimizer


def apply_torch_schedule(s: RankState) -> RankState:
    if not s.torch_pp:
        return s
    from lmforge.components.training.schedules import build_engine

    rank = s.rank
    return replace(s, engine=build_engine(s.model, s.req, s.windows,
                                          log=lambda line: print(line, flush=True) if rank == 0 else None))


def apply_pipeline(s: RankState) -> RankState:
    if s.layout.pp == 1 or s.torch_pp:
        return s
    pipe = s.req.ds_config["pipeline"]
    return replace(s, stages=build_pipeline(s.model, stages=s.layout.pp, partition=pipe["partition"],
                                            activation_checkpoint_interval=pipe["activation_checkpoint_interval"],
                                            tensor_parallel=pipe.get("tensor_parallel", 1)))


def apply_activation_checkpointing(s: RankState) -> RankState:
    if s.layout.pp > 1 or not s.cfg.activation_checkpointing:
        return s
    s.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return s


def apply_deepspeed(s: RankState) -> RankState:
    if s.torch_pp:
        return s
    net = s.model if s.stages is None else s.stages
    params: list[Any] = [p for p in net.parameters() if p.requires_grad]
    if s.moe:
        from lmforge.components.training.moe import optimizer_groups

        params = optimizer_groups(params)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=params, config=for_deepspeed(s.req.ds_config))
    keep_grad_norm(engine)
    return replace(s, engine=engine)


def apply_moe_groups(s: RankState) -> RankState:
    if s.moe:
        s.moe.check_groups(s.rank)
    return s


def apply_compile(s: RankState) -> RankState:
    if s.req.hardware.compile:
        s.engine.compile()
    return s


APPLY = (apply_moe, apply_lora, apply_torch_schedule, apply_pipeline, apply_activation_checkpointing, apply_deepspeed,
         apply_moe_groups, apply_compile)


def assemble(s: RankState) -> RankState:
    """Every step of APPLY in order, then the engine's data-parallel coordinates (checked against the layout)."""
    for apply in APPLY:
        s = apply(s)
    if s.layout.pp > 1:
        dp_rank, dp_size = s.engine.grid.get_data_parallel_rank(), s.engine.grid.get_data_parallel_world_size()
    else:  # the data-parallel group the engine reduces gradients over, from its public attributes
        dp_rank, dp_size = deepspeed.comm.get_rank(group=s.engine.data_parallel_group), s.engine.dp_world_size
    assert dp_size == s.layout.dp, (dp_size, s.layout)
    return replace(s, dp_rank=dp_rank, dp_size=dp_size)


def keep_grad_norm(engine: Any) -> None:
    """engine.get_global_grad_norm() for every precision: DeepSpeed keeps the norm its ZeRO and bf16 optimizers
    compute, but drops the one its fp32 clip (clip_fp32_gradients, no ZeRO) computes; this keeps that one too."""
    from deepspeed.runtime import engine as ds_engine

    def clip() -> None:
        engine._global_grad_norm = ds_engine.clip_grad_norm_(parameters=engine.module.parameters(),
                                                             max_norm=engine.gradient_clipping(), mpu=engine.mpu)
    engine.clip_fp32_gradients = clip
