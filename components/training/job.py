"""A training job from the [training] section and the dataset's paths: checked, then ready to launch.

    job = prepare_job(cfg.training, shards=ws.training_shards(v), tokenizer=ws.dataset_dir(v) / "tokenizer",
                      run_dir=ws.run_dir("demo-20260101-120000"), resume=False, meta={"dataset_version": v})
    result = launch(job.launch)            # components/training/launcher.py
    job.ds_config, job.layout              # what was generated, for the run's record
    job.hardware.summary()                 # device, precision and why, peak FLOP/s and its source
    job.base                               # with training.model.init: the checked base (components/model/basemodel.py)

Everything that can be checked before ranks start is checked here (layout, data, resume
state, num_ranks against the visible GPUs), so a bad setting costs a second, not a launch. A resume on
another number of ranks is checked and its checkpoint converted to DeepSpeed's universal form here
(components/training/universal.py), and the job's notes say so. The
precision `auto` resolves to and the peak FLOP/s of the device are decided here too, once,
before the ranks start (components/runtime/accelerator.py, components/training/perf.py). With a base
(`training.model.init`) the folder is checked here, and a dataset tokenised with any other
tokenizer than the base's is refused: its token ids would index the wrong embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.data.shards import read_index
from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import BaseCheckpoint, check_base, tokenizer_hash
from lmforge.components.runtime.accelerator import Precision, choose_precision, cpu_model, pick_device, visible_gpus
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.serving.task import DEMO, Task
from lmforge.components.taskdata import check_task
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.launcher import LaunchRequest
from lmforge.components.training.layout import Layout, check_layout, world_size_of
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

    def with_meta(self, **updates: Any) -> "Job":
        """The same job with `updates` merged into the meta its export records.

        The request is frozen and holds its own copy of the meta given to prepare_job, so a
        value known only later (the MLflow run id: the run opens after the job is checked)
        goes in here, not by changing the caller's dict.
        """
        request = self.launch.request.model_copy(update={"meta": {**self.launch.request.meta, **updates}})
        return dataclasses.replace(self, launch=dataclasses.replace(self.launch, request=request))


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
    """The device, the precision `auto` resolves to (with its reason), the peak and whether to compile."""
    import torch

    device = pick_device()
    gpus = tuple(visible_gpus())
    precision = choose_precision(cfg.precision, device)
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

    `base` is init already resolved (components/basesource.py resolve_base: a registry reference is a folder
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


def prepare_job(cfg: TrainingConfig, *, shards: Path, tokenizer: Path, run_dir: Path, resume: bool,
                meta: dict[str, Any], timeout_s: float | None = None, base: BaseCheckpoint | None = None,
                records: Path | None = None, task: Task = DEMO) -> Job:
    """The checked job. `records`: the dataset's records folder, which objective = "sft" reads (default: beside
    the tokenizer, as the data stage writes a dataset); `task` renders its examples (components/serving/task.py) and must
    fit the tokenizer (a chat task needs a chat template)."""
    tok = load_tokenizer(tokenizer)
    check_task(task, tok)
    cfg, base = check_base_dataset(cfg, tokenizer, base)
    index = read_index(shards)
    if "train" not in index["splits"] or index["splits"]["train"]["tokens"] <= cfg.seq_len:
        raise UserError("shards", shards, f"hold too few train tokens for training.seq_len={cfg.seq_len}",
                        "Use more data or a shorter seq_len")
    gpus = visible_gpus()
    cfg = cfg.model_copy(update={"num_ranks": num_ranks_for(cfg, gpus)})
    if cfg.parallel.parameter_server and cfg.precision == "auto":
        cfg = cfg.model_copy(update={"precision": "fp32"})  # the parameter-server family trains fp32 (ps/rank.py)
    hardware = training_hardware(cfg)
    layout = check_layout(cfg, vocab_size=len(tok), world_size=world_size_of(cfg),
                          bf16_supported=hardware.precision.name == "bf16")
    if cfg.parallel.parameter_server:
        from lmforge.components.training.ps.checks import check_ps_job

        check_ps_job(cfg, layout, device=hardware.device, resume=resume)
    start = 0
    notes: list[str] = []
    elastic = False
    if resume:
        start, folder = ckpt.latest_complete(Path(run_dir) / "checkpoints")
        saved = json.loads((folder / ckpt.MARKER).read_text())
        if start >= cfg.max_steps:
            raise UserError("--resume", folder, f"is already at step {start} of max_steps={cfg.max_steps}",
                            "Raise training.max_steps to train further")
        if "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_param):
            from lmforge.components.training.nvme import check_resume

            # not yet: see components/training/nvme.py
            check_resume(cfg.parallel.offload_optimizer, folder, offload_param=cfg.parallel.offload_param)
        if saved["world_size"] != layout.world_size:
            # Another world size: checked, then converted once to DeepSpeed's universal checkpoint (universal.py).
            from lmforge.components.training.universal import prepare_elastic

            notes.append(prepare_elastic(folder, saved, cfg, layout))
            elastic = True
    sft_batching = None
    if cfg.objective == "sft":
        sft_batching = prepare_sft(cfg, tok, Path(records or Path(tokenizer).parent / "records"), Path(run_dir), resume,
                                   notes, task)
    if cfg.lora.r:
        from lmforge.components.training.lora import adapter_params, check_adapters
        from lmforge.components.training.model import model_config

        chosen = check_adapters(cfg, model_config(cfg.model, tok, seq_len=cfg.seq_len))
        skipped = f"; left frozen: {', '.join(sorted(set(chosen.skipped.values())))}" if chosen.skipped else ""
        notes.append(f"LoRA r={cfg.lora.r} on {len(chosen.targets)} projections, {adapter_params(chosen, cfg.lora.r):,} "
                     f"trainable parameters{skipped}")
    ds = apply_universal_load(deepspeed_config(cfg, layout, device=hardware.device), elastic)
    if "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_param):
        from lmforge.components.training.nvme import largest_param, place_swap

        ds = place_swap(ds, run_dir=Path(run_dir), largest_param=largest_param(cfg, tok))  # O_DIRECT checked here
    request = RankRequest(training=cfg, layout=layout, ds_config=ds, run_dir=Path(run_dir), shards=Path(shards),
                          tokenizer=Path(tokenizer), resume=resume, meta=meta, attempt=next_attempt(run_dir),
                          hardware=hardware.for_rank(), sft_batching=sft_batching)
    req = LaunchRequest(run_dir=Path(run_dir), request=request, num_ranks=cfg.num_ranks, hostfile=cfg.hostfile,
                        master_port=cfg.master_port, timeout_s=timeout_s, gpus=hardware.gpus)
    return Job(launch=req, layout=layout, ds_config=ds, start_step=start, hardware=hardware, base=base, notes=tuple(notes))


def prepare_sft(cfg: TrainingConfig, tok: Any, records: Path, run_dir: Path, resume: bool, notes: list[str],
                task: Task) -> str:
    """The run's SFT examples (<run>/sft, written once: a resume reads the same ones) and the batching they get."""
    from lmforge.components.training.sft import SFT_DIR, choose_batching, write_examples

    sft_dir = run_dir / SFT_DIR
    if not (resume and (sft_dir / "made.json").is_file()):
        notes.append(write_examples(records / "train.jsonl", tok, sft_dir, task, seq_len=cfg.seq_len).summary())
    batching, why = choose_batching(sft_dir, setting=cfg.sft.batching, seq_len=cfg.seq_len, micro=cfg.micro_batch_size,
                                    seed=cfg.seed)
    notes.append(f"SFT batching: {batching} ({why})")
    return batching
