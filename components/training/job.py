"""A training job from the [training] section and the dataset's paths: checked, then ready to launch.

    job = prepare_job(cfg.training, shards=ws.training_shards(v), tokenizer=ws.dataset_dir(v) / "tokenizer",
                      run_dir=ws.run_dir("demo-20260101-120000"), resume=False, meta={"dataset_version": v})
    result = launch(job.launch)            # components/training/launcher.py
    job.ds_config, job.layout              # what was generated, for the run's record
    job.hardware.summary()                 # device, precision and why, peak FLOP/s and its source
    job.base                               # with training.model.init: the checked base (components/model/basemodel.py)

prepare_job runs the steps of PREPARE in order over a Draft, each applying one check or decision when the
config asks for it, the way assemble.py's APPLY builds a rank (tokenizer and task, base, shards, ranks,
hardware, layout, parameter server, resume/elastic, SFT, LoRA, DeepSpeed, NVMe). Everything that can be
checked before ranks start is checked here, so a bad setting costs a second, not a launch. The steps also
build what the export records (the meta: the run's facts, the task, the base's lineage, LoRA), so the job
is never patched afterwards; the MLflow run id comes from the run record (protocol.py export_meta). A resume
on another number of ranks is checked and its checkpoint converted to DeepSpeed's universal form here
(components/training/universal.py), and the job's notes say so. The precision `auto` resolves to is decided
once, after the layout's fp32-only rule is known (layout.py fp32_only: torch's pipeline schedules and the
parameter-server family train in fp32, and `auto` then gives fp32 with that reason; an explicit bf16 there
is refused with the fix), else by the device (components/runtime/accelerator.py), with the peak FLOP/s
(components/training/perf.py). With a base (`training.model.init`) the folder is checked here, and a dataset
tokenised with any other tokenizer than the base's is refused: its token ids would index the wrong embeddings.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmforge.components.data.shards import read_index
from lmforge.components.data.taskdata import check_task
from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import BaseCheckpoint, check_base, tokenizer_hash
from lmforge.components.runtime.accelerator import Precision, choose_precision, cpu_model, pick_device, visible_gpus
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.serving.task import DEMO, Task
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.launcher import LaunchRequest
from lmforge.components.training.layout import Layout, check_layout, fp32_only, world_size_of
from lmforge.components.training.model import load_tokenizer
from lmforge.components.training.perf import Peak, device_peak
from lmforge.components.training.protocol import REQUEST_GLOB, RankHardware, RankRequest
from lmforge.components.training.strategies import apply_universal_load, deepspeed_config

CPU_DEFAULT_RANKS = 2


@dataclass(frozen=True)
class Job:
    launch: LaunchRequest
    layout: Layout
    ds_config: dict[str, Any]
    start_step: int
    hardware: "Hardware"
    base: BaseCheckpoint | None = None
    notes: tuple[str, ...] = ()    # what was decided before launch and why (SFT batching, LoRA targets), to print


@dataclass(frozen=True)
class Hardware:
    """Where and how the ranks compute, decided once before they start (and logged by the flow)."""

    device: str                  # "cuda" | "cpu"
    device_name: str
    gpus: tuple[str, ...]        # physical ids the ranks run on; empty on CPU
    precision: Precision
    peak: Peak                   # of one device: one GPU, or the whole CPU
    compile: bool

    def for_rank(self) -> RankHardware:
        """The part of the request the ranks read (flat and JSON-able)."""
        return RankHardware(device=self.device, device_name=self.device_name, gpus=self.gpus,  # type: ignore[arg-type]
                            precision=self.precision.name, precision_reason=self.precision.reason,  # type: ignore[arg-type]
                            peak_flops_per_device=self.peak.flops, peak_source=self.peak.source, compile=self.compile)

    def to_dict(self) -> dict[str, Any]:
        return self.for_rank().model_dump(mode="json")

    def summary(self) -> str:
        where = f"{self.device_name} (GPUs {','.join(self.gpus)})" if self.gpus else self.device_name
        return (f"{where}: {self.precision.name} ({self.precision.reason}); peak {self.peak.flops / 1e12:.3g} TFLOP/s per "
                f"device ({self.peak.source}); compile {'on' if self.compile else 'off'}")


def num_ranks_for(cfg: TrainingConfig, gpus: list[str]) -> int:
    """training.num_ranks checked against the visible GPUs; unset = all of them (CUDA) or 2 (CPU)."""
    if cfg.hostfile is not None:
        return cfg.num_ranks or 1  # the hostfile's slots decide; world_size_of reads them
    if not gpus:
        return cfg.num_ranks or CPU_DEFAULT_RANKS
    if cfg.num_ranks is None:
        return len(gpus)
    if cfg.num_ranks > len(gpus):
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"CUDA_VISIBLE_DEVICES={env}" if env is not None else "all of this machine's"
        raise UserError("training.num_ranks", cfg.num_ranks, f"is more than the {len(gpus)} visible GPU(s) ({seen})",
                        f"Set training.num_ranks to at most {len(gpus)}, or unset it to use every visible GPU")
    return cfg.num_ranks


def training_hardware(cfg: TrainingConfig) -> Hardware:
    """The device, the precision `auto` resolves to (with its reason), the peak and whether to compile.

    `auto` is resolved against the layout: where it trains only in fp32 (layout.py fp32_only: the torch pipeline
    schedules, the parameter-server family) it is fp32 and the reason says why; elsewhere the device decides."""
    import torch

    device = pick_device()
    gpus = tuple(visible_gpus())
    rule = fp32_only(cfg) if cfg.precision == "auto" else None
    precision = Precision("fp32", f"auto, and {rule}") if rule else choose_precision(cfg.precision, device)
    peak = device_peak(precision.name, device)
    compile_ = cfg.compile if cfg.compile is not None else device.type == "cuda"
    if compile_ and (cfg.parallel.pipeline.stages > 1 or cfg.parallel.tensor.autotp_size > 1):
        if cfg.compile:
            raise UserError("training.compile", True, "is not supported with pipeline stages or AutoTP",
                            "Set training.compile = false, or use a data-parallel strategy")
        compile_ = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return Hardware(device=device.type, device_name=name, gpus=gpus, precision=precision, peak=peak, compile=compile_)


def next_attempt(run_dir: Path) -> int:
    found = [int(m.group(1)) for p in Path(run_dir).glob(REQUEST_GLOB) if (m := re.match(r"request-(\d+)\.json$", p.name))]
    return max(found, default=-1) + 1


def check_base_dataset(cfg: TrainingConfig, tokenizer: Path,
                       base: BaseCheckpoint | None = None) -> tuple[TrainingConfig, BaseCheckpoint | None]:
    """With init: the checked base, and the section with init as an absolute path (the ranks run in the run folder).

    `base` is init already resolved (components/registry/basesource.py resolve_base: a registry reference is a folder
    only once resolved); without it init must be a folder."""
    if cfg.model.init is None:
        return cfg, None
    base = base if base is not None else check_base(cfg.model.init)
    theirs = tokenizer_hash(tokenizer)
    if theirs != base.tokenizer_sha256:
        raise UserError("dataset", Path(tokenizer).parent,
                        f"was tokenised with another tokenizer than the base's (tokenizer hash {theirs[:12]}, "
                        f"the base {base.path} has {base.tokenizer_sha256[:12]})",
                        "Re-run the data stage with the same training.model.init: lmforge run data "
                        f"--set training.model.init={base.named}")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init": str(base.path)})}), base


@dataclass(frozen=True)
class Draft:
    """What the PREPARE steps build up before launch; each step returns a new draft (dataclasses.replace) or this one."""

    cfg: TrainingConfig
    shards: Path
    tokenizer: Path
    run_dir: Path
    resume: bool
    records: Path
    task: Task
    meta: dict[str, Any]                  # what the export's lmforge.json records, built up by the steps
    tok: Any = None                       # the dataset's tokenizer, after check_task_fits
    base: BaseCheckpoint | None = None
    hardware: Hardware | None = None
    layout: Layout | None = None
    start_step: int = 0
    elastic: bool = False                 # resumed on another world size, from the universal checkpoint
    sft_batching: str | None = None
    ds_config: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()

    def noted(self, *notes: str) -> "Draft":
        return replace(self, notes=self.notes + notes)


def check_task_fits(d: Draft) -> Draft:
    """The dataset's tokenizer, and the task it renders (a chat task needs a chat template); both go into the meta."""
    tok = load_tokenizer(d.tokenizer)
    check_task(d.task, tok)
    return replace(d, tok=tok, meta={**d.meta, "task": d.task.to_dict()})


