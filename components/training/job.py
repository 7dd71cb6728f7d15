"""A training job from the [training] section and the dataset's paths: checked, then ready to launch.

    job = prepare_job(cfg.training, shards=ws.training_shards(v), tokenizer=ws.dataset_dir(v) / "tokenizer",
                      run_dir=ws.run_dir("demo-20260101-120000"), resume=False, meta={"dataset_version": v})
    result = launch(job.launch)            # components/training/launcher.py
    job.ds_config, job.layout              # what was generated, for the run's record

Everything that can be checked before ranks start is checked here (layout, data, resume
state), so a bad setting costs a second, not a launch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.data.shards import read_index
from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.launcher import LaunchRequest
from lmforge.components.training.layout import Layout, check_layout, world_size_of
from lmforge.components.training.model import load_tokenizer
from lmforge.components.training.strategies import deepspeed_config


@dataclass(frozen=True)
class Job:
    launch: LaunchRequest
    layout: Layout
    ds_config: dict[str, Any]
    start_step: int


def bf16_supported() -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported()) if torch.cuda.is_available() else True


def next_attempt(run_dir: Path) -> int:
    found = [int(m.group(1)) for p in Path(run_dir).glob("request-*.json") if (m := re.match(r"request-(\d+)\.json$", p.name))]
    return max(found, default=-1) + 1


def prepare_job(cfg: TrainingConfig, *, shards: Path, tokenizer: Path, run_dir: Path, resume: bool,
                meta: dict[str, Any], timeout_s: float | None = None) -> Job:
    tok = load_tokenizer(tokenizer)
    index = read_index(shards)
    if "train" not in index["splits"] or index["splits"]["train"]["tokens"] <= cfg.seq_len:
        raise UserError("shards", shards, f"hold too few train tokens for training.seq_len={cfg.seq_len}",
                        "Use more data or a shorter seq_len")
    layout = check_layout(cfg, vocab_size=len(tok), world_size=world_size_of(cfg), bf16_supported=bf16_supported())
    start = 0
    if resume:
        start, folder = ckpt.latest_complete(Path(run_dir) / "checkpoints")
        saved = json.loads((folder / ckpt.MARKER).read_text())
        if saved["world_size"] != layout.world_size:
            raise UserError("--resume", folder, f"was saved by {saved['world_size']} ranks, this job has {layout.world_size}",
                            "Resume with the same training.num_ranks")
        if start >= cfg.max_steps:
            raise UserError("--resume", folder, f"is already at step {start} of max_steps={cfg.max_steps}",
                            "Raise training.max_steps to train further")
    ds = deepspeed_config(cfg, layout)
    request = {"training": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "ds_config": ds,
               "run_dir": str(run_dir), "shards": str(shards), "tokenizer": str(tokenizer), "resume": resume,
               "meta": meta, "attempt": next_attempt(run_dir)}
    req = LaunchRequest(run_dir=Path(run_dir), request=request, num_ranks=cfg.num_ranks, hostfile=cfg.hostfile,
                        master_port=cfg.master_port, timeout_s=timeout_s)
    return Job(launch=req, layout=layout, ds_config=ds, start_step=start)
