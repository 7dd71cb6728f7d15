"""The parallel layout of a run, checked before launch: each broken rule is named.

    layout = check_layout(cfg.training, vocab_size=4096, world_size=2)
    layout.dp, layout.pp, layout.tp, layout.accum, layout.global_batch, layout.lr

world_size = dp x pp x tp. A layout DeepSpeed would reject minutes into a launch (or,
worse, accept and run wrongly) is refused here with the rule it broke and a fix.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig


class Layout(BaseModel):
    """A pydantic model, not a dataclass, because it also crosses into the ranks inside the
    request (components/training/protocol.py), where an unknown or missing field must fail."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int
    dp: int
    pp: int
    tp: int
    zero_stage: int
    micro: int
    accum: int
    global_batch: int
    lr: float
    bf16: bool
    autocast: bool  # bf16 as torch.autocast over fp32 weights (mixed_precision = "autocast"), not bf16 weights

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def world_size_of(cfg: TrainingConfig) -> int:
    """Ranks in the job: the hostfile's slots when there is one, else num_ranks."""
    if cfg.hostfile is None:
        assert cfg.num_ranks is not None, "resolve training.num_ranks with job.num_ranks_for first"
        return cfg.num_ranks
    from pathlib import Path

    path = Path(cfg.hostfile)
    if not path.is_file():
        raise UserError("training.hostfile", path, "does not exist", "Point it at a DeepSpeed hostfile (lines of `host slots=N`)")
    total = 0
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        slots = [p.split("=", 1)[1] for p in line.split()[1:] if p.startswith("slots=")]
        if not slots or not slots[0].isdigit():
            raise UserError("training.hostfile", path, f"has a line without slots=N: {line!r}",
                            "Write lines like `worker-1 slots=8`")
        total += int(slots[0])
    return total


# Measured: DeepSpeed's AutoTP shards a tied head without the embedding, and the loss then fails
# ("Target ... is out of bounds"), for lmforge's preset and a base alike.
TIED_HEAD_UNDER_AUTOTP = ("output head is tied to its input embedding, and AutoTP shards the head without the embedding "
                          "(its logits come out a vocabulary shard wide)")


def check_layout(cfg: TrainingConfig, *, vocab_size: int, world_size: int, bf16_supported: bool = True) -> Layout:
    par = cfg.parallel
    pp, tp = par.pipeline.stages, par.tensor.autotp_size

    def broken(key: str, value: Any, rule: str, fix: str) -> UserError:
        return UserError(key, value, f"breaks the layout rule: {rule}", fix)

    if cfg.model.init is not None and (pp > 1 or tp > 1):
        _check_base_split(cfg, pp=pp, tp=tp, broken=broken)
    if world_size % (pp * tp):
        raise broken("training.num_ranks", world_size,
                     f"world size must be divisible by pipeline stages x autotp_size = {pp} x {tp}",
                     f"Use a multiple of {pp * tp} ranks, or change training.parallel")
    if cfg.model.init is None:
        _check_shape(cfg, pp=pp, tp=tp, broken=broken)
    dp = world_size // (pp * tp)
    ep = par.expert_parallel
    if dp % ep:
        raise broken("training.parallel.expert_parallel", ep,
                     f"the expert-parallel degree must divide the data-parallel ranks ({dp}): each expert-parallel "
                     "group is that many data-parallel ranks sharing one set of experts",
                     f"Use an expert_parallel that divides {dp}, or a multiple of {ep} ranks")
    accum = par.pipeline.micro_batches if pp > 1 and par.pipeline.micro_batches else cfg.grad_accum_steps
    global_batch = cfg.micro_batch_size * accum * dp
    if cfg.global_batch_size is not None and cfg.global_batch_size != global_batch:
        raise broken("training.global_batch_size", cfg.global_batch_size,
                     f"global batch = micro_batch_size x accumulation x data-parallel ranks = "
                     f"{cfg.micro_batch_size} x {accum} x {dp} = {global_batch}",
                     "Change one of them, or unset global_batch_size")
    if cfg.warmup_steps > cfg.max_steps:
        raise broken("training.warmup_steps", cfg.warmup_steps, f"warmup must not exceed max_steps ({cfg.max_steps})",
                     "Lower warmup_steps")
    lr = cfg.lr * global_batch / cfg.reference_batch_size if cfg.lr_scaling else cfg.lr
    # `auto` is bf16 where the hardware runs it natively, unless this layout trains only in fp32 (fp32_only).
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_supported and fp32_only(cfg) is None)
    if pp > 1 or par.pipeline.schedule != "1f1b":
        _check_schedule(cfg, pp=pp, micro_batches=accum, bf16=bf16, broken=broken)
    assert vocab_size > 0
    return Layout(world_size=world_size, dp=dp, pp=pp, tp=tp, zero_stage=par.zero_stage, micro=cfg.micro_batch_size,
                  accum=accum, global_batch=global_batch, lr=lr, bf16=bf16,
                  autocast=bf16 and cfg.mixed_precision == "autocast")


