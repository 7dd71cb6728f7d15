"""The [training] table: model, recipe and parallel layout.

    [training]
    max_steps = 200            # num_ranks unset = every visible GPU (CUDA) or 2 CPU processes
    micro_batch_size = 8
    [training.model]
    preset = "demo"            # tiny | demo | 125m | 1b; any size key below overrides the preset
    # init = "/models/qwen2-0.5b"   # or: fine-tune a local Hugging Face folder (its config.json decides the architecture)
    # init = "models:/lmforge-lm@champion"   # or a registered version: models:/<name>@<alias>, models:/<name>/<version>
    [training.model.moe]
    num_experts = 0            # > 0: a Mixture of Experts preset (Qwen3-MoE), top_k experts a token
    [training.parallel]
    strategy = "zero2"         # ddp | zero1 | zero2 | zero3 | ps-sync | async-sgd | hogwild | easgd
    expert_parallel = 1        # with experts: the ranks one layer's experts are spread over
    offload_optimizer = "none" # none | cpu | nvme (and offload_param: zero3); nvme needs zero3 and nvme_path
    [training.parallel.pipeline]
    stages = 1
    [training.parallel.tensor]
    autotp_size = 1

The batch arithmetic is global_batch = micro_batch_size x grad_accum_steps x data-parallel
ranks, where data-parallel ranks = world size / (pipeline stages x autotp_size). Whether a
layout fits the model and the world size is checked before launch
(components/training/layout.py), because it needs the dataset's vocabulary and the rank count.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ._base import NAME_PATTERN, NAME_RULE, Name, Section
from .compression import DEFAULT_LORA_TARGETS

PRESETS: dict[str, dict[str, int]] = {
    # hidden, layers, heads, kv heads, MLP width; the vocabulary comes from the dataset's tokenizer
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 128},
    "demo": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 688},
    "125m": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "intermediate_size": 2048},
    "1b": {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4, "intermediate_size": 5632},
}


# The keys that describe a from-scratch Llama's shape; with `init` the base's config.json describes it.
ARCHITECTURE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "rope_theta",
                     "tie_embeddings")


REGISTRY_SCHEME = "models:/"
REGISTRY_SHAPES = "models:/<name>@<alias> or models:/<name>/<version>"


@dataclass(frozen=True)
class RegistryRef:
    """`training.model.init` naming a registered model version: models:/<name>@<alias> or models:/<name>/<version>."""

    name: str
    alias: str | None = None
    version: str | None = None     # a positive integer, as MLflow writes it ("3")

    def __str__(self) -> str:
        return f"{REGISTRY_SCHEME}{self.name}@{self.alias}" if self.alias else f"{REGISTRY_SCHEME}{self.name}/{self.version}"

    @property
    def selector(self) -> str:
        """What the registry resolves: the alias, or the version number."""
        return self.alias or str(self.version)


def parse_registry_ref(init: str) -> RegistryRef | None:
    """The reference `init` holds; None when it is no registry reference (a folder). ValueError for a bad shape."""
    if not init.startswith(REGISTRY_SCHEME):
        return None
    rest = init[len(REGISTRY_SCHEME):]
    name, at, alias = rest.partition("@")
    if not at:
        name, slash, version = rest.partition("/")
        if not slash:
            raise ValueError(f"names no alias or version: write {REGISTRY_SHAPES}")
        if not re.fullmatch(r"[1-9][0-9]{0,8}", version):
            raise ValueError(f"has version {version!r}, which is not a positive integer: write {REGISTRY_SHAPES}")
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"has model name {name!r}, which is not a name ({NAME_RULE})")
    if not at:
        return RegistryRef(name=name, version=version)
    if not re.fullmatch(NAME_PATTERN, alias):
        raise ValueError(f"has alias {alias!r}, which is not an alias name ({NAME_RULE})")
    if alias.isdigit():
        raise ValueError(f"has alias {alias!r}, which is a number: for a version write {REGISTRY_SCHEME}{name}/{alias}")
    return RegistryRef(name=name, alias=alias)


class MoeConfig(Section):
    """Mixture of Experts on a preset: every `every`-th decoder layer's MLP becomes `num_experts` experts and a router.

    The model is transformers' Qwen3MoeForCausalLM (what the export loads as); on the ranks each
    sparse block runs as deepspeed.moe.layer.MoE (components/training/moe.py), its experts spread
    over `training.parallel.expert_parallel` ranks.
    """

    num_experts: int = Field(0, ge=0, description="experts per MoE layer; 0 = a dense model")
    top_k: int = Field(1, ge=1, description="experts each token is routed to")
    capacity_factor: float = Field(1.25, gt=0, description="training capacity per expert, as a multiple of its even share "
                                                           "of the tokens (x top_k); tokens past it are dropped")
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss added to the LM loss")
    every: int = Field(1, ge=1, description="every Nth decoder layer gets experts (layer i when (i + 1) % every == 0)")
    expert_size: int | None = Field(None, ge=8, description="each expert's MLP width; unset = the preset's intermediate_size")

    @model_validator(mode="after")
    def _routing(self) -> "MoeConfig":
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k = {self.top_k} routes each token to more experts than there are "
                             f"(num_experts = {self.num_experts}): use a top_k of at most num_experts")
        if self.num_experts == 1:
            raise ValueError("num_experts = 1 is a dense MLP with a router in front: use 0 for a dense model, or 2 or more")
        return self


class ModelConfig(Section):
    """A LlamaForCausalLM from a preset (optionally with some sizes overridden), or a local checkpoint to fine-tune.

    With `init` set, the base's config.json decides the architecture: `preset` is ignored (a config
    file may keep one for runs without init), and a size key set to anything but its default is
    an error, because the base could not honour it. The folder itself is checked where the
    stages start (components/model/basemodel.py resolve_base), not at config load, which reads no files
    and asks no registry; only the shape of a registry reference is checked here.
    """

    init: str | None = Field(
        None, description="a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a "
                          "registered version (models:/<name>@<alias>, models:/<name>/<version>), to fine-tune in "
                          "full; the data stage then tokenises with its tokenizer. Unset = a fresh model from preset")
    preset: Literal["tiny", "demo", "125m", "1b"] = Field(
        "demo", description="base sizes: tiny (tests), demo (~5M, CPU), 125m, 1b (GPUs)")
    hidden_size: int | None = Field(None, ge=8, description="overrides the preset's hidden size")
    num_layers: int | None = Field(None, ge=1, description="overrides the preset's decoder layer count")
    num_heads: int | None = Field(None, ge=1, description="overrides the preset's attention heads")
    num_kv_heads: int | None = Field(None, ge=1, description="overrides the preset's key/value heads (grouped-query attention)")
    intermediate_size: int | None = Field(None, ge=8, description="overrides the preset's MLP width")
    rope_theta: float = Field(10000.0, gt=0, description="rotary embedding base")
    tie_embeddings: bool = Field(False, description="share the input embedding with the output head")
    moe: MoeConfig = MoeConfig()

    @field_validator("init")
    @classmethod
    def _registry_shape(cls, value: str | None) -> str | None:
        try:
            if value is not None:
                parse_registry_ref(value)
        except ValueError as e:
            raise PydanticCustomError("registry_ref", "a registry reference that {problem}", {"problem": str(e)}) from None
        return value

    @model_validator(mode="after")
    def _init_or_sizes(self) -> "ModelConfig":
        if self.init is not None:
            # By value, not model_fields_set: the config crosses into the ranks as JSON, where every field is "set".
            given = [k for k in ARCHITECTURE_KEYS if getattr(self, k) != type(self).model_fields[k].default]
            if given:
                raise ValueError(f"{', '.join(given)} cannot be set together with init: the base's config.json decides "
                                 f"the architecture; remove them, or unset init to train a preset from scratch")
            if not self.init.strip():
                raise ValueError("init is empty: set it to a local model folder, or leave it out")
            if self.moe.num_experts:
                raise ValueError(f"moe.num_experts = {self.moe.num_experts} builds experts into a preset trained from "
                                 "scratch, and init sets a base: a MoE base (Qwen3-MoE, Mixtral) fine-tunes like any base, "
                                 "with its own experts; set moe.num_experts = 0 with init, or unset init")
        return self

    def sizes(self) -> dict[str, int]:
        """The preset's sizes with this table's overrides applied."""
        out = dict(PRESETS[self.preset])
        for key in out:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class PipelineParallelConfig(Section):
    """The decoder split into stages: DeepSpeed's 1F1B engine, or a torch.distributed.pipelining schedule."""

    stages: int = Field(1, ge=1, description="pipeline stages; 1 = no pipeline")
    micro_batches: int | None = Field(None, ge=1, description="micro-batches per step (the 1F1B depth); unset = grad_accum_steps")
    partition: str = Field("type:DecoderBlock", description="deepspeed partition_method: parameters | uniform | type:<regex> "
                                                            "(schedule 1f1b; the torch schedules partition by measured cost)")
    schedule: Literal["1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"] = Field(
        "1f1b", description="1f1b: DeepSpeed's PipelineEngine; interleaved-1f1b, zero-bubble (ZB-V), dualpipev: "
                            "torch.distributed.pipelining (components/training/schedules.py)")
    virtual_stages: int = Field(1, ge=1, description="model chunks per rank: 1 for 1f1b, 2 or more for interleaved-1f1b, "
                                                     "exactly 2 for zero-bubble and dualpipev")