def check_the_base(d: Draft) -> Draft:
    """training.model.init: the checked base (its tokenizer is the dataset's) and its lineage in the meta."""
    cfg, base = check_base_dataset(d.cfg, d.tokenizer, d.base)
    if base is None:
        return d
    return replace(d, cfg=cfg, base=base, meta={**d.meta, "base": base.lineage()})  # lineage: hashed once, here


def check_shards(d: Draft) -> Draft:
    index = read_index(d.shards)
    if "train" not in index["splits"] or index["splits"]["train"]["tokens"] <= d.cfg.seq_len:
        raise UserError("shards", d.shards, f"hold too few train tokens for training.seq_len={d.cfg.seq_len}",
                        "Use more data or a shorter seq_len")
    return d


def count_ranks(d: Draft) -> Draft:
    return replace(d, cfg=d.cfg.model_copy(update={"num_ranks": num_ranks_for(d.cfg, visible_gpus())}))


def choose_hardware(d: Draft) -> Draft:
    """The device and the precision, `auto` resolved against the layout's fp32-only rule (training_hardware)."""
    return replace(d, hardware=training_hardware(d.cfg))


def check_the_layout(d: Draft) -> Draft:
    """The layout's rules; an explicit bf16 where the layout trains only in fp32 is refused here, with the fix."""
    assert d.hardware is not None
    layout = check_layout(d.cfg, vocab_size=len(d.tok), world_size=world_size_of(d.cfg),
                          bf16_supported=d.hardware.precision.name == "bf16")
    return replace(d, layout=layout)