def fp32_only(cfg: TrainingConfig) -> str | None:
    """Why this layout trains only in fp32 (precision = "auto" then resolves to fp32, an explicit bf16 is refused),
    or None when it trains in either precision."""
    if cfg.parallel.parameter_server:
        return f"the parameter-server family ({cfg.parallel.strategy}) trains in fp32 (components/training/ps/rank.py)"
    pipe = cfg.parallel.pipeline
    if pipe.stages > 1 and pipe.schedule != "1f1b":
        return (f"the {pipe.schedule} schedule trains in fp32 (DeepSpeed's bf16 keeps fp32 master weights, which the "
                "torch schedules do not reproduce yet)")
    return None


def _check_base_split(cfg: TrainingConfig, *, pp: int, tp: int, broken: Any) -> None:
    """Whether a base (training.model.init) can be split as asked, from its config.json and what its modules are
    (a model built on the meta device: no weights are read)."""
    from transformers import AutoConfig

    from lmforge.components.model.projections import projections
    from lmforge.components.training.model import meta_model
    from lmforge.components.training.pipeline_model import unsplittable

    config = AutoConfig.from_pretrained(cfg.model.init, trust_remote_code=False)
    model = meta_model(config)
    text = config.get_text_config()
    name = f"the base's {type(model).__name__}"
    if tp > 1:
        key = "training.parallel.tensor.autotp_size"
        view = projections(model).values()
        conv = sorted({p.name.rsplit(".", 1)[-1] for p in view if p.transposed})
        if conv:
            raise broken(key, tp, f"AutoTP splits nn.Linear layers, and {name}'s {', '.join(conv)} are GPT-2-style Conv1D",
                         "Set tensor.autotp_size = 1 (data parallel, ZeRO-3 to partition the weights)")
        if any(p.tied for p in view):
            raise broken(key, tp, f"{name}'s {TIED_HEAD_UNDER_AUTOTP}",
                         "Set tensor.autotp_size = 1 (data parallel, ZeRO-3 to partition the weights)")
        refused = _autotp_plan_refusal(model)
        if refused:
            raise broken(key, tp, f"DeepSpeed's AutoTP cannot split {name}: {refused}",
                         "Set tensor.autotp_size = 1 (data parallel, ZeRO-3 to partition the weights)")
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        inter = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
        if heads % tp or kv % tp or inter % tp:
            raise broken(key, tp, f"{name} has {heads} attention heads, {kv} key/value heads and an MLP width of {inter}, "
                                  f"which the TP degree must each divide", "Use a TP degree that divides all three")
    if pp > 1:
        why = unsplittable(model, seq_len=cfg.seq_len)
        if why is not None:
            raise broken("training.parallel.pipeline.stages", pp, f"{name} cannot be split into pipeline stages: {why}",
                         "Set pipeline.stages = 1 (data parallel: ddp, zero1-3)")
        if pp > text.num_hidden_layers:
            raise broken("training.parallel.pipeline.stages", pp,
                         f"more pipeline stages than {name}'s decoder layers ({text.num_hidden_layers})",
                         f"Use at most {text.num_hidden_layers} stages")
        if tp > 1:
            from lmforge.components.training.pipeline_model import tp_unshardable

            why = tp_unshardable(model.model.layers[0])  # the pipeline's blocks shard themselves (dp x pp x tp)
            if why is not None:
                raise broken("training.parallel.tensor.autotp_size", tp, f"{name} cannot be tensor-split inside pipeline "
                             f"stages: {why}", "Set tensor.autotp_size = 1, or pipeline.stages = 1 (AutoTP alone)")