class TensorParallelConfig(Section):
    """DeepSpeed AutoTP: attention and MLP projections sharded across ranks."""

    autotp_size: int = Field(1, ge=1, description="tensor-parallel degree; 1 = off; must divide the attention heads")


# The parameter-server family (components/training/ps/): run beside DeepSpeed by their own rank entry, not inside it.
PS_STRATEGIES = ("ps-sync", "async-sgd", "hogwild", "easgd")


class EasgdConfig(Section):
    """Elastic averaging SGD (Zhang, Choromanska, LeCun 2015): local weights pulled towards a center every tau steps."""

    alpha: float = Field(0.2, gt=0, lt=1, description="elastic coefficient: each round x_i <- x_i - alpha (x_i - center) and "
                                                      "center <- center + alpha sum_i (x_i - center); alpha x workers must "
                                                      "stay at most 1 (checked before launch)")
    tau: int = Field(4, ge=1, description="local steps between two elastic rounds (the communication period)")


class AsyncSgdConfig(Section):
    """Asynchronous SGD on a parameter server: each worker's gradient is applied as it arrives."""

    max_staleness: int = Field(4, ge=0, description="a gradient computed on weights more than this many server updates "
                                                    "old is dropped (not applied); the worker gets fresh weights back")


class Offload(enum.StrEnum):
    """Where [training.parallel] offload_optimizer / offload_param keep their tensors (DeepSpeed's offload device)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"

    def __bool__(self) -> bool:
        # `if par.offload_param:` keeps meaning "offloaded somewhere", as when the keys were booleans.
        return self is not Offload.NONE


class ParallelConfig(Section):
    """How the model and the optimizer are spread over the ranks."""

    strategy: Literal["ddp", "zero1", "zero2", "zero3", "ps-sync", "async-sgd", "hogwild", "easgd"] = Field(
        "zero2", description="ddp = ZeRO stage 0; zeroN = ZeRO stage N; ps-sync, async-sgd, hogwild, easgd = the "
                             "parameter-server family, beside DeepSpeed (components/training/ps/)")
    easgd: EasgdConfig = EasgdConfig()
    async_sgd: AsyncSgdConfig = AsyncSgdConfig()
    offload_optimizer: Offload = Field(
        Offload.NONE, description="optimizer states: none (on the device), cpu (host memory, stepped by DeepSpeedCPUAdam; "
                                  "zero2/zero3) or nvme (swap files under nvme_path, ZeRO-Infinity; zero3); true = cpu")
    offload_param: Offload = Field(Offload.NONE, description="parameters between uses: none, cpu (host memory) or nvme (swap "
                                                             "files under nvme_path); zero3; true = cpu")
    nvme_path: str | None = Field(None, description="with nvme offload: a folder on a file system that takes O_DIRECT (ext4, "
                                                    "xfs, btrfs on a local disk, ideally an NVMe SSD; not tmpfs), where each "
                                                    "run swaps to its own subfolder")
    pipeline: PipelineParallelConfig = PipelineParallelConfig()
    tensor: TensorParallelConfig = TensorParallelConfig()
    expert_parallel: int = Field(1, ge=1, description="expert-parallel degree: each MoE layer's experts are spread over "
                                                      "this many ranks; must divide model.moe.num_experts and the "
                                                      "data-parallel ranks")

    @model_validator(mode="after")
    def _combinations(self) -> "ParallelConfig":
        stage = self.zero_stage
        self._parameter_server()
        if self.offload_optimizer and stage < 2:
            raise ValueError(f"offload_optimizer needs zero2 or zero3, not {self.strategy}")
        if self.offload_param and stage != 3:
            raise ValueError(f"offload_param needs zero3, not {self.strategy}")
        self._nvme()
        if self.pipeline.stages > 1 and stage > 1:
            raise ValueError(f"pipeline parallelism runs with ddp or zero1, not {self.strategy}")
        if self.tensor.autotp_size > 1 and stage > 2:
            raise ValueError(f"AutoTP runs with ddp, zero1 or zero2, not {self.strategy}")
        if self.tensor.autotp_size > 1 and self.pipeline.stages > 1 and self.pipeline.schedule != "1f1b":
            raise ValueError(f"pipeline stages with tensor parallelism (dp x pp x tp) run on DeepSpeed's 1f1b engine, whose "
                             f"blocks shard themselves, not on schedule {self.pipeline.schedule!r}: set pipeline.schedule = "
                             f"\"1f1b\", or tensor.autotp_size = 1")
        return self

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _offload_bool(cls, value: object) -> object:
        """The booleans these keys took before the nvme tier: true = "cpu", false = "none"."""
        return ("cpu" if value else "none") if isinstance(value, bool) else value

    def _nvme(self) -> None:
        """ZeRO-Infinity's NVMe tier: ZeRO-3 only, and a folder to swap to."""
        nvme = [k for k in ("offload_optimizer", "offload_param") if getattr(self, k) is Offload.NVME]
        if nvme and self.zero_stage != 3:
            # DeepSpeed's ZeRO-1/2 optimizer (runtime/zero/stage_1_and_2.py) takes any offload device as host memory:
            # offload_optimizer = "nvme" there would silently run as "cpu".
            raise ValueError(f"{nvme[0]} = \"nvme\" needs zero3, not {self.strategy} (DeepSpeed's ZeRO-1/2 optimizer keeps "
                             "an offloaded optimizer in host memory whatever the device says): set strategy = \"zero3\", "
                             f"or {nvme[0]} = \"cpu\"")
        if nvme and not self.nvme_path:
            raise ValueError(f"{nvme[0]} = \"nvme\" needs nvme_path: set training.parallel.nvme_path to a folder on a local "
                             "file system with O_DIRECT (ext4, xfs; not tmpfs), ideally on an NVMe SSD")
        if self.nvme_path is not None and not nvme:
            raise ValueError(f"nvme_path = {self.nvme_path!r} is set, and neither offload_optimizer nor offload_param is "
                             "\"nvme\": set one of them to \"nvme\", or remove nvme_path")

    def _parameter_server(self) -> None:
        if self.strategy not in PS_STRATEGIES:
            return
        used = [name for name, on in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param),
                                      ("pipeline.stages > 1", self.pipeline.stages > 1),
                                      ("tensor.autotp_size > 1", self.tensor.autotp_size > 1),
                                      ("expert_parallel > 1", self.expert_parallel > 1)) if on]
        if used:
            raise ValueError(f"strategy {self.strategy!r} runs beside DeepSpeed, not inside it: every worker holds the whole "
                             f"model and the server the whole optimizer, so {', '.join(used)} (DeepSpeed's engine) cannot "
                             "apply; remove them, or use ddp/zero1-3")

    @property
    def parameter_server(self) -> bool:
        """One of the parameter-server family (components/training/ps/), not a DeepSpeed engine."""
        return self.strategy in PS_STRATEGIES

    @property
    def zero_stage(self) -> int:
        return int(self.strategy[-1]) if self.strategy.startswith("zero") else 0