def check_parameter_server(d: Draft) -> Draft:
    if not d.cfg.parallel.parameter_server:
        return d
    from lmforge.components.training.ps.checks import check_ps_job

    assert d.layout is not None and d.hardware is not None
    check_ps_job(d.cfg, d.layout, device=d.hardware.device, resume=d.resume)
    return d


def check_resume(d: Draft) -> Draft:
    """--resume: the last complete checkpoint; on another world size, converted once to the universal form."""
    if not d.resume:
        return d
    cfg, layout = d.cfg, d.layout
    assert layout is not None
    start, folder = ckpt.latest_complete(d.run_dir / "checkpoints")
    saved = json.loads((folder / ckpt.MARKER).read_text())
    if start >= cfg.max_steps:
        raise UserError("--resume", folder, f"is already at step {start} of max_steps={cfg.max_steps}",
                        "Raise training.max_steps to train further")
    if "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_param):
        from lmforge.components.training.nvme import check_resume as check_nvme_resume

        # not yet: see components/training/nvme.py
        check_nvme_resume(cfg.parallel.offload_optimizer, folder, offload_param=cfg.parallel.offload_param)
    d = replace(d, start_step=start)
    if saved["world_size"] == layout.world_size:
        return d
    from lmforge.components.training.universal import prepare_elastic

    return replace(d.noted(prepare_elastic(folder, saved, cfg, layout)), elastic=True)


def prepare_sft(d: Draft) -> Draft:
    """objective = "sft": the run's examples (<run>/sft, written once: a resume reads the same ones) and their batching."""
    if d.cfg.objective != "sft":
        return d
    from lmforge.components.training.sft import SFT_DIR, choose_batching, write_examples

    cfg, sft_dir = d.cfg, d.run_dir / SFT_DIR
    if not (d.resume and (sft_dir / "made.json").is_file()):
        d = d.noted(write_examples(d.records / "train.jsonl", d.tok, sft_dir, d.task, seq_len=cfg.seq_len).summary())
    batching, why = choose_batching(sft_dir, setting=cfg.sft.batching, seq_len=cfg.seq_len, micro=cfg.micro_batch_size,
                                    seed=cfg.seed)
    return replace(d.noted(f"SFT batching: {batching} ({why})"), sft_batching=batching)


def choose_lora(d: Draft) -> Draft:
    """training.lora.r > 0: the projections that get adapters (checked here), in the notes and the meta."""
    if not d.cfg.lora.r:
        return d
    from lmforge.components.training.lora_training import adapter_params, check_adapters
    from lmforge.components.training.model import model_config

    cfg = d.cfg
    chosen = check_adapters(cfg, model_config(cfg.model, d.tok, seq_len=cfg.seq_len))
    skipped = f"; left frozen: {', '.join(sorted(set(chosen.skipped.values())))}" if chosen.skipped else ""
    d = replace(d, meta={**d.meta, "lora": cfg.lora.model_dump(mode="json")})
    return d.noted(f"LoRA r={cfg.lora.r} on {len(chosen.targets)} projections, "
                   f"{adapter_params(chosen, cfg.lora.r):,} trainable parameters{skipped}")


