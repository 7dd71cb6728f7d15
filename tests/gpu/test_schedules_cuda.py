"""On two CUDA devices: the zero-bubble (ZB-V) schedule trains on NCCL, matches DDP's losses and logs its bubble.

    pytest -m gpu tests/gpu/test_schedules_cuda.py     # skipped (not failed) without 2 CUDA devices

The same comparison as tests/integration/test_train_schedules.py, through lmforge's real launcher
on two GPUs (a pipeline needs a rank per stage, and NCCL one device per rank): the tiny model at
4 layers, 2 stages x 2 chunks, 4 micro-batches, fp32 (TF32 matmuls on both sides, so the
tolerance is looser than on the CPU). On CUDA the stage clock waits for the device before each
reading, so the logged F/I/W times are kernel times, not launch times.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.components.workspace import Workspace
from tests.integration.train_support import make_dataset, run_training, tiny_training

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                 reason="a 2-stage pipeline needs 2 CUDA devices")]

STEPS = {"precision": "fp32", "max_steps": 6, "save_every": 3, "warmup_steps": 2, "model": {"num_layers": 4},
         "num_ranks": 2}


def test_zero_bubble_on_two_gpus_matches_ddp(tmp_path):
    ws = Workspace(tmp_path / "ws").ensure()
    make_dataset(ws)
    ddp, _ = run_training(ws, "ddp", tiny_training(**STEPS, grad_accum_steps=2, parallel={"strategy": "ddp"}))
    zb, run_dir = run_training(ws, "zb", tiny_training(**STEPS, parallel={"strategy": "ddp", "pipeline": {
        "stages": 2, "micro_batches": 4, "schedule": "zero-bubble", "virtual_stages": 2}}))
    ours, theirs = [e["loss"] for e in zb], [e["loss"] for e in ddp]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 2e-2, (ours, theirs)
    bubble = zb[-1]["bubble"]
    assert bubble["schedule"] == "zero-bubble" and math.isfinite(bubble["bubble"]) and bubble["t_f"] > 0
    assert (run_dir / "export" / "config.json").is_file()