class LoraTrainingConfig(Section):
    """LoRA as a way to train: peft adapters on the base's projections learn, the base stays frozen.

    Needs `training.model.init` (adapters on random weights learn nothing a full run would not).
    Only the adapters' parameters reach the optimizer, so gradients and Adam states shrink to the
    adapters' size; the run exports the merged weights (for serving) and the adapter (for lineage).
    """

    r: int = Field(0, ge=0, description="adapter rank; 0 = off (every weight trains)")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is B @ A x alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(list(DEFAULT_LORA_TARGETS),
                                      description="module-name suffixes that get adapters; [] = every projection in the "
                                                  "decoder blocks, which is also what the default means on a model that has "
                                                  "no q_proj/v_proj (GPT-2, GPT-NeoX, Phi-3)")


class SftConfig(Section):
    """How supervised fine-tuning examples are laid out in a batch (components/training/sft.py)."""

    batching: Literal["auto", "pack", "pad"] = Field(
        "auto", description="pack: examples share rows (attention never crosses two); pad: one example a row; "
                            "auto: whichever computes fewer tokens for this data")


class TrainingConfig(Section):
    """A causal LM trained with DeepSpeed: a preset from scratch, or a base fine-tuned in full or with LoRA."""

    seed: int = Field(0, description="seeds the weights and the data order (a function of seed, rank and step)")
    model: ModelConfig = ModelConfig()
    objective: Literal["causal", "sft"] = Field(
        "causal", description="causal: next-token loss on every token of the shards; sft: prompt/completion pairs from "
                              "the dataset's records, loss on the completion only")
    sft: SftConfig = SftConfig()
    lora: LoraTrainingConfig = LoraTrainingConfig()
    parallel: ParallelConfig = ParallelConfig()
    num_ranks: int | None = Field(None, ge=1,
                                  description="local ranks for the deepspeed launcher; unset = every visible GPU on CUDA, 2 CPU "
                                              "processes on CPU")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs; unset = this machine only")
    master_port: int | None = Field(None, ge=1024, le=65535, description="rendezvous port; unset = a free one")
    seq_len: int = Field(128, ge=8, description="tokens per training window")
    micro_batch_size: int = Field(8, ge=1, description="windows per rank per forward pass")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    global_batch_size: int | None = Field(None, ge=1,
                                          description="if set, must equal micro x accum x data-parallel ranks (a check)")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    lr: float = Field(3e-3, gt=0, lt=1, description="peak learning rate (at reference_batch_size when lr_scaling is on)")
    lr_scaling: bool = Field(False, description="scale lr linearly with global_batch / reference_batch_size")
    reference_batch_size: int = Field(16, ge=1, description="the global batch size that lr is tuned for")
    warmup_steps: int = Field(10, ge=1, description="linear warmup steps, then cosine decay to min_lr_ratio x lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine floor as a fraction of the peak lr")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(1.0, ge=0, description="gradient norm clip; 0 = off")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto",
                                                       description="auto = bf16 where it is really faster: CUDA with bf16 "
                                                                   "support, or a CPU whose measured bf16 matmul beats fp32")
    mixed_precision: Literal["bf16_weights", "autocast"] = Field(
        "bf16_weights", description="how bf16 trains: bf16_weights = DeepSpeed's bf16 (the model in bf16, an fp32 master "
                                    "copy in the optimizer); autocast = DeepSpeed's torch_autocast (fp32 weights, bf16 "
                                    "matmuls under torch.autocast, as a plain PyTorch loop runs). Not with pipeline stages; "
                                    "benchmarks/bench_train.py --device cuda measures both")
    compile: bool | None = Field(
        None, description="torch.compile the model through DeepSpeed's engine.compile(); unset = on for CUDA, off on CPU")
    activation_checkpointing: bool = Field(False, description="recompute decoder activations in backward to save memory")
    save_every: int = Field(50, ge=1, description="save a DeepSpeed checkpoint every N steps (and at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept; older ones are deleted")
    log_every: int = Field(1, ge=1, description="log metrics every N steps")
    run_name: Name | None = Field(
        None, description="the run's folder under runs/; unset = <config name>-<UTC time>; --resume picks the newest run")
    log_model_artifact: bool = Field(True, description="copy the exported model folder into MLflow as an artifact")

    @model_validator(mode="after")
    def _objective_and_adapters(self) -> "TrainingConfig":
        split = self.parallel.pipeline.stages > 1 or self.parallel.tensor.autotp_size > 1
        if self.lora.r and self.model.init is None:
            raise ValueError("lora.r > 0 trains adapters on a pretrained base: set training.model.init to its folder (or a "
                             "registry reference), or set lora.r = 0 to train every weight")
        if (self.lora.r or self.objective == "sft") and split:
            what = "LoRA" if self.lora.r else "objective = \"sft\""
            raise ValueError(f"{what} runs data-parallel only (ddp, zero1, zero2, zero3): set parallel.pipeline.stages = 1 "
                             "and parallel.tensor.autotp_size = 1")
        if self.mixed_precision == "autocast" and self.parallel.pipeline.stages > 1:
            raise ValueError("mixed_precision = \"autocast\" runs where DeepSpeed's engine runs the forward, which a "
                             "pipeline does not: set parallel.pipeline.stages = 1, or mixed_precision = \"bf16_weights\"")
        self._moe_combinations()
        if self.parallel.parameter_server:
            self._parameter_server_combinations()
        return self

    def _parameter_server_combinations(self) -> None:
        """The parameter-server family trains a preset or a base in full, causal, in fp32 (components/training/ps/)."""
        what = [name for name, on in (("lora.r > 0", self.lora.r > 0), ("objective = \"sft\"", self.objective == "sft"),
                                      ("model.moe.num_experts > 0", self.model.moe.num_experts > 0),
                                      ("precision = \"bf16\"", self.precision == "bf16"),
                                      ("compile = true", self.compile is True)) if on]
        if what:
            raise ValueError(f"strategy {self.parallel.strategy!r} (the parameter-server family) is built for full causal "
                             f"training in fp32 of a dense model, and this run sets {', '.join(what)}; the server keeps fp32 "
                             "master weights and whole-model gradients, and the adapters, SFT batching, experts and compile "
                             "ride on DeepSpeed's engine: remove them, or use ddp/zero1-3")

    def _moe_combinations(self) -> None:
        """What MoE runs with: DeepSpeed's MoE layer under DDP or ZeRO-1/2 on a preset, full causal training."""
        experts, ep, par = self.model.moe.num_experts, self.parallel.expert_parallel, self.parallel
        if not experts:
            if ep > 1:
                raise ValueError(f"parallel.expert_parallel = {ep} spreads experts over ranks, and the model has none "
                                 "(model.moe.num_experts = 0): set model.moe.num_experts, or expert_parallel = 1")
            return
        if experts % ep:
            raise ValueError(f"parallel.expert_parallel = {ep} must divide model.moe.num_experts = {experts} (each rank "
                             "of an expert-parallel group holds the same number of experts): use a divisor")
        if par.zero_stage == 3:
            raise ValueError("MoE runs with ddp, zero1 or zero2, not zero3: DeepSpeed 0.19.8 refuses its MoE layer under "
                             "ZeRO stage 3 ('Native DeepSpeed MoE is not supported with ZeRO Stage 3'); use zero2")
        if par.pipeline.stages > 1 or par.tensor.autotp_size > 1:
            raise ValueError("MoE runs data- and expert-parallel only: lmforge's pipeline stages and AutoTP split "
                             "dense decoder blocks, not DeepSpeed MoE layers; set pipeline.stages = 1 and "
                             "tensor.autotp_size = 1")
        if self.lora.r or self.objective == "sft":
            raise ValueError("MoE trains a preset from scratch with the causal objective: LoRA and objective = \"sft\" "
                             "fine-tune a base (training.model.init), and a MoE base fine-tunes like any base; set "
                             "model.moe.num_experts = 0 for them")