def _check_schedule(cfg: TrainingConfig, *, pp: int, micro_batches: int, bf16: bool, broken: Any) -> None:
    """The pipeline schedule's own rules (components/training/schedules.py schedule_rule) and what the torch
    schedules run with."""
    from lmforge.components.training.schedules import schedule_rule

    pipe = cfg.parallel.pipeline
    key = "training.parallel.pipeline.schedule"
    if pp == 1:
        raise broken(key, pipe.schedule, "a schedule orders the micro-batches of pipeline stages, and stages = 1",
                     "Set pipeline.stages = 2 or more, or leave schedule at \"1f1b\"")
    if cfg.model.init is not None:
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(cfg.model.init).get_text_config().num_hidden_layers
    else:
        layers = cfg.model.sizes()["num_layers"]
    rule = schedule_rule(pipe.schedule, stages=pp, virtual_stages=pipe.virtual_stages, micro_batches=micro_batches,
                         blocks=layers + 2)
    if rule is not None:
        raise broken(*rule)
    if pipe.schedule == "1f1b":
        return
    if cfg.parallel.zero_stage:
        raise broken("training.parallel.strategy", cfg.parallel.strategy,
                     f"the {pipe.schedule} schedule runs on torch.distributed.pipelining with ddp (ZeRO-1's optimizer "
                     "sharding is DeepSpeed's pipeline engine's)", "Set strategy = \"ddp\", or schedule = \"1f1b\"")
    if bf16:
        raise broken("training.precision", cfg.precision, f"not yet: {fp32_only(cfg)}", "Set training.precision = \"fp32\"")
    if cfg.activation_checkpointing:
        raise broken("training.activation_checkpointing", True,
                     f"not yet: the {pipe.schedule} schedule does not recompute activations",
                     "Set activation_checkpointing = false, or schedule = \"1f1b\"")


def _autotp_plan_refusal(model: Any) -> str | None:
    """What DeepSpeed's AutoTP would refuse about the model's own tensor-parallel plan (transformers'
    `base_model_tp_plan`), asked of DeepSpeed's converter the way its engine asks it at initialize
    (Phi-3's fused projections use a partition style it does not support). The plan is the config's public
    `base_model_tp_plan`: the per-layer styles, where every refusal seen comes from; the head's entry, which
    DeepSpeed merges in from the model class, is a style it supports."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter

    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    try:
        if plan:
            TPPlanConverter.convert(plan)
    except ValueError as e:
        return str(e).split(". ")[0]
    return None


def _check_shape(cfg: TrainingConfig, *, pp: int, tp: int, broken: Any) -> None:
    """The rules a preset's shape must keep against the layout."""
    par = cfg.parallel
    sizes = cfg.model.sizes()
    heads, kv_heads, layers = sizes["num_heads"], sizes["num_kv_heads"], sizes["num_layers"]
    if sizes["hidden_size"] % heads:
        raise broken("training.model.num_heads", heads, f"hidden_size {sizes['hidden_size']} must be divisible by the heads",
                     "Pick a head count that divides hidden_size")
    if heads % kv_heads:
        raise broken("training.model.num_kv_heads", kv_heads, f"attention heads {heads} must be divisible by the key/value heads",
                     "Pick a divisor of num_heads")
    if tp > 1:
        if cfg.model.tie_embeddings:
            raise broken("training.parallel.tensor.autotp_size", tp, f"the model's {TIED_HEAD_UNDER_AUTOTP}",
                         "Set tie_embeddings = false for AutoTP runs, or tensor.autotp_size = 1")
        if heads % tp or kv_heads % tp:
            raise broken("training.parallel.tensor.autotp_size", tp,
                          f"attention heads ({heads}) and key/value heads ({kv_heads}) must be divisible by the TP degree",
                          "Use a TP degree that divides both")
        if sizes["intermediate_size"] % tp:
            raise broken("training.parallel.tensor.autotp_size", tp,
                          f"intermediate_size {sizes['intermediate_size']} must be divisible by the TP degree", "Use a divisor")
    if pp > layers:
        raise broken("training.parallel.pipeline.stages", pp, f"more pipeline stages than decoder layers ({layers})",
                     f"Use at most {layers} stages")
    if pp > 1 and cfg.model.tie_embeddings:
        raise broken("training.model.tie_embeddings", True, "a pipeline puts the embedding and the head on different stages",
                      "Set tie_embeddings = false for pipeline runs")
    if pp > 1 and not par.pipeline.partition.startswith(("type:", "parameters", "uniform")):
        raise broken("training.parallel.pipeline.partition", par.pipeline.partition,
                     "the partition method is parameters, uniform or type:<regex>", "Use one of those")