def build_deepspeed(d: Draft) -> Draft:
    assert d.layout is not None and d.hardware is not None
    return replace(d, ds_config=apply_universal_load(deepspeed_config(d.cfg, d.layout, device=d.hardware.device),
                                                     d.elastic))


def place_nvme(d: Draft) -> Draft:
    """parallel.offload_* = "nvme": a per-run swap folder, O_DIRECT checked (components/training/nvme.py)."""
    if "nvme" not in (d.cfg.parallel.offload_optimizer, d.cfg.parallel.offload_param):
        return d
    from lmforge.components.training.nvme import largest_param, place_swap

    assert d.ds_config is not None
    return replace(d, ds_config=place_swap(d.ds_config, run_dir=d.run_dir, largest_param=largest_param(d.cfg, d.tok)))


# The order the checks need: the tokenizer before the base (their hashes must agree) and the layout (its vocabulary),
# the ranks before the hardware and the layout, the hardware (its precision) before the layout's rules, the layout
# before what depends on it (the parameter server's checks, the resume's world size, DeepSpeed's config), and the
# DeepSpeed config before its NVMe swap folder.
PREPARE = (check_task_fits, check_the_base, check_shards, count_ranks, choose_hardware, check_the_layout,
           check_parameter_server, check_resume, prepare_sft, choose_lora, build_deepspeed, place_nvme)


def run_meta(cfg: TrainingConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """What every export records of the run (the steps add the task, the base's lineage and LoRA); `meta`: the
    caller's facts (run_name, dataset_version). seq_len: the context the model was trained at; evaluation never
    scores positions beyond it. The MLflow run id is the run record's (protocol.py export_meta)."""
    from lmforge.components.config import config_hash
    from lmforge.components.runtime.resources import source_commit

    return {"config_hash": config_hash(cfg), "strategy": cfg.parallel.strategy, "seq_len": cfg.seq_len,
            "objective": cfg.objective, "git_commit": source_commit(), **meta}


def prepare_job(cfg: TrainingConfig, *, shards: Path, tokenizer: Path, run_dir: Path, resume: bool,
                meta: dict[str, Any] | None = None, timeout_s: float | None = None, base: BaseCheckpoint | None = None,
                records: Path | None = None, task: Task = DEMO) -> Job:
    """The checked job: every step of PREPARE in order. `meta`: facts of the caller the export records (run_name,
    dataset_version); `base`: training.model.init already resolved (components/registry/basesource.py); `records`: the
    dataset's records folder, which objective = "sft" reads (default: beside the tokenizer, as the data stage writes
    a dataset); `task` renders its examples (components/serving/task.py) and must fit the tokenizer."""
    d = Draft(cfg=cfg, shards=Path(shards), tokenizer=Path(tokenizer), run_dir=Path(run_dir), resume=resume,
              records=Path(records or Path(tokenizer).parent / "records"), task=task, meta=run_meta(cfg, meta or {}),
              base=base)
    for step in PREPARE:
        d = step(d)
    return job_of(d, timeout_s)


def job_of(d: Draft, timeout_s: float | None) -> Job:
    """The launchable job from a finished draft."""
    assert d.layout is not None and d.hardware is not None and d.ds_config is not None
    request = RankRequest(training=d.cfg, layout=d.layout, ds_config=d.ds_config, run_dir=d.run_dir, shards=d.shards,
                          tokenizer=d.tokenizer, resume=d.resume, meta=d.meta, attempt=next_attempt(d.run_dir),
                          hardware=d.hardware.for_rank(), sft_batching=d.sft_batching)
    launch = LaunchRequest(run_dir=d.run_dir, request=request, num_ranks=d.cfg.num_ranks, hostfile=d.cfg.hostfile,
                           master_port=d.cfg.master_port, timeout_s=timeout_s, gpus=d.hardware.gpus)
    return Job(launch=launch, layout=d.layout, ds_config=d.ds_config, start_step=d.start_step, hardware=d.hardware,
               base=d.base, notes=d.notes)
